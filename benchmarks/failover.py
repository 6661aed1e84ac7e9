"""Streams that outlive their node, measured: a node killed under load, and a rolling restart of both nodes.

    .venv/bin/python benchmarks/failover.py [--streams 8] [--tokens 300] [--threads 1] [--grace 120] [--seed 1]
        [--protocols openai,anthropic,ollama] [--json] [--preamble WORDS --n-ctx N] [--kv on|off] [--no-rolling]
        [--kill-after SECONDS]

One cluster on loopback: ``redis-server``, two ``meshgate node`` agents (each runner ``--threads`` llama.cpp
threads) and one gateway, two replicas of the packaged Gemma 3 270M (one per node). For each protocol (OpenAI chat,
Anthropic Messages, Ollama chat, through the official SDKs) ``--streams`` greedy streams of ``--tokens`` tokens run
at once, with distinct prompts, three times:

1. **undisturbed**: the reference texts;
2. **node killed**: at a random moment (uniform over 10-60% of the undisturbed run's duration, ``--seed``) one
   node's agent gets SIGKILL (its runners die with it); it is started again after the run, and the run after waits
   for both replicas;
3. **rolling restart**: while the streams run, each node in turn gets SIGTERM (it drains: its replicas take no new
   stream and finish theirs within ``--grace`` seconds, ``MESHGATE_DRAIN_GRACE``, while a replacement is placed on
   the other node), is started again once it has exited, and the next one goes once both replicas are ready again.

Reported per run: streams completed (the SDK raised nothing and the answer is whole), texts equal to the
undisturbed run (in the rolling restart each client sends stream after stream until both nodes are back; every one
counts), the streams that were resumed (the gateway's ``meshgate_stream_resumes_total``), and the longest
gap a client saw between two text pieces (p50 of each stream's longest gap, and the worst).

Every loop is bounded; every process is stopped on the way out.

Measured 2026-12-04 on the 2-core box (each runner 1 thread), ``--streams 8 --tokens 300``, grace 120 s:

    | protocol  | run                      | completed | equal to undisturbed | resumed | longest gap p50 / max | wall |
    | openai    | undisturbed              | 8/8       | 8/8                  | 0       | 0.34 / 0.45 s         | 30 s |
    | openai    | node-1 killed at 5.0 s   | 8/8       | 8/8                  | 4       | 0.57 / 6.27 s         | 38 s |
    | openai    | rolling restart          | 16/16     | 16/16                | 0       | 0.53 / 1.35 s         | 71 s |
    | anthropic | undisturbed              | 8/8       | 8/8                  | 0       | 0.21 / 0.44 s         | 27 s |
    | anthropic | node-1 killed at 6.2 s   | 8/8       | 8/8                  | 8       | 9.14 / 9.24 s         | 42 s |
    | anthropic | rolling restart          | 16/16     | 16/16                | 0       | 0.97 / 2.01 s         | 63 s |
    | ollama    | undisturbed              | 8/8       | 8/8                  | 0       | 0.24 / 0.67 s         | 29 s |
    | ollama    | node-1 killed at 14.1 s  | 8/8       | 8/8                  | 8       | 13.76 / 15.79 s       | 41 s |
    | ollama    | rolling restart          | 16/16     | 16/16                | 0       | 0.88 / 1.71 s         | 59 s |

With long prompts, where the KV tier matters (``--protocols openai --preamble 500 --n-ctx 4096 --no-rolling
--kill-after 12``: each of the 8 prompts ~1,300 tokens, every node its own KV directory; 2026-12-05, same box):

    | KV tiers | run                      | completed | equal to undisturbed | resumed | longest gap p50 / max |
    | off      | undisturbed              | 8/8       | 8/8                  | 0       | 2.82 / 4.12 s         |
    | off      | node-1 killed at 12.0 s  | 8/8       | 8/8                  | 4       | 4.36 / 43.24 s        |
    | on       | undisturbed              | 8/8       | 8/8                  | 0       | 3.38 / 4.80 s         |
    | on       | node-1 killed at 12.0 s  | 8/8       | 8/8                  | 4       | 4.11 / 14.29 s        |

Without tiers the surviving replica prefills each resumed prompt again; with them it restores each from the copy
the dying node's runner had sent it as the prompt ended (its disk tier), evaluates the last chunk again (the
prompt's last 1-256 tokens) and decodes the tokens its client had been sent one step each (what no tier holds),
beside its own four streams. (Before exact slot reuse, a second run of the same long prompts answered otherwise in
4 of 8 streams without tiers, 6 of 8 with them.)

Every stream completed with the undisturbed text. A kill costs a resume: when the killed node held both replicas
(8 resumed) a replica is placed and loaded first, and every resumed stream then decodes the tokens it had sent
one step each before its next token. A rolling restart costs none: each node drains (its streams finish on it
while a replacement is placed on the other), so the longest gap is a replica's start beside the load.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import random
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.concurrency import PROMPTS  # noqa: E402  (the repository root first, for tests.* and benchmarks.*)
from meshgate.gateway.cli.bench import percentile  # noqa: E402

MODEL = "gemma3:270m"
N_CTX = 2048
PROTOCOLS = ("openai", "anthropic", "ollama")


@dataclass
class Run:
    protocol: str
    scenario: str
    completed: int
    equal: int
    streams: int
    resumed: int
    gap_p50: float
    gap_max: float
    seconds: float


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


class Cluster:
    """Redis, two agents and a gateway; ``restart`` a node by name."""

    def __init__(
        self, data_dir: Path, logs: Path, threads: int, grace: float, n_ctx: int = N_CTX, kv: bool = True
    ) -> None:
        from tests.cluster.redis_server import RedisServer
        from tests.cluster.test_cluster_e2e import FAST
        from tests.conftest import Server

        self.data_dir, self.logs = data_dir, logs
        # a node stays a member through a CPU stall on 2 cores: only the kills and restarts here change the cluster
        self.env = {
            **FAST,
            "MESHGATE_HEARTBEAT": "0.5",
            "MESHGATE_NODE_TTL": "15",
            "MESHGATE_THREADS": str(threads),
            "MESHGATE_DRAIN_GRACE": str(grace),
            **({} if kv else {"MESHGATE_KV_RAM_MIB": "0", "MESHGATE_KV_DISK_MIB": "0"}),
        }
        self.n_ctx = n_ctx
        self.grace = grace
        self.redis = RedisServer(logs / "redis")
        self.redis.__enter__()
        self.agents = {name: self._agent(name) for name in ("node-1", "node-2")}
        self.gateway = Server(data_dir, "--redis", self.redis.url, "--n-ctx", str(n_ctx), env=self.env)
        self.url = self.gateway.url
        _wait(lambda: len(httpx.get(f"{self.url}/cluster").json()["nodes"]) == 2, 120, "two nodes")
        r = httpx.post(f"{self.url}/instances", json={"model": MODEL, "replicas": 2}, timeout=120)
        r.raise_for_status()
        self.ready()

    def _agent(self, name: str):
        from tests.cluster.test_cluster_e2e import Agent

        env = {**self.env, "MESHGATE_KV_DIR": str(self.data_dir / f"kv-{name}")}  # each node its own disk
        return Agent(self.redis.url, name, self.data_dir, self.logs, n_ctx=self.n_ctx, env=env, memory=str(4 << 30))

    def ready(self, timeout: float = 300) -> None:
        """Until two replicas of the model are ready."""

        def two() -> bool:
            found = httpx.get(f"{self.url}/instances", timeout=10).json()
            return sum(1 for i in found if i["model"] == MODEL and i["state"]["state"] == "ready") >= 2

        try:
            _wait(two, timeout, "two ready replicas")
        except RuntimeError:
            for i in httpx.get(f"{self.url}/instances", timeout=10).json():
                print(i["id"], i["state"], [s["node_id"] for s in i["placement"]["shards"]], file=sys.stderr)
            events = httpx.get(f"{self.url}/events", params={"count": 30}, timeout=10).json()
            print(json.dumps(events, indent=1)[-4000:], file=sys.stderr)
            raise

    def replica_nodes(self) -> list[str]:
        """The nodes the model's replicas run on, one entry per replica."""
        found = httpx.get(f"{self.url}/instances", timeout=10).json()
        return sorted(i["placement"]["shards"][0]["node_id"] for i in found if i["model"] == MODEL)

    def kill(self, name: str) -> None:
        self.agents[name].kill()

    def restart(self, name: str, graceful: bool) -> None:
        agent = self.agents[name]
        if graceful:
            agent.proc.terminate()  # SIGTERM: the node drains
            agent.proc.wait(self.grace + 60)
        else:
            agent.kill()
        self.agents[name] = self._agent(name)

    def resumes(self) -> float:
        text = httpx.get(f"{self.url}/metrics", timeout=10).text
        lines = text.splitlines()
        return sum(float(x.rsplit(" ", 1)[1]) for x in lines if x.startswith("meshgate_stream_resumes_total{"))

    def close(self) -> None:
        self.gateway.stop()
        for agent in self.agents.values():
            agent.stop()
        self.redis.__exit__(None, None, None)


def _one(url: str, protocol: str, prompt: str, tokens: int) -> tuple[str, float, bool]:
    """One greedy stream: its text, the longest gap between two pieces, whether it completed."""
    from tests.cluster.faults import greedy_streams

    pieces, last, gap = [], time.monotonic(), 0.0
    try:
        for piece in greedy_streams(url, MODEL, prompt, tokens)[protocol]:
            now = time.monotonic()
            gap, last = max(gap, now - last) if pieces else gap, now
            pieces.append(piece)
        return "".join(pieces), gap, True
    except Exception as exc:  # an SDK's mid-stream error: the stream did not complete
        print(f"  {protocol} stream failed: {exc!r}"[:300], file=sys.stderr)
        return "".join(pieces), gap, False


def load(
    cluster: Cluster,
    protocol: str,
    scenario: str,
    streams: int,
    tokens: int,
    reference: list[str] | None,
    act=None,
    steady: bool = False,
    prompts: list[str] = PROMPTS,
) -> tuple[Run, list[str]]:
    """``streams`` streams at once through ``protocol``; ``act`` (run in a thread beside them) disturbs the cluster.
    ``steady``: each client sends its next stream as soon as one ends, until ``act`` is done."""
    before = cluster.resumes()
    began = time.monotonic()
    actor = threading.Thread(target=act, daemon=True) if act is not None else None
    if actor is not None:
        actor.start()

    def client(n: int) -> list[tuple[int, tuple[str, float, bool]]]:
        """Client ``n``'s streams: one, or while ``steady`` and the actor runs (bounded), one after another."""
        done = [(n, _one(cluster.url, protocol, prompts[n], tokens))]
        while steady and actor is not None and actor.is_alive() and len(done) < 100:
            done.append((n, _one(cluster.url, protocol, prompts[n], tokens)))
        return done

    with ThreadPoolExecutor(streams) as pool:
        results = [r for rs in pool.map(client, range(streams)) for r in rs]
    seconds = time.monotonic() - began
    if actor is not None:
        actor.join(600)
    texts = [text for _, (text, _, _) in results]
    gaps = [gap for _, (_, gap, _) in results]
    run = Run(
        protocol=protocol,
        scenario=scenario,
        completed=sum(ok and bool(text) for _, (text, _, ok) in results),
        equal=sum(text == (reference or texts)[n] for n, (text, _, _) in results),
        streams=len(results),
        resumed=round(cluster.resumes() - before),
        gap_p50=percentile(gaps, 0.5),
        gap_max=max(gaps),
        seconds=seconds,
    )
    return run, texts


WORDS = "the parser reads each token of the file and the linter reports a warning when a rule fails".split()


def preamble(n: int, words: int) -> str:
    """Client ``n``'s own preamble of ``words`` words (an agent's instructions): "" for none."""
    if not words:
        return ""
    return f"Agent {n} instructions: " + " ".join(f"{WORDS[(i * 7 + n) % len(WORDS)]}{i % 89}" for i in range(words))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=300)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--grace", type=float, default=120.0, help="MESHGATE_DRAIN_GRACE of the cluster")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--protocols", default=",".join(PROTOCOLS))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--keep", action="store_true", help="keep the data and logs folder (printed)")
    parser.add_argument("--preamble", type=int, default=0, help="words of a distinct preamble before each prompt")
    parser.add_argument("--n-ctx", type=int, default=N_CTX)
    parser.add_argument("--kv", choices=["on", "off"], default="on", help="the runners' KV tiers (default: on)")
    parser.add_argument("--no-rolling", action="store_true", help="skip the rolling restart")
    parser.add_argument("--kill-after", type=float, default=None, help="kill this many seconds into the run")
    args = parser.parse_args()
    prompts = [preamble(n, args.preamble) + prompt for n, prompt in enumerate(PROMPTS)]
    rng = random.Random(args.seed)
    import tempfile

    from meshgate.backends.llama_cpp.sources import PackagedGGUFSource

    with (
        contextlib.nullcontext(tempfile.mkdtemp(prefix="meshgate-failover-"))
        if args.keep
        else tempfile.TemporaryDirectory(prefix="meshgate-failover-") as tmp
    ):
        data_dir, logs = Path(tmp) / "data", Path(tmp) / "logs"
        if args.keep:
            print(f"data and logs in {tmp}", file=sys.stderr)
        logs.mkdir(parents=True)
        PackagedGGUFSource(data_dir / "models").models()
        cluster = Cluster(data_dir, logs, args.threads, args.grace, args.n_ctx, args.kv == "on")
        runs: list[Run] = []
        try:
            for protocol in args.protocols.split(","):
                undisturbed, reference = load(
                    cluster, protocol, "undisturbed", args.streams, args.tokens, None, prompts=prompts
                )
                runs.append(undisturbed)
                print(undisturbed, file=sys.stderr)
                at = args.kill_after or rng.uniform(0.1, 0.6) * undisturbed.seconds
                victim = rng.choice(cluster.replica_nodes())  # a node holding a replica (both may be on one)

                def kill(at: float = at, victim: str = victim) -> None:
                    time.sleep(at)
                    cluster.kill(victim)

                scenario = f"{victim} killed at {at:.1f} s"
                killed, _ = load(
                    cluster, protocol, scenario, args.streams, args.tokens, reference, kill, False, prompts
                )
                runs.append(killed)
                print(killed, file=sys.stderr)
                cluster.restart(victim, graceful=False)
                cluster.ready()
                if args.no_rolling:
                    continue

                def rolling() -> None:
                    time.sleep(2)
                    for name in sorted(cluster.agents):
                        cluster.restart(name, graceful=True)
                        cluster.ready()

                rolled, _ = load(
                    cluster, protocol, "rolling restart", args.streams, args.tokens, reference, rolling, True, prompts
                )
                runs.append(rolled)
                print(rolled, file=sys.stderr)
                cluster.ready()
        finally:
            cluster.close()
    if args.json:
        print(json.dumps([asdict(r) for r in runs], indent=1))
        return
    print(f"\n{args.streams} greedy streams of {args.tokens} tokens per protocol, 2 replicas on 2 nodes")
    print("| protocol | run | completed | equal to undisturbed | resumed | longest gap p50 / max | wall |")
    print("|---|---|---|---|---|---|---|")
    for r in runs:
        print(
            f"| {r.protocol} | {r.scenario} | {r.completed}/{r.streams} | {r.equal}/{r.streams} | {r.resumed} | "
            f"{r.gap_p50:.2f} / {r.gap_max:.2f} s | {r.seconds:.0f} s |"
        )


if __name__ == "__main__":
    main()
