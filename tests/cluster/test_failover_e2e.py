"""Streams that outlive their node, for real: redis-server, two ``meshgate node`` agents, two gateways on the same
Redis, two replicas of the packaged Gemma 3 270M (one per node). A greedy stream in each protocol, through the
official SDKs, spread over both gateways; the node serving some of them is SIGKILLed (its runner dies with its
agent) while they generate: every stream goes on on the other replica from the tokens it had sent, and each SDK
gets the undisturbed text. The deployment gets its second replica back once the node returns.

Then a rolling restart under steady load: a client per protocol streams greedy chats without a pause, spread over
the gateways a load balancer would send to, while each node is stopped with ``SIGTERM`` (it drains) and started
again, then each gateway (taken out of the balancer first, then ``SIGTERM``: it finishes its streams). Every
request completes with the undisturbed text.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from meshgate.gateway.auth.keys import SEAL_SETTLE
from tests.cluster.faults import greedy_streams, resumes
from tests.cluster.redis_server import RedisServer
from tests.cluster.store_faults import Load, Outcome, ready, restart_empty
from tests.cluster.test_cluster_e2e import FAST, Agent, wait_for
from tests.conftest import MODEL, Server

# a node stays a member through a CPU stall on 2 cores (a missed heartbeat would fail its replica too)
ENV = {
    **FAST,
    "MESHGATE_HEARTBEAT": "0.5",
    "MESHGATE_NODE_TTL": "15",
    "MESHGATE_THREADS": "1",
    "MESHGATE_DRAIN_GRACE": "30",
}
N_CTX = 1024
PROMPT, TOKENS = "Count from one to five hundred.", 64
LONG = 150  # tokens of a stream that outlasts a gateway's old 5 s shutdown wait


@pytest.fixture(scope="module")
def failover_redis(tmp_path_factory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("failover-redis")) as redis:  # no persistence: a restart is empty
        yield redis


@pytest.fixture(scope="module")
def cluster(
    data_dir, packaged_gguf, tmp_path_factory, failover_redis
) -> Iterator[tuple[list[Server], dict[str, Agent], str]]:
    logs = tmp_path_factory.mktemp("failover-logs")
    url = failover_redis.url
    agents = {name: Agent(url, name, data_dir, logs, n_ctx=N_CTX, env=ENV) for name in ("a", "b")}
    gateways: list[Server] = []
    try:
        gateways += [Server(data_dir, "--redis", url, "--n-ctx", str(N_CTX), env=ENV) for _ in range(2)]
        wait_for(lambda: len(httpx.get(f"{gateways[0].url}/cluster").json()["nodes"]) == 2, 60, "two nodes")
        r = httpx.post(f"{gateways[0].url}/instances", json={"model": MODEL, "replicas": 2}, timeout=60)
        assert r.status_code == 201, r.text
        _two_ready(gateways[0])
        yield gateways, agents, url
    finally:
        for gateway in gateways:
            gateway.stop()
        for agent in agents.values():
            agent.stop()


def _two_ready(gateway: Server, timeout: float = 180) -> list[dict]:
    def ready() -> list[dict] | None:
        found = [i for i in httpx.get(f"{gateway.url}/instances").json() if i["model"] == MODEL]
        return found if sum(i["state"]["state"] == "ready" for i in found) == 2 else None

    return wait_for(ready, timeout, "two ready replicas")  # type: ignore[return-value]


def _busy_node(gateways: list[Server]) -> str:
    """The node of a replica some stream runs on, as the gateways' shared load shows it."""

    def busy() -> str | None:
        for instance in httpx.get(f"{gateways[0].url}/instances").json():
            if (instance.get("load") or {}).get("running"):
                return instance["placement"]["shards"][0]["node_id"]
        return None

    return wait_for(busy, 30, "a replica with a running stream")  # type: ignore[return-value]


def test_a_node_killed_mid_stream_loses_no_stream(cluster, data_dir, tmp_path):
    gateways, agents, redis_url = cluster
    reference = "".join(greedy_streams(gateways[0].url, MODEL, PROMPT, TOKENS)["openai"])
    assert len(reference) > 60, reference
    streams = {
        **{p: s for p, s in greedy_streams(gateways[0].url, MODEL, PROMPT, TOKENS).items() if p != "ollama"},
        "ollama": greedy_streams(gateways[1].url, MODEL, PROMPT, TOKENS)["ollama"],
    }
    got = {protocol: next(stream) for protocol, stream in streams.items()}  # all three generating
    victim = _busy_node(gateways)
    agents[victim].kill()
    for protocol, stream in streams.items():
        got[protocol] += "".join(stream)
    assert got == dict.fromkeys(streams, reference)
    moved = sum(resumes(gateway.url) for gateway in gateways)
    assert 1 <= moved <= 3, moved
    agents[victim] = Agent(redis_url, victim, data_dir, tmp_path, n_ctx=N_CTX, env=ENV)
    replicas = _two_ready(gateways[1])
    assert len(replicas) == 2


def test_a_rolling_restart_of_every_node_and_gateway_loses_no_request(cluster, data_dir, tmp_path):
    gateways, agents, redis_url = cluster
    reference = "".join(greedy_streams(gateways[0].url, MODEL, PROMPT, 32)["openai"])
    long_reference = "".join(greedy_streams(gateways[0].url, MODEL, PROMPT, LONG)["openai"])
    in_service = list(gateways)  # where a load balancer sends requests: a gateway leaves it before its SIGTERM
    resumed_before = sum(resumes(gateway.url) for gateway in gateways)
    done: list[tuple[str, str]] = []
    errors: list[str] = []
    stop = threading.Event()

    def client(protocol: str, offset: int) -> None:
        for n in range(300):  # bounded; stopped once every process has been restarted
            if stop.is_set():
                return
            url = in_service[(n + offset) % len(in_service)].url
            try:
                done.append((protocol, "".join(greedy_streams(url, MODEL, PROMPT, 32)[protocol])))
            except Exception as exc:  # a lost request: the assertion below shows it
                errors.append(f"{protocol} via {url}: {exc!r}")

    clients = [threading.Thread(target=client, args=(p, i)) for i, p in enumerate(("openai", "anthropic", "ollama"))]
    for thread in clients:
        thread.start()
    try:
        for name in ("a", "b"):
            time.sleep(2)  # streams running on the node
            agents[name].stop(drain=True, timeout=90)  # the drain is bounded by its grace (30 s) and margin (5 s)
            assert agents[name].proc.returncode == 0, agents[name].log.read_text()[-6000:]
            agents[name] = Agent(redis_url, name, data_dir, tmp_path, n_ctx=N_CTX, env=ENV)
            wait_for(lambda: len(httpx.get(f"{gateways[1].url}/cluster").json()["nodes"]) == 2, 60, "node back")
        moved = sum(resumes(gateway.url) for gateway in gateways) - resumed_before  # drained: none cut
        for i in range(2):
            old = gateways[i]
            long = greedy_streams(old.url, MODEL, PROMPT, LONG)["anthropic"]
            pieces = [next(long)]  # a long stream open on the gateway when it is told to stop
            in_service.remove(old)
            time.sleep(0.5)  # the balancer's deregistration delay: requests already picked it have reached it
            old.proc.terminate()  # SIGTERM, as an operator's restart sends it
            pieces += list(long)
            assert "".join(pieces) == long_reference, "the gateway finished its stream before it stopped"
            old.stop()  # its exit (uvicorn's graceful shutdown, then the control plane's) is not what is tested here
            gateways[i] = Server(data_dir, "--redis", redis_url, "--n-ctx", str(N_CTX), env=ENV)
            in_service.append(gateways[i])
        time.sleep(2)
    finally:
        stop.set()
        for thread in clients:
            thread.join(180)
    assert errors == [] and moved == 0, (errors, moved)
    assert {p for p, _ in done} == {"openai", "anthropic", "ollama"} and len(done) >= 9, len(done)
    assert [p for p, text in done if text != reference] == []
    events = httpx.get(f"{gateways[0].url}/events", params={"count": 1000}).json()
    kinds = [e["kind"] for e in events]
    assert kinds.count("node.draining") >= 2, kinds


def test_redis_restarted_empty_under_load_cuts_no_stream_and_keeps_both_replicas(cluster, failover_redis):
    """Redis SIGKILLed and started again with nothing, under a steady greedy stream in each protocol over both
    gateways: no stream is cut and no text differs; requests fail only with a 503 (Redis down, then the few
    seconds the gateways wait for a seal to come back: this cluster never made a key), none once that is over;
    the two replicas are the same instances on the same runners (none started again): the gateways put them back
    (``cluster.recovery``), the agents kept their runners meanwhile."""
    gateways, agents, _ = cluster
    before = sorted(i["id"] for i in _two_ready(gateways[0]))
    launched = {name: agent.log.read_text().count("started shard") for name, agent in agents.items()}
    reference = "".join(greedy_streams(gateways[0].url, MODEL, PROMPT, 24)["openai"])
    with Load(lambda: [g.url for g in gateways], reference) as load:
        time.sleep(3)
        restart_empty(failover_redis)
        back = time.monotonic()
        for gateway in gateways:
            wait_for(lambda g=gateway: sorted(i["id"] for i in ready(g)) == before, 30, "the replicas put back")
        time.sleep(SEAL_SETTLE + 4)
    statuses = collections.Counter(o.status for o in load.outcomes)
    print(statuses, [(round(o.began - back, 1), o.status, o.message[:80]) for o in load.outcomes if o.status != "ok"])
    refused = ("503", "529")  # the store away: 503, or Anthropic's 529 overloaded_error (docs/PROTOCOLS)
    assert set(statuses) <= {"ok", *refused}, [o for o in load.outcomes if o.status not in ("ok", *refused)]
    assert not [o for o in load.outcomes if o.status != "ok" and o.began > back + SEAL_SETTLE + 1]
    assert {p for p, n in _answered(load.outcomes).items() if n} == {"openai", "anthropic", "ollama"}
    assert {name: agent.log.read_text().count("started shard") for name, agent in agents.items()} == launched
    events = httpx.get(f"{gateways[0].url}/events", params={"count": 1000}).json()
    assert "store.republished" in [e["kind"] for e in events]


def _answered(outcomes: list[Outcome]) -> dict[str, int]:
    return collections.Counter(o.protocol for o in outcomes if o.status == "ok")
