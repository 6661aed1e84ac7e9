"""Replicas and routing, measured side by side in one run: more machines serving more clients, prefix affinity
against plain least-loaded and round-robin routing, and what routing costs the gateway.

    .venv/bin/python benchmarks/replicas.py [--levels 8,16] [--tokens 64] [--conversations 16] [--turns 6]
                                            [--agents 4] [--agent-requests 3] [--agent-tokens 4000] [--json]

Every configuration is a fresh cluster on loopback: ``redis-server``, one ``meshgate node`` agent per node (each
runner with ``--threads`` llama.cpp threads, 1 by default) and one gateway, serving the packaged Gemma 3 270M.

1. **Capacity.** 1 replica on 1 node against 2 replicas on 2 nodes (``POST /instances`` with ``replicas``): for each
   level N, N clients each send ``--rounds`` streamed chat requests (``benchmarks/concurrency.run_level``);
   aggregate tok/s, TTFT p50/p99. Beside them, llama.cpp's raw batched decode of the same GGUF with the same
   threads, in this process (one replica's ceiling). From the 1-replica cluster also the two figures step 9
   left open: the first token of the 8th of 8 cold prompts, and gateway CPU per streamed token at one stream.
2. **Prefix-heavy load**, on 2 replicas, once per routing rule (``MESHGATE_ROUTING``: affinity, least_loaded,
   round_robin), each on a fresh cluster (cold caches): ``--conversations`` chats of ``--turns`` turns each (every
   turn resends the whole history) run at once beside ``--agents`` agent clients that each send
   ``--agent-requests`` tasks behind one shared system prompt of about ``--agent-tokens`` tokens. Reported: TTFT
   p50/p99, and prompt tokens reused from a runner's cache (``usage.prompt_tokens_details.cached_tokens``) over
   the tokens that could have been: for a turn, the previous turn's prompt (a prefix of this one); for an agent
   task after the first, the shared system prompt (as ``count_tokens`` counts it).
3. **Routing cost**: ``request_routing`` + ``route`` per request, in this process, with 2 and 8 replicas.

Every loop is bounded; every process is stopped on the way out.

Measured 2026-12-04 on the 2-core box, quiet (each node's runner 1 thread, so the 2-replica cluster's two runners
have the box's two cores and share them with the gateway, the agents, Redis and the clients). "raw 2 procs": two
llama.cpp processes in this script, each decoding n/2 sequences, started together, against "raw 1 proc" decoding n:
the engine's own ceiling for two one-thread replicas on this box.

    --levels 8,16 --tokens 32 --rounds 2
    | streams | 1 replica | 2 replicas | ratio | raw 1 proc | raw 2 procs | ratio | TTFT p50/p99, 1 | TTFT p50/p99, 2 |
    |       8 |  51.1 t/s |   78.3 t/s |  1.53 |   71.0 t/s |   107.2 t/s |  1.51 | 0.79 / 1.60 s   | 0.45 / 0.82 s   |
    |      16 |  56.4 t/s |   96.2 t/s |  1.71 |   85.7 t/s |   137.6 t/s |  1.61 | 1.00 / 7.71 s   | 0.64 / 1.28 s   |
    first token of the 8th of 8 cold prompts (1 replica, 1 thread): 1.00 s
    gateway CPU per streamed token at one stream: 0.625 ms (0.540 net of idle)

    (16 chats x 6 turns, 4 agents x 3 tasks, ~4,000-token shared system prompt, --tokens 32)
    | routing      | reused / reusable      | TTFT p50 | TTFT p99 | chat p50 | agent p50 | wall  |
    | affinity     | 53281 / 53933  (98.8%) |   0.79 s |  29.26 s |   0.78 s |    0.81 s |  65 s |
    | least_loaded | 49990 / 53933  (92.7%) |   0.82 s |  32.36 s |   0.86 s |    0.59 s |  78 s |
    | round_robin  | 45792 / 53933  (84.9%) |   1.08 s |  34.41 s |   1.13 s |    0.88 s | 106 s |
    routing cost: 22.3 us a request with the prefix key (2 replicas), 29.5 us (8); 3.6 us without a key

Run again 2026-12-07 (``--skip prefix``), with the raw columns also running the clients' own work (their chat
prompts prefilled one a decode, then their 32 tokens batched, timed whole: ``RawDecoder.workload_rate``; the
decode-only columns leave out the ~1 s of prefill each request waits for its first token):

    | streams | 1 replica | 2 replicas | ratio | raw 1 proc, with prefill | raw 2 procs, with prefill | meshgate / raw |
    |       8 |  44.0 t/s |   72.8 t/s |  1.65 |                45.6 t/s |                  76.6 t/s | 0.97x, 0.95x   |
    |      16 |  46.2 t/s |   84.9 t/s |  1.84 |                50.6 t/s |                  86.8 t/s | 0.91x, 0.98x   |
    (decode only, same run: raw 67.6 / 107.0 t/s at 8, 72.8 / 128.4 at 16)

Measured sequentially, raw minutes after meshgate, those ratios moved with the VM (another run: 1.19x, 0.97x at 8,
1.05x, 0.87x at 16), so each level's work now also runs raw just before and just after it, the cluster idle
("beside it"). Two runs the same afternoon, meshgate against the mean of the raw runs beside it:

    | streams, replicas | run 1                          | run 2                          |
    |             8, 1  | 51.9 t/s, raw 52.0 / 47.1: 1.05x | 49.9 t/s, raw 50.0 / 50.5: 0.99x |
    |            16, 1  | 58.5 t/s, raw 55.9 / 55.2: 1.05x | 47.4 t/s, raw 53.8 / 48.1: 0.93x |
    |             8, 2  | 82.6 t/s, raw 80.9 / 85.0: 1.00x | 72.9 t/s, raw 77.9 / 82.3: 0.91x |
    |            16, 2  | 94.1 t/s, raw 95.4 / 100.4: 0.96x | 93.9 t/s, raw 92.5 / 94.3: 1.01x |

Two replicas against one at 16 streams: 1.61x and 1.98x (the raw work beside them: 1.76x and 1.83x).

Two replicas give what two raw llama.cpp processes give here (1.51-1.61x one process: batching n/2 sequences is
less efficient than n, and the two share the box's memory bandwidth and the rest of the load), so the cluster
adds all the capacity the engine can on this box. Affinity reuses the most (98.8%) and finishes the workload
fastest (65 s against 106 s), but its TTFT p50 is 73% of round-robin's, not half: with two replicas, round-robin
still finds most of a chat's history on the replica it lands on (slots share cached prefixes), so the turns it
misses cost little next to queueing behind ~10 streams a one-thread runner.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.concurrency import (  # noqa: E402  (the repository root first, for tests.* and benchmarks.*)
    PROMPTS,
    Level,
    RawDecoder,
    idle_rate,
    packaged_gguf,
    run_level,
)
from meshgate.gateway.cli.bench import percentile  # noqa: E402

MODEL = "gemma3:270m"
N_CTX = 4096  # room for a conversation's sixth turn and an agent's long system prompt


@contextmanager
def cluster(
    data_dir: Path, logs: Path, nodes: int, threads: int, routing: str = "affinity"
) -> Iterator[tuple[str, int]]:
    """Redis, ``nodes`` agents and a gateway on loopback; yields the gateway's URL and pid once ``nodes`` replicas
    are ready and every node has calibrated llama.cpp (which would otherwise share the CPU with a measurement)."""
    from tests.cluster.redis_server import RedisServer
    from tests.cluster.test_cluster_e2e import FAST, Agent
    from tests.conftest import Server

    env = {**FAST, "MESHGATE_THREADS": str(threads), "MESHGATE_ROUTING": routing}
    memory = str(4 << 30)
    with RedisServer(logs / f"redis-{time.monotonic_ns()}") as redis:
        agents = [
            Agent(redis.url, f"node-{n + 1}", data_dir, logs, n_ctx=N_CTX, env=env, memory=memory) for n in range(nodes)
        ]
        gateway = None
        try:
            gateway = Server(data_dir, "--redis", redis.url, "--n-ctx", str(N_CTX), env=env)
            _wait(lambda: len(httpx.get(f"{gateway.url}/cluster").json()["nodes"]) == nodes, 120, "nodes")
            r = httpx.post(f"{gateway.url}/instances", json={"model": MODEL, "replicas": nodes}, timeout=120)
            r.raise_for_status()
            ids = [i["id"] for i in r.json()["replicas"]]

            def ready() -> bool:
                found = [httpx.get(f"{gateway.url}/instances/{i}").json() for i in ids]
                return all(i["state"]["state"] == "ready" for i in found)

            _wait(ready, 300, "replicas ready")

            def calibrated() -> bool:
                found = httpx.get(f"{gateway.url}/cluster").json()["nodes"]
                return all("llama_cpp" in n.get("calibration", {}) for n in found)

            _wait(calibrated, 600, "nodes calibrated")
            yield gateway.url, gateway.proc.pid
        finally:
            if gateway is not None:
                gateway.stop()
            for agent in agents:
                agent.stop()


def _wait(check, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if check():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"timed out waiting for {what}")


# ------------------------------------------------------------------------------------------- prefix-heavy load


@dataclass
class PrefixRun:
    routing: str
    requests: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    reusable: int = 0
    reused: int = 0
    wall_s: float = 0.0
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    conversation_ttft_p50: float = float("nan")
    agent_ttft_p50: float = float("nan")
    errors: list[str] = field(default_factory=list)

    @property
    def reuse(self) -> float:
        return self.reused / self.reusable if self.reusable else float("nan")


TOPICS = [
    "the history of Rome",
    "how bees make honey",
    "the rules of chess",
    "training for a marathon",
    "the water cycle",
    "how compilers work",
    "growing tomatoes",
    "the French revolution",
    "black holes",
    "learning the guitar",
    "the stock market",
    "baking sourdough",
    "volcanoes",
    "the printing press",
    "sleep and memory",
    "electric cars",
]


def agent_preamble(tokens: int) -> str:
    """A coding agent's system prompt of about ``tokens`` tokens (its rules and a tool catalogue, repeated)."""
    rules = (
        "You are a careful coding agent working in a large repository. Read files before editing them, keep "
        "changes small, run the tests after every change, and explain what you did in one short paragraph. "
        "Tool read_file(path) returns a file; tool write_file(path, text) replaces it; tool run(command) runs a "
        "shell command and returns its output; tool search(pattern) lists matching lines with their files. "
    )
    n = max(1, tokens // 94)  # the paragraph is ~94 tokens (Gemma 3's tokenizer)
    return "".join(f"Rule set {i + 1}. {rules}" for i in range(n))


async def _chat(client: httpx.AsyncClient, messages: list[dict], tokens: int) -> tuple[float, str, dict]:
    body = {
        "model": MODEL,
        "messages": messages,
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    first = None
    text: list[str] = []
    usage: dict = {}
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                first = first or time.perf_counter()
                text.append(chunk["choices"][0]["delta"]["content"])
            if chunk.get("usage"):
                usage = chunk["usage"]
    return (first or time.perf_counter()) - started, "".join(text), usage


async def prefix_load(url: str, routing: str, args: argparse.Namespace) -> PrefixRun:
    run = PrefixRun(routing)
    preamble = agent_preamble(args.agent_tokens)
    conversation_ttfts: list[float] = []
    agent_ttfts: list[float] = []
    limits = httpx.Limits(max_connections=64, max_keepalive_connections=64)
    async with httpx.AsyncClient(base_url=url, timeout=args.timeout, limits=limits, trust_env=False) as client:
        counted = await client.post(
            "/v1/messages/count_tokens",
            json={"model": MODEL, "system": preamble, "messages": [{"role": "user", "content": "."}]},
        )
        shared = counted.json().get("input_tokens", 0) - 8  # the system prompt, less the turn around "."

        async def conversation(n: int) -> None:
            topic = TOPICS[n % len(TOPICS)]
            messages = [{"role": "user", "content": f"Conversation {n}. Tell me about {topic} in a few sentences."}]
            previous = 0
            for turn in range(args.turns):
                try:
                    ttft, text, usage = await _chat(client, messages, args.tokens)
                except (httpx.HTTPError, RuntimeError) as exc:
                    run.failed += 1
                    run.errors.append(str(exc))
                    return
                conversation_ttfts.append(ttft)
                _count(run, usage, previous)
                previous = usage.get("prompt_tokens", 0)
                messages += [
                    {"role": "assistant", "content": text},
                    {"role": "user", "content": f"Turn {turn + 2}: and what else about {topic}?"},
                ]

        async def agent(n: int) -> None:
            for task in range(args.agent_requests):
                messages = [
                    {"role": "system", "content": preamble},
                    {"role": "user", "content": f"Task {n}.{task}: fix failing test number {n * 10 + task}."},
                ]
                try:
                    ttft, _, usage = await _chat(client, messages, args.tokens)
                except (httpx.HTTPError, RuntimeError) as exc:
                    run.failed += 1
                    run.errors.append(str(exc))
                    continue
                agent_ttfts.append(ttft)
                _count(run, usage, shared if (n, task) != (0, 0) else 0)

        started = time.perf_counter()
        await asyncio.gather(
            *(conversation(n) for n in range(args.conversations)), *(agent(n) for n in range(args.agents))
        )
        run.wall_s = time.perf_counter() - started
    ttfts = conversation_ttfts + agent_ttfts
    run.ttft_p50, run.ttft_p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    run.conversation_ttft_p50 = percentile(conversation_ttfts, 0.5)
    run.agent_ttft_p50 = percentile(agent_ttfts, 0.5)
    return run


def _count(run: PrefixRun, usage: dict, reusable: int) -> None:
    run.requests += 1
    prompt = usage.get("prompt_tokens", 0)
    run.prompt_tokens += prompt
    run.reusable += min(reusable, prompt)
    run.reused += min((usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0), reusable, prompt)


# ------------------------------------------------------------------------------------------- routing cost


def routing_cost(replicas: int, n: int = 20000) -> tuple[float, float]:
    """Microseconds per request: (request_routing + route with affinity, route without a key)."""
    from meshgate.gateway.cluster.routing import Replica, route
    from meshgate.gateway.serving.dispatch import request_routing
    from meshgate.protocols.model import Message, Request, TextPart

    pool = [Replica(f"{n:012x}", n % 4) for n in range(replicas)]
    request = Request(
        model=MODEL,
        messages=(
            Message(role="system", parts=(TextPart(text=agent_preamble(1000)),)),
            Message(role="user", parts=(TextPart(text="Fix the failing test."),)),
        ),
    )
    rng = random.Random(0)
    started = time.perf_counter()
    for _ in range(n):
        route(pool, request_routing(request).key, rng)
    keyed = (time.perf_counter() - started) / n * 1e6
    started = time.perf_counter()
    for _ in range(n):
        route(pool, None, rng)
    return keyed, (time.perf_counter() - started) / n * 1e6


# ------------------------------------------------------------------------------------------- the run


_RAW_CHILD = """
import sys
sys.path.insert(0, sys.argv[1])
from benchmarks.concurrency import PROMPTS, RawDecoder
raw = RawDecoder(sys.argv[2], int(sys.argv[3]), 2048)
raw.decode_rate(1, 4, PROMPTS)
print("ready", flush=True)
sys.stdin.readline()
n, steps, rounds = int(sys.argv[4]), int(sys.argv[5]), int(sys.argv[6])
print(raw.decode_rate(n, steps, PROMPTS) if rounds == 0 else raw.workload_rate(n, steps, PROMPTS, rounds), flush=True)
"""


def raw_pair_rate(gguf: Path, threads: int, n: int, steps: int, rounds: int = 0) -> float:
    """Tokens per second of two raw llama.cpp processes decoding ``n // 2`` sequences each, started together: the
    most two one-node replicas could give on this box (against ``RawDecoder.decode_rate(n)`` in one process);
    with ``rounds``, ``RawDecoder.workload_rate``'s prefill and decode instead."""
    argv = [sys.executable, "-c", _RAW_CHILD, str(ROOT), str(gguf), str(threads), str(n // 2), str(steps)]
    argv.append(str(rounds))
    procs = [subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        for proc in procs:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        return sum(float(proc.communicate(timeout=600)[0]) for proc in procs)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="8,16", help="concurrent streams per level, comma-separated")
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens of each request (greedy)")
    parser.add_argument("--rounds", type=int, default=2, help="requests each capacity client sends in turn")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp threads of each node's runner")
    parser.add_argument("--conversations", type=int, default=16)
    parser.add_argument("--turns", type=int, default=6)
    parser.add_argument("--agents", type=int, default=4, help="agent clients sharing one system prompt")
    parser.add_argument("--agent-requests", type=int, default=3, help="tasks each agent client sends in turn")
    parser.add_argument("--agent-tokens", type=int, default=4000, help="tokens of the agents' system prompt")
    parser.add_argument("--skip", default="", help="parts to leave out: capacity,prefix")
    parser.add_argument("--routings", default="affinity,least_loaded,round_robin")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds one request may take")
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",") if n.strip()]
    skip = set(args.skip.split(","))
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    logs = Path(os.environ.get("TMPDIR", "/tmp")) / f"meshgate-replicas-{os.getpid()}"
    logs.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))
    report: dict = {"levels": levels, "threads": args.threads, "tokens": args.tokens}

    if "capacity" not in skip:
        capacity: dict[int, list[Level]] = {}
        gguf = packaged_gguf(data_dir)
        raw = RawDecoder(str(gguf), args.threads, 2048)
        raw.decode_rate(1, 4, PROMPTS)
        beside: dict[int, dict[int, tuple[float, float]]] = {1: {}, 2: {}}  # raw with prefill before / after a level

        def raw_work(nodes: int, n: int) -> float:
            """The level's work done raw while the cluster idles: in this process (1 node) or two (2 nodes)."""
            if nodes == 1:
                return raw.workload_rate(n, args.tokens, PROMPTS, args.rounds)
            return raw_pair_rate(gguf, args.threads, n, args.tokens, args.rounds)

        for nodes in (1, 2):
            say(f"capacity: {nodes} replica(s) on {nodes} node(s) ...")
            with cluster(data_dir, logs, nodes, args.threads) as (url, pid):
                asyncio.run(run_level(url, MODEL, nodes, 1, 8, None, args.timeout))  # warm-up
                if nodes == 1:
                    idle = idle_rate(pid)
                    one = asyncio.run(run_level(url, MODEL, 1, 4, args.tokens, pid, args.timeout, idle))
                    report["one_stream_gateway_cpu_ms_per_token"] = one.gateway_cpu_ms_per_token
                    report["one_stream_gateway_cpu_ms_per_token_net"] = one.gateway_cpu_ms_per_token_net
                capacity[nodes] = []
                for n in levels:
                    before = raw_work(nodes, n)  # the same work raw, just before and just after: the VM drifts
                    level = asyncio.run(run_level(url, MODEL, n, args.rounds, args.tokens, pid, args.timeout))
                    beside[nodes][n] = (before, raw_work(nodes, n))
                    capacity[nodes].append(level)
                    say(f"  {n} streams: {level.tok_s:.1f} tok/s, TTFT p99 {level.ttft_p99:.2f} s")
                if nodes == 1 and 8 in levels:
                    cold = asyncio.run(run_level(url, MODEL, 8, 1, 8, None, args.timeout))  # 8 new prompts
                    report["eighth_cold_prompt_ttft_s"] = cold.ttft_p99
        report["raw_tok_s"] = {n: raw.decode_rate(n, args.tokens, PROMPTS) for n in levels}
        report["raw_pair_tok_s"] = {n: raw_pair_rate(gguf, args.threads, n, args.tokens) for n in levels}
        # the clients' own work done raw: their prompts prefilled, then their tokens, timed whole
        report["raw_work_tok_s"] = {n: raw.workload_rate(n, args.tokens, PROMPTS, args.rounds) for n in levels}
        report["raw_work_pair_tok_s"] = {
            n: raw_pair_rate(gguf, args.threads, n, args.tokens, args.rounds) for n in levels
        }
        report["raw_work_beside_tok_s"] = beside
        report["capacity"] = {nodes: [asdict(lv) for lv in lvs] for nodes, lvs in capacity.items()}
        say("")
        say(
            f"Capacity: {args.rounds} streamed chats a client, max_tokens {args.tokens}, "
            f"{args.threads} llama.cpp thread(s) a node"
        )
        say(f"{'streams':>7} {'1 replica tok/s':>16} {'2 replicas tok/s':>17} {'ratio':>6} {'raw 1 proc':>10} "
            f"{'raw 2 procs':>11} {'ratio':>6} {'TTFT p50/p99, 1':>16} {'TTFT p50/p99, 2':>16}")  # fmt: skip
        for a, b in zip(capacity[1], capacity[2], strict=True):
            one, two = report["raw_tok_s"][a.concurrency], report["raw_pair_tok_s"][a.concurrency]
            say(
                f"{a.concurrency:>7} {a.tok_s:16.1f} {b.tok_s:17.1f} {b.tok_s / a.tok_s:6.2f} "
                f"{one:10.1f} {two:11.1f} {two / one:6.2f} {a.ttft_p50:7.2f}/{a.ttft_p99:<7.2f}s "
                f"{b.ttft_p50:7.2f}/{b.ttft_p99:<7.2f}s"
            )
        say("with prefill (the raw columns run the clients' prompts, then their tokens, timed whole):")
        for a, b in zip(capacity[1], capacity[2], strict=True):
            one, two = report["raw_work_tok_s"][a.concurrency], report["raw_work_pair_tok_s"][a.concurrency]
            say(
                f"{a.concurrency:>7} {a.tok_s:16.1f} {b.tok_s:17.1f} {b.tok_s / a.tok_s:6.2f} "
                f"{one:10.1f} {two:11.1f} {two / one:6.2f}   meshgate / raw: {a.tok_s / one:.2f}x, {b.tok_s / two:.2f}x"
            )
        say("beside it (the same work raw just before and just after each level, the cluster idle; mean of the two):")
        for nodes in (1, 2):
            for level in capacity[nodes]:
                before, after = beside[nodes][level.concurrency]
                say(
                    f"{level.concurrency:>7} streams, {nodes} replica(s): meshgate {level.tok_s:.1f}, raw {before:.1f} "
                    f"before / {after:.1f} after: {level.tok_s / ((before + after) / 2):.2f}x"
                )
        if "eighth_cold_prompt_ttft_s" in report:
            say(f"first token of the 8th of 8 cold prompts (1 replica): {report['eighth_cold_prompt_ttft_s']:.2f} s")
        say(
            f"gateway CPU per streamed token at one stream: {report['one_stream_gateway_cpu_ms_per_token']:.3f} ms "
            f"({report['one_stream_gateway_cpu_ms_per_token_net']:.3f} net of idle)"
        )

    if "prefix" not in skip:
        runs = []
        for routing in args.routings.split(","):
            say(f"prefix-heavy load, routing {routing} ...")
            with cluster(data_dir, logs, 2, args.threads, routing) as (url, _):
                runs.append(asyncio.run(prefix_load(url, routing, args)))
        report["prefix"] = [{**asdict(r), "reuse": r.reuse} for r in runs]
        say("")
        say(
            f"Prefix-heavy: {args.conversations} chats x {args.turns} turns beside {args.agents} agents x "
            f"{args.agent_requests} tasks behind a ~{args.agent_tokens}-token system prompt; 2 replicas"
        )
        say(f"{'routing':>13} {'reused/reusable':>16} {'TTFT p50':>9} {'TTFT p99':>9} {'chat p50':>9} "
            f"{'agent p50':>9} {'wall':>7} {'failed':>6}")  # fmt: skip
        for r in runs:
            say(
                f"{r.routing:>13} {r.reused:>7}/{r.reusable:<7} {r.reuse:5.1%} {r.ttft_p50:8.2f}s {r.ttft_p99:8.2f}s "
                f"{r.conversation_ttft_p50:8.2f}s {r.agent_ttft_p50:8.2f}s {r.wall_s:6.0f}s {r.failed:>6}"
            )
            for error in r.errors[:3]:
                say(f"    failed: {error}")

    costs = {n: routing_cost(n) for n in (2, 8)}
    report["routing_us"] = costs
    say("")
    for n, (keyed, plain) in costs.items():
        say(f"routing cost, {n} replicas: {keyed:.1f} us with the prefix key, {plain:.1f} us without")
    if args.json:
        print(json.dumps(report, default=str).replace("NaN", "null"))


if __name__ == "__main__":
    main()
