"""Gateway CPU per relayed token, per protocol, with a scripted runner process (``benchmarks.relay_plugin``).

    .venv/bin/python benchmarks/relay.py [--tokens 200] [--streams 20] [--levels 1,8] [--pacing NAME ...] [--json]

Starts a gateway with the relay plugin; for each runner pacing (``PACINGS``: one event per chunk at 500/s; back
to back; bursts of 16 events per chunk, as a batched runner writes what it has ready; and, asked for with
``--pacing``, one event per chunk at 100/s (``model``) or 40/s (``sparse``)), each streaming protocol (OpenAI
chat, OpenAI completions, OpenAI Responses, Anthropic Messages, Ollama chat and generate) and each level N of
``--levels`` it runs ``--streams`` streams of ``--tokens`` tokens, N at a time, and divides the gateway process's
CPU time (``/proc/<pid>/task/*/schedstat``) by the tokens it relayed, less what the gateway spends idle over as
long (its timers, measured first and printed). The runner's own CPU is in another process and not counted.
Target: <= 0.15 ms per token everywhere.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import Server  # noqa: E402

MODEL = "relay"
PACINGS = {  # name -> prompt options for the scripted runner
    "paced": "burst=1 interval=0.002",  # one event per chunk, 500 a second
    "back-to-back": "burst=1 interval=0",  # one event per chunk, as fast as the runner writes
    "burst16": "burst=16 interval=0.002",  # 16 events per chunk: a batched runner's step, or a gateway behind
    "sparse": "burst=1 interval=0.025",  # one event per chunk, 40 a second: one stream of a small model on a CPU
    "model": "burst=1 interval=0.01",  # one event per chunk, 100 a second: the packaged 270M model's pace
}
DEFAULT_PACINGS = ("paced", "back-to-back", "burst16")


def cpu_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has run so far, all its threads: ``/proc/<pid>/task/*/schedstat`` (nanoseconds;
    ``/proc/<pid>/stat`` counts 10 ms clock ticks, as coarse as a whole stream's relaying), else ``stat``."""
    total = 0
    for stat in Path(f"/proc/{pid}/task").glob("*/schedstat"):
        with contextlib.suppress(OSError, ValueError, IndexError):  # a thread that ended meanwhile
            total += int(stat.read_text().split()[0])
    if total:
        return total / 1e9
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def requests(prompt: str, tokens: int) -> dict[str, tuple[str, dict, dict]]:
    """Protocol -> (path, headers, streaming body) asking for ``tokens`` tokens."""
    chat = [{"role": "user", "content": prompt}]
    return {
        "openai chat": (
            "/v1/chat/completions",
            {},
            {
                "model": MODEL,
                "messages": chat,
                "max_tokens": tokens,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ),
        "openai completions": (
            "/v1/completions",
            {},
            {"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True},
        ),
        "openai responses": (
            "/v1/responses",
            {},
            {"model": MODEL, "input": prompt, "max_output_tokens": tokens, "stream": True},
        ),
        "anthropic": (
            "/v1/messages",
            {"anthropic-version": "2023-06-01"},
            {"model": MODEL, "messages": chat, "max_tokens": tokens, "stream": True},
        ),
        "ollama chat": (
            "/api/chat",
            {},
            {"model": MODEL, "messages": chat, "stream": True, "options": {"num_predict": tokens}},
        ),
        "ollama generate": (
            "/api/generate",
            {},
            {"model": MODEL, "prompt": prompt, "stream": True, "options": {"num_predict": tokens}},
        ),
    }


def stream_once(client: httpx.Client, path: str, headers: dict, body: dict) -> int:
    """One streamed request, read to its end; the bytes received."""
    size = 0
    with client.stream("POST", path, json=body, headers=headers) as response:
        response.raise_for_status()
        for chunk in response.iter_raw():
            size += len(chunk)
    return size


def idle_rate(pid: int, seconds: float = 3.0) -> float:
    """CPU seconds per second the gateway spends with nothing to do (its timers: heartbeats, reconcile loops)."""
    before, started = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - started)


def run_level(url: str, n: int, rounds: int, path: str, headers: dict, body: dict) -> None:
    """``n`` clients at once, each streaming ``rounds`` requests one after another (a thread and a connection
    each: the clients' own CPU is in this process, not the gateway's)."""

    def client_loop() -> None:
        with httpx.Client(base_url=url, timeout=60) as client:
            for _ in range(rounds):
                stream_once(client, path, headers, body)

    with ThreadPoolExecutor(n) as pool:
        for future in [pool.submit(client_loop) for _ in range(n)]:
            future.result()


def measure(
    server: Server, tokens: int, streams: int, pacings: list[str], levels: list[int], idle: float
) -> dict[str, dict[str, dict[int, float]]]:
    """Pacing -> protocol -> concurrent streams -> gateway CPU milliseconds per relayed token, less what the
    gateway spends idle (``idle`` CPU seconds per second) over as long."""
    results: dict[str, dict[str, dict[int, float]]] = {}
    for pacing in pacings:
        prompt = PACINGS[pacing]
        results[pacing] = {}
        for protocol, (path, headers, body) in requests(prompt, tokens).items():
            results[pacing][protocol] = {}
            for n in levels:
                rounds = max(1, streams // n)
                run_level(server.url, n, 1, path, headers, body)  # warm-up
                before, started = cpu_seconds(server.proc.pid), time.perf_counter()
                run_level(server.url, n, rounds, path, headers, body)
                wall = time.perf_counter() - started
                spent = max(0.0, cpu_seconds(server.proc.pid) - before - idle * wall)
                results[pacing][protocol][n] = spent * 1000 / (n * rounds * tokens)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--streams", type=int, default=20, help="streams per protocol, pacing and level")
    parser.add_argument("--levels", default="1", help="streams in flight at once, comma-separated (1,8)")
    parser.add_argument(
        "--pacing",
        action="append",
        choices=list(PACINGS),
        help=f"runner pacing(s) to measure (default: {', '.join(DEFAULT_PACINGS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",") if n.strip()]
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    server = Server(
        data_dir, "--plugin", "benchmarks.relay_plugin", env={"MESHGATE_DISABLED_PLUGINS": "llama_cpp,mlx,vllm"}
    )
    try:
        httpx.post(f"{server.url}/api/generate", json={"model": MODEL}, timeout=60).raise_for_status()  # load
        time.sleep(1.0)  # let the load's aftermath (instance records, first reconciles) settle
        idle = idle_rate(server.proc.pid)
        started = time.perf_counter()
        results = measure(server, args.tokens, args.streams, args.pacing or list(DEFAULT_PACINGS), levels, idle)
    finally:
        server.stop()
    if args.json:
        print(
            json.dumps(
                {"tokens": args.tokens, "streams": args.streams, "idle_ms_per_s": idle * 1000, "ms_per_token": results}
            )
        )
        return
    protocols = list(next(iter(results.values())))
    columns = [(p, n) for p in results for n in levels]
    print(
        f"gateway CPU per relayed token (ms, net of idle), {args.streams} streams x {args.tokens} tokens per cell "
        f"({time.perf_counter() - started:.0f} s); idle: {idle * 1000:.1f} ms of CPU per second"
    )
    print(f"{'protocol':<20}" + "".join(f"{f'{p} x{n}':>18}" for p, n in columns))
    for protocol in protocols:
        print(f"{protocol:<20}" + "".join(f"{results[p][protocol][n]:>18.3f}" for p, n in columns))


if __name__ == "__main__":
    main()
