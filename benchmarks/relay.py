"""Gateway CPU per relayed token, per protocol, with a scripted runner process (``benchmarks.relay_plugin``).

    .venv/bin/python benchmarks/relay.py [--tokens 200] [--streams 20] [--pacing NAME ...] [--json]

Starts a gateway with the relay plugin; for each runner pacing (``PACINGS``: one event per chunk at 500/s; back
to back; bursts of 16 events per chunk, as a batched runner writes what it has ready; and, asked for with
``--pacing sparse``, one event per chunk at 40/s, which also counts the gateway's idle timers) and each
streaming protocol (OpenAI chat, OpenAI completions, OpenAI Responses, Anthropic Messages, Ollama chat and
generate) it runs ``--streams`` streams of ``--tokens`` tokens one after another and divides the gateway
process's CPU time (``/proc/<pid>/stat``, user + system) by the tokens it relayed. The runner's own CPU is in
another process and not counted. Target: <= 0.15 ms per token everywhere.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
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
}
DEFAULT_PACINGS = ("paced", "back-to-back", "burst16")


def cpu_seconds(pid: int) -> float:
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


def measure(server: Server, tokens: int, streams: int, pacings: list[str]) -> dict[str, dict[str, float]]:
    """Pacing -> protocol -> gateway CPU milliseconds per relayed token."""
    results: dict[str, dict[str, float]] = {}
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for pacing in pacings:
            prompt = PACINGS[pacing]
            results[pacing] = {}
            for protocol, (path, headers, body) in requests(prompt, tokens).items():
                for _ in range(3):
                    stream_once(client, path, headers, body)
                before = cpu_seconds(server.proc.pid)
                for _ in range(streams):
                    stream_once(client, path, headers, body)
                spent = cpu_seconds(server.proc.pid) - before
                results[pacing][protocol] = spent * 1000 / (streams * tokens)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=200)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument(
        "--pacing",
        action="append",
        choices=list(PACINGS),
        help=f"runner pacing(s) to measure (default: {', '.join(DEFAULT_PACINGS)})",
    )
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    server = Server(
        data_dir, "--plugin", "benchmarks.relay_plugin", env={"MESHGATE_DISABLED_PLUGINS": "llama_cpp,mlx,vllm"}
    )
    try:
        httpx.post(f"{server.url}/api/generate", json={"model": MODEL}, timeout=60).raise_for_status()  # load
        started = time.perf_counter()
        results = measure(server, args.tokens, args.streams, args.pacing or list(DEFAULT_PACINGS))
    finally:
        server.stop()
    if args.json:
        print(json.dumps({"tokens": args.tokens, "streams": args.streams, "ms_per_token": results}))
        return
    protocols = list(next(iter(results.values())))
    print(
        f"gateway CPU per relayed token (ms), {args.streams} streams x {args.tokens} tokens each "
        f"({time.perf_counter() - started:.0f} s)"
    )
    print(f"{'protocol':<20}" + "".join(f"{p:>16}" for p in results))
    for protocol in protocols:
        print(f"{protocol:<20}" + "".join(f"{results[p][protocol]:>16.3f}" for p in results))


if __name__ == "__main__":
    main()
