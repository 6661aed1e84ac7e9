"""Gemma 3 270M split across two node agents with llama.cpp RPC, placed by the planner, through all protocols.

Agent ``a`` runs the head runner (input embedding and the first layers), agent ``b`` an RPC worker with the
rest (and the output layer). At temperature 0 the split model must give the tokens of a single process.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from meshgate.backends.base import ModelCard
from meshgate.backends.llama_cpp import LlamaCppBackend
from meshgate.backends.placement import Candidate, NodeId, Shard
from meshgate.protocols.model import BackendUnavailable
from tests.cluster.agents import linked_cluster
from tests.cluster.faults import alive, greedy_streams
from tests.cluster.test_cluster_e2e import FAST, instance, wait_for
from tests.conftest import MODEL, ROOT, Server, free_port

# nodes stay members through a load's CPU stall on two cores: only process deaths fail shards in this module
STEADY = {**FAST, "MESHGATE_HEARTBEAT": "0.5", "MESHGATE_NODE_TTL": "15"}
PROMPT = "The three primary colors are"
TOKENS = 16
LONG, LONG_TOKENS = "Count from one to five hundred.", 64  # a stream still generating when a process is killed
N_CTX = 512


def rss(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line for line in status.splitlines() if line.startswith("VmRSS")).split()[1]) * 1024


def single_process_text(gguf: Path) -> str:
    """The reference: one process, repacking off (as meshgate loads), greedy."""
    code = (
        "import sys, threading; from meshgate.backends.llama_cpp.engine import LlamaEngine; "
        "from meshgate.protocols.model import Request, Sampling, TextDelta; "
        f"e = LlamaEngine(sys.argv[1], n_ctx={N_CTX}); "
        f"r = Request(model='m', raw_prompt={PROMPT!r}, max_tokens={TOKENS}, sampling=Sampling(temperature=0.0)); "
        "print(''.join(ev.text for ev in e.generate(r, threading.Event()) if isinstance(ev, TextDelta)), end='')"
    )
    return subprocess.run(
        [sys.executable, "-c", code, str(gguf)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        timeout=120,
    ).stdout


@pytest.fixture(scope="module")
def split(tmp_path_factory, data_dir, packaged_gguf) -> Iterator[tuple[Server, dict, dict]]:
    with linked_cluster(tmp_path_factory, data_dir, "rpc", n_ctx=N_CTX, env=STEADY, nodes={"a": {}, "b": {}}) as (
        gateway,
        agents,
    ):
        created = httpx.post(
            f"{gateway.url}/instances", json={"model": MODEL, "strategy": "pipeline", "min_nodes": 2}
        ).json()
        assert created["placement"]["strategy"] == "pipeline", created
        ready = wait_for(
            lambda: (i := instance(gateway, created["id"]))["state"]["state"] == "ready" and i,
            120,
            "the split instance ready",
        )
        yield gateway, agents, ready


def test_the_planner_splits_layers_with_the_head_first(split):
    _, _, ready = split
    shards = ready["placement"]["shards"]
    assert [s["node_id"] for s in shards] == ["a", "b"] or [s["node_id"] for s in shards] == ["b", "a"]
    assert shards[0]["layer_start"] == 0 and shards[0]["layer_end"] == shards[1]["layer_start"]
    assert shards[1]["layer_end"] == 18 and shards[0]["holds_embedding"]
    head, worker = (ready["runners"][s["node_id"]] for s in shards)
    assert head["url"].startswith("http://127.0.0.1:") and worker["url"].startswith("rpc://127.0.0.1:")


def test_split_generates_the_single_process_tokens_through_all_protocols(split, packaged_gguf):
    gateway, _, _ = split
    expected = single_process_text(packaged_gguf)
    assert expected.strip()
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    plain = oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0)
    assert plain.choices[0].text == expected
    streamed = "".join(
        c.choices[0].text
        for c in oai.completions.create(model=MODEL, prompt=PROMPT, max_tokens=TOKENS, temperature=0, stream=True)
        if c.choices
    )
    assert streamed == expected
    generated = ollama.Client(host=gateway.url).generate(
        model=MODEL, prompt=PROMPT, raw=True, options={"temperature": 0, "num_predict": TOKENS}
    )
    assert generated.response == expected and generated.eval_count == TOKENS
    message = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0).messages.create(
        model=MODEL,
        max_tokens=8,
        messages=[{"role": "user", "content": "Name a color."}],
        extra_body={"temperature": 0},
    )
    assert message.content[0].text and message.usage.output_tokens <= 8
    assert message.stop_reason in ("end_turn", "max_tokens")


def test_preview_memory_matches_what_the_processes_hold(split):
    """The memory per node the preview showed vs the resident memory of the head and the worker, after a prompt
    that fills the context (the KV cache is touched as it fills); the head's KV tier, counted whole by the planner,
    is left out (it is resident as it fills)."""
    gateway, _, ready = split
    long_prompt = " ".join(["one two three four five six seven eight nine ten"] * 40)  # ~440 tokens
    r = httpx.post(
        f"{gateway.url}/api/generate",
        timeout=120,
        json={
            "model": MODEL,
            "prompt": long_prompt,
            "raw": True,
            "stream": False,
            "options": {"num_predict": 8, "temperature": 0},
        },
    )
    assert r.status_code == 200, r.text
    # the head's KV tier is reserved whole but resident only as prompts are kept (this one is too short for it)
    tiers = {shard["node_id"]: shard.get("cache_bytes", 0) for shard in ready["placement"]["shards"]}
    assert tiers[ready["placement"]["shards"][0]["node_id"]] > 0, "the planner counts the head's KV tier"
    predicted = {node: held - tiers.get(node, 0) for node, held in ready["placement"]["memory_per_node"].items()}
    measured = {node: rss(status["pid"]) for node, status in ready["runners"].items()}
    for shard in ready["placement"]["shards"]:
        node = shard["node_id"]
        print(
            f"node {node} layers {shard['layer_start']}-{shard['layer_end'] - 1}: preview "
            f"{predicted[node] / 2**20:.0f} MiB, resident {measured[node] / 2**20:.0f} MiB "
            f"({(measured[node] - predicted[node]) / predicted[node]:+.1%})"
        )
    for node in predicted:
        assert abs(measured[node] - predicted[node]) <= 0.10 * predicted[node], (node, predicted[node], measured)


def test_worker_killed_mid_generation_hands_the_streams_on(split):
    """A greedy stream in each protocol, all three generating when the RPC worker is killed: the head runner dies
    with it, the instance is re-placed (one kill and one re-placement for the three) and each stream goes on there
    from the tokens it had sent (``gateway.serving.resume``): every SDK gets its whole answer, the undisturbed text."""
    gateway, _, _ = split
    current = next(i for i in httpx.get(f"{gateway.url}/instances").json() if i["model"] == MODEL)
    current = wait_for(
        lambda: (i := instance(gateway, current["id"]))["state"]["state"] == "ready" and i, 120, "ready before the kill"
    )
    worker_node = current["placement"]["shards"][-1]["node_id"]
    head_node = current["placement"]["shards"][0]["node_id"]
    worker_pid, head_pid = current["runners"][worker_node]["pid"], current["runners"][head_node]["pid"]
    reference = "".join(greedy_streams(gateway.url, MODEL, LONG, LONG_TOKENS)["openai"])
    streams = greedy_streams(gateway.url, MODEL, LONG, LONG_TOKENS)
    got = {protocol: next(stream) for protocol, stream in streams.items()}
    os.kill(worker_pid, signal.SIGKILL)
    for protocol, stream in streams.items():
        got[protocol] += "".join(stream)
    assert got == dict.fromkeys(streams, reference)
    assert httpx.get(f"{gateway.url}/api/version").status_code == 200, "the gateway stays up"
    try:
        replaced = wait_for(
            lambda: (
                (i := instance(gateway, current["id"]))["state"]["state"] == "ready"
                and i["epoch"] > current["epoch"]
                and i
            ),
            60,
            "re-placed and ready",
        )
    except AssertionError:
        print(json.dumps(instance(gateway, current["id"]), indent=1))
        print(json.dumps(httpx.get(f"{gateway.url}/events", params={"count": 100}).json(), indent=1))
        raise
    assert replaced["placement"]["strategy"] == "pipeline", "re-placed with its own constraints"
    reply = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0).completions.create(
        model=MODEL, prompt="Hello", max_tokens=2, temperature=0
    )
    assert reply.usage.completion_tokens == 2
    wait_for(lambda: not alive(head_pid) and not alive(worker_pid), 30, "the old head and worker gone")


def test_deleting_the_instance_leaves_no_process_behind(split):
    gateway, _, _ = split
    pids = [s["pid"] for i in httpx.get(f"{gateway.url}/instances").json() for s in i["runners"].values()]
    assert pids
    for i in httpx.get(f"{gateway.url}/instances").json():
        assert httpx.delete(f"{gateway.url}/instances/{i['id']}").status_code in (202, 204)  # it settles first
    wait_for(lambda: not any(alive(pid) for pid in pids), 30, "every runner and worker stopped")


def test_an_unreachable_worker_is_the_placements_error(packaged_gguf):
    """The head probes its workers before loading: a dead one is a clear error, not an aborted process."""
    card = ModelCard(name=MODEL, path=str(packaged_gguf), context_length=32768)
    placement = Candidate(
        id="x",
        model=MODEL,
        backend="llama_cpp",
        strategy="pipeline",
        context=N_CTX,
        shards=(
            Shard(node_id=NodeId("a"), layer_start=0, layer_end=9),
            Shard(node_id=NodeId("b"), layer_start=9, layer_end=18),
        ),
        memory_per_node={},
    )
    closed = free_port()

    async def peers():
        return {"b": f"rpc://127.0.0.1:{closed}"}

    async def launch():
        async with httpx.AsyncClient() as http:
            await LlamaCppBackend(http, n_ctx=N_CTX).launch(
                card, placement, placement.shards[0], host="127.0.0.1", peers=peers
            )

    with pytest.raises(BackendUnavailable) as exc:
        asyncio.run(launch())
    assert f"127.0.0.1:{closed} is unreachable" in exc.value.message
