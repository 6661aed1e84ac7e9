"""The KV tier on the MLX engine (``backends.mlx.kvcache``): a prompt's cache kept, then restored instead of prefilled.

Both tiny families, in the MLX venv (``kv_tier_check.py``, one process per family): the tiny llama has only plain
``KVCache`` layers, the tiny gemma3 three sliding-window layers (``RotatingKVCache``, a window of 8 tokens) and a
global one, so its restore points carry the windows' rows. A prompt of 2 * ``CHUNK`` + about 100 tokens is run
cold (no tier), kept, then restored by fresh engines (a runner restarted with its tier): whole, its first token
from the kept logits; and a longer prompt (its next turn) from the restore point at 1,024 tokens, its rest
prefilled in cold's chunks; in float32 and in bfloat16 (stored as its bits, the logits cast back). MLX computes
the same bytes from the same cache and chunks, so the tests ask for
cold's greedy tokens and the first pick's logits bit for bit, and for the restored-then-prefilled cache to be the
bytes a cold prefill of that prompt keeps.

Over a 2-rank ring (``ring_kv_check.py``, both ranks launched once for every ring assertion, ~12 s): the tiny
gemma3 by pipeline (each rank its own directory, as two nodes) and the tiny llama by tensor (one directory, as two
ranks of one node), each rank keeping its shard in its own tier: the same exactness after the ring restarts, a
rank that lost its shard making every rank prefill, and a ring's entries never loading alone.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshgate.backends.base import ModelCard
from meshgate.backends.mlx import MlxBackend
from meshgate.backends.placement import Candidate, NodeId, Shard
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests.mlx.test_mlx_engine import ENV, FAMILIES, HERE, ROOT, _mlx, mlx_python

CHUNK = 512  # backends.mlx.batch.CHUNK (that module imports mlx lazily, this process has none)


@pytest.fixture(scope="module", params=FAMILIES)
def report(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> dict:
    family = request.param
    root = tmp_path_factory.mktemp(f"kv-{family}")
    _mlx(str(HERE / "tiny_model.py"), str(root / family), family)
    done = _mlx(str(HERE / "kv_tier_check.py"), str(root / family), str(root), timeout=240)
    return json.loads(done.stdout.splitlines()[-1]) | {"family": family}


def test_a_prompt_restored_whole_or_at_a_chunk_gives_its_cold_tokens(report: dict) -> None:
    whole, longer = report["lengths"]
    assert 2 * CHUNK < whole < 3 * CHUNK and whole % CHUNK and whole < longer < 3 * CHUNK
    assert report["shared"] >= 2 * CHUNK, "the longer prompt goes on from the kept one's restore point"
    cold = report["cold"]
    assert report["kept"] == cold["whole"] and cold["whole"]["cached"] == 0
    assert report["entry"]["points"] == [CHUNK, 2 * CHUNK], "the last two chunk boundaries inside the prompt"
    assert report["entry"]["logits"] == cold["whole"]["first"], "the kept logits are cold's, bit for bit"

    restored = report["restored"]
    assert restored["cached"] == whole == restored["prompt"], "the whole prompt restored, nothing prefilled"
    assert restored["tokens"] == cold["whole"]["tokens"] and len(restored["tokens"]) == 16
    assert restored["first"] == cold["whole"]["first"]

    extended = report["extended"]
    assert extended["cached"] == 2 * CHUNK, "restored at the kept prompt's last chunk boundary"
    assert extended["tokens"] == cold["longer"]["tokens"]
    assert extended["first"] == cold["longer"]["first"], "the restored cache is cold's: its next logits bit for bit"
    assert report["extended_state_is_cold"], "restored, then prefilled in cold's chunks: cold's cache, byte for byte"

    (whole_bf16, longer_bf16), cold_bf16 = report["bfloat16"], report["bfloat16_cold"]
    assert (whole_bf16["cached"], longer_bf16["cached"]) == (whole, 2 * CHUNK)
    assert [whole_bf16, longer_bf16] == [cold_bf16[0] | {"cached": whole}, cold_bf16[1] | {"cached": 2 * CHUNK}]
    assert cold_bf16[0]["tokens"] != cold["whole"]["tokens"] or cold_bf16[0]["first"] != cold["whole"]["first"]

    stats = report["restarted_stats"]
    assert (stats["hits_ram"], stats["restored_tokens"], stats["saved"]) == (2, whole + 2 * CHUNK, 2)
    assert report["health"] == {"tier": 2, "prefixes": 1, "restored": whole + 2 * CHUNK}


def test_entries_survive_a_restart_on_disk_and_stay_in_their_scope(report: dict) -> None:
    cold = report["cold"]["whole"]
    assert report["disk_kept"] == cold
    assert report["disk_files"] == 1 and report["disk_mode"] == "0o600"
    assert report["other_scope"] == cold, "another tenant's entry is never served: computed again"
    again = report["disk_restored"]
    assert again["cached"] == report["lengths"][0] and again["tokens"] == cold["tokens"]
    assert again["first"] == cold["first"]
    assert report["disk_stats"]["hits_disk"] == 1 and report["disk_stats"]["refused"] == 0


def test_a_corrupt_entry_is_refused_and_its_prompt_computed_again(report: dict) -> None:
    cold = report["cold"]["whole"]
    assert report["corrupt"] == cold, "a file whose checksum fails is never loaded"
    assert report["corrupt_stats"]["refused"] == 1 and report["corrupt_stats"]["restored_tokens"] == 0
    assert report["corrupt_file_gone"]
    assert report["unloadable"] == cold, "an entry whose bytes make no cache: prefilled instead"


def test_serialized_size_per_token(report: dict) -> None:
    """The tiny llama: 4 layers * (K + V) * 4 heads * 16 dims * float32 = 2 KiB a token, plus a header; the tiny
    gemma3 keeps one global layer's 128 bytes a token and each window's last 8 rows, so its restore points are
    small (the window's rows read again, not the chunk's)."""
    entry, whole = report["entry"], report["lengths"][0]
    per_token = entry["state_bytes"] / whole
    print(f"{report['family']}: {per_token:.1f} bytes a token, restore points {entry['point_bytes']}")
    if report["family"] == "llama":  # no sliding-window layer: a restore point is a header, the state is cut back
        assert 2048 <= per_token < 2048 * 1.01 and max(entry["point_bytes"].values()) < 100
    else:
        assert 128 <= per_token < 128 * 1.1 and max(entry["point_bytes"].values()) < 8 * 1024


RING = (
    {"family": "gemma3", "mode": "pipeline", "shared": False},  # each rank its own directory, as two nodes
    {"family": "llama", "mode": "tensor", "shared": True},  # one directory, as two ranks of one node
)


@pytest.fixture(scope="module")
def ring(tmp_path_factory: pytest.TempPathFactory) -> list[tuple[dict, dict, dict]]:
    """Per ``RING`` run: (its spec, the head's report, the follower's), from one launch of two ranks."""
    from meshgate.backends.mlx.launch import launch

    root = tmp_path_factory.mktemp("kv-ring")
    build = "import sys; from tests.mlx.tiny_model import build\nfor f in sys.argv[2:]: build(sys.argv[1] + '/' + f, f)"
    _mlx("-c", build, str(root), *{spec["family"] for spec in RING})
    specs = [{"model": str(root / spec["family"]), **spec} for spec in RING]
    started = time.monotonic()
    argv = [str(mlx_python()), str(HERE / "ring_kv_check.py"), json.dumps(specs), str(root)]
    ranks = launch(2, argv, env=ENV, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outs = [p.communicate(timeout=240) for p in ranks.procs]
    finally:
        ranks.close()
    assert [p.returncode for p in ranks.procs] == [0, 0], [err[-1500:] for _, err in outs]
    print(f"the KV tier over 2 ranks: {time.monotonic() - started:.1f} s")
    head, follower = (json.loads(out.splitlines()[-1]) for out, _ in outs)
    return list(zip(RING, head["runs"], follower["runs"], strict=True))


def _shards(report: dict) -> dict[str, tuple[list[int], str]]:
    return {n: (entry["points"], entry["state"]) for n, entry in report["entries"].items()}


@pytest.mark.parametrize("run", range(len(RING)), ids=[f"{s['family']}-{s['mode']}" for s in RING])
def test_a_ring_restores_every_rank_s_shard_as_cold_computes(ring: list, run: int) -> None:
    """Kept by a ring (a disk tier on every rank, each its shard), restored by the ring restarted: whole, its first
    pick from the kept logits, and the longer prompt from 1,024 tokens, on every rank at once; greedy tokens and
    the first pick's logits are cold's bit for bit, and each rank's cache after the restore and the rest's prefill
    is the bytes a cold prefill keeps there."""
    spec, head, follower = ring[run]
    whole, longer = head["lengths"]
    cold_whole, cold_longer = head["cold"]["runs"]
    assert head["kept"]["runs"] == [cold_whole] and cold_whole["cached"] == 0
    files = 2 if spec["shared"] else 1  # one directory for both ranks: each rank's own file beside the other's
    for rank in (head, follower):
        assert rank["kept"]["files"] == files and _shards(rank["kept"]).keys() == {str(whole)}
        assert rank["kept"]["entries"][str(whole)]["points"] == [CHUNK, 2 * CHUNK]
    assert head["kept"]["namespace"] != follower["kept"]["namespace"], "each rank's shard is its own cache"

    restored, extended = head["restarted"]["runs"]
    assert restored == cold_whole | {"cached": whole}, "restored whole on both ranks: nothing prefilled"
    assert extended == cold_longer | {"cached": 2 * CHUNK}, "both ranks from 1,024 tokens, the rest prefilled"
    assert head["restarted"]["batch"]["restored_tokens"] == whole + 2 * CHUNK
    assert head["restarted"]["batch"]["ring_refused"] == 0
    for rank in (head, follower):
        stats = rank["restarted"]["stats"]
        assert (stats["hits_disk"], stats["restored_tokens"], stats["refused"]) == (2, whole + 2 * CHUNK, 0)
        kept_after, kept_cold = _shards(rank["restarted"])[str(longer)], _shards(rank["cold_longer"])[str(longer)]
        assert kept_after[1] == kept_cold[1], "a rank's cache restored, then prefilled: cold's, byte for byte"


def test_a_rank_without_the_entry_makes_every_rank_prefill(ring: list) -> None:
    """The follower's tier lost its files: the head's hit is refused by the vote and every rank prefills (cold's
    tokens and logits), the follower keeps the prompt again, and the next ask restores it on both."""
    spec, head, follower = ring[0]
    whole = head["lengths"][0]
    cold_whole = head["cold"]["runs"][0]
    refused, again = head["lost"]["runs"]
    assert refused == cold_whole, "prefilled on every rank, not restored on the head alone"
    assert again == cold_whole | {"cached": whole}
    assert (head["lost"]["batch"]["ring_refused"], head["lost"]["batch"]["restored_tokens"]) == (1, whole)
    stats = follower["lost"]["stats"]
    assert (stats["misses"], stats["hits_ram"], stats["restored_tokens"], stats["saved"]) == (1, 1, whole, 1)


@pytest.mark.parametrize("run", range(len(RING)), ids=[f"{s['family']}-{s['mode']}" for s in RING])
def test_a_ring_s_entries_never_load_into_a_runner_of_one_process(ring: list, run: int) -> None:
    _, head, follower = ring[run]
    alone = head["alone"]
    assert alone["runs"][0]["cached"] == 0 and alone["runs"][0]["tokens"] == head["cold"]["runs"][0]["tokens"]
    assert alone["stats"]["refused"] == 0, "another namespace's files are left alone, not refused"
    assert alone["namespace"] not in (head["kept"]["namespace"], follower["kept"]["namespace"])


def test_the_mlx_plugin_gives_every_rank_the_kv_tier_settings(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The llama.cpp plugin's settings size the MLX tiers too; a runner of one rank and every rank of a ring are
    told them (each rank keeps its shard); by default (no host tier) the planner's figures are those of no tier,
    and a set host tier is counted on every rank."""

    def backend(environ: dict[str, str]) -> MlxBackend:
        settings = Settings.from_env({"MESHGATE_MLX_PYTHON": "/mlx/bin/python", **environ}, data_dir=str(tmp_path))
        found: list = []
        build_plugin_manager(settings).hook.meshgate_register_backends(
            register=found.append, settings=settings, http=None
        )
        return next(b for b in found if b.name == "mlx")

    card = ModelCard(name="m", path="/m", format="safetensors", digest="sha256:1")
    default = backend({})
    assert default.kv_ram is None and default.kv_dir == str(tmp_path / "kv-cache") and default.kv_disk > 0
    assert default.costs(card).cache(24 << 30) == 0, "no host tier unless its size is set: the disk tier only"
    costs = default.costs(card)
    assert (costs.base_bytes, costs.head_bytes) == (190 << 20, 25 << 20), "placements as with no tier at all"
    set_ = backend({"MESHGATE_KV_RAM_MIB": "512", "MESHGATE_KV_DISK_MIB": "1024", "MESHGATE_KV_DIR": "/srv/kv"})
    assert (set_.kv_ram, set_.kv_disk, set_.kv_dir) == (512 << 20, 1 << 30, "/srv/kv")
    off = backend({"MESHGATE_KV_RAM_MIB": "0"}).costs(card)
    assert (set_.costs(card).base_bytes - off.base_bytes, set_.costs(card).head_bytes) == (512 << 20, 25 << 20)

    started: list[list[str]] = []

    async def start(argv: list[str], **_: object) -> SimpleNamespace:
        started.append(argv)
        return SimpleNamespace(pid=1, port=1, alive=True)

    async def ring(host: str, followers: object) -> str:
        return str(tmp_path / "hostfile")

    async def peers() -> dict[str, str]:
        return {"b": "http://127.0.0.1:1"}

    monkeypatch.setattr("meshgate.backends.mlx.RunnerProcess.start", start)
    monkeypatch.setattr(set_, "_ring", ring)
    set_.runtime_dir = tmp_path / "runtime"
    a, b = NodeId("a"), NodeId("b")
    one = Candidate(
        id="one",
        model="m",
        backend="mlx",
        strategy="single",
        context=256,
        memory_per_node={},
        shards=(Shard(node_id=a, layer_start=0, layer_end=4),),
    )
    two = Candidate(
        id="two",
        model="m",
        backend="mlx",
        strategy="pipeline",
        context=256,
        memory_per_node={},
        shards=(Shard(node_id=a, layer_start=0, layer_end=2), Shard(node_id=b, layer_start=2, layer_end=4)),
    )
    asyncio.run(set_.launch(card, one, one.shards[0], host="127.0.0.1", peers=peers))
    asyncio.run(set_.launch(card, two, two.shards[0], host="127.0.0.1", peers=peers))
    asyncio.run(set_.launch(card, two, two.shards[1], host="127.0.0.1", peers=peers))
    expected = ["--kv-ram", str(512 << 20), "--model-digest", "sha256:1", "--kv-dir", "/srv/kv", "--kv-disk"]
    for argv in started:  # alone, the ring's head, its follower
        assert argv[argv.index("--kv-ram") :][:8] == [*expected, str(1 << 30)]
    assert started[2][started[2].index("--rank") + 1] == "1"
