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

import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.cluster.faults import greedy_streams, resumes
from tests.cluster.redis_server import RedisServer
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
def cluster(data_dir, packaged_gguf, tmp_path_factory) -> Iterator[tuple[list[Server], dict[str, Agent], str]]:
    logs = tmp_path_factory.mktemp("failover-logs")
    with RedisServer(tmp_path_factory.mktemp("failover-redis")) as redis:
        agents = {name: Agent(redis.url, name, data_dir, logs, n_ctx=N_CTX, env=ENV) for name in ("a", "b")}
        gateways: list[Server] = []
        try:
            gateways += [Server(data_dir, "--redis", redis.url, "--n-ctx", str(N_CTX), env=ENV) for _ in range(2)]
            wait_for(lambda: len(httpx.get(f"{gateways[0].url}/cluster").json()["nodes"]) == 2, 60, "two nodes")
            r = httpx.post(f"{gateways[0].url}/instances", json={"model": MODEL, "replicas": 2}, timeout=60)
            assert r.status_code == 201, r.text
            _two_ready(gateways[0])
            yield gateways, agents, redis.url
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
