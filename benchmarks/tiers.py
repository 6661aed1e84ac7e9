"""Service tiers: a batch job in the capacity interactive clients leave, and a gateway killed halfway through one.

    .venv/bin/python benchmarks/tiers.py [--lines 500] [--clients 4] [--rounds 4] [--json]
    .venv/bin/python benchmarks/tiers.py --lines 60 --rounds 3 --kill-lines 60      # ~10 minutes on 2 cores

Starts a gateway on the packaged Gemma 3 270M GGUF (``meshgate serve``, ``MESHGATE_PARALLEL`` lanes, ``--spares``
spare sequences: ``MESHGATE_BATCH_SPARES``; ``MESHGATE_BATCH_CONCURRENCY`` = the lanes) and measures, from the
client:

1. **idle**: ``--clients`` interactive clients chat at once, ``--rounds`` streamed greedy requests each, one after
   another, ``--waves`` times: time to first token (request sent to first content chunk), p50 and p99 (each
   prompt starts with its own tag: no chat finds its question in a slot);
2. **batch alone**: a batch of ``--lines`` short chat lines (greedy, ``max_tokens`` ``--line-tokens``) through the
   OpenAI Batch API (``/v1/files`` + ``/v1/batches``, polled): lines/s and completion tokens/s from creation to
   completion: the runner's capacity with no interactive load; then the idle clients again (``idle, after the
   batch``: the machine after minutes of load, as the mixed phase finds it);
3. **batch + interactive**: the same batch again with the same clients chatting while it runs (``--waves`` waves,
   ``--wave-gap`` seconds apart, the first 2 s after the batch starts): their TTFT against
   both idle figures, and the batch's lines/s and tokens/s against (2), and against the capacity the chats left
   (the gaps: (2)'s tokens/s times this phase's wall time, less the tokens the chats generated); then the idle
   clients a third time (``idle, after both``), so the mixed phase has an idle phase on either side of it in time:
   its TTFT is set against each idle phase and against the mean of those two neighbours (the VM's speed drifts by
   up to 10% between minutes, and one phase's chats take about 10 s of prefill and decode in all);
4. **killed halfway** (``--kill-lines``, 0 to skip): Redis, one ``meshgate node`` agent holding the runner, and two
   gateways on the store. A batch is created on gateway A; when half its lines are done A is SIGKILLed and started
   again; its claimed lines run again once their lease (``MESHGATE_BATCH_LEASE``, ``--lease``) runs out. The
   output and error files must answer every ``custom_id`` exactly once. (Without Redis batch jobs live in the
   gateway's memory and die with it: the restart part needs the store.)
5. **paired** (``--pairs``, 0 to skip; run before the kill phase): rounds of one idle wave and one wave beside a
   fresh batch of ``--pair-lines`` (cancelled once its wave is done, the runner left to empty), in ABBA order: the
   two sets of chats are seconds apart, so the VM's drift, which moves whole phases by more than 10%, cancels.
   ``--lines 0`` runs only this.

Every loop is bounded by ``--timeout``. The figures depend on the machine and on what else runs on it: on a shared
box they are noisy, so each phase prints ``other``, the cores' worth of CPU spent outside the gateway's processes
and the benchmark's while it ran (``OtherLoad``): a run whose ``other`` is not near 0 measured the box's load too.

Measured 2026-12-07 on the quiet 2-core box (``other`` 0.01 in every phase), defaults (500 lines of 16 tokens,
4 clients x 4 chats of 24 tokens x 6 waves, 4 lanes + 4 spares, exact batches), 425 s in all:

    phase                    TTFT p50      p99 chats lines  wall s lines/s   tok/s  once
    idle                        0.245    0.477    96     0
    batch alone                     -        -     0   500   121.8    4.10    65.7   yes
    idle, after the batch       0.251    0.517    96     0
    batch + chats               0.282    0.540    96   500   158.0    3.16    50.6   yes   TTFT x1.11 (p50), x1.02
                                                                                          (p99) of its neighbours'
                                                                                          mean; 77% of the batch
                                                                                          alone, 99% of the gaps
    idle, after both            0.255    0.539    96     0
    gateway killed halfway          -        -     0   100    35.0    2.86    45.7   yes   A killed at 52 done

The run before it: idle 0.240 / 0.288 / 0.279 s (p50; the three idle phases of one run differ by 20%), beside the
batch 0.275 s: x0.97 (p50) and x1.02 (p99) of its neighbours' mean, 105% of the gaps. Earlier runs without the
neighbours ranged from x1.05 to x1.40 against the idle phase before the batch (all but the last with the benchmark's
own polling taking 6% of a core, since fixed). Where a chat's time goes in the runner (a trace of
``batch.Scheduler``, submit to first token, means over 80 chats a phase, one run): idle 263 ms = own prompt 102 +
other chats' prompts 144 + decode steps 15 + 2; beside the batch 288 ms = 103 + 155 + decode steps 23 (14 of them
with batch rows) + batch prompt chunks 4 + 3. What the batch itself adds there is ~12 ms (~4%); a chat's prompt
takes 98-106 ms in every phase, moving with the VM, not with the batch. Prompts are evaluated one sequence at a time
(exact batches: a row's numbers must not depend on its neighbours), so the fourth chat of a wave waits for three.
With ``--threads 1 --lines 250 --kill-lines 0`` (a core left to the gateway, the runner's event loop and the
clients): idle 0.456 / 0.444 / 0.444 s, beside the batch 0.432 s, x0.97 (p50) and x0.95 (p99) of its neighbours'
mean, 106% of the gaps; a second run x1.02 / x1.04, 93%. What is left above at two threads is each hop of a chat's
request waiting for a core that llama.cpp holds for the whole mixed phase.

Paired waves (``--pairs``, added since: each round one idle wave and one beside a fresh batch, ABBA, seconds
apart). Defaults, 2026-12-07 evening, after a step that a chat shares with batch jobs became stoppable for a
newcomer (``batch.Scheduler``): idle 0.306 / 0.298 / 0.244 s, beside the batch 0.314 s (x1.02 / x1.05 / x1.29 p50),
77% of the batch alone (62.5 tok/s), 99% of the gaps; paired: idle waves 0.274 / 0.484 s, beside a batch 0.264 /
0.530 s: **x0.97 (p50), x1.09 (p99)**, the rounds' ratios x0.76-x1.14 (median x1.00); 100 of 100 lines exactly once
after the kill. Paired only (``--lines 0 --kill-lines 0 --pairs 8``), back to back: without that change x1.14 /
x1.22, with it x1.00 / x0.85 (and x1.07 / x0.99 just before). Tried and dropped: batch-only decodes on a second
thread at Linux's ``SCHED_IDLE`` (x1.10 / x1.05 paired), since a second decoding thread gives llama.cpp a second
OpenMP team and libgomp then throttles every team's barriers (docs/runtimes.md): the batch alone fell to 39-47
tok/s and the idle phases after it slowed by a third.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import io
import itertools
import json
import os
import shutil
import signal
import statistics
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from meshgate.gateway.cli.bench import percentile  # the nearest-rank quantile `meshgate bench` reports

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "gemma3:270m"
CHATS = [
    "Explain how a hash table works.",
    "What causes the seasons on Earth?",
    "Describe a relaxing weekend in the mountains.",
    "Give three tips for writing clear documentation.",
    "What is the difference between a process and a thread?",
    "How does photosynthesis work?",
]
SECRET = "tiers-benchmark"  # the runners' secret, to read their /health
TOPICS = ["rivers", "owls", "bridges", "tea", "comets", "maps", "bees", "clocks", "salt", "kites", "ferns", "glass"]


@dataclass
class Phase:
    name: str
    ttft_p50: float | None = None
    ttft_p99: float | None = None
    chats: int = 0
    lines: int = 0
    wall_s: float = 0.0
    lines_s: float | None = None
    tokens_s: float | None = None
    answered_once: bool | None = None
    gap_share: float | None = None  # batch tokens against the alone rate x wall, less the chats' tokens
    other_cores: float | None = None  # CPU spent outside the gateway and the benchmark meanwhile (``OtherLoad``)
    notes: list[str] = field(default_factory=list)


# --------------------------------------------------------------------------------------------- interactive clients


async def chat(client: httpx.AsyncClient, prompt: str, tokens: int) -> tuple[float, int]:
    """One streamed greedy chat; returns its time to first content chunk and the tokens it generated."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    generated = 0
    started = time.perf_counter()
    first = None
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line.replace(" ", ""):
                chunk = json.loads(line[6:])
                if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                    first = time.perf_counter() - started
            elif line.startswith("data: {") and '"usage":{' in line.replace(" ", ""):
                generated = (json.loads(line[6:]).get("usage") or {}).get("completion_tokens", 0)
    if first is None:
        raise RuntimeError("no content")
    return first, generated


_WAVES = itertools.count()


async def clients(url: str, n: int, rounds: int, tokens: int, timeout: float) -> list[tuple[float, int]]:
    """``n`` clients, ``rounds`` chats each one after another: every chat's TTFT and generated tokens. Every prompt
    starts with its own tag, so no chat finds more of itself in a slot than the chat template (a slot that held
    the same question would make a chat faster in one phase than in the other). The clients share the one
    ``CHATTERS`` client of ``url`` (its connections stay open between waves): a new httpx client builds an SSL
    context, tens of milliseconds of CPU taken from llama.cpp's threads just as a wave's prompts are evaluated."""
    wave = next(_WAVES)
    if url not in CHATTERS:
        CHATTERS[url] = httpx.AsyncClient(base_url=url, timeout=timeout, limits=httpx.Limits(max_connections=64))
    client = CHATTERS[url]

    async def one(i: int) -> list[tuple[float, int]]:
        return [await chat(client, f"[{wave}.{i}.{r}] " + CHATS[(i + r) % len(CHATS)], tokens) for r in range(rounds)]

    return [t for ts in await asyncio.gather(*(one(i) for i in range(n))) for t in ts]


async def one_chat(url: str, timeout: float) -> None:
    """One short chat on a client of its own (closed again): the model is loaded and answers."""
    await clients(url, 1, 1, 4, timeout)
    await forget_chatters()


CHATTERS: dict[str, httpx.AsyncClient] = {}  # by base URL, for the life of one event loop (``forget_chatters``)


async def forget_chatters() -> None:
    """Close the shared chat clients (before their event loop ends)."""
    for client in CHATTERS.values():
        await client.aclose()
    CHATTERS.clear()


# ------------------------------------------------------------------------------------------------------ batch jobs


def lines(n: int, tokens: int) -> list[dict]:
    return [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": MODEL,
                "messages": [{"role": "user", "content": f"One sentence about {TOPICS[i % len(TOPICS)]} ({i})."}],
                "max_tokens": tokens,
                "temperature": 0,
            },
        }
        for i in range(n)
    ]


def create_batch(url: str, rows: list[dict]) -> str:
    data = "\n".join(json.dumps(row) for row in rows).encode()
    files = {"file": ("lines.jsonl", io.BytesIO(data), "application/jsonl")}
    uploaded = httpx.post(f"{url}/v1/files", files=files, data={"purpose": "batch"}, timeout=60)
    uploaded.raise_for_status()
    body = {"input_file_id": uploaded.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = httpx.post(f"{url}/v1/batches", json=body, timeout=60)
    created.raise_for_status()
    return str(created.json()["id"])


def batch_state(url: str, batch_id: str, http: httpx.Client | None = None) -> dict:
    answer = (http or httpx).get(f"{url}/v1/batches/{batch_id}", timeout=30)
    answer.raise_for_status()
    return dict(answer.json())


async def wait_batch(url: str, batch_id: str, timeout: float) -> dict:
    """Poll the batch once a second until it ends, on one client (a new client a poll would build an SSL context
    each time: ~6% of a core at two polls a second, measured, taken from the chats' prefills)."""
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=30) as http:
        while time.monotonic() < deadline:
            state = await asyncio.to_thread(batch_state, url, batch_id, http)
            if state["status"] in ("completed", "failed", "expired", "cancelled"):
                return state
            await asyncio.sleep(1.0)
    raise RuntimeError(f"batch {batch_id} did not finish in {timeout:g} s")


def results(url: str, state: dict) -> list[dict]:
    """The output and error files' rows."""
    rows = []
    for key in ("output_file_id", "error_file_id"):
        if state.get(key):
            text = httpx.get(f"{url}/v1/files/{state[key]}/content", timeout=60).text
            rows += [json.loads(line) for line in text.splitlines() if line.strip()]
    return rows


def tokens_of(rows: list[dict]) -> int:
    return sum(
        ((row.get("response") or {}).get("body") or {}).get("usage", {}).get("completion_tokens", 0) for row in rows
    )


def exactly_once(rows: list[dict], n: int) -> tuple[bool, str]:
    seen = Counter(row["custom_id"] for row in rows)
    missing = [f"line-{i}" for i in range(n) if f"line-{i}" not in seen]
    twice = [cid for cid, k in seen.items() if k > 1]
    errors = sum(1 for row in rows if row.get("error") or (row.get("response") or {}).get("status_code") != 200)
    return (
        not missing and not twice,
        f"{len(seen)} answered, {len(missing)} missing, {len(twice)} twice, {errors} errors",
    )


async def run_batch(url: str, n: int, tokens: int, timeout: float, name: str) -> tuple[Phase, float, float]:
    """A batch of ``n`` lines from creation to completion: the phase, when it was created and when it ended."""
    rows = lines(n, tokens)
    started = time.perf_counter()
    batch_id = await asyncio.to_thread(create_batch, url, rows)
    state = await wait_batch(url, batch_id, timeout)
    ended = time.perf_counter()
    got = await asyncio.to_thread(results, url, state)
    once, note = exactly_once(got, n)
    wall = ended - started
    phase = Phase(name, lines=n, wall_s=wall, lines_s=n / wall, tokens_s=tokens_of(got) / wall, answered_once=once)
    phase.notes.append(f"{state['status']}: {note}")
    return phase, started, ended


def ttft(phase: Phase, chats: list[tuple[float, int]]) -> Phase:
    times = [t for t, _ in chats]
    phase.chats = len(times)
    phase.ttft_p50, phase.ttft_p99 = statistics.median(times), percentile(times, 99)
    return phase


class OtherLoad:
    """The CPU the machine spent outside the gateway's processes (``pid`` and its descendants) and this one while a
    phase ran, in cores: the load a phase's figures shared the box with (two cores leave no room for a third busy
    process: a chat's path waits for a core at each hop). Processes that ended during the phase count as other."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.start = self._read()

    def _read(self) -> tuple[float, float, float]:
        from benchmarks.workers import descendants

        tick = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as f:
            values = [int(v) for v in f.readline().split()[1:9]]
        busy = (sum(values) - values[3] - values[4]) / tick  # all but idle and iowait
        ours = 0.0
        for pid in [self.pid, *descendants(self.pid)]:
            with contextlib.suppress(OSError, IndexError, ValueError):  # one that ended meanwhile
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                ours += (int(fields[11]) + int(fields[12])) / tick  # utime + stime, its ended threads' included
        return time.monotonic(), busy, ours + time.process_time()

    def cores(self) -> float:
        now, busy, ours = self._read()
        then, busy0, ours0 = self.start
        return max(0.0, (busy - busy0) - (ours - ours0)) / max(now - then, 1e-6)


# ----------------------------------------------------------------------------------------------------- the phases


def gateway_env(args: argparse.Namespace) -> dict[str, str]:
    return {
        "MESHGATE_PARALLEL": str(args.parallel),
        "MESHGATE_BATCH_SPARES": str(args.spares),
        "MESHGATE_BATCH_CONCURRENCY": str(args.parallel),
        "MESHGATE_BATCH_LEASE": str(args.lease),
        "MESHGATE_EXACT_BATCHES": "1",
        "MESHGATE_CLUSTER_SECRET": SECRET,
    }


async def tiers(url: str, pid: int, args: argparse.Namespace, say) -> list[Phase]:
    await clients(url, 1, 1, 4, args.timeout)  # loads the model

    async def idle(name: str) -> Phase:
        load = OtherLoad(pid)
        chats: list[tuple[float, int]] = []
        for _ in range(args.waves):
            chats += await clients(url, args.clients, args.rounds, args.chat_tokens, args.timeout)
        phase = ttft(Phase(name, other_cores=load.cores()), chats)
        say(row(phase))
        return phase

    if not args.lines:
        phases = await paired(url, pid, args, say)
        await forget_chatters()
        return phases
    phases = [await idle("idle")]
    load = OtherLoad(pid)
    alone, _, _ = await run_batch(url, args.lines, args.line_tokens, args.timeout, "batch alone")
    alone.other_cores = load.cores()
    phases.append(alone)
    say(row(alone))
    phases.append(await idle("idle, after the batch"))  # right after minutes of load, as the mixed phase comes
    load = OtherLoad(pid)
    batch = asyncio.create_task(run_batch(url, args.lines, args.line_tokens, args.timeout, "batch + chats"))
    chats: list[tuple[float, int]] = []
    for wave in range(args.waves):  # spread over the batch's run: the first once its lanes are taken
        await asyncio.sleep(2.0 if wave == 0 else args.wave_gap)
        if not batch.done():
            chats += await clients(url, args.clients, args.rounds, args.chat_tokens, args.timeout)
    mixed, _, _ = await batch
    mixed.other_cores = load.cores()
    ttft(mixed, chats)
    last = await idle("idle, after both")  # the mixed phase's other neighbour in time
    phases += [mixed, last]
    for q in ("p50", "p99"):  # against each idle phase, and against the two on either side of it
        idles = [getattr(phases[k], f"ttft_{q}") or 1.0 for k in (0, 2, 4)]
        now = getattr(mixed, f"ttft_{q}") or 0.0
        ratios = " / ".join(f"x{now / t:.2f}" for t in [*idles, (idles[1] + idles[2]) / 2])
        mixed.notes.append(f"TTFT {ratios} ({q}) of idle before / after / after both / its neighbours' mean")
    mixed.notes.append(f"throughput {mixed.lines_s / alone.lines_s:.0%} of the batch alone")  # type: ignore[operator]
    # the gaps the chats left: what the runner does alone in the same time, less the tokens the chats took
    chat_tokens = sum(n for _, n in chats)
    gaps = alone.tokens_s * mixed.wall_s - chat_tokens  # type: ignore[operator]
    mixed.gap_share = mixed.tokens_s * mixed.wall_s / gaps  # type: ignore[operator]
    mixed.notes.append(f"{mixed.gap_share:.0%} of the capacity the chats left ({chat_tokens} chat tokens)")
    say(row(mixed))
    health = runner_health(url)
    mixed.notes.append(
        f"runner: {health.get('paused_batch_jobs', '?')} batch jobs paused in all, "
        f"{health.get('interrupted_steps', '?')} batch steps stopped for a chat"
    )
    if args.pairs:
        phases += await paired(url, pid, args, say)
    await forget_chatters()
    return phases


async def paired(url: str, pid: int, args: argparse.Namespace, say) -> list[Phase]:
    """``--pairs`` rounds of one idle wave and one wave beside a running batch, in ABBA order (idle first in even
    rounds, the batch first in odd ones), so the two sets of chats are measured seconds apart, not minutes: the
    VM's drift between phases cancels. A wave beside a batch: a batch of ``--pair-lines`` lines is created, its
    lanes fill (2 s, as in the mixed phase), the clients chat once, and the batch is cancelled and the runner left
    to empty before the next wave. TTFT p50/p99 of each set, and the batch waves' against the idle ones'."""
    load = OtherLoad(pid)
    idle: list[tuple[float, int]] = []
    beside: list[tuple[float, int]] = []
    per_round = []
    for k in range(args.pairs):
        waves = {}
        for which in ("idle", "beside") if k % 2 == 0 else ("beside", "idle"):
            if which == "idle":
                waves[which] = await clients(url, args.clients, args.rounds, args.chat_tokens, args.timeout)
                continue
            batch_id = await asyncio.to_thread(create_batch, url, lines(args.pair_lines, args.line_tokens))
            await asyncio.sleep(2.0)
            waves[which] = await clients(url, args.clients, args.rounds, args.chat_tokens, args.timeout)
            await asyncio.to_thread(cancel_batch, url, batch_id)
            state = await wait_batch(url, batch_id, args.timeout)
            if state["status"] == "completed":
                raise RuntimeError(
                    f"the batch of {args.pair_lines} lines ended before its wave: pass more --pair-lines"
                )
            await asyncio.to_thread(runner_empty, url, args.timeout)
        idle += waves["idle"]
        beside += waves["beside"]
        per_round.append(
            statistics.median(t for t, _ in waves["beside"]) / statistics.median(t for t, _ in waves["idle"])
        )
    other = load.cores()
    phases = [ttft(Phase("idle, paired", other_cores=other), idle), ttft(Phase("beside a batch, paired"), beside)]
    a, b = phases
    spread = f"x{min(per_round):.2f}-x{max(per_round):.2f}, median x{statistics.median(per_round):.2f}"
    b.notes.append(
        f"TTFT x{b.ttft_p50 / a.ttft_p50:.2f} (p50), x{b.ttft_p99 / a.ttft_p99:.2f} (p99) of the idle waves "  # type: ignore[operator]
        f"between; each round's wave medians {spread}"
    )
    for phase in phases:
        say(row(phase))
    return phases


def cancel_batch(url: str, batch_id: str) -> None:
    httpx.post(f"{url}/v1/batches/{batch_id}/cancel", timeout=30).raise_for_status()


def runner_empty(url: str, timeout: float) -> None:
    """Wait until the model's runner holds no sequence (a cancelled batch's lines have left it)."""
    deadline = time.monotonic() + timeout
    while runner_health(url).get("active_sequences", 0) and time.monotonic() < deadline:
        time.sleep(0.5)


def runner_health(url: str) -> dict:
    """The model's runner's ``/health`` (its scheduler's figures), or ``{}``."""
    try:
        instance = next(i for i in httpx.get(f"{url}/instances", timeout=10).json() if i["model"] == MODEL)
        runner = next(r["url"] for r in instance["runners"].values() if r.get("url"))
        return dict(httpx.get(f"{runner}/health", headers={"x-meshgate-secret": SECRET}, timeout=10).json())
    except (httpx.HTTPError, ValueError, StopIteration, KeyError, TypeError):
        return {}


def killed_halfway(data_dir: Path, args: argparse.Namespace, say) -> Phase:
    from tests.cluster.redis_server import RedisServer
    from tests.cluster.test_cluster_e2e import Agent, wait_for
    from tests.conftest import Server

    phase = Phase("gateway killed halfway", lines=args.kill_lines)
    env = {**gateway_env(args), "MESHGATE_HEARTBEAT": "0.3", "MESHGATE_NODE_TTL": "1.5", "MESHGATE_THREADS": "2"}
    work = Path(tempfile.mkdtemp(prefix="meshgate-tiers-"))
    gateways: list[Server] = []
    agent = None
    with RedisServer(work / "redis") as redis:
        try:
            agent = Agent(redis.url, "a", data_dir, work, n_ctx=args.n_ctx, env=env, memory=str(3 << 30))
            args_ = ("--redis", redis.url, "--n-ctx", str(args.n_ctx))
            gateways += [Server(data_dir, *args_, env=env) for _ in range(2)]
            wait_for(lambda: httpx.get(f"{gateways[0].url}/cluster").json()["nodes"], 60, "the node")
            r = httpx.post(f"{gateways[0].url}/instances", json={"model": MODEL}, timeout=120)
            assert r.status_code == 201, r.text
            asyncio.run(one_chat(gateways[0].url, args.timeout))  # ready
            batch_id = create_batch(gateways[0].url, lines(args.kill_lines, args.line_tokens))
            started = time.perf_counter()
            half = args.kill_lines // 2
            wait_for(
                lambda: batch_state(gateways[1].url, batch_id)["request_counts"]["completed"] >= half, args.timeout
            )
            done = batch_state(gateways[1].url, batch_id)["request_counts"]
            gateways[0].proc.send_signal(signal.SIGKILL)
            gateways[0].proc.wait()
            say(f"  killed gateway A at {done['completed']}/{args.kill_lines} lines; restarting it")
            gateways[0] = Server(data_dir, *args_, env=env)
            state = asyncio.run(wait_batch(gateways[0].url, batch_id, args.timeout))
            phase.wall_s = time.perf_counter() - started
            rows = results(gateways[1].url, state)
            phase.answered_once, note = exactly_once(rows, args.kill_lines)
            phase.lines_s, phase.tokens_s = args.kill_lines / phase.wall_s, tokens_of(rows) / phase.wall_s
            phase.notes.append(f"{state['status']}: {note}; A killed at {done['completed']} done")
        finally:
            for gateway in gateways:
                gateway.stop()
            if agent is not None:
                agent.stop()
    shutil.rmtree(work, ignore_errors=True)
    say(row(phase))
    return phase


def row(p: Phase) -> str:
    def f(x: float | None, spec: str) -> str:
        return format(x, spec) if x is not None else "-"

    once = "-" if p.answered_once is None else ("yes" if p.answered_once else "NO")
    return (
        f"{p.name:<24} {f(p.ttft_p50, '.3f'):>8} {f(p.ttft_p99, '.3f'):>8} {p.chats:>5} {p.lines:>5} "
        f"{f(p.wall_s, '.1f'):>7} {f(p.lines_s, '.2f'):>7} {f(p.tokens_s, '.1f'):>7} {once:>5} "
        f"{f(p.other_cores, '.2f'):>6}  {'; '.join(p.notes)}"
    )


HEADER = (
    f"{'phase':<24} {'TTFT p50':>8} {'p99':>8} {'chats':>5} {'lines':>5} {'wall s':>7} {'lines/s':>7} "
    f"{'tok/s':>7} {'once':>5} {'other':>6}  notes"
)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lines", type=int, default=500, help="lines of the measured batch")
    parser.add_argument("--line-tokens", type=int, default=16, help="max_tokens of each batch line (greedy)")
    parser.add_argument("--clients", type=int, default=4, help="interactive clients")
    parser.add_argument("--rounds", type=int, default=4, help="chats each client sends one after another")
    parser.add_argument("--waves", type=int, default=6, help="times the clients chat so, in each phase")
    parser.add_argument("--wave-gap", type=float, default=15.0, help="seconds between waves beside the batch")
    parser.add_argument("--chat-tokens", type=int, default=24, help="max_tokens of each chat (greedy)")
    parser.add_argument("--parallel", type=int, default=4, help="MESHGATE_PARALLEL: the runner's decode lanes")
    parser.add_argument("--spares", type=int, default=4, help="MESHGATE_BATCH_SPARES: sequences for interactive")
    parser.add_argument("--lease", type=float, default=5.0, help="MESHGATE_BATCH_LEASE, seconds")
    parser.add_argument(
        "--pairs", type=int, default=6, help="rounds of an idle wave and a wave beside a batch (0: skip)"
    )
    parser.add_argument("--pair-lines", type=int, default=200, help="lines of each paired wave's batch (cancelled)")
    parser.add_argument("--kill-lines", type=int, default=100, help="lines of the killed-halfway batch (0: skip)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--n-ctx", type=int, default=1024)
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds any one phase may take")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))

    from benchmarks.concurrency import calibrated
    from tests.conftest import Server

    say(HEADER)
    started = time.perf_counter()
    server = Server(data_dir, "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), env=gateway_env(args))
    try:
        calibrated(server.url, args.timeout, say)
        phases = asyncio.run(tiers(server.url, server.proc.pid, args, say))
    finally:
        server.stop()
    if args.kill_lines:
        phases.append(killed_halfway(data_dir, args, say))
    summary = {"settings": vars(args), "phases": [asdict(p) for p in phases], "took_s": time.perf_counter() - started}
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        print(f"\n{HEADER}\n" + "\n".join(row(p) for p in phases) + f"\n(took {summary['took_s']:.0f} s)")


if __name__ == "__main__":
    main()
