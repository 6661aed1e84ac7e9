"""The cluster secret: runner processes, their control endpoints and the node agents' probes answer only callers
that present it; ``RunnerClient`` and the agents present it; it reaches a runner through its environment, never its
command line; the state stores hand every process the first one proposed.

Runners here are real processes started by ``RunnerProcess`` serving a tiny engine over real sockets.
"""

from __future__ import annotations

import asyncio
import contextlib
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.control import JsonHandler, serve_control
from meshgate.backends.runner.process import RunnerProcess
from meshgate.gateway.cluster.agent import NodeAgent
from meshgate.gateway.cluster.redis_store import RedisStore
from meshgate.gateway.cluster.store import MemoryStore, StateStore
from meshgate.gateway.http import runtime
from meshgate.protocols.model import BackendProtocolError, Failed, Finished, Request, TextDelta
from tests.cluster.conftest import redis_server  # noqa: F401 (a fixture)

SECRET = "test-cluster-secret-0123456789"
REQUEST = Request(model="m", raw_prompt="hi", stream=True)

ENGINE = """
from meshgate.backends.runner.server import serve
from meshgate.protocols.model import Finished, TextDelta, Usage

class Engine:
    calls = 0

    def generate(self, request, cancel):
        Engine.calls += 1
        yield Usage(prompt_tokens=1)
        yield TextDelta(text="hello")
        yield Finished(reason="stop")

    def count_tokens(self, request, cancel):
        Engine.calls += 1
        return {"count": 3}

    def health(self):
        return {"status": "ok", "calls": Engine.calls}

serve(Engine())
"""


@pytest.fixture
def secret() -> Iterator[str]:
    """This process's cluster secret set to ``SECRET`` for the test, as the control plane does."""
    before = cluster_secret._current
    cluster_secret.use(SECRET)
    yield SECRET
    cluster_secret._current = before


@pytest.fixture
async def runner(secret: str) -> AsyncIterator[RunnerProcess]:
    process = await RunnerProcess.start([sys.executable, "-c", ENGINE], name="secret-test", ready_timeout=60)
    yield process
    await process.stop()


def url(process: RunnerProcess) -> str:
    return f"http://127.0.0.1:{process.port}"


BODY = b'{"model":"m","raw_prompt":"hi","stream":true}'
CALLS = [("GET", "/health"), ("POST", "/generate"), ("POST", "/tokenize"), ("POST", "/embed"), ("GET", "/nowhere")]


async def test_a_runner_refuses_every_call_without_the_secret_and_runs_nothing(runner: RunnerProcess) -> None:
    async with httpx.AsyncClient(base_url=url(runner), trust_env=False) as http:
        for headers in (
            {},
            {"authorization": "Bearer wrong"},
            {"authorization": f"Basic {SECRET}"},
            {"x-meshgate-secret": SECRET[:-1]},
            {"authorization": "Bearer"},
        ):
            for method, path in CALLS:
                reply = await http.request(method, path, content=BODY if method == "POST" else None, headers=headers)
                assert reply.status_code == 401, (method, path, headers, reply.text)
                assert reply.json()["error"]["kind"] == "AuthenticationFailed"
                assert reply.headers["www-authenticate"] == "Bearer"
        health = await http.get("/health", headers={"x-meshgate-secret": SECRET})
        assert health.status_code == 200 and health.json()["calls"] == 0, "nothing ran for the refused calls"
        health = await http.get("/health", headers={"authorization": f"bearer {SECRET}"})
        assert health.status_code == 200 and health.json()["finished"] == 0


async def test_runner_client_presents_the_secret(runner: RunnerProcess) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        client = RunnerClient(url(runner), http)
        events = [e async for e in client.generate(REQUEST)]
        assert [e for e in events if isinstance(e, TextDelta)] == [TextDelta(text="hello")]
        assert isinstance(events[-1], Finished)
        assert await client.count_tokens(REQUEST) == 3
        assert (await client.health())["calls"] == 2


async def test_a_client_with_another_secret_gets_a_backend_error_not_an_auth_error(runner: RunnerProcess) -> None:
    async with httpx.AsyncClient(trust_env=False) as http:
        client = RunnerClient(url(runner), http, secret="another-clusters-secret")
        [failed] = [e async for e in client.generate(REQUEST)]
        assert isinstance(failed, Failed) and failed.error.kind == "BackendProtocolError", failed
        with pytest.raises(BackendProtocolError, match="cluster secret"):
            await client.count_tokens(REQUEST)
        assert (await RunnerClient(url(runner), http).health())["calls"] == 0


async def test_the_secret_travels_in_the_environment_not_the_command_line(runner: RunnerProcess) -> None:
    assert SECRET.encode() not in Path(f"/proc/{runner.pid}/cmdline").read_bytes()
    assert f"{cluster_secret.ENV}={SECRET}".encode() in Path(f"/proc/{runner.pid}/environ").read_bytes().split(b"\0")


def test_control_endpoints_demand_the_secret_of_their_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    class Handler(JsonHandler):
        def do_GET(self) -> None:
            self.reply(200, {"ok": True})

        def do_POST(self) -> None:
            self.reply(200, {"joined": self.body()})

    monkeypatch.setenv(cluster_secret.ENV, SECRET)
    server = serve_control("127.0.0.1", 0, Handler, "secret-test")
    try:
        base = f"http://127.0.0.1:{server.server_address[1]}"
        with httpx.Client(base_url=base, trust_env=False, timeout=10) as http:
            assert http.get("/ring").status_code == 401
            assert http.post("/join", json={"rank": 1}, headers={"authorization": "Bearer no"}).status_code == 401
            assert http.get("/ring", headers={"authorization": f"Bearer {SECRET}"}).json() == {"ok": True}
            assert http.post("/join", json={"rank": 1}, headers={"x-meshgate-secret": SECRET}).json() == {
                "joined": {"rank": 1}
            }
    finally:
        server.shutdown()
        server.server_close()


async def _agent(store: StateStore, name: str, secret: str | None) -> NodeAgent:
    agent = NodeAgent(
        store, [], lambda model: None, choose=lambda **_: None, name=name, flops=1e9, probe_bytes=1 << 20, secret=secret
    )  # type: ignore[arg-type]
    await agent.start()
    return agent


async def test_agents_probe_each_other_with_the_secret_and_refuse_strangers() -> None:
    store = MemoryStore()
    a, b = await _agent(store, "a", SECRET), await _agent(store, "b", SECRET)
    stranger = await _agent(store, "stranger", "some-other-secret")
    try:
        async with httpx.AsyncClient(trust_env=False) as http:
            assert (await http.get(f"{a.agent_url}/ping")).status_code == 401
            assert (await http.get(f"{a.agent_url}/blob", params={"bytes": 1 << 20})).status_code == 401
            assert (await http.get(f"{a.agent_url}/ping", headers={"x-meshgate-secret": "nope"})).status_code == 401
            assert (await http.get(f"{a.agent_url}/ping", headers={"authorization": f"Bearer {SECRET}"})).text == "pong"
        assert {link.dst for link in await a.probe_links()} == {"b"}, "the stranger's agent refused a's probes"
        assert await stranger.probe_links() == [], "a and b refused the stranger's probes"
    finally:
        for agent in (a, b, stranger):
            await agent.close()
        await store.close()


@contextlib.asynccontextmanager
async def _two_clients(kind: str, request: pytest.FixtureRequest) -> AsyncIterator[tuple[StateStore, StateStore]]:
    """Two clients of one state store: the same object in memory, two connections to one prefix on Redis."""
    if kind == "memory":
        one = two = MemoryStore()
    else:
        server = request.getfixturevalue("redis_server")
        prefix = f"secret-{id(request)}:"
        one, two = RedisStore(server.url, prefix=prefix), RedisStore(server.url, prefix=prefix)
    try:
        yield one, two
    finally:
        await one.close()
        if two is not one:
            await two.close()


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_stores_hand_everyone_the_first_proposed_secret(kind: str, request: pytest.FixtureRequest) -> None:
    async with _two_clients(kind, request) as (first, second):
        proposals = ["first-proposal", "second-proposal", "third-proposal"]
        stores = [first, second, first]
        got = await asyncio.gather(*(s.cluster_secret(p) for s, p in zip(stores, proposals, strict=True)))
        assert len(set(got)) == 1 and got[0] in proposals
        assert await second.cluster_secret("later") == got[0]


def test_a_secret_that_cannot_travel_in_a_header_is_refused() -> None:
    for bad in ("", "two words", "line\r\nx-injected: 1", "caf\u00e9"):
        with pytest.raises(ValueError):
            cluster_secret.use(bad)


@pytest.mark.parametrize("kind", ["memory", "redis"])
async def test_the_secret_running_runners_hold_survives_a_store_restarted_empty(
    kind: str, request: pytest.FixtureRequest
) -> None:
    """Issue 37, 14: the store loses the secret; a gateway started meanwhile makes one up (provisional); the next
    heartbeat of an agent whose runners demand the old one puts that back, and the gateway's next read takes it.
    A confirmed secret is never replaced, and a provisional one that agrees is confirmed."""
    async with _two_clients(kind, request) as (agent_side, gateway_side):
        assert await agent_side.cluster_secret("old", held=True) == "old"
        assert await gateway_side.cluster_secret("made-up") == "old"  # a gateway joining takes the stored one
        if kind == "memory":
            agent_side._secret = None  # type: ignore[attr-defined]  # the store restarted empty
        else:
            client = aioredis.Redis.from_url(request.getfixturevalue("redis_server").url)
            for key in await client.keys(f"{agent_side.prefix}*"):  # type: ignore[attr-defined]
                await client.delete(key)
            await client.aclose()
        assert await gateway_side.cluster_secret("made-up") == "made-up"  # provisional
        assert await agent_side.cluster_secret("old", held=True) == "old"  # the heartbeat: runners demand "old"
        assert await gateway_side.cluster_secret("made-up") == "old"  # the gateway's next read (follow_secret)
        assert await agent_side.cluster_secret("other", held=True) == "old"  # confirmed: never replaced


async def test_a_gateway_follows_the_secret_the_store_holds(monkeypatch) -> None:
    monkeypatch.setattr(cluster_secret, "_current", None)  # this process's own is put back afterwards
    store = MemoryStore()
    await store.cluster_secret("mine")
    cluster_secret.use("mine")
    following = asyncio.create_task(runtime.follow_secret(store, every=0.01))
    try:
        await store.cluster_secret("the-agents", held=True)  # replaces the provisional one
        for _ in range(200):
            if cluster_secret.current() == "the-agents":
                break
            await asyncio.sleep(0.01)
        assert cluster_secret.current() == "the-agents"
    finally:
        following.cancel()
        await store.close()
