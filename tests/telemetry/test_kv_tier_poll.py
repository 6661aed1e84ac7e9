"""Each replica's KV cache tier, in-process: the runner's ``/health`` read as a tolerant reader, the gateway's poll
(``gateway.cluster.kv_tiers``: only ready replicas, failures keep the last figures, gone instances drop theirs),
the runner client it reaches the runner through, and the figures a fake health source feeds shown in
``/metrics``, ``/instances`` and ``meshgate ps`` of a gateway app with the scripted backend."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time

import httpx
import pytest
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from meshgate.backends.llama_cpp import LlamaCppRunner
from meshgate.backends.placement import NodeId
from meshgate.backends.runner.client import RunnerClient
from meshgate.gateway.cli import commands
from meshgate.gateway.cluster.kv_tiers import KvTiers, merge
from meshgate.gateway.cluster.records import Draining, Failed, Instance, Ready, RunnerStatus, Starting
from meshgate.gateway.http.app import create_app
from meshgate.gateway.serving.runner_health import health_reporter, runner_health
from meshgate.gateway.telemetry.instruments import exposition
from meshgate.gateway.telemetry.kv_tier import KvTier, kv_tier_of
from meshgate.gateway.telemetry.metrics import GatewayMetrics, PlaneSnapshot
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests import scripted_plugin
from tests.cluster.test_store import instance

GiB = 2**30
FIGURES = {
    "ram_bytes": int(1.2 * GiB),
    "ram_budget": int(1.5 * GiB),
    "ram_entries": 3,
    "disk_bytes": int(3.4 * GiB),
    "disk_budget": 8 * GiB,
    "disk_entries": 11,
    "hits_ram": 5,
    "hits_disk": 2,
    "misses": 7,
    "restored_tokens": 4096,
    "saved": 14,
    "refused": 1,
}
HEALTH = {"status": "ok", "slots": 4, "kv_tier": FIGURES}


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def test_the_runners_health_is_read_as_a_tolerant_reader():
    assert kv_tier_of(HEALTH) == KvTier(**FIGURES)
    assert kv_tier_of({"kv_tier": {"ram_bytes": 9, "later_field": "x"}}) == KvTier(ram_bytes=9)  # unknown: ignored
    assert kv_tier_of({"status": "ok"}) is None  # a runner without a tier (MLX, vLLM)
    assert kv_tier_of({"kv_tier": None}) is None
    assert kv_tier_of({"kv_tier": {"ram_bytes": "lots"}}) is None
    assert kv_tier_of({"kv_tier": {"ram_bytes": -1}}) is None
    assert kv_tier_of({"kv_tier": [1, 2]}) is None


def test_a_pass_keeps_the_last_figures_of_a_failed_read_and_drops_what_went():
    old, new = KvTier(ram_bytes=1), KvTier(ram_bytes=2)
    last = {"a": old, "b": old, "c": old, "gone": old}
    reads = [("a", new, True), ("b", None, False), ("c", None, True), ("late", new, True)]
    # a: read again; b: its read failed, the last stays; c: it answered without a tier; gone: no longer kept;
    # late: read, but it went during the pass
    assert merge(last, {"a", "b", "c"}, reads) == {"a": new, "b": old}


def _instances(*states) -> list[Instance]:
    return [instance(f"i{n}", nodes=("a",), state=state) for n, state in enumerate(states)]


async def test_the_poll_reads_ready_replicas_only_and_bounds_each_read():
    view = _instances(Ready(), Starting(), Draining(), Failed(reason="x"))
    asked: list[str] = []
    answers: dict[str, object] = {"i0": HEALTH, "i2": HEALTH}

    async def health_of(i: Instance):
        asked.append(i.id)
        answer = answers[i.id]
        if answer == "hang":
            await asyncio.sleep(60)
        if isinstance(answer, Exception):
            raise answer
        return answer

    tiers = KvTiers(lambda: view, health_of, timeout=0.05)
    await tiers.poll()
    assert asked == ["i0"]  # only the ready one is asked
    assert tiers.get("i0") == KvTier(**FIGURES) and tiers.figures() == {"i0": KvTier(**FIGURES)}

    answers["i0"] = "hang"  # too slow: the last figures stay, and the pass is not held up
    started = time.monotonic()
    await tiers.poll()
    assert time.monotonic() - started < 5 and tiers.get("i0") == KvTier(**FIGURES)
    answers["i0"] = httpx.ConnectError("refused")
    await tiers.poll()
    assert tiers.get("i0") == KvTier(**FIGURES)

    view[0] = instance("i0", nodes=("a",), state=Draining())  # draining: not asked, its figures kept
    asked.clear()
    await tiers.poll()
    assert asked == [] and tiers.get("i0") is not None
    view.pop(0)  # the instance went: its figures go, though nothing is ready to ask
    await tiers.poll()
    assert asked == [] and tiers.figures() == {}

    view.append(instance("i5", nodes=("a",), state=Ready()))
    answers["i5"] = {"status": "ok"}  # a runner without a tier
    await tiers.poll()
    assert asked == ["i5"] and tiers.figures() == {}


async def test_the_background_poll_runs_every_period_and_stops_on_close():
    view = _instances(Ready())
    calls = 0

    async def health_of(i: Instance):
        nonlocal calls
        calls += 1
        return HEALTH

    tiers = KvTiers(lambda: view, health_of, every=0.01)
    await tiers.start()
    try:
        for _ in range(500):
            if calls >= 2:
                break
            await asyncio.sleep(0.01)
    finally:
        await tiers.close()
    assert calls >= 2 and tiers.get("i0") == KvTier(**FIGURES)
    stopped = calls
    await asyncio.sleep(0.05)
    assert calls == stopped


async def test_a_llama_cpp_runner_is_asked_for_its_health_with_the_cluster_secret():
    seen: list[httpx.Request] = []

    def runner(request: httpx.Request) -> httpx.Response:
        seen.append(request)
        return httpx.Response(200, json=HEALTH)

    async with httpx.AsyncClient(transport=httpx.MockTransport(runner)) as http:
        client = RunnerClient("http://10.0.0.5:4000", http, secret="s3cret")

        class Head:  # what a backend's ``connect`` gives the dispatcher
            name = "fake"

            def connect(self, card, placement, urls):
                return LlamaCppRunner(RunnerClient(urls["a"], http, secret="s3cret"))

        status = RunnerStatus(node_id=NodeId("a"), state="ready", url="http://10.0.0.5:4000")
        placed = instance("i0", nodes=("a",), state=Ready(), runners={"a": status})
        health_of = runner_health(lambda name: scripted_plugin.CARD, lambda card: Head())
        assert kv_tier_of(await health_of(placed)) == KvTier(**FIGURES)
    assert [str(r.url) for r in seen] == ["http://10.0.0.5:4000/health"]
    assert seen[0].headers["authorization"] == "Bearer s3cret"
    head = LlamaCppRunner(client)
    assert health_reporter(head) is head
    assert health_reporter(scripted_plugin.ScriptedRunner()) is None  # no health: nothing is sent to it


def test_metrics_show_the_tiers_of_known_instances_only():
    metrics = GatewayMetrics()
    known = instance("i0", nodes=("a",), state=Ready())

    class Plane:
        async def snapshot(self) -> PlaneSnapshot:
            return PlaneSnapshot(instances=[known], kv_tiers={"i0": KvTier(**FIGURES), "gone": KvTier(ram_bytes=1)})

    asyncio.run(metrics.refresh(Plane()))
    got = samples(exposition(metrics.registry, "")[0].decode())
    assert got[("meshgate_kv_tier_bytes", (("instance", "i0"), ("tier", "ram")))] == FIGURES["ram_bytes"]
    assert got[("meshgate_kv_tier_budget_bytes", (("instance", "i0"), ("tier", "disk")))] == FIGURES["disk_budget"]
    assert got[("meshgate_kv_tier_hits", (("instance", "i0"), ("tier", "disk")))] == 2
    assert not any(labels == (("instance", "gone"), ("tier", "ram")) for _, labels in got)

    asyncio.run(metrics.refresh(None))  # no tier anywhere: no family at all
    assert not any(
        name.startswith("meshgate_kv_tier") for name, _ in samples(exposition(metrics.registry, "")[0].decode())
    )


def test_ps_shows_the_kv_cache_in_short():
    assert commands._kv_cache(FIGURES) == "1.2 GiB/1.5 GiB ram, 3.4 GiB disk"
    assert commands._kv_cache({**FIGURES, "disk_budget": 0, "ram_bytes": 300 << 20}) == "300 MiB/1.5 GiB ram"
    assert commands._kv_cache(None) == "-" and commands._kv_cache({"ram_budget": 0, "disk_budget": 0}) == "-"


# ------------------------------------------------------------------ a gateway app, its runner's health faked


@pytest.fixture
def gateway(tmp_path):
    settings = Settings(data_dir=str(tmp_path), disabled_plugins=("llama_cpp", "mlx", "vllm"), agent_port=0)
    app = create_app(settings, build_plugin_manager(settings, extra=[scripted_plugin]))
    with TestClient(app) as client:
        yield app, client


def _ready_instance(client: TestClient) -> str:
    placed = client.post("/instances", json={"model": "scripted"})
    assert placed.status_code == 201, placed.text
    instance_id = placed.json()["id"]
    deadline = time.monotonic() + 30
    while client.get(f"/instances/{instance_id}").json()["state"]["state"] != "ready":
        assert time.monotonic() < deadline, "the scripted instance never became ready"
        time.sleep(0.05)
    return instance_id


def _kv_column(client: TestClient, monkeypatch, capsys, instance_id: str) -> str:
    """``meshgate ps``'s KV CACHE column for ``instance_id``, as it prints it for ``client``'s gateway."""
    monkeypatch.setattr(commands, "_client", lambda args: contextlib.nullcontext(client))
    assert commands._ps(Settings(), argparse.Namespace()) == 0
    lines = capsys.readouterr().out.splitlines()
    header = next(line for line in lines if line.startswith("INSTANCE"))
    row = next(line for line in lines if line.startswith(instance_id))
    return row[header.index("KV CACHE") : header.index("NODES")].strip()


def test_a_polled_kv_tier_shows_in_metrics_instances_and_ps(gateway, monkeypatch, capsys):
    app, client = gateway
    plane = app.state.plane
    instance_id = _ready_instance(client)
    assert _kv_column(client, monkeypatch, capsys, instance_id) == "-"  # the scripted runner reports no tier
    assert client.get("/instances").json()[0]["kv_tier"] is None

    async def health_of(i: Instance):
        return HEALTH if i.id == instance_id else None

    plane.kv_tiers.health_of = health_of  # the fake runner health source, through the gateway's own poll
    client.blocking_portal.call(plane.kv_tiers.poll)

    got = samples(client.get("/metrics").text)
    per_tier = lambda tier: (("instance", instance_id), ("tier", tier))  # noqa: E731
    assert got[("meshgate_kv_tier_bytes", per_tier("ram"))] == FIGURES["ram_bytes"]
    assert got[("meshgate_kv_tier_bytes", per_tier("disk"))] == FIGURES["disk_bytes"]
    assert got[("meshgate_kv_tier_budget_bytes", per_tier("ram"))] == FIGURES["ram_budget"]
    assert got[("meshgate_kv_tier_entries", per_tier("disk"))] == 11
    assert got[("meshgate_kv_tier_hits", per_tier("ram"))] == 5
    assert got[("meshgate_kv_tier_misses", (("instance", instance_id),))] == 7
    assert got[("meshgate_kv_tier_restored_tokens", (("instance", instance_id),))] == 4096

    listed = client.get("/instances").json()
    assert [i["kv_tier"] for i in listed] == [FIGURES]
    assert client.get(f"/instances/{instance_id}").json()["kv_tier"] == FIGURES
    assert _kv_column(client, monkeypatch, capsys, instance_id) == "1.2 GiB/1.5 GiB ram, 3.4 GiB disk"

    deleted = client.delete(f"/instances/{instance_id}", params={"grace": 0})
    assert deleted.status_code in (202, 204), deleted.text
    deadline = time.monotonic() + 30
    while client.get("/instances").json():
        assert time.monotonic() < deadline, "the instance never went"
        time.sleep(0.05)
    client.blocking_portal.call(plane.instances.refresh)  # this gateway's view, as the reconcile loop reads it
    client.blocking_portal.call(plane.kv_tiers.poll)
    assert plane.kv_tiers.figures() == {}
    assert not any(name.startswith("meshgate_kv_tier") for name, _ in samples(client.get("/metrics").text))
    assert json.loads(client.get("/instances").text) == []
