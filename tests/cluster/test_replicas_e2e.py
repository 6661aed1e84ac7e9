"""Replicas for real: redis-server, two ``meshgate node`` agents (one thread each), two gateways on the same Redis,
the real Gemma 3 270M. Two replicas placed at once land on both nodes; streams sent to both gateways use both;
a conversation keeps its replica and reuses its prefix there; Ollama's ``num_ctx`` never evicts a replica that
serves; a pipeline replica runs over RPC beside another.
"""

from __future__ import annotations

import re
import subprocess
import sys
import threading
from collections import Counter
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from tests.cluster.redis_server import RedisServer
from tests.cluster.test_cluster_e2e import FAST, Agent, wait_for
from tests.conftest import MODEL, ROOT, Server

ENV = {**FAST, "MESHGATE_THREADS": "1"}
N_CTX = 1024
LONG = 400
"""The tokens of the stream that serves while ``num_ctx`` requests come (``test_num_ctx_never_evicts...``)."""


@pytest.fixture(scope="module")
def two_gateways(data_dir, packaged_gguf, tmp_path_factory) -> Iterator[tuple[Server, Server]]:
    logs = tmp_path_factory.mktemp("replica-logs")
    with RedisServer(tmp_path_factory.mktemp("replica-redis")) as redis:
        agents = [Agent(redis.url, name, data_dir, logs, n_ctx=N_CTX, env=ENV) for name in ("a", "b")]
        gateways: list[Server] = []
        try:
            gateways += [Server(data_dir, "--redis", redis.url, "--n-ctx", str(N_CTX), env=ENV) for _ in range(2)]
            wait_for(lambda: len(httpx.get(f"{gateways[0].url}/cluster").json()["nodes"]) == 2, 60, "two nodes")
            yield gateways[0], gateways[1]
        finally:
            for gateway in gateways:
                gateway.stop()
            for agent in agents:
                agent.stop()


def _ready(gateway: Server, ids: list[str]) -> list[dict]:
    def check() -> list[dict] | None:
        found = [httpx.get(f"{gateway.url}/instances/{i}").json() for i in ids]
        return found if all(i["state"]["state"] == "ready" for i in found) else None

    return wait_for(check, 120, f"instances {ids} ready")  # type: ignore[return-value]


def _counter(gateways: tuple[Server, ...], name: str) -> Counter[str]:
    """``name``{instance=...} summed over the gateways' /metrics, by instance."""
    found: Counter[str] = Counter()
    pattern = re.compile(rf'^{name}\{{[^}}]*instance="([^"]+)"[^}}]*\}} ([0-9.e+]+)$', re.M)
    for gateway in gateways:
        for instance_id, value in pattern.findall(httpx.get(f"{gateway.url}/metrics").text):
            found[instance_id] += float(value)
    return found


@pytest.fixture(scope="module")
def replicas(two_gateways) -> list[dict]:
    one, two = two_gateways
    r = httpx.post(f"{one.url}/instances", json={"model": MODEL, "replicas": 2}, timeout=60)
    assert r.status_code == 201, r.text
    placed = r.json()["replicas"]
    return _ready(two, [i["id"] for i in placed])


def test_two_replicas_land_on_both_nodes_and_both_gateways_know_the_deployment(two_gateways, replicas):
    one, two = two_gateways
    assert sorted(i["placement"]["shards"][0]["node_id"] for i in replicas) == ["a", "b"]
    assert all(i["note"] is None and i["placement"]["sequences"] >= 8 for i in replicas)
    for gateway in (one, two):
        assert [(d["model"], d["replicas"]) for d in httpx.get(f"{gateway.url}/deployments").json()] == [(MODEL, 2)]
    ps = subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "ps", "--url", two.url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert ps.returncode == 0, ps.stderr
    rows = [line for line in ps.stdout.splitlines() if any(i["id"] in line for i in replicas)]
    assert len(rows) == 2 and "1/2" in rows[0] and "2/2" in rows[1]
    assert all(re.search(r"\b[ab]\[0:18\]", row) for row in rows)  # each replica's node and layers


def test_streams_sent_to_both_gateways_use_both_replicas(two_gateways, replicas):
    before = _counter(two_gateways, "meshgate_instance_requests_total")

    def stream(n: int) -> str:
        gateway = two_gateways[n % 2]
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=120)
        chunks = client.completions.create(
            model=MODEL, prompt=f"Story number {n}: once upon a time", max_tokens=16, temperature=0, stream=True
        )
        return "".join(c.choices[0].text for c in chunks if c.choices)

    with ThreadPoolExecutor(16) as pool:
        texts = list(pool.map(stream, range(16)))
    assert all(texts)
    served = _counter(two_gateways, "meshgate_instance_requests_total") - before
    assert sum(served.values()) == 16
    assert all(served[i["id"]] >= 4 for i in replicas), served  # all 16 on one replica was the bug


def _idle(gateways: tuple[Server, ...]) -> None:
    """Wait until every gateway sees no load on any replica (the shared load of a burst just ended is up to a
    second old on the other gateway, and a loaded replica is rightly passed over)."""

    def idle() -> bool:
        views = [i.get("load") or {} for g in gateways for i in httpx.get(f"{g.url}/instances").json()]
        return all(not v.get("running") and not v.get("queued") for v in views)

    wait_for(idle, 10, "no load left on the replicas")


def test_a_conversation_keeps_its_replica_and_reuses_its_prefix(two_gateways, replicas):
    _idle(two_gateways)
    requests_before = _counter(two_gateways, "meshgate_instance_requests_total")
    hits_before = _counter(two_gateways, "meshgate_prefix_cache_hits_total")
    # over routing.MIN_PREFIX characters: a key every gateway hashes alike (a shorter chat goes least-loaded)
    first = "Here is a long question about the history of the city of Paris, its rivers, its bridges and " * 6
    messages = [{"role": "system", "content": "You answer briefly."}, {"role": "user", "content": first}]
    for turn in range(3):
        gateway = two_gateways[turn % 2]  # the turns alternate between the gateways
        client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=120)
        reply = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=8, temperature=0)
        messages += [
            {"role": "assistant", "content": reply.choices[0].message.content or ""},
            {"role": "user", "content": f"Tell me more, part {turn + 2}."},
        ]
    served = _counter(two_gateways, "meshgate_instance_requests_total") - requests_before
    assert len(+served) == 1 and sum(served.values()) == 3, served
    [home] = list(+served)
    hits = _counter(two_gateways, "meshgate_prefix_cache_hits_total") - hits_before
    assert hits[home] >= 2, hits  # turns 2 and 3 found turn 1's tokens in the runner's cache


def test_num_ctx_never_evicts_a_replica_that_serves(two_gateways, replicas):
    one, two = two_gateways
    original = {i["id"] for i in replicas}
    done: dict[str, object] = {}

    def long_stream() -> None:
        lines = []
        # greedy counting never ends by itself: the stream runs its whole num_predict, long after the checks below
        # begin (at one thread, 400 tokens take ~20 s), whatever the box's speed or the other gateway's lag
        options = {"num_predict": LONG, "num_ctx": N_CTX, "temperature": 0}
        with httpx.stream(
            "POST",
            f"{one.url}/api/generate",
            json={"model": MODEL, "prompt": "Count from 1 to 1000: 1, 2, 3, 4,", "options": options},
            timeout=300,
        ) as r:
            for line in r.iter_lines():
                if line:
                    lines.append(line)
                    done.setdefault("started", True)
        done["last"] = lines[-1]

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    wait_for(lambda: done.get("started"), 60, "the long stream's first token")
    busy = wait_for(
        lambda: [i for i in httpx.get(f"{two.url}/instances").json() if (i.get("load") or {}).get("running")],
        60,
        "the other gateway seeing the stream's load",
    )
    assert "last" not in done, "the stream ended before the other gateway saw it: the test proves nothing"
    assert {i["id"] for i in busy} <= original  # type: ignore[union-attr]
    smaller = httpx.post(
        f"{two.url}/api/generate",
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "num_ctx": 512}},
        timeout=60,
    )
    assert smaller.status_code == 200
    assert {i["id"] for i in httpx.get(f"{two.url}/instances").json()} == original, "a smaller num_ctx fits"
    bigger = httpx.post(
        f"{two.url}/api/generate",
        json={"model": MODEL, "prompt": "Hi", "stream": False, "options": {"num_predict": 2, "num_ctx": 2048}},
        timeout=180,
    )
    assert bigger.status_code == 200, bigger.text
    streaming.join(300)
    assert '"done":true' in str(done["last"]) and f'"eval_count":{LONG}' in str(done["last"]), done["last"]
    now = {i["id"]: i for i in httpx.get(f"{one.url}/instances").json()}
    assert original < set(now), "the bigger replica was placed beside the others"
    [extra] = [i for i in now.values() if i["id"] not in original]
    assert extra["placement"]["context"] == 2048
    _delete(one, extra["id"])
    assert [(d["model"], d["replicas"]) for d in httpx.get(f"{one.url}/deployments").json()] == [(MODEL, 2)]


def test_pipeline_replicas_over_rpc(two_gateways, replicas):
    one, two = two_gateways
    # the replicas there now (a fresh clone once found one of the module's first two already gone: a 404 here;
    # why is not known yet, see the stop note of issue 36)
    for old in [i for i in httpx.get(f"{one.url}/instances").json() if i["model"] == MODEL]:
        _delete(one, old["id"])
    body = {"model": MODEL, "replicas": 2, "strategy": "pipeline", "min_nodes": 2}
    r = httpx.post(f"{one.url}/instances", json=body, timeout=60)
    assert r.status_code == 201, r.text
    placed = _ready(one, [i["id"] for i in r.json()["replicas"]])
    _ready(two, [i["id"] for i in placed])  # the gateway sending them sees both ready (CI once saw it route to one)
    assert all(sorted(s["node_id"] for s in i["placement"]["shards"]) == ["a", "b"] for i in placed)
    assert placed[0]["note"] is None and "shares" in placed[1]["note"]  # two nodes hold both: it says why
    client = openai.OpenAI(base_url=f"{two.url}/v1", api_key="x", max_retries=0, timeout=120)
    before = _counter(two_gateways, "meshgate_instance_requests_total")
    # bursts of 8 until both replicas have served one: which replica a burst's requests land on is routing's call
    # (on fresh clones a burst has gone to one replica alone); what must hold is that both pipelines generate
    for burst in range(4):
        with ThreadPoolExecutor(8) as pool:
            texts = list(
                pool.map(
                    lambda n: (
                        client.completions.create(model=MODEL, prompt=f"{n} + {n} =", max_tokens=8).choices[0].text
                    ),
                    range(8 * burst, 8 * burst + 8),
                )
            )
        assert all(texts)
        served = _counter(two_gateways, "meshgate_instance_requests_total") - before
        if set(+served) == {i["id"] for i in placed}:
            break
    assert set(+served) == {i["id"] for i in placed}, served


def test_keep_alive_zero_unloads_idle_replicas_and_never_cuts_a_stream(two_gateways):
    """An admin's deployment keeps its ``min_replicas`` whatever a request's ``keep_alive`` says (issue 37, 8): the
    two replicas placed by ``POST /instances`` are its minimum until the admin lowers it to 1; then ``keep_alive:
    0`` unloads the idle one and never the one a stream runs on."""
    one, two = two_gateways
    done: dict[str, object] = {}
    r = httpx.put(f"{one.url}/deployments/{MODEL}", json={"min_replicas": 1}, timeout=30)
    assert r.status_code == 200 and r.json()["min_replicas"] == 1, r.text

    def long_stream() -> None:
        with httpx.stream(
            "POST",
            f"{one.url}/api/generate",
            json={"model": MODEL, "prompt": "Count slowly:", "options": {"num_predict": 480, "temperature": 0}},
            timeout=180,
        ) as r:
            for line in r.iter_lines():
                if line:
                    done.setdefault("started", True)
                    done["last"] = line

    streaming = threading.Thread(target=long_stream)
    streaming.start()
    wait_for(lambda: done.get("started"), 60, "the stream's first token")
    busy = wait_for(
        lambda: [i["id"] for i in httpx.get(f"{two.url}/instances").json() if (i.get("load") or {}).get("running")],
        10,
        "the stream's load seen by the other gateway",
    )
    r = httpx.post(
        f"{two.url}/api/generate",
        json={"model": MODEL, "prompt": "Hi", "stream": False, "keep_alive": 0, "options": {"num_predict": 2}},
        timeout=60,
    )
    assert r.status_code == 200
    serving = {i["id"] for i in httpx.get(f"{one.url}/instances").json() if i["state"]["state"] != "draining"}
    assert serving == set(busy), "idle replicas unloaded (they settle 2.5 s, taking nothing new)"  # type: ignore[arg-type]
    streaming.join(180)
    assert '"done":true' in str(done["last"]) and '"eval_count":480' in str(done["last"]), done["last"]


def _delete(server, instance_id: str) -> None:
    """``DELETE /instances/{id}``, then wait until it is gone. 204 when the gateway sees the replica idle; 202
    (draining) when the shared load, published by the other gateway up to a second before, still counts a request
    that has just ended: the drain then finds nothing to wait for."""
    assert httpx.delete(f"{server.url}/instances/{instance_id}").status_code in (202, 204)
    wait_for(
        lambda: instance_id not in {i["id"] for i in httpx.get(f"{server.url}/instances").json()},
        30,
        f"instance {instance_id} removed",
    )
