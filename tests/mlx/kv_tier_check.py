"""The MLX engine's KV tier, run with the MLX venv's python (``test_mlx_kv_tier.py`` starts it).

``python tests/mlx/kv_tier_check.py MODEL_DIR WORK_DIR``: greedy generations of a prompt of 2 * ``CHUNK`` + about
100 tokens (``whole``), a longer one that shares its first 1,024 tokens or more (``longer``, the next turn), run
cold (engines without a tier), kept (an engine with a tier), then restored (fresh engines over the same tier: a
runner restarted), in float32 and in bfloat16; then a disk tier across engines, with another scope, a corrupt
file and an entry whose bytes check but make no cache. Each run reports its picks, the usage's ``cached_tokens``
and a digest of the logits its first token was picked from (each run is alone in its engine, so that is its
sequence's first pick). Prints one JSON line of what the test asserts, then leaves with ``os._exit`` (as
``rank_check.py``).
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import threading
from pathlib import Path

import mlx.core as mx
import numpy as np

from meshgate.backends.mlx import batch as mlx_batch
from meshgate.backends.mlx.batch import CHUNK
from meshgate.backends.mlx.engine import MlxEngine
from meshgate.backends.runner.kvtier import Entry
from meshgate.protocols.model import Request, Sampling, Usage

LIMIT = 16
FIRST: list[bytes] = []  # the logits of each sequence's first pick, in order
_pick = mlx_batch.Scheduler._pick


def _recording_pick(rows: list, logits: object) -> list[int]:
    last = mlx_batch._last(logits)
    for i, seq in enumerate(rows):
        if seq.count == 0 and not seq.forced:
            FIRST.append(np.array(last[i].astype(mx.float32)).tobytes())
    return _pick(rows, logits)


mlx_batch.Scheduler._pick = staticmethod(_recording_pick)  # type: ignore[method-assign]


def _sentences(start: int) -> str:
    tools = ["linter", "parser", "compiler", "router", "profiler", "cache"]
    return " ".join(
        f"Step {i}: the {tools[i % 6]} reads line {i * 13 % 97} and reports {i * 7 % 31}."
        for i in range(start, start + 400)
    )


def _text(engine: MlxEngine, head: str, at_least: int) -> str:
    """The shortest run of sentences after ``head`` whose prompt is ``at_least`` tokens long."""
    words = _sentences(0).split(" ")
    for n in range(len(words)):
        text = head + " ".join(words[:n])
        if len(engine.tokenize(Request(model="tiny", raw_prompt=text))) >= at_least:
            return text
    raise AssertionError("the sentences are too short")


def run(engine: MlxEngine, text: str, scope: str = "") -> dict:
    FIRST.clear()
    request = Request(
        model="tiny", raw_prompt=text, sampling=Sampling(temperature=0.0), max_tokens=LIMIT, cache_scope=scope
    )
    usage = Usage()
    for event in engine.generate(request, threading.Event()):
        if isinstance(event, Usage):
            usage = event
    return {
        "tokens": list(engine.last_tokens),
        "cached": usage.cached_tokens,
        "prompt": usage.prompt_tokens,
        "first": hashlib.sha256(FIRST[0]).hexdigest(),
    }


def engine(model: str, **kv: object) -> MlxEngine:
    return MlxEngine(model, parallel=2, **kv)  # type: ignore[arg-type]


def over(tier: object, model: str, **more: object) -> MlxEngine:
    """A fresh engine that uses ``tier`` (another engine's, in host memory: a runner restarted with its tier)."""
    fresh = engine(model, kv_ram=1 << 30, **more)
    fresh.tier = fresh.scheduler.keeper.tier = tier  # type: ignore[assignment, union-attr]
    return fresh


def main() -> None:
    model, work = sys.argv[1], Path(sys.argv[2])
    out: dict = {}
    plain = engine(model)
    whole = _text(plain, "", 2 * CHUNK + 100)
    longer = whole + " And then " + _sentences(500)[:600]
    tokens = [plain.tokenize(Request(model="tiny", raw_prompt=t)) for t in (whole, longer)]
    out["lengths"] = [len(t) for t in tokens]
    out["shared"] = next((i for i, (a, b) in enumerate(zip(*tokens, strict=False)) if a != b), len(tokens[0]))
    out["cold"] = {"whole": run(plain, whole), "longer": run(plain, longer)}
    plain.shutdown()

    # kept by one engine, restored by fresh ones over the same tier (host memory only)
    first = engine(model, kv_ram=1 << 30)
    tier = first.tier
    assert tier is not None
    out["kept"] = run(first, whole)
    (entry,) = list(tier._ram.values())
    out["entry"] = {
        "points": sorted(entry.points),
        "state_bytes": len(entry.state),
        "point_bytes": {n: len(p) for n, p in entry.points.items()},
        "logits": hashlib.sha256(bytes(entry.logits)).hexdigest(),
    }
    first.shutdown()
    restarted = over(tier, model)
    out["restored"] = run(restarted, whole)
    out["extended"] = run(restarted, longer)
    out["restarted_stats"] = tier.stats()
    health = restarted.health()
    out["health"] = {"tier": health["kv_tier"]["saved"], "prefixes": len(health["kv_tier"]["prefixes"])}
    out["health"]["restored"] = health["batch"]["restored_tokens"]
    longer_entry = next(e for e in tier._ram.values() if len(e.tokens) == out["lengths"][1])
    restarted.shutdown()
    cold_tier = engine(model, kv_ram=1 << 30)  # the longer prompt kept cold: the same bytes as kept after a restore
    run(cold_tier, longer)
    (cold_entry,) = list(cold_tier.tier._ram.values())  # type: ignore[union-attr]
    out["extended_state_is_cold"] = bytes(cold_entry.state) == bytes(longer_entry.state)
    cold_tier.shutdown()

    # the disk tier across a restart, scopes, a corrupt file, an entry that makes no cache
    disk = work / "kv"
    writer = engine(model, kv_dir=str(disk), kv_disk=1 << 30)
    out["disk_kept"] = run(writer, whole, scope="team-a")
    writer.tier.flush()  # type: ignore[union-attr]
    writer.tier.close()  # type: ignore[union-attr]
    writer.shutdown()
    files = sorted(disk.glob("*.kv"))
    out["disk_files"] = len(files)
    out["disk_mode"] = oct(files[0].stat().st_mode & 0o777)
    reader = engine(model, kv_ram=1 << 30, kv_dir=str(disk), kv_disk=1 << 30)
    out["other_scope"] = run(reader, whole, scope="team-b")
    out["disk_restored"] = run(reader, whole, scope="team-a")
    out["disk_stats"] = reader.tier.stats()  # type: ignore[union-attr]
    reader.tier.flush()  # type: ignore[union-attr]
    reader.tier.close()  # type: ignore[union-attr]
    reader.shutdown()
    body = bytearray(files[0].read_bytes())
    body[-5] ^= 0xFF  # a flipped bit in its last logits' bytes
    files[0].write_bytes(bytes(body))
    damaged = engine(model, kv_ram=1 << 30, kv_dir=str(disk), kv_disk=1 << 30)
    out["corrupt"] = run(damaged, whole, scope="team-a")
    out["corrupt_stats"] = damaged.tier.stats()  # type: ignore[union-attr]
    out["corrupt_file_gone"] = not files[0].exists() or files[0].read_bytes() != bytes(body)
    damaged.tier.close()  # type: ignore[union-attr]
    damaged.shutdown()
    # bfloat16 (kept as its bits, the logits as float32 and cast back): restored whole and at 1,024, as cold
    half = engine(model, dtype="bfloat16")
    cold = [run(half, whole), run(half, longer)]
    half.shutdown()
    keeper = engine(model, dtype="bfloat16", kv_ram=1 << 30)
    run(keeper, whole)
    keeper.shutdown()
    again = over(keeper.tier, model, dtype="bfloat16")
    out["bfloat16"] = [run(again, whole), run(again, longer)]
    out["bfloat16_cold"] = cold
    again.shutdown()

    junk = engine(model, kv_ram=1 << 30)
    ids = np.asarray(tokens[0], dtype=np.int32)
    junk.tier.put(Entry("", ids, bytearray(b"\x04\x00\x00\x00junk"), bytearray(entry.logits)))  # type: ignore[union-attr]
    out["unloadable"] = run(junk, whole)
    junk.shutdown()
    print(json.dumps(out), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
