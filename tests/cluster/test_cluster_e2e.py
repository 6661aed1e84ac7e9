"""The control plane for real: redis-server with AOF, node agents and gateways as separate processes on loopback.

Agents heartbeat every 0.3 s with a 1.5 s TTL so node loss is seen quickly; each offers 1.5 GiB so that the
2 GiB ``scripted-big`` model needs a two-node pipeline while Gemma 3 270M fits on one node.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.redis_server import RedisServer
from tests.conftest import MODEL, ROOT, Server

FAST = {"MESHGATE_HEARTBEAT": "0.3", "MESHGATE_NODE_TTL": "1.5"}
NODE_MEMORY = str(3 << 29)  # 1.5 GiB


def wait_for(check: Callable[[], object], timeout: float = 60.0, what: str = "condition") -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


class Agent:
    """A ``meshgate node`` process."""

    def __init__(
        self,
        redis_url: str,
        name: str,
        data_dir: Path,
        log_dir: Path,
        n_ctx: int = 1024,
        env: dict[str, str] | None = None,
        memory: str = NODE_MEMORY,
    ) -> None:
        self.name = name
        self.log = log_dir / f"agent-{name}.log"
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshgate.gateway.cli",
                    "node",
                    "--redis",
                    redis_url,
                    "--name",
                    name,
                    "--data-dir",
                    str(data_dir),
                    "--memory",
                    memory,
                    "--n-ctx",
                    str(n_ctx),
                    "--log-level",
                    "info",
                    "--plugin",
                    "tests.scripted_plugin",
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                env={**os.environ, **FAST, "PYTHONPATH": str(ROOT), **(env or {})},
            )

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self, *, drain: bool = False, timeout: float = 15) -> None:
        """Stop the agent at once (SIGINT: its streams resume elsewhere), or with ``drain`` as an operator's
        ``SIGTERM`` does (its replicas finish their streams first, within ``MESHGATE_DRAIN_GRACE``)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM if drain else signal.SIGINT)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="module")
def redis(tmp_path_factory) -> Iterator[RedisServer]:
    with RedisServer(tmp_path_factory.mktemp("redis-aof"), appendonly=True) as server:
        yield server


@pytest.fixture(scope="module")
def cluster(redis, data_dir, packaged_gguf, tmp_path_factory):
    """Agents a and b, and one gateway, all on the same Redis."""
    logs = tmp_path_factory.mktemp("logs")
    agents = {name: Agent(redis.url, name, data_dir, logs) for name in ("a", "b")}
    gateway = Server(data_dir, "--redis", redis.url, "--plugin", "tests.scripted_plugin", env=FAST)
    try:
        wait_for(lambda: len(nodes(gateway)) == 2, 60, "two nodes registered")
        yield gateway, agents, logs
    finally:
        gateway.stop()
        for agent in agents.values():
            agent.stop()


def nodes(gateway: Server) -> dict[str, dict]:
    return {n["id"]: n for n in httpx.get(f"{gateway.url}/cluster").json()["nodes"]}


def instance(gateway: Server, instance_id: str) -> dict:
    return httpx.get(f"{gateway.url}/instances/{instance_id}").json()


def test_agents_register_resources_and_measure_links(cluster):
    gateway, _, _ = cluster
    found = nodes(gateway)
    assert set(found) == {"a", "b"}
    for node in found.values():
        assert node["memory_total"] == 3 << 29 and node["cpu_count"] >= 1 and node["flops"] > 0
        assert "llama_cpp" in node["runtimes"] and node["address"] == "127.0.0.1"
    links = wait_for(
        lambda: (
            {(k["src"], k["dst"]): k for k in httpx.get(f"{gateway.url}/cluster").json()["links"]}
            if len(httpx.get(f"{gateway.url}/cluster").json()["links"]) >= 2
            else None
        ),
        30,
        "links",
    )
    assert {("a", "b"), ("b", "a")} <= set(links)
    assert all(0 < link["latency"] < 0.05 and link["bandwidth"] > 1e7 for link in links.values())


def test_previews_show_memory_cost_and_reasons(cluster):
    gateway, _, _ = cluster
    wait_for(lambda: len(httpx.get(f"{gateway.url}/cluster").json()["links"]) >= 2, 30, "links")
    body = httpx.get(f"{gateway.url}/instances/previews", params={"model": "scripted-big"}).json()
    fitting = [c for c in body["candidates"] if c["fits"]]
    assert fitting and fitting[0]["strategy"] == "pipeline" and set(fitting[0]["memory_per_node"]) == {"a", "b"}
    assert sum(s["layer_end"] - s["layer_start"] for s in fitting[0]["shards"]) == 16
    assert fitting[0]["tok_s"] > 0 and fitting[0]["link_cost"] > 0
    only_a = httpx.get(f"{gateway.url}/instances/previews", params={"model": "scripted-big", "nodes": "a"}).json()
    assert not any(c["fits"] for c in only_a["candidates"])
    assert all(c["reason"] for c in only_a["candidates"])
    small = httpx.get(f"{gateway.url}/instances/previews", params={"model": MODEL}).json()["candidates"][0]
    assert small["fits"] and small["strategy"] == "single"
    [(node, memory)] = small["memory_per_node"].items()
    assert memory > 246_587_904  # weights + KV cache + overhead


def test_create_wait_serve_delete(cluster):
    gateway, _, _ = cluster
    created = httpx.post(f"{gateway.url}/instances", json={"model": MODEL, "nodes": ["a"]}).json()
    with httpx.stream("GET", f"{gateway.url}/instances/{created['id']}/events", timeout=120) as r:
        states = [line.split(": ", 1)[1] for line in r.iter_lines() if line.startswith("event: ")]
    assert states[-1] == "ready"
    ready = instance(gateway, created["id"])
    pid = ready["runners"]["a"]["pid"]
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    reply = client.completions.create(model=MODEL, prompt="The sky is", max_tokens=3, temperature=0)
    assert reply.usage.completion_tokens == 3
    assert httpx.delete(f"{gateway.url}/instances/{created['id']}").status_code in (202, 204)  # it settles first
    wait_for(
        lambda: not os.path.exists(f"/proc/{pid}") or "Z" in Path(f"/proc/{pid}/stat").read_text().split()[2],
        30,
        "runner stopped",
    )
    assert httpx.get(f"{gateway.url}/instances/{created['id']}").status_code == 404


def test_a_model_that_fits_nowhere_gets_each_protocols_error_with_the_reason(cluster):
    gateway, _, _ = cluster
    chat = {"model": "scripted-huge", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    r = httpx.post(f"{gateway.url}/v1/chat/completions", json=chat)
    assert r.status_code == 503 and "fits nowhere" in r.json()["error"]["message"]
    assert "GiB" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.url}/v1/messages", json=chat)
    assert r.status_code == 529 and r.json()["error"]["type"] == "overloaded_error"
    assert "fits nowhere" in r.json()["error"]["message"]
    r = httpx.post(f"{gateway.url}/api/chat", json={"model": "scripted-huge", "messages": chat["messages"]})
    assert r.status_code == 503 and "fits nowhere" in r.json()["error"]
    body = httpx.post(f"{gateway.url}/instances", json={"model": "scripted-big", "nodes": ["b"]})
    assert body.status_code == 503 and "fits nowhere" in body.json()["error"]["message"]


def test_first_request_places_the_model_with_keepalives(redis, data_dir, cluster):
    gateway = Server(
        data_dir, "--redis", redis.url, "--plugin", "tests.scripted_plugin", env={**FAST, "MESHGATE_KEEPALIVE": "0.2"}
    )
    try:
        for old in httpx.get(f"{gateway.url}/instances").json():
            if old["model"] == MODEL:
                httpx.delete(f"{gateway.url}/instances/{old['id']}", params={"grace": 0})
        with httpx.stream(
            "POST",
            f"{gateway.url}/v1/chat/completions",
            timeout=120,
            json={"model": MODEL, "stream": True, "max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}]},
        ) as r:
            lines = [line for line in r.iter_lines() if line]
        assert lines[0].startswith(":"), "keep-alive comments while the instance starts"
        assert lines[-1] == "data: [DONE]" and any('"content"' in line for line in lines)
        placed = [i for i in httpx.get(f"{gateway.url}/instances").json() if i["model"] == MODEL]
        assert len(placed) == 1 and placed[0]["state"]["state"] == "ready"
    finally:
        gateway.stop()


def test_two_gateways_share_instances(cluster, redis, data_dir):
    gateway, _, _ = cluster
    other = Server(data_dir, "--redis", redis.url, "--plugin", "tests.scripted_plugin", env=FAST)
    try:
        created = httpx.post(f"{gateway.url}/instances", json={"model": "scripted", "nodes": ["b"]}).json()
        seen = wait_for(
            lambda: (
                instance(other, created["id"])
                if instance(other, created["id"]).get("state", {}).get("state") == "ready"
                else None
            ),
            30,
            "ready seen by the second gateway",
        )
        assert seen["placement"] == created["placement"]
        client = openai.OpenAI(base_url=f"{other.url}/v1", api_key="x", max_retries=0)
        assert (
            client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hello"}])
            .choices[0]
            .message.content
            == "Hello, world"
        )
        ids = [i["id"] for i in httpx.get(f"{other.url}/instances").json() if i["model"] == "scripted"]
        assert ids == [created["id"]], "the second gateway placed no instance of its own"
    finally:
        other.stop()


def test_autoscaling_adds_a_replica_while_requests_wait_and_removes_it_idle(cluster, redis, data_dir):
    gateway, _, _ = cluster
    env = {
        **FAST,
        "MESHGATE_PARALLEL": "1",
        "MESHGATE_SCALE_UP_WAIT": "1",
        "MESHGATE_SCALE_DOWN_IDLE": "2",
        "MESHGATE_SCALE_COOLDOWN": "0.5",
    }
    scaler = Server(data_dir, "--redis", redis.url, "--plugin", "tests.scripted_plugin", env=env)
    try:
        for old in httpx.get(f"{gateway.url}/instances").json():
            if old["model"] == "scripted":
                httpx.delete(f"{gateway.url}/instances/{old['id']}", params={"grace": 0})
        body = {"model": "scripted", "nodes": ["a"], "min_replicas": 1, "max_replicas": 2}
        created = httpx.post(f"{scaler.url}/instances", json=body).json()
        wait_for(lambda: instance(scaler, created["id"])["state"]["state"] == "ready", 30, "ready on a")
        client = openai.OpenAI(base_url=f"{scaler.url}/v1", api_key="x", max_retries=0, timeout=60)

        def slow(_: int) -> str | None:
            ask = [{"role": "user", "content": "sleep 3"}]
            return client.chat.completions.create(model="scripted", messages=ask).choices[0].message.content

        def events(kind: str) -> list[dict]:
            found = httpx.get(f"{gateway.url}/events", params={"count": 1000}).json()
            return [e for e in found if e["kind"] == kind and e["message"].startswith("scripted:")]

        with ThreadPoolExecutor(3) as pool:  # one slot: two of the three wait, 3 and 6 seconds
            answers = pool.map(slow, range(3))
            [up] = wait_for(lambda: events("deployment.scaled_up"), 30, "a replica added")
            assert list(answers) == ["slept"] * 3
        assert "waited for a slot" in up["data"]["reason"] and up["data"]["max_replicas"] == "2"
        [down] = wait_for(lambda: events("deployment.scaled_down"), 30, "an idle replica removed")
        assert "idle for" in down["data"]["reason"]
        [deployment] = [d for d in httpx.get(f"{gateway.url}/deployments").json() if d["model"] == "scripted"]
        assert (deployment["replicas"], deployment["min_replicas"], deployment["max_replicas"]) == (1, 1, 2)
        bounds = httpx.put(f"{gateway.url}/deployments/scripted", json={"min_replicas": 3})
        assert bounds.status_code == 400 and "above max_replicas (2)" in bounds.json()["error"]["message"]
    finally:
        scaler.stop()
        for old in httpx.get(f"{gateway.url}/instances").json():
            if old["model"] == "scripted":
                httpx.delete(f"{gateway.url}/instances/{old['id']}", params={"grace": 0})


def test_deleting_a_busy_instance_drains_it(cluster):
    """``DELETE /instances/{id}`` on an instance with a request running: 202 and state draining; the request ends
    well; the instance goes once it has (the gateway's grace, ``MESHGATE_DRAIN_GRACE``, is 5 s here)."""
    gateway, _, _ = cluster
    created = httpx.post(f"{gateway.url}/instances", json={"model": "scripted", "nodes": ["a"]}).json()
    wait_for(lambda: instance(gateway, created["id"])["state"]["state"] == "ready", 30, "ready on a")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=60)
    ask = [{"role": "user", "content": "sleep 2"}]
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(lambda: client.chat.completions.create(model="scripted", messages=ask))
        wait_for(lambda: (instance(gateway, created["id"]).get("load") or {}).get("running"), 10, "running")
        r = httpx.delete(f"{gateway.url}/instances/{created['id']}")
        assert r.status_code == 202 and r.json()["state"]["state"] == "draining", r.text
        assert r.json()["state"]["reason"] == "deleted"
        assert answer.result().choices[0].message.content == "slept"
    wait_for(lambda: httpx.get(f"{gateway.url}/instances/{created['id']}").status_code == 404, 10, "gone")
    events = httpx.get(f"{gateway.url}/events", params={"count": 1000}).json()
    drained = [e["message"] for e in events if e["kind"] == "instance.drained" and e["instance_id"] == created["id"]]
    assert len(drained) == 1 and "streams finished" in drained[0], drained


def test_node_loss_moves_in_flight_requests_and_replaces(cluster):
    """The only replica's node dies mid-stream: the instance is re-placed on the other node and the stream goes on
    there from the tokens it had sent (``gateway.serving.resume``), ending as a whole answer."""
    gateway, agents, _ = cluster
    for old in httpx.get(f"{gateway.url}/instances").json():
        httpx.delete(f"{gateway.url}/instances/{old['id']}", params={"grace": 0})
    created = httpx.post(f"{gateway.url}/instances", json={"model": MODEL, "nodes": ["a"]}).json()
    wait_for(lambda: instance(gateway, created["id"])["state"]["state"] == "ready", 120, "ready on a")
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    stream = iter(
        client.chat.completions.create(
            model=MODEL,
            stream=True,
            max_tokens=200,
            temperature=0,  # greedy: it never ends by itself before max_tokens
            messages=[{"role": "user", "content": "Count to a thousand."}],
        )
    )
    next(stream)
    killed_at = time.monotonic()
    agents["a"].kill()
    wait_for(lambda: "a" not in nodes(gateway), 10, "node a leaving")
    assert time.monotonic() - killed_at < 1.5 + 2.0, "node left within the heartbeat TTL (plus polling slack)"
    finish = [c.choices[0].finish_reason for c in stream if c.choices and c.choices[0].finish_reason]
    assert finish == ["length"], finish  # the whole answer, no error
    resumes = [x for x in httpx.get(f"{gateway.url}/metrics").text.splitlines() if "stream_resumes_total{" in x]
    assert resumes and float(resumes[0].rsplit(" ", 1)[1]) >= 1, resumes
    replaced = wait_for(
        lambda: (
            (i := instance(gateway, created["id"]))["state"]["state"] == "ready"
            and i["placement"]["shards"][0]["node_id"] == "b"
            and i
        ),
        120,
        "re-placed on b",
    )
    assert replaced["epoch"] == 1
    reply = client.completions.create(model=MODEL, prompt="Hello", max_tokens=2, temperature=0)
    assert reply.usage.completion_tokens == 2
    kinds = [
        e["kind"]
        for e in httpx.get(f"{gateway.url}/events", params={"count": 1000}).json()
        if e["instance_id"] == created["id"]
    ]
    assert kinds[0] == "instance.placed" and "instance.failed" in kinds and "instance.replaced" in kinds
    assert kinds.index("instance.failed") < kinds.index("instance.replaced")


def test_placements_survive_a_redis_restart_and_a_gateway_restart(cluster, redis, data_dir):
    gateway, _, _ = cluster
    before = {i["id"]: i["placement"] for i in httpx.get(f"{gateway.url}/instances").json()}
    assert before
    redis.restart()
    after = wait_for(lambda: _instances_or_none(gateway), 30, "gateway reconnects to redis")
    assert {i["id"]: i["placement"] for i in after} == before
    restarted = Server(data_dir, "--redis", redis.url, "--plugin", "tests.scripted_plugin", env=FAST)
    try:
        assert {i["id"]: i["placement"] for i in httpx.get(f"{restarted.url}/instances").json()} == before
    finally:
        restarted.stop()


def _instances_or_none(gateway: Server) -> list | None:
    try:
        r = httpx.get(f"{gateway.url}/instances", timeout=5)
        return r.json() if r.status_code == 200 else None
    except httpx.HTTPError:
        return None


def test_cli_ps_and_place_mirror_the_api(cluster):
    gateway, _, _ = cluster

    def run(*a: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "meshgate.gateway.cli", *a, "--url", gateway.url],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )

    preview = run("place", "scripted-big", "--preview")
    assert preview.returncode == 0, preview.stderr
    assert "b=" in preview.stdout and "MiB" in preview.stdout  # node a was lost earlier: only b is left
    assert "rejected: needs" in preview.stdout
    created = run("place", "scripted", "--nodes", "b")
    assert created.returncode == 0 and '"model": "scripted' in created.stdout
    ps = run("ps")
    assert ps.returncode == 0 and "NODE" in ps.stdout and "scripted" in ps.stdout
    assert "DEPLOYMENT" in ps.stdout and "MIN" in ps.stdout
    assert all(name in ps.stdout for name in ("b",))


def test_cluster_api_is_in_the_openapi_schema(cluster):
    gateway, _, _ = cluster
    paths = httpx.get(f"{gateway.url}/schema/openapi.json").json()["paths"]
    for path in (
        "/cluster",
        "/instances",
        "/instances/previews",
        "/instances/{instance_id}",
        "/instances/{instance_id}/events",
        "/events",
    ):
        assert path in paths, path
    assert {"get", "post"} <= set(paths["/instances"]) and "delete" in paths["/instances/{instance_id}"]


def test_a_node_told_to_stop_while_it_calibrates_stops_within_its_grace(redis, data_dir, tmp_path):
    """A calibration takes minutes on a busy machine; a SIGTERM meanwhile must not wait for it (an agent restarted
    just before a rolling restart once outlived the test's 90 s this way)."""
    agent = Agent(redis.url, "calibrating", data_dir, tmp_path, env={"SCRIPTED_CALIBRATE_SECONDS": "600"})
    try:
        wait_for(lambda: "up; probes at" in agent.log.read_text(), 60, "the agent up")
        time.sleep(2)  # into its calibration
        agent.stop(drain=True, timeout=20)  # grace: FAST's MESHGATE_DRAIN_GRACE; nothing is placed on it
        assert agent.proc.returncode == 0, agent.log.read_text()[-3000:]
    finally:
        agent.kill()
