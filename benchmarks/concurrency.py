"""Many clients at once: meshgate's aggregate throughput and latencies beside llama.cpp's raw batched decode.

    .venv/bin/python benchmarks/concurrency.py [--levels 1,4,8,16] [--tokens 96] [--rounds 2] [--json]
    .venv/bin/python benchmarks/concurrency.py --url http://127.0.0.1:8000 [--gateway-pid PID] [--no-raw]

Starts a gateway on the packaged Gemma 3 270M GGUF (``meshgate serve``, 127.0.0.1, ``--threads`` threads,
``MESHGATE_PARALLEL`` = the highest level unless ``--parallel`` says otherwise), or uses the one at ``--url``.
For each level N it keeps N streaming OpenAI chat requests in flight (each of N clients sends ``--rounds`` short
chat prompts one after another; greedy, ``max_tokens`` = ``--tokens``) and measures, from the client:

- aggregate tok/s: completion tokens (the streams' ``usage``) over the level's wall time, prefill included;
- TTFT p50/p99: request sent to first content chunk; ITL p50/p99: between consecutive content chunks;
- gateway CPU per streamed token: the gateway process's user+system time (``/proc/<pid>/stat``) over the level,
  over its tokens (a gateway at ``--url`` on this machine is found by its listening port); and the same less
  what the gateway spends idle over as long (its timers: heartbeats, reconcile loops), measured before the levels.

In the same run, with the gateway idle, the same GGUF is loaded here through llama-cpp-python's low-level API and
decoded raw: one ``llama_batch`` per step with one token per sequence, ``n_seq_max`` = N, ``--threads`` threads,
greedy argmax, repacking off and per-sequence KV as the runner loads it; its tok/s counts decode steps only (no
prefill). The table shows meshgate/raw for each N.

Works whatever the runner does (one request at a time or batched): it only measures. Every loop is bounded.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import itertools
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

import httpx

from meshgate.gateway.cli.bench import percentile  # the nearest-rank quantile `meshgate bench` reports

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

MODEL = "gemma3:270m"
SYSTEM = "You are a helpful assistant. Answer in full sentences."
PROMPTS = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Explain how a hash table works and when you would use one.",
    "What are the main causes of the seasons on Earth? Explain step by step.",
    "Describe a relaxing weekend in the mountains, hour by hour.",
    "Give me ten tips for writing clear technical documentation, with a sentence on each.",
    "Explain the difference between a process and a thread to a new programmer.",
    "Write a friendly email inviting my team to a summer picnic next Friday.",
    "How does photosynthesis work? Describe each stage.",
    "Tell me about the history of the bicycle, from its invention to today.",
    "What should I pack for a week-long trip to a rainy city? Explain each item.",
    "Write a poem about the ocean at night, in six stanzas.",
    "Explain what recursion is, with an everyday example and a code example.",
    "Describe how to bake a loaf of bread from scratch, step by step.",
    "What are the benefits of regular exercise? Give a detailed answer.",
    "Summarize the plot of a heist movie you would like to see, scene by scene.",
    "Explain how the internet delivers a web page, from typing the address to seeing it.",
]


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process ``pid`` so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def listening_pid(port: int) -> int | None:
    """The pid of the local process listening on TCP ``port`` (its socket's inode among /proc/*/fd)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            rows = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            cols = row.split()
            if int(cols[1].rsplit(":", 1)[1], 16) == port and cols[3] == "0A":  # 0A: LISTEN
                inodes.add(f"socket:[{cols[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                return int(proc.name)
        except OSError:
            continue
    return None


# ------------------------------------------------------------------------------------------------ through meshgate


@dataclass
class Stream:
    ttft: float
    gaps: list[float]
    tokens: int


@dataclass
class Level:
    concurrency: int
    requests: int = 0
    failed: int = 0
    tokens: int = 0
    wall_s: float = 0.0
    tok_s: float = 0.0
    ttft_p50: float = float("nan")
    ttft_p99: float = float("nan")
    itl_p50: float = float("nan")
    itl_p99: float = float("nan")
    gateway_cpu_ms_per_token: float | None = None
    gateway_cpu_ms_per_token_net: float | None = None  # less what the gateway spends idle over the same time
    raw_tok_s: float | None = None
    ratio: float | None = None
    errors: list[str] = field(default_factory=list)


async def one_stream(client: httpx.AsyncClient, model: str, prompt: str, tokens: int) -> Stream:
    """One streamed chat completion, read to its end."""
    body = {
        "model": model,
        "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": prompt}],
        "max_tokens": tokens,
        "temperature": 0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    started = time.perf_counter()
    stamps: list[float] = []
    count = 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as response:
        if response.status_code != 200:
            raise RuntimeError(f"HTTP {response.status_code}: {(await response.aread())[:200]!r}")
        async for line in response.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                raise RuntimeError(f"stream error: {chunk['error']}")
            if chunk.get("choices") and chunk["choices"][0]["delta"].get("content"):
                stamps.append(time.perf_counter())
            if chunk.get("usage"):
                count = chunk["usage"]["completion_tokens"]
    if not stamps:
        raise RuntimeError("the stream had no content")
    return Stream(
        ttft=stamps[0] - started, gaps=[b - a for a, b in itertools.pairwise(stamps)], tokens=count or len(stamps)
    )


async def run_level(
    url: str, model: str, n: int, rounds: int, tokens: int, pid: int | None, timeout: float, idle: float = 0.0
) -> Level:
    """``n`` clients, each sending ``rounds`` requests one after another."""
    level = Level(concurrency=n)
    streams: list[Stream] = []
    limits = httpx.Limits(max_connections=n + 4, max_keepalive_connections=n + 4)
    async with httpx.AsyncClient(base_url=url, timeout=timeout, limits=limits, trust_env=False) as client:

        async def client_loop(i: int) -> None:
            for r in range(rounds):
                try:
                    streams.append(await one_stream(client, model, PROMPTS[(i * rounds + r) % len(PROMPTS)], tokens))
                except (httpx.HTTPError, RuntimeError) as exc:
                    level.failed += 1
                    level.errors.append(str(exc) or type(exc).__name__)

        before = cpu_seconds(pid) if pid else None
        started = time.perf_counter()
        await asyncio.gather(*(client_loop(i) for i in range(n)))
        level.wall_s = time.perf_counter() - started
        spent = cpu_seconds(pid) - before if pid and before is not None else None
    level.requests = n * rounds
    level.tokens = sum(s.tokens for s in streams)
    level.tok_s = level.tokens / level.wall_s
    ttfts = [s.ttft for s in streams]
    gaps = [g for s in streams for g in s.gaps]
    level.ttft_p50, level.ttft_p99 = percentile(ttfts, 0.5), percentile(ttfts, 0.99)
    level.itl_p50, level.itl_p99 = percentile(gaps, 0.5), percentile(gaps, 0.99)
    if spent is not None and level.tokens:
        level.gateway_cpu_ms_per_token = spent * 1000 / level.tokens
        level.gateway_cpu_ms_per_token_net = max(0.0, spent - idle * level.wall_s) * 1000 / level.tokens
    return level


# ------------------------------------------------------------------------------------------------ raw llama.cpp


class RawDecoder:
    """The GGUF loaded here with llama-cpp-python's low-level API, for batched greedy decode loops."""

    def __init__(self, path: str, threads: int, n_ctx: int) -> None:
        import llama_cpp as lib

        self._quiet = lib.llama_log_callback(lambda level, text, data: None)  # llama.cpp's load chatter
        lib.llama_log_set(self._quiet, ctypes.c_void_p(0))
        self.lib = lib
        self.threads = threads
        self.n_ctx = n_ctx
        lib.llama_backend_init()
        params = lib.llama_model_default_params()
        params.use_extra_bufts = False  # no weight repacking: as meshgate's runners load (MESHGATE_LLAMA_REPACK)
        self.model = lib.llama_model_load_from_file(path.encode(), params)
        if not self.model:
            raise RuntimeError(f"llama.cpp could not load {path}")
        self.vocab = lib.llama_model_get_vocab(self.model)
        self.n_vocab = lib.llama_vocab_n_tokens(self.vocab)

    def tokenize(self, text: str) -> list[int]:
        lib = self.lib
        data = text.encode()
        buffer = (lib.llama_token * (len(data) + 8))()
        n = lib.llama_tokenize(self.vocab, data, len(data), buffer, len(buffer), True, True)
        if n < 0:
            raise RuntimeError("tokenize failed")
        return list(buffer[:n])

    def workload_rate(self, n: int, tokens: int, prompts: list[str], rounds: int) -> float:
        """Tokens per second of ``rounds`` rounds in which ``n`` sequences each prefill a chat prompt (``SYSTEM`` and
        the prompt in Gemma's turn format, one sequence a decode, as meshgate's scheduler prefills) and then generate
        ``tokens`` greedy tokens batched: what ``run_level``'s clients ask, prefill included, timed whole."""
        turn = "<start_of_turn>user\n{}\n\n{}<end_of_turn>\n<start_of_turn>model\n"
        batches = [
            [self.tokenize(turn.format(SYSTEM, prompts[(i * rounds + r) % len(prompts)])) for i in range(n)]
            for r in range(rounds)
        ]
        with _Loop(self, n, max(len(p) for b in batches for p in b)) as loop:
            started = time.perf_counter()
            for prompt_tokens in batches:
                loop.clear()
                nxt, pos = loop.prefill(prompt_tokens)  # each sequence's first token
                for _ in range(tokens - 1):
                    nxt = loop.step(nxt, pos)
            return n * tokens * rounds / (time.perf_counter() - started)

    def decode_rate(self, n: int, steps: int, prompts: list[str]) -> float:
        """Tokens per second of ``steps`` batched decode steps over ``n`` sequences, after their prefill."""
        prompt_tokens = [self.tokenize(prompts[i % len(prompts)]) for i in range(n)]
        with _Loop(self, n, max(len(p) for p in prompt_tokens)) as loop:
            nxt, pos = loop.prefill(prompt_tokens)
            started = time.perf_counter()
            for _ in range(steps):
                nxt = loop.step(nxt, pos)
            return n * steps / (time.perf_counter() - started)


class _Loop:
    """A context of ``n`` sequences on ``raw``'s model and a batch for it: greedy prefill and batched decode steps."""

    def __init__(self, raw: RawDecoder, n: int, longest: int) -> None:
        lib = self.lib = raw.lib
        self.n, self.n_vocab = n, raw.n_vocab
        n_batch = max(n, longest)
        params = lib.llama_context_default_params()
        params.n_ctx = raw.n_ctx * n
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = n
        params.kv_unified = False
        params.swa_full = True
        params.n_threads = params.n_threads_batch = raw.threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED
        self.ctx = lib.llama_init_from_model(raw.model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {raw.n_ctx} x {n}")
        self.batch = lib.llama_batch_init(n_batch, 0, 1)

    def __enter__(self) -> _Loop:
        return self

    def __exit__(self, *_: object) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)

    def _put(self, row: int, token: int, pos: int, seq: int, logits: bool) -> None:
        batch = self.batch
        batch.token[row], batch.pos[row], batch.n_seq_id[row] = token, pos, 1
        batch.seq_id[row][0], batch.logits[row] = seq, logits

    def _argmax(self, row: int) -> int:
        import numpy as np

        logits = self.lib.llama_get_logits_ith(self.ctx, row)
        return int(np.ctypeslib.as_array(logits, shape=(self.n_vocab,)).argmax())

    def clear(self) -> None:
        self.lib.llama_memory_clear(self.lib.llama_get_memory(self.ctx), True)

    def prefill(self, prompts: list[list[int]]) -> tuple[list[int], list[int]]:
        """Each prompt into its sequence, one sequence a decode; each one's first token and next position."""
        nxt, pos = [], []
        for seq, tokens in enumerate(prompts):
            for i, token in enumerate(tokens):
                self._put(i, token, i, seq, i == len(tokens) - 1)
            self.batch.n_tokens = len(tokens)
            if self.lib.llama_decode(self.ctx, self.batch) != 0:
                raise RuntimeError("prefill failed")
            nxt.append(self._argmax(len(tokens) - 1))
            pos.append(len(tokens))
        return nxt, pos

    def step(self, nxt: list[int], pos: list[int]) -> list[int]:
        """One batched decode of every sequence's last token (``pos`` advances); the next tokens."""
        for seq in range(self.n):
            self._put(seq, nxt[seq], pos[seq], seq, True)
            pos[seq] += 1
        self.batch.n_tokens = self.n
        if self.lib.llama_decode(self.ctx, self.batch) != 0:
            raise RuntimeError("decode failed")
        return [self._argmax(seq) for seq in range(self.n)]


# ------------------------------------------------------------------------------------------------ the run


def packaged_gguf(data_dir: Path) -> Path:
    from meshgate.backends.llama_cpp.sources import PackagedGGUFSource

    return Path(PackagedGGUFSource(data_dir / "models").models()[0].path)


def idle_rate(pid: int, seconds: float = 3.0) -> float:
    """CPU seconds per second the gateway spends with nothing to do (heartbeats, timers)."""
    before, started = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - started)


def table(levels: list[Level]) -> str:
    head = (
        f"{'streams':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'ITL p50':>8} {'ITL p99':>8} "
        f"{'raw tok/s':>9} {'ratio':>6} {'gw CPU ms/tok':>13} {'net of idle':>11} {'failed':>6}"
    )
    rows = [head, "-" * len(head)]
    for lv in levels:
        raw = f"{lv.raw_tok_s:9.1f}" if lv.raw_tok_s else f"{'-':>9}"
        ratio = f"{lv.ratio:6.2f}" if lv.ratio else f"{'-':>6}"
        cpu = f"{lv.gateway_cpu_ms_per_token:13.3f}" if lv.gateway_cpu_ms_per_token is not None else f"{'-':>13}"
        net = (
            f"{lv.gateway_cpu_ms_per_token_net:11.3f}" if lv.gateway_cpu_ms_per_token_net is not None else f"{'-':>11}"
        )
        rows.append(
            f"{lv.concurrency:>7} {lv.tok_s:8.1f} {lv.ttft_p50:8.3f}s {lv.ttft_p99:8.3f}s "
            f"{lv.itl_p50 * 1000:6.1f}ms {lv.itl_p99 * 1000:6.1f}ms {raw} {ratio} {cpu} {net} {lv.failed:>6}"
        )
    return "\n".join(rows)


def calibrated(url: str, timeout: float, say: Callable[..., None]) -> None:
    """Wait until the node agent has measured llama.cpp on this machine (``Backend.calibrate``: a subprocess that
    decodes for seconds when a setting is new, e.g. this ``MESHGATE_PARALLEL``), so it does not share the CPU with
    a measured level."""
    deadline, told = time.monotonic() + timeout, False
    while time.monotonic() < deadline:
        nodes = httpx.get(f"{url}/cluster", timeout=10).json()["nodes"]
        if nodes and all("llama_cpp" in n.get("calibration", {}) for n in nodes):
            return
        if not told:
            say("waiting for the node to calibrate llama.cpp ...")
            told = True
        time.sleep(1.0)
    raise RuntimeError(f"the node did not calibrate in {timeout:g} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--levels", default="1,4,8,16", help="concurrent streams per level, comma-separated")
    parser.add_argument("--tokens", type=int, default=96, help="max_tokens of each request (greedy)")
    parser.add_argument("--rounds", type=int, default=2, help="requests each client sends one after another")
    parser.add_argument("--threads", type=int, default=2, help="llama.cpp threads, for the runner and the raw loop")
    parser.add_argument("--n-ctx", type=int, default=2048, help="context per sequence, for the runner and raw loop")
    parser.add_argument("--parallel", type=int, help="MESHGATE_PARALLEL for the started gateway (the top level)")
    parser.add_argument(
        "--inexact",
        action="store_true",
        help="MESHGATE_EXACT_BATCHES=0 for the started gateway: every sequence in one decode",
    )
    parser.add_argument("--url", help="use this running gateway instead of starting one")
    parser.add_argument("--gateway-pid", type=int, help="the --url gateway's pid (found by its port if local)")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--gguf", help="the GGUF for the raw loop (default: the packaged Gemma 3 270M)")
    parser.add_argument("--no-raw", action="store_true", help="skip the raw llama.cpp decode loop")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one request may take")
    parser.add_argument("--json", action="store_true", help="print the results as one JSON object")
    args = parser.parse_args()
    levels = [int(n) for n in args.levels.split(",") if n.strip()]
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    data_dir.mkdir(parents=True, exist_ok=True)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.json else (lambda *a: print(*a, flush=True))

    server = None
    if args.url:
        url = args.url.rstrip("/")
        pid = args.gateway_pid
        if pid is None and httpx.URL(url).host in ("127.0.0.1", "localhost", "::1"):
            pid = listening_pid(httpx.URL(url).port or 80)
    else:
        from tests.conftest import Server

        env = {
            "MESHGATE_PARALLEL": str(args.parallel or max(levels)),
            "MESHGATE_EXACT_BATCHES": "0" if args.inexact else "1",
        }
        server = Server(data_dir, "--threads", str(args.threads), "--n-ctx", str(args.n_ctx), env=env)
        url, pid = server.url, server.proc.pid
    results: list[Level] = []
    try:
        say(f"gateway {url} (pid {pid or '?'}); loading {args.model} ...")
        asyncio.run(run_level(url, args.model, 1, 1, 8, None, args.timeout))  # loads the model, warms up
        if server is not None:
            calibrated(url, args.timeout, say)
        idle = idle_rate(pid) if pid else 0.0
        raw = None
        if not args.no_raw:
            raw = RawDecoder(args.gguf or str(packaged_gguf(data_dir)), args.threads, args.n_ctx)
            raw.decode_rate(1, 4, PROMPTS)  # warm-up
        for n in levels:
            level = asyncio.run(run_level(url, args.model, n, args.rounds, args.tokens, pid, args.timeout, idle))
            if raw is not None:
                level.raw_tok_s = raw.decode_rate(n, args.tokens, PROMPTS)
                level.ratio = level.tok_s / level.raw_tok_s
            results.append(level)
            say(table([level]).splitlines()[-1] if results[1:] else table([level]))
    finally:
        if server is not None:
            server.stop()
    summary = {
        "url": url,
        "model": args.model,
        "tokens": args.tokens,
        "rounds": args.rounds,
        "threads": args.threads,
        "gateway_idle_cpu": idle,
        "levels": [asdict(lv) for lv in results],
    }
    if args.json:
        print(json.dumps(summary, default=str).replace("NaN", "null"))
        return
    print()
    print(
        f"{args.model}: {args.rounds} chat request(s) per client, max_tokens {args.tokens}, greedy, "
        f"{args.threads} llama.cpp threads"
    )
    print(table(results))
    cpus = [lv.gateway_cpu_ms_per_token for lv in results if lv.gateway_cpu_ms_per_token is not None]
    if cpus:
        print(
            f"gateway CPU per streamed token: {statistics.mean(cpus):.3f} ms mean over the levels; idle, the "
            f"gateway spends {idle * 1000:.1f} ms of CPU per second ('net of idle' leaves that out)"
        )
    for lv in results:
        for error in lv.errors[:3]:
            print(f"  {lv.concurrency} streams, failed: {error}")


if __name__ == "__main__":
    main()
