"""Relayed tokens per second through ``meshgate serve --workers N``, N = 1, 2, 4, against a scripted runner.

    .venv/bin/python benchmarks/workers.py [--workers 1,2,4] [--streams 256] [--tokens 256] [--seconds 5]
                                           [--rounds 3] [--pacing "burst=16 interval=0"]

For each N it starts a gateway with the relay plugin (``benchmarks.relay_plugin``: a runner process that plays
back ``--tokens`` text deltas as fast as it can write them, 16 per HTTP chunk by default, as a batched runner
writes a step; the built-in backends disabled), ``--workers N`` on the embedded default (N = 1: one process, no
Redis, as ever; N > 1: a private redis-server, one node agent, N workers), places the model and warms every worker,
then keeps ``--streams`` OpenAI chat streams open at once (each a connection of its own, so the kernel spreads
them over the workers; a finished stream is followed at once by the next) and counts what arrives in ``--seconds``
once all are under way (bytes, over a whole stream's bytes per token: streams cut at either end count for what
they received), ``--rounds`` times, showing the best window (a shared machine disturbs some; ``failed`` counts
streams that did not end well in all of them). The client is one asyncio loop on raw sockets that reads bytes and
checks each stream ended in ``[DONE]``: it parses nothing, so it costs little beside the gateway.

Printed side by side: tokens/s, ratio to linear (tokens/s over N times the 1-worker figure), each worker's CPU
(cores busy, from ``/proc/<pid>/task/*/schedstat``), gateway CPU per token, and the runner's and this client's
CPU, and the rest of the server's process tree (with N > 1: the redis-server, the node agent, the supervisor): when
the runner or the client is at a core, more workers cannot help, and the table shows it. ``x free-core linear``
is the figure against linear up to the cores those leave free: the 1-worker tokens/s per core of worker CPU, times
N or the free cores, whichever is less. Linux only.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.relay import cpu_seconds  # noqa: E402
from tests.conftest import Server  # noqa: E402

MODEL = "relay"
FIRST_FAILURE: list[str] = []  # what the first stream that did not end well received, for the note under the table


def cpu(pid: int) -> float:
    """``relay.cpu_seconds``, 0 for a process that is gone (a runner replaced mid-run: the run says so)."""
    try:
        return cpu_seconds(pid)
    except OSError:
        return 0.0


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (its children, theirs, ...)."""
    found, todo = [], [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*/children"):
            with contextlib.suppress(OSError):
                kids = [int(p) for p in task.read_text().split()]
                found += kids
                todo += kids
    return found


def cmdline(pid: int) -> list[bytes]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return []


def roles(server: Server) -> tuple[list[int], list[int]]:
    """The gateway processes (the server itself with one worker, else its workers) and the relay runners."""
    under = descendants(server.proc.pid)
    workers = [p for p in under if b"meshgate.gateway.cli.workers" in cmdline(p) and b"gateway" in cmdline(p)]
    runners = [p for p in under if b"benchmarks.relay_plugin" in cmdline(p)]
    return workers or [server.proc.pid], runners


def request(port: int, prompt: str, tokens: int) -> bytes:
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": prompt}],
            "max_tokens": tokens,
            "stream": True,
        }
    ).encode()
    head = (
        f"POST /v1/chat/completions HTTP/1.1\r\nhost: 127.0.0.1:{port}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    )
    return head.encode() + body


async def one_stream(port: int, payload: bytes, received: list[int]) -> int:
    """One stream read to its end on a connection of its own, each chunk's size added to ``received[0]`` as it
    comes; the stream's size if it ended well (200, ``[DONE]``), else 0."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(payload)
        size, head, tail = 0, b"", b""
        while chunk := await reader.read(65536):
            received[0] += len(chunk)
            size += len(chunk)
            head = head or chunk[:16]
            tail = (tail + chunk)[-64:]
        if head.startswith(b"HTTP/1.1 200") and b"[DONE]" in tail:
            return size
        if not FIRST_FAILURE:
            FIRST_FAILURE.append((head + b"..." + tail).decode(errors="replace"))
        return 0
    finally:
        writer.close()
        with contextlib.suppress(OSError):
            await writer.wait_closed()


async def load(
    port: int, streams: int, seconds: float, prompt: str, tokens: int, watched: Sequence[int] = ()
) -> dict[str, float]:
    """``streams`` clients streaming back to back; what arrived in the ``seconds`` that follow (streams cut at
    the end are counted by the bytes they had received: tokens = bytes over a whole stream's bytes per token),
    and the CPU seconds each ``watched`` process spent meanwhile."""
    payload = request(port, prompt, tokens)
    received, sizes, failed = [0], [], [0]

    async def client() -> None:
        while True:
            try:
                size = await one_stream(port, payload, received)
            except OSError:
                size = 0
            if size:
                sizes.append(size)
            else:
                failed[0] += 1

    tasks = [asyncio.create_task(client()) for _ in range(streams)]
    await asyncio.sleep(1.0)  # every client under way
    before, got, started = {p: cpu(p) for p in watched}, received[0], time.perf_counter()
    done = len(sizes)
    await asyncio.sleep(seconds)
    spent = {p: max(0.0, cpu(p) - before[p]) for p in watched}
    wall, got, done = time.perf_counter() - started, received[0] - got, len(sizes) - done
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
    per_token = statistics.median(sizes) / tokens if sizes else float("inf")
    return {
        "tokens": got / per_token,
        "wall": wall,
        "done": done,
        "failed": failed[0],
        **{str(p): spent[p] for p in watched},
    }


def measure(n: int, args: argparse.Namespace) -> dict:
    data = Path(tempfile.mkdtemp(prefix="meshgate-bench-workers-"))
    env = {
        "MESHGATE_DISABLED_PLUGINS": "llama_cpp,mlx,vllm",
        "MESHGATE_PARALLEL": str(args.streams * 2),  # slots: the relay runner has no limit of its own
        "MESHGATE_MAX_QUEUE": str(args.streams * 4),
        "MESHGATE_METRICS": "1",
    }
    server = Server(data, "--plugin", "benchmarks.relay_plugin", "--workers", str(n), env=env)
    try:
        placed = httpx.post(f"{server.url}/api/generate", json={"model": MODEL}, timeout=120)
        if placed.status_code != 200:
            raise RuntimeError(f"the relay model did not load: {placed.status_code} {placed.text}")
        deadline = time.monotonic() + 60
        while len(roles(server)[0]) < n and time.monotonic() < deadline:
            time.sleep(0.2)
        asyncio.run(load(server.port, min(args.streams, 64), 1.0, args.pacing, 16))  # every worker warm
        time.sleep(1.0)
        workers, runners = roles(server)
        rest = [q for q in [server.proc.pid, *descendants(server.proc.pid)] if q not in (*workers, *runners)]
        watched = [*workers, *runners, *rest, os.getpid()]  # rest: the store, the node agent, the supervisor
        rounds = [
            asyncio.run(load(server.port, args.streams, args.seconds, args.pacing, args.tokens, watched))
            for _ in range(args.rounds)
        ]
        got = max(rounds, key=lambda r: r["tokens"] / r["wall"])  # the best window: the least disturbed one
        got["failed"] = sum(r["failed"] for r in rounds)
        if roles(server) != (workers, runners):
            print(f"note: processes changed during the run with {n} workers (a restart?)", file=sys.stderr)
    except Exception:
        print(server.log.read_text(errors="replace")[-4000:], file=sys.stderr)
        raise
    finally:
        server.stop()
        shutil.rmtree(data, ignore_errors=True)
    tokens, wall = got["tokens"], got["wall"]
    spent = {p: got[str(p)] for p in watched}
    gateway_cpu = sum(spent[p] for p in workers)
    return {
        "workers": n,
        "tokens_per_s": tokens / wall,
        "streams": got["done"],
        "failed": got["failed"],
        "wall_s": wall,
        "worker_cores": [spent[p] / wall for p in workers],
        "gateway_us_per_token": gateway_cpu * 1e6 / max(tokens, 1),
        "runner_cores": sum(spent[p] for p in runners) / wall,
        "client_cores": spent[os.getpid()] / wall,
        "rest_cores": sum(spent[p] for p in rest) / wall,
    }


def free_linear(result: dict, one: dict, cores: int) -> float:
    """``result``'s tokens/s over linear up to the free cores: the 1-worker figure per core of worker CPU, times the
    cores its N workers could have had (N, or what the runner, the client and the rest of the tree left of the
    machine's ``cores``, whichever is less)."""
    per_core = one["tokens_per_s"] / max(sum(one["worker_cores"]), 1e-6)
    others = result["runner_cores"] + result["client_cores"] + result["rest_cores"]
    return result["tokens_per_s"] / (per_core * min(result["workers"], max(cores - others, 1e-6)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", default="1,2,4", help="worker counts, comma-separated (1,2,4)")
    parser.add_argument("--streams", type=int, default=256, help="streams open at once (256)")
    parser.add_argument("--tokens", type=int, default=256, help="tokens per stream (256)")
    parser.add_argument("--seconds", type=float, default=5.0, help="seconds of one measured window (5)")
    parser.add_argument("--rounds", type=int, default=3, help="windows per worker count; the best is shown (3)")
    parser.add_argument("--pacing", default="burst=16 interval=0", help="the relay runner's options (see relay_plugin)")
    parser.add_argument("--json", action="store_true", help="print the results as JSON")
    args = parser.parse_args()
    results = [measure(int(n), args) for n in args.workers.split(",") if n.strip()]
    if args.json:
        print(json.dumps(results))
        return
    one = next((r for r in results if r["workers"] == 1), None)  # the free-core column needs a 1-worker row
    base, cores = (one or results[0])["tokens_per_s"], os.cpu_count() or 1
    print(
        f"relayed tokens/s through the gateway: {args.streams} concurrent OpenAI chat streams x {args.tokens} tokens, "
        f"runner '{args.pacing}', best of {args.rounds} x {args.seconds:g} s per row, {cores} cores"
    )
    print(
        f"{'workers':>7} {'tokens/s':>10} {'x linear':>8} {'streams':>8} {'failed':>6} {'worker CPU (cores each)':>28} "
        f"{'us CPU/token':>12} {'runner':>7} {'client':>7} {'rest':>5} {'x free-core linear':>18}"
    )
    for r in results:
        each = " ".join(f"{c:.2f}" for c in r["worker_cores"])
        print(
            f"{r['workers']:>7} {r['tokens_per_s']:>10.0f} {r['tokens_per_s'] / (base * r['workers']):>8.2f} "
            f"{r['streams']:>8} {r['failed']:>6} {each:>28} {r['gateway_us_per_token']:>12.1f} "
            f"{r['runner_cores']:>7.2f} {r['client_cores']:>7.2f} {r['rest_cores']:>5.2f} "
            f"{free_linear(r, one, cores) if one else float('nan'):>18.2f}"
        )
    if FIRST_FAILURE:
        print(f"the first failed stream received: {FIRST_FAILURE[0]!r}")


if __name__ == "__main__":
    main()
