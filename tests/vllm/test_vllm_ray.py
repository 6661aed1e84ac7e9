"""vLLM across two node agents over Ray: pipeline stage 0 on one agent's Ray node, stage 1 on the other's.

Redis, two ``meshgate node`` agents (``a`` on 127.0.0.2, ``b`` on 127.0.0.3: Ray takes 127.0.0.1 for "this machine"
and swaps in the routable address, so each stand-in machine has its own loopback address) and a gateway. The tiny
deterministic llama of ``tests/vllm/tiny_model.py`` is placed with ``{"strategy": "pipeline", "min_nodes": 2}``: the
agents start a Ray head and a Ray worker node, the head's agent joins them and starts vLLM's API server with
``--distributed-executor-backend ray``, PP=2. Meanwhile the same model starts alone on this machine (vLLM's mp-less
single worker, through ``VllmBackend.launch`` as an agent starts it: the reference; the two starts overlap, each
mostly one Python thread). Greedy text through the OpenAI SDK equals the reference; no process of the instance
listens on a wildcard address. Then vLLM's worker actor on the other node is killed mid-generation: the stream
fails, the instance is re-placed and answers alike; deleting it leaves no process and no folder behind.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest

from tests.cluster.agents import linked_cluster
from tests.cluster.faults import alive, long_stream
from tests.cluster.sockets import listening, public
from tests.cluster.test_cluster_e2e import instance, wait_for
from tests.conftest import Server
from tests.vllm.test_vllm import HERE, _cmdline, _launch_and_generate, _snapshot, short_dir, vllm_python
from tests.vllm.test_vllm import TOKENS as REFERENCE_TOKENS

MODEL = "tiny-vllm"
PROMPTS = ["Hello world", "Ranks talk over a ring"]
TOKENS = 16
N_CTX = 4096  # the tiny model's own: a long stream outlasts the kill (tiny_model.NO_EOS: it never ends early)
FAULT_TOKENS = 3500
ADDRESSES = {"a": "127.0.0.2", "b": "127.0.0.3"}


@pytest.fixture(scope="module")
def runtime_dir() -> Iterator[Path]:
    with short_dir("mg-ray-") as path:
        yield path


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("ray-checkpoints") / MODEL
    subprocess.run(
        [str(vllm_python()), str(HERE / "tiny_model.py"), str(path)], check=True, timeout=120, capture_output=True
    )
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, data_dir, runtime_dir: Path, checkpoint: Path) -> Iterator[Server]:
    env = {
        "MESHGATE_MODELS": f"{MODEL}={checkpoint}",
        "MESHGATE_VLLM_PYTHON": str(vllm_python()),
        "MESHGATE_VLLM_EAGER": "1",
        "MESHGATE_RUNTIME_DIR": str(runtime_dir),
        "MESHGATE_DISABLED_PLUGINS": "mlx",
        "MESHGATE_MLX_PYTHON": "",
        "HF_HUB_OFFLINE": "1",
        "MESHGATE_HEARTBEAT": "0.5",
        "MESHGATE_NODE_TTL": "15",
        "MESHGATE_LINK_PROBE_EVERY": "2",
        # Streams are not resumed here: the fault test checks that a stream whose replica died ends with its
        # protocol's error when no other may take over (resume itself: test_vllm's worker-kill test).
        "MESHGATE_RESUME_WAIT": "0",
    }
    nodes = {name: {"MESHGATE_CLUSTER_ADDRESS": address} for name, address in ADDRESSES.items()}
    with linked_cluster(
        tmp_path_factory, data_dir, "ray", n_ctx=N_CTX, env=env, nodes=nodes, memory=str(8 << 30), show_logs=True
    ) as (gateway, _):
        yield gateway


def remove_all(gateway: Server, runtime_dir: Path) -> None:
    """Delete every instance; wait until no process of them runs and their folders are gone."""
    for old in httpx.get(f"{gateway.url}/instances").json():
        assert httpx.delete(f"{gateway.url}/instances/{old['id']}", params={"grace": 0}).status_code == 204
    wait_for(lambda: not using(runtime_dir), 60, "no process of the deleted instances left")
    wait_for(lambda: not list(runtime_dir.iterdir()), 30, "the instances' runtime folders removed")


def using(runtime_dir: Path) -> list[str]:
    """Live processes of instances (the agents' Ray node keepers, Ray's daemons and actors, vLLM's server): their
    command line names ``runtime_dir``, or their ``TMPDIR`` is in it (every one of them gets its TMPDIR there)."""
    found, needle = [], str(runtime_dir).encode()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if (proc / "stat").read_text().rsplit(")", 1)[1].split()[0] in "ZX":
                continue
            if needle in (proc / "cmdline").read_bytes() or b"\0TMPDIR=" + needle in (proc / "environ").read_bytes():
                found.append(f"{proc.name}: {(proc / 'cmdline').read_bytes()[:120]!r}")
        except (OSError, IndexError):
            continue
    return found


def place(gateway: Server, **body: object) -> dict:
    def create() -> dict | None:
        created = httpx.post(f"{gateway.url}/instances", json={"model": MODEL, **body}).json()
        if "ms link" in created.get("error", {}).get("message", ""):
            return None  # loopback measured slow while two cores are busy: the next probe will tell
        assert "placement" in created, created
        return created

    created = wait_for(create, 60, "links fast enough for the placement")

    def ready() -> dict | None:
        found = instance(gateway, created["id"])
        assert found["state"]["state"] != "failed", found
        return found if found["state"]["state"] == "ready" else None

    return wait_for(ready, 400, f"the {body} instance ready")


def texts(gateway: Server) -> list[str]:
    client = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0, timeout=120)
    return [
        client.completions.create(model=MODEL, prompt=p, max_tokens=TOKENS, temperature=0).choices[0].text
        for p in PROMPTS
    ]


def single_reference(checkpoint: Path) -> list[str]:
    """The greedy texts of ``PROMPTS`` from the model started alone on this machine (TP=1, no Ray)."""
    with short_dir("mg-ref-") as runtime:
        found, startup = asyncio.run(_launch_and_generate(vllm_python(), checkpoint, runtime, "single", tuple(PROMPTS)))
    print(f"single-node reference: ready in {startup:.1f}s")
    return found


@pytest.fixture(scope="module")
def pipeline(cluster: Server, runtime_dir: Path, checkpoint: Path) -> dict:
    """The PP=2 instance over Ray (left running for the tests below), placed while the single-node reference
    starts beside it."""
    assert REFERENCE_TOKENS == TOKENS
    before = _snapshot()
    started = time.monotonic()
    with ThreadPoolExecutor(1) as pool:
        single = pool.submit(single_reference, checkpoint)
        ready = place(cluster, strategy="pipeline", min_nodes=2)
        print(f"PP=2 over Ray: ready in {time.monotonic() - started:.1f}s")
        reference = single.result(timeout=600)
    assert all(reference), reference
    return {"instance": ready, "reference": reference, "before": before}


def test_pipeline_over_ray_across_two_agents_gives_the_single_node_text(
    cluster: Server, runtime_dir: Path, pipeline: dict
) -> None:
    ready = pipeline["instance"]
    placement = ready["placement"]
    assert placement["backend"] == "vllm" and placement["strategy"] == "pipeline"
    assert {s["node_id"] for s in placement["shards"]} == {"a", "b"}
    head = min(placement["shards"], key=lambda s: s["layer_start"])["node_id"]
    folders = {p.name.split("-")[0] for p in runtime_dir.iterdir()}
    assert folders == {"ray", "vllm"}, folders  # a Ray node per agent, one API server (the head's)
    layout = next(runtime_dir.glob("vllm-*/layout.json")).read_text()
    assert '"--distributed-executor-backend", "ray"' in layout and '"--pipeline-parallel-size", "2"' in layout
    assert ADDRESSES[head] in ready["runners"][head]["url"]
    # vLLM's rank 1 runs as a Ray actor of the other agent's node
    assert len(actors(runtime_dir)) == 2, using(runtime_dir)
    other = ADDRESSES[next(n for n in ADDRESSES if n != head)]
    assert actors(runtime_dir, on=other), "no vLLM worker on the other node"
    # and it is vLLM's stage 1: Ray node ids sort by stage (raynode.stage_env), the head's first
    raylets = {
        m.group(2): m.group(1)
        for line in using(runtime_dir)
        if "raylet" in line
        for m in [re.search(r"--node_id=(\w+) --node_ip_address=([\d.]+)", _cmdline(int(line.split(":")[0])))]
        if m
    }
    assert raylets[ADDRESSES[head]].startswith("00000000") and raylets[other].startswith("00000001"), raylets
    log = next(runtime_dir.glob("vllm-*/server.log")).read_text(errors="replace")
    assert [int(pid) for pid in re.findall(r"Worker_PP1 pid=(\d+)", log)][:1] == actors(runtime_dir, on=other)
    assert texts(cluster) == pipeline["reference"]
    # every port of Ray's and vLLM's processes is on a node's cluster address (bindshim), none on a wildcard
    ports = listening(int(line.split(":")[0]) for line in using(runtime_dir))
    gcs = json.loads(layout)["env"]["RAY_ADDRESS"]
    assert (ADDRESSES[head], int(gcs.rsplit(":", 1)[1])) in ports, (gcs, ports)
    assert public(ports, ADDRESSES.values()) == set() and len(ports) >= 8, ports


def actors(runtime_dir: Path, on: str | None = None) -> list[int]:
    """pids of vLLM's Ray worker actors (on the node whose address is ``on``)."""
    found = [int(line.split(":")[0]) for line in using(runtime_dir) if "RayWorkerProc" in line]
    return [
        pid
        for pid in found
        if on is None or f"VLLM_HOST_IP={on}\0" in (Path("/proc") / str(pid) / "environ").read_text(errors="replace")
    ]


def test_a_ray_worker_killed_mid_generation_fails_the_stream_and_the_instance_is_replaced(
    cluster: Server, runtime_dir: Path, pipeline: dict
) -> None:
    """SIGKILL vLLM's stage-1 actor on the other node while a stream runs (resume off): the OpenAI stream ends with
    an error, the gateway stays up, the head's agent sees its vLLM server gone and the instance is re-placed over
    Ray (a new epoch, new processes) and answers alike; at the end, deleting it leaves nothing."""
    current = pipeline["instance"]
    head = min(current["placement"]["shards"], key=lambda s: s["layer_start"])["node_id"]
    [victim] = actors(runtime_dir, on=ADDRESSES[next(n for n in ADDRESSES if n != head)])
    old = [int(line.split(":")[0]) for line in using(runtime_dir)]
    stream, error = long_stream(cluster.url, MODEL, "openai", max_tokens=FAULT_TOKENS)
    next(stream)
    os.kill(victim, signal.SIGKILL)
    started = time.monotonic()
    with pytest.raises(error):
        for _ in stream:
            pass
    print(f"the stream failed {time.monotonic() - started:.1f}s after the kill")
    assert httpx.get(f"{cluster.url}/api/version").status_code == 200, "the gateway stays up"
    replaced = wait_for(
        lambda: (
            (i := instance(cluster, current["id"]))["state"]["state"] == "ready" and i["epoch"] > current["epoch"] and i
        ),
        400,
        "re-placed and ready",
    )
    print(f"re-placed and ready {time.monotonic() - started:.1f}s after the kill")
    assert replaced["placement"]["strategy"] == "pipeline", "re-placed with its own constraints"
    assert not any(alive(pid) for pid in old), [pid for pid in old if alive(pid)]
    assert texts(cluster) == pipeline["reference"]

    remove_all(cluster, runtime_dir)
    assert not using(runtime_dir)
    assert not Path(tempfile.gettempdir(), "ray").exists(), "Ray wrote to /tmp/ray"
    after = _snapshot()
    for where in ("tmp", "shm", "cache"):
        assert after[where] - pipeline["before"][where] == set(), f"vLLM or Ray left files in {where}"
