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
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace

import pytest

from meshgate.backends.base import ModelCard
from meshgate.backends.mlx import MlxBackend
from meshgate.backends.placement import Candidate, NodeId, Shard
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests.mlx.test_mlx_engine import FAMILIES, HERE, _mlx

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


def test_the_mlx_plugin_gives_runners_of_one_rank_the_kv_tier_settings(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The llama.cpp plugin's settings size the MLX tiers too; a runner of one rank is told them, a ring's head
    is not (each rank holds a shard of the cache); the planner counts the host tier as the head's memory."""

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
    set_ = backend({"MESHGATE_KV_RAM_MIB": "512", "MESHGATE_KV_DISK_MIB": "1024", "MESHGATE_KV_DIR": "/srv/kv"})
    assert (set_.kv_ram, set_.kv_disk, set_.kv_dir) == (512 << 20, 1 << 30, "/srv/kv")
    assert set_.costs(card).head_bytes - backend({"MESHGATE_KV_RAM_MIB": "0"}).costs(card).head_bytes == 512 << 20

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
    alone, head = started
    flags = alone[alone.index("--kv-ram") :]
    assert flags[:4] == ["--kv-ram", str(512 << 20), "--model-digest", "sha256:1"]
    assert flags[4:8] == ["--kv-dir", "/srv/kv", "--kv-disk", str(1 << 30)]
    assert "--kv-ram" not in head and "--kv-dir" not in head
