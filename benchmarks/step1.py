"""Step 1 benchmark: decode speed through meshgate vs llama-cpp-python directly, and gateway CPU overhead.

    .venv/bin/python benchmarks/step1.py [--tokens 128] [--requests 1000]

Prints, from one run:
1. decode tokens/s of Gemma 3 270M called directly with llama-cpp-python, and through a meshgate server
   (measured by the client from first to last streamed token), and the ratio (target >= 0.95);
2. server CPU time per chat completion for meshgate with an instant scripted backend, and for a minimal
   Litestar app that only decodes and answers, and the ratio (target <= 2).
Both sides of each comparison run on the same machine, one after the other, with the same thread count.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import Server, free_port  # noqa: E402

PROMPT = "Here is a list of the numbers from 1 to 500, separated by commas: 1, 2, 3, 4, 5,"


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Direct:
    """llama-cpp-python in this process, the way a user would call it without meshgate."""

    def __init__(self, path: str, threads: int) -> None:
        from llama_cpp import Llama

        from meshgate.backends.llama_cpp.rpc import weight_repacking

        with weight_repacking(False):  # the setting meshgate's runners load with (MESHGATE_LLAMA_REPACK)
            self.llm = Llama(model_path=path, n_ctx=2048, n_threads=threads, n_threads_batch=threads, verbose=False)
        self.prompt = self.llm.tokenize(PROMPT.encode(), add_bos=True)

    def decode_rate(self, tokens: int) -> float:
        count, first = 0, 0.0
        self.llm.reset()
        for _token in self.llm.generate(self.prompt, temp=0.0, reset=True):
            count += 1
            if count == 1:
                first = time.perf_counter()
            if count == tokens:
                break
        return (count - 1) / (time.perf_counter() - first)


def gateway_decode_rate(server: Server, tokens: int) -> float:
    """Client-side: from the first to the last streamed token of a raw /api/generate."""
    body = {
        "model": "gemma3:270m",
        "prompt": PROMPT,
        "raw": True,
        "stream": True,
        "options": {"num_predict": tokens, "temperature": 0},
    }
    stamps = []
    with httpx.stream("POST", f"{server.url}/api/generate", json=body, timeout=120) as r:
        for line in r.iter_lines():
            if '"done":false' in line:
                stamps.append(time.perf_counter())
    return (len(stamps) - 1) / (stamps[-1] - stamps[0])


def decode_comparison(data_dir: Path, tokens: int, threads: int, runs: int) -> tuple[float, float]:
    """Median decode tok/s (direct, through meshgate), runs interleaved so drift hits both alike."""
    server = Server(data_dir, "--threads", str(threads), "--n-ctx", "2048")
    try:
        gateway_decode_rate(server, 8)  # loads the runner
        direct = Direct(str(next((data_dir / "models").glob("*.gguf"))), threads)
        direct.decode_rate(8)
        pairs = [(direct.decode_rate(tokens), gateway_decode_rate(server, tokens)) for _ in range(runs)]
        del direct
    finally:
        server.stop()
    return statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs)


def server_cpu_per_request(pid: int, url: str, requests: int, body: dict) -> float:
    """Server process CPU seconds per request, over ``requests`` sequential requests after a warm-up."""
    with httpx.Client(base_url=url) as client:
        for _ in range(50):
            client.post("/v1/chat/completions", json=body).raise_for_status()
        before = cpu_seconds(pid)
        for _ in range(requests):
            client.post("/v1/chat/completions", json=body).raise_for_status()
        return (cpu_seconds(pid) - before) / requests


def overhead_comparison(data_dir: Path, requests: int) -> tuple[float, float]:
    """Server CPU per chat completion: (minimal Litestar app, meshgate with an instant scripted backend)."""
    body = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}
    gateway = Server(data_dir, "--plugin", "tests.scripted_plugin", env={"MESHGATE_DISABLED_PLUGINS": "llama_cpp"})
    try:
        ours = server_cpu_per_request(gateway.proc.pid, gateway.url, requests, body)
    finally:
        gateway.stop()
    port = free_port()
    minimal = subprocess.Popen([sys.executable, str(ROOT / "benchmarks" / "minimal_app.py"), str(port)])
    try:
        _wait(f"http://127.0.0.1:{port}")
        floor = server_cpu_per_request(minimal.pid, f"http://127.0.0.1:{port}", requests, body)
    finally:
        minimal.terminate()
        minimal.wait()
    return floor, ours


def _wait(url: str) -> None:
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            return
        except httpx.HTTPError:
            time.sleep(0.1)
    raise RuntimeError(f"{url} did not come up")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--requests", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    args = parser.parse_args()
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    data_dir.mkdir(parents=True, exist_ok=True)

    for threads in sorted({args.threads, 1}, reverse=True):
        direct, via_gateway = decode_comparison(data_dir, args.tokens, threads, args.runs)
        print(f"decode, {args.tokens} tokens, {threads} thread(s), median of {args.runs} interleaved runs")
        print(f"  llama-cpp-python direct : {direct:7.1f} tok/s")
        print(f"  through meshgate        : {via_gateway:7.1f} tok/s")
        print(f"  ratio                   : {via_gateway / direct:7.3f}   (target >= 0.95)", flush=True)

    floor, ours = overhead_comparison(data_dir, args.requests)
    print(f"server CPU per chat completion, instant backend, {args.requests} sequential requests")
    print(f"  minimal Litestar app    : {floor * 1000:7.3f} ms")
    print(f"  meshgate                : {ours * 1000:7.3f} ms")
    print(f"  ratio                   : {ours / floor:7.3f}   (target <= 2)")


if __name__ == "__main__":
    main()
