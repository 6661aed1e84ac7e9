"""MLX across two node agents, placed by the planner, through all three protocols.

Redis, two ``meshgate node`` agents (``a``, ``b``) on loopback and a gateway, every rank a process of the MLX
venv's python. The model is the tests' tiny Gemma 3 (``tests/mlx/tiny_model.py``: shaped like Gemma 3 270M, one
KV head, sliding-window layers and a global one, tied embeddings; built here, no hub): the real Gemma 3 270M
decodes about 3 tokens a second on this CPU in MLX, so its own checks stay in ``test_mlx_engine`` (batched equals
one at a time), ``test_convert`` (MLX gives llama.cpp's greedy text) and ``test_mlx_kv_tier`` (a ring's shards).
Two single-rank replicas first, one per node (the single-process reference), then a 2-rank pipeline and 2-rank
tensor placement: greedy text through the three official SDKs must equal the single run, and so must the text of
requests sent all at once (the head decodes them in one batch, on one rank and across the ring). Then faults: a
follower rank SIGKILLed mid-stream stops the instance's ranks; it is placed again and every client's stream goes
on there, unbroken, with the text of an undisturbed run.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.cluster.agents import linked_cluster
from tests.cluster.faults import alive, greedy_streams, resumes
from tests.cluster.test_cluster_e2e import instance, wait_for
from tests.conftest import Server
from tests.mlx.test_mlx_engine import HERE, _mlx, mlx_python
from tests.mlx.tiny_model import GEMMA3_CONFIG

MODEL = "tiny-gemma3"
LAYERS = GEMMA3_CONFIG["num_hidden_layers"]
PROMPTS = ["def fibonacci(n):", "The three primary colors are"]
TOKENS = 24
TOGETHER = 160  # tokens of the requests sent at once: long enough, even on the tiny model, that all four overlap
RESUMED = ("Count slowly:", 320)  # the streams a rank's death interrupts: a chat whose greedy answer runs on
N_CTX = 512


SECRET = "mlx-cluster-test-secret"  # every process's, so these tests may read the head runner's /health
RUNNER = {"authorization": f"Bearer {SECRET}"}


@pytest.fixture(scope="module")
def tiny_gemma(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("mlx-cluster") / MODEL
    _mlx(str(HERE / "tiny_model.py"), str(path), "gemma3")
    return path


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, data_dir, tiny_gemma: Path) -> Iterator[Server]:
    # a node's time-to-live well above a load's CPU stall on two cores: only process deaths should fail ranks here
    env = {
        "MESHGATE_MODELS": f"{MODEL}={tiny_gemma}",
        "MESHGATE_MLX_PYTHON": str(mlx_python()),
        "MESHGATE_DISABLED_PLUGINS": "vllm",
        "MESHGATE_HEARTBEAT": "0.5",
        "MESHGATE_NODE_TTL": "15",
        "MESHGATE_LINK_PROBE_EVERY": "2",
        "MESHGATE_CLUSTER_SECRET": SECRET,
        "MESHGATE_RESUME_WAIT": "240",  # a stream waits for its pipeline's ring to be placed again
    }
    with linked_cluster(tmp_path_factory, data_dir, "mlx", n_ctx=N_CTX, env=env, nodes={"a": {}, "b": {}}) as (
        gateway,
        _,
    ):
        yield gateway
        remove_all(gateway)


def remove_all(gateway: Server) -> None:
    """Delete every instance of ``MODEL`` and wait until its ranks are gone (agents stopped with a ring still up
    wait out its stop barrier)."""
    for old in httpx.get(f"{gateway.url}/instances").json():
        if old["model"] == MODEL:
            assert httpx.delete(f"{gateway.url}/instances/{old['id']}", params={"grace": 0}).status_code == 204
            pids = [r["pid"] for r in old["runners"].values() if r.get("pid")]
            wait_for(lambda pids=pids: not any(alive(p) for p in pids), 30, "the previous instance's ranks gone")


def place(gateway: Server, **body: object) -> dict:
    remove_all(gateway)

    def create() -> dict | None:
        created = httpx.post(f"{gateway.url}/instances", json={"model": MODEL, **body}).json()
        if "ms link" in created.get("error", {}).get("message", ""):
            return None  # loopback measured slow while two cores are busy loading: the next probe will tell
        assert "placement" in created, created
        return created

    created = wait_for(create, 60, "links fast enough for the placement")
    return wait_for(
        lambda: (i := instance(gateway, created["id"]))["state"]["state"] == "ready" and i,
        180,
        f"the {body} instance ready",
    )


def texts(gateway: Server) -> dict[str, list[str]]:
    """Greedy text for each prompt through each protocol."""
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    claude = anthropic.Anthropic(base_url=gateway.url, api_key="x", max_retries=0)
    olm = ollama.Client(host=gateway.url)
    out: dict[str, list[str]] = {"openai": [], "openai-stream": [], "anthropic": [], "ollama": []}
    for prompt in PROMPTS:
        out["openai"].append(
            oai.completions.create(model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0).choices[0].text
        )
        out["openai-stream"].append(
            "".join(
                c.choices[0].text
                for c in oai.completions.create(
                    model=MODEL, prompt=prompt, max_tokens=TOKENS, temperature=0, stream=True
                )
                if c.choices
            )
        )
        out["ollama"].append(
            olm.generate(
                model=MODEL, prompt=prompt, raw=True, options={"temperature": 0, "num_predict": TOKENS}
            ).response
        )
        with claude.messages.stream(
            model=MODEL,
            max_tokens=TOKENS,
            extra_body={"temperature": 0},
            messages=[{"role": "user", "content": prompt}],
        ) as stream:
            out["anthropic"].append("".join(stream.text_stream))
    return out


def _completion(gateway: Server, prompt: str, tokens: int) -> str:
    oai = openai.OpenAI(base_url=f"{gateway.url}/v1", api_key="x", max_retries=0)
    return oai.completions.create(model=MODEL, prompt=prompt, max_tokens=tokens, temperature=0).choices[0].text


def together(gateway: Server, ready: dict) -> tuple[list[str], int]:
    """Every prompt twice, all four requests at once through the OpenAI API (``TOGETHER`` tokens each); their
    texts and the widest batch the instance's head has decoded."""
    with ThreadPoolExecutor(2 * len(PROMPTS)) as pool:
        found = list(pool.map(lambda p: _completion(gateway, p, TOGETHER), PROMPTS * 2))
    head = min(ready["placement"]["shards"], key=lambda s: (s["layer_start"], s["tensor_rank"]))["node_id"]
    return found, httpx.get(f"{ready['runners'][head]['url']}/health", headers=RUNNER).json()["batch"]["widest"]


@pytest.fixture(scope="module")
def reference(cluster: Server) -> dict[str, list[str]]:
    """Greedy texts from two single-rank replicas, one on each node (either gives the same text); requests sent
    at once reach both (bounded loads spread them even if both prompts' keys pick the same replica)."""
    first = place(cluster, replicas=2)
    ids = [i["id"] for i in httpx.get(f"{cluster.url}/instances").json() if i["model"] == MODEL]
    replicas = [
        wait_for(lambda i=i: (found := instance(cluster, i))["state"]["state"] == "ready" and found, 180, "ready")
        for i in ids
    ]
    assert first["id"] in ids and sorted(r["placement"]["shards"][0]["node_id"] for r in replicas) == ["a", "b"]
    assert all(r["placement"]["strategy"] == "single" and r["placement"]["backend"] == "mlx" for r in replicas)
    found = texts(cluster)
    assert all(found["openai"]) and found["openai"] == found["openai-stream"] == found["ollama"]
    found["alone"] = [_completion(cluster, p, TOGETHER) for p in PROMPTS]  # one at a time: what a batch must give
    batched, _ = together(cluster, replicas[0])
    assert batched == found["alone"] * 2
    heads = [r["runners"][r["placement"]["shards"][0]["node_id"]]["url"] for r in replicas]
    assert all(httpx.get(f"{u}/health", headers=RUNNER).json()["batch"]["steps"] > 0 for u in heads), "both served"
    return found


@pytest.mark.parametrize("strategy", ["tensor", "pipeline"])  # pipeline last: the resume test below uses its ring
def test_two_ranks_give_the_single_rank_text_through_all_protocols(cluster, reference, strategy):
    ready = place(cluster, strategy=strategy, min_nodes=2)
    placement = ready["placement"]
    assert placement["backend"] == "mlx" and placement["strategy"] == strategy
    assert {s["node_id"] for s in placement["shards"]} == {"a", "b"}
    if strategy == "pipeline":
        ranges = sorted((s["layer_start"], s["layer_end"]) for s in placement["shards"])
        assert ranges[0][0] == 0 and ranges[0][1] == ranges[1][0] and ranges[1][1] == LAYERS
    else:
        assert sorted(s["tensor_rank"] for s in placement["shards"]) == [0, 1]
    head = min(placement["shards"], key=lambda s: (s["layer_start"], s["tensor_rank"]))["node_id"]
    health = httpx.get(f"{ready['runners'][head]['url']}/health", headers=RUNNER).json()
    assert health["ranks"] == 2 and health["sharding"] == strategy
    assert texts(cluster) == {k: v for k, v in reference.items() if k != "alone"}
    batched, widest = together(cluster, ready)
    assert batched == reference["alone"] * 2 and widest >= 2


def test_a_rank_killed_mid_generation_resumes_every_stream(cluster):
    """A follower rank SIGKILLed while a greedy stream in each protocol generates on a 2-rank pipeline: the ring's
    head exits, the instance is placed again with its own constraints, and each stream goes on, on the new ring,
    from the tokens it had sent (each text delta carries its ids; the new head decodes them one step each). Every
    SDK gets its whole answer without an error, equal to an undisturbed run's; ``/metrics`` counts the resumes."""
    current = next((i for i in httpx.get(f"{cluster.url}/instances").json() if i["model"] == MODEL), None)
    if current is None or current["placement"]["strategy"] != "pipeline":
        current = place(cluster, strategy="pipeline", min_nodes=2)
    current = wait_for(
        lambda: (i := instance(cluster, current["id"]))["state"]["state"] == "ready" and i, 180, "ready before the kill"
    )
    reference = {p: "".join(text) for p, text in greedy_streams(cluster.url, MODEL, *RESUMED).items()}
    assert len(set(reference.values())) == 1 and len(reference["openai"]) > 200, reference
    shards = sorted(current["placement"]["shards"], key=lambda s: s["layer_start"])
    head_pid, follower_pid = (current["runners"][s["node_id"]]["pid"] for s in shards)
    before = resumes(cluster.url)
    streams = greedy_streams(cluster.url, MODEL, *RESUMED)
    got = {protocol: next(text) for protocol, text in streams.items()}  # text has reached every client
    os.kill(follower_pid, signal.SIGKILL)
    for protocol, text in streams.items():
        got[protocol] += "".join(text)
    assert got == reference
    assert resumes(cluster.url) - before >= 1  # at least one stream was still running at the kill (all, mostly)
    assert not alive(head_pid), "the head of the broken ring gone"
    replaced = instance(cluster, current["id"])
    assert replaced["epoch"] > current["epoch"] and replaced["placement"]["strategy"] == "pipeline", replaced
