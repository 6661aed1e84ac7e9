"""Redis faults under a steady streamed load, with real processes: what clients of each protocol see.

``python -m tests.cluster.store_faults`` starts redis-server (with its append-only file) behind a TCP proxy, two
``meshgate node`` agents and two gateways on it, and two replicas of the packaged Gemma 3 270M; then, for each
fault, one client per protocol streams greedy chats through the official SDKs without a pause, spread over both
gateways, while Redis is paused (SIGSTOP) for 30 s, killed and started again empty, killed and started again from
its append-only file, or slowed by the proxy. It prints a table, fault x protocol: requests sent, answered, errors
by status, streams cut, and the time from the fault's end to the last failed request (docs/operations.md, "When
Redis is away", has its figures). ``tests/cluster/test_failover_e2e.py`` runs the empty restart in CI.

A request is *answered* when its stream ends with the reference text; *cut* when it began and then failed; an
error is the status the SDK raised before any text (503: the store away, as documented). Every error message is
checked for the store's address: none may leak it.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import secrets
import shutil
import socket
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.cluster.faults import greedy_streams
from tests.cluster.redis_server import RedisServer
from tests.cluster.test_cluster_e2e import FAST, Agent, wait_for
from tests.conftest import MODEL, ROOT, Server

PROTOCOLS = ("openai", "anthropic", "ollama")
PROMPT, TOKENS = "Count from one to five hundred.", 24
ENV = {**FAST, "MESHGATE_HEARTBEAT": "0.5", "MESHGATE_NODE_TTL": "15", "MESHGATE_THREADS": "1"}
N_CTX = 1024


@dataclass
class Outcome:
    protocol: str
    began: float
    ended: float
    status: str  # "ok", "cut", "wrong text", or the status (or error class) raised before any text
    message: str = ""


@dataclass
class Load:
    """One streaming client per protocol, each request on the next gateway ``urls()`` gives, until ``stop``."""

    urls: Callable[[], list[str]]
    reference: str
    key: str = "x"  # the API key clients send
    outcomes: list[Outcome] = field(default_factory=list)
    stop: threading.Event = field(default_factory=threading.Event)
    _threads: list[threading.Thread] = field(default_factory=list)

    def __enter__(self) -> Load:
        self._threads = [threading.Thread(target=self._client, args=(p, i)) for i, p in enumerate(PROTOCOLS)]
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        for thread in self._threads:
            thread.join(240)

    def _client(self, protocol: str, offset: int) -> None:
        for n in range(10_000):  # bounded; ended by ``stop``
            if self.stop.is_set():
                return
            urls = self.urls()
            self.outcomes.append(self.once(urls[(n + offset) % len(urls)], protocol))

    def once(self, url: str, protocol: str) -> Outcome:
        began, pieces = time.monotonic(), []
        try:
            for piece in greedy_streams(url, MODEL, PROMPT, TOKENS, self.key)[protocol]:
                pieces.append(piece)
        except Exception as exc:
            status = "cut" if pieces else str(getattr(exc, "status_code", None) or type(exc).__name__)
            return Outcome(protocol, began, time.monotonic(), status, str(exc))
        status = "ok" if "".join(pieces) == self.reference else "wrong text"
        return Outcome(protocol, began, time.monotonic(), status, "".join(pieces))


class Proxy:
    """A TCP proxy on loopback in front of ``upstream``'s port; ``delay`` seconds are added to every chunk it
    forwards, each way. A connection it cannot make upstream (Redis down) is closed at once."""

    def __init__(self, upstream: int) -> None:
        self.upstream = upstream
        self.delay = 0.0
        self.loop = asyncio.new_event_loop()
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._thread = threading.Thread(target=self._run, daemon=True, name="redis-proxy")
        self._thread.start()

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        server = self.loop.run_until_complete(asyncio.start_server(self._serve, sock=self._sock))
        self.loop.run_forever()
        server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            up_reader, up_writer = await asyncio.open_connection("127.0.0.1", self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True)

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            while data := await reader.read(65536):
                if self.delay:
                    await asyncio.sleep(self.delay)
                writer.write(data)
                await writer.drain()
        finally:
            writer.close()

    def close(self) -> None:
        self.loop.call_soon_threadsafe(self.loop.stop)


@contextlib.contextmanager
def cluster(
    data_dir: Path, work: Path, admin: str | None = None
) -> Iterator[tuple[RedisServer, Proxy, list[Server], dict[str, Agent]]]:
    """Redis (AOF on) behind a proxy, agents a and b, two gateways (with the bootstrap admin key ``admin``, if
    any), two ready replicas of ``MODEL``."""
    with RedisServer(work / "redis", appendonly=True) as redis:
        proxy = Proxy(redis.port)
        url = f"redis://127.0.0.1:{proxy.port}/0"
        agents = {name: Agent(url, name, data_dir, work, n_ctx=N_CTX, env=ENV) for name in ("a", "b")}
        gateways: list[Server] = []
        args = ("--redis", url, "--n-ctx", str(N_CTX), *(("--api-key", admin) if admin else ()))
        headers = {"authorization": f"Bearer {admin}"} if admin else {}
        seals = set((data_dir / "sealed").glob("*"))
        try:
            gateways += [Server(data_dir, *args, env=ENV) for _ in range(2)]
            nodes = lambda: httpx.get(f"{gateways[0].url}/cluster", headers=headers).json()["nodes"]  # noqa: E731
            wait_for(lambda: len(nodes()) == 2, 60, "two nodes")
            body = {"model": MODEL, "replicas": 2}
            r = httpx.post(f"{gateways[0].url}/instances", json=body, headers=headers, timeout=60)
            assert r.status_code == 201, r.text
            wait_for(lambda: len(ready(gateways[0], admin)) == 2, 180, "two ready replicas")
            yield redis, proxy, gateways, agents
        finally:
            for gateway in gateways:
                gateway.stop()
            for agent in agents.values():
                agent.stop()
            proxy.close()
            for seal in set((data_dir / "sealed").glob("*")) - seals:  # this run's store only: nobody else's
                seal.unlink()


def ready(gateway: Server, admin: str | None = None) -> list[dict]:
    headers = {"authorization": f"Bearer {admin}"} if admin else {}
    answer = httpx.get(f"{gateway.url}/instances", headers=headers, timeout=30)
    if answer.status_code != 200:  # 503 while the store is away
        return []
    return [i for i in answer.json() if i["model"] == MODEL and i["state"]["state"] == "ready"]


def restart_empty(redis: RedisServer) -> None:
    """SIGKILL, its append-only file removed, started again: a Redis that comes back with nothing."""
    redis.stop(kill=True)
    shutil.rmtree(redis.directory / "appendonlydir", ignore_errors=True)
    redis.start()


def inject(name: str, redis: RedisServer, proxy: Proxy, seconds: float) -> None:
    """Apply fault ``name`` and end it; returns when it has ended."""
    if name == "paused":
        redis.pause()
        time.sleep(seconds)
        redis.resume()
    elif name == "restarted empty":
        restart_empty(redis)
    elif name == "restarted from AOF":
        redis.stop(kill=True)
        redis.start()
    elif name == "slowed":
        proxy.delay = 0.3
        time.sleep(seconds)
        proxy.delay = 0.0
    else:
        raise ValueError(name)


def under_fault(
    name: str, redis: RedisServer, proxy: Proxy, gateways: list[Server], seconds: float, after: float, key: str
):
    """A steady load over both gateways: ``after`` seconds before the fault, the fault, ``after`` seconds after.
    The outcomes, when the fault began and when it ended (monotonic)."""
    reference = "".join(greedy_streams(gateways[0].url, MODEL, PROMPT, TOKENS, key)["openai"])
    with Load(lambda: [g.url for g in gateways], reference, key) as load:
        time.sleep(after)
        began = time.monotonic()
        inject(name, redis, proxy, seconds)
        ended = time.monotonic()
        time.sleep(after)
    return load.outcomes, began, ended


def table(rows: list[tuple[str, list[Outcome], float, float]], secret_words: tuple[str, ...]) -> str:
    lines = [
        "| fault | protocol | sent | answered | errors (status x count) | cut | last error after the fault ended |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, outcomes, _began, ended in rows:
        for protocol in PROTOCOLS:
            mine = [o for o in outcomes if o.protocol == protocol]
            errors = collections.Counter(o.status for o in mine if o.status not in ("ok", "cut"))
            failed = [o for o in mine if o.status != "ok"]
            late = max((o.ended for o in failed), default=None)
            after = "none failed" if late is None else f"{max(0.0, late - ended):.1f} s"
            said = ", ".join(f"{status} x {count}" for status, count in sorted(errors.items())) or "-"
            lines.append(
                f"| {name} | {protocol} | {len(mine)} | {sum(o.status == 'ok' for o in mine)} | {said} | "
                f"{sum(o.status == 'cut' for o in mine)} | {after} |"
            )
    leaks = [o.message for _, outcomes, _, _ in rows for o in outcomes if any(w in o.message for w in secret_words)]
    lines.append(f"\nmessages naming the store's address: {len(leaks)}" + (f": {leaks[:3]}" if leaks else ""))
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.cluster.store_faults", description=__doc__.split("\n")[0])
    parser.add_argument("--faults", default="paused,restarted from AOF,slowed,restarted empty")
    parser.add_argument("--open", action="store_true", help="no keys: an open cluster (else an inference key)")
    parser.add_argument("--seconds", type=float, default=30.0, help="how long a pause or a slow-down lasts")
    parser.add_argument("--after", type=float, default=15.0, help="seconds of load before and after each fault")
    parser.add_argument("--data-dir", default=str(ROOT / ".cache" / "test-data"))
    args = parser.parse_args(argv)
    rows = []
    admin = None if args.open else f"mg-admin-{secrets.token_hex(8)}"
    with tempfile.TemporaryDirectory(prefix="meshgate-store-faults-") as work:
        with cluster(Path(args.data_dir), Path(work), admin) as (redis, proxy, gateways, _agents):
            key = "x"
            if admin:  # clients use an inference key, as in production; the admin key only makes it
                made = httpx.post(
                    f"{gateways[0].url}/keys",
                    json={"name": "load", "scope": "inference"},
                    headers={"authorization": f"Bearer {admin}"},
                )
                assert made.status_code == 201, made.text
                key = made.json()["key"]
            for name in args.faults.split(","):
                print(f"fault: {name}", file=sys.stderr, flush=True)
                outcomes, began, ended = under_fault(name, redis, proxy, gateways, args.seconds, args.after, key)
                rows.append((name, outcomes, began, ended))
                wait_for(lambda: len(ready(gateways[0], admin)) == 2, 120, "two ready replicas again")
            words = (f":{redis.port}", f":{proxy.port}", "redis://")
    print(table(rows, words))
    return 0


if __name__ == "__main__":
    sys.exit(main())
