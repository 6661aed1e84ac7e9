"""One rank of the KV tier over a 2-rank MLX ring, run with the MLX venv's python (``test_mlx_kv_tier.py`` starts
both ranks with ``backends.mlx.launch``).

``python tests/mlx/ring_kv_check.py RUNS_JSON WORK_DIR``: ``RUNS_JSON`` lists runs ``{"model", "mode", "shared"}``
(``shared``: both ranks' tiers in one directory, as two ranks of one node; else one per rank, as two nodes), done
one after another in the same processes, each through these phases (each a fresh engine on every rank, joined
over the ring; followers follow, then flush their tier and report it):

- ``cold``: no tier: the prompt ``whole`` (2 * ``CHUNK`` + about 100 tokens) and ``longer`` (it, then more);
- ``kept``: a disk tier only (the default: no host tier): ``whole`` is kept, each rank its shard;
- ``restarted``: fresh engines over the same directories (the ring restarted): ``whole`` restored whole, then
  ``longer`` from the restore point at 1,024 tokens;
- ``cold_longer``: a fresh directory: ``longer`` kept cold, to compare each rank's bytes with the entry kept after
  the restore;
- ``lost`` (pipeline runs): the follower's tier in an empty directory (a rank that lost its files) with host
  tiers: the head holds ``whole`` but the follower does not, so every rank prefills it; asked again, every rank
  restores it (the follower kept it then);
- ``alone`` (head only, last): an engine of one process over the head's ring directory: no ring entry loads.

Each head run reports its picks, ``cached_tokens`` and a digest of the logits of its first pick (as
``kv_tier_check.py``). Every rank prints one JSON line, then leaves with ``os._exit``.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
from pathlib import Path
from typing import Any

import mlx.core as mx

from meshgate.backends.mlx.batch import CHUNK
from meshgate.backends.mlx.engine import MlxEngine
from meshgate.protocols.model import Request
from tests.mlx.kv_tier_check import _sentences, _text, run


def _engine(group: Any, spec: dict, **kv: Any) -> MlxEngine:
    return MlxEngine(spec["model"], group=group, mode=spec["mode"], parallel=2, **kv)


def _tier(engine: MlxEngine) -> dict:
    """What this rank's tier holds: its namespace, figures and entries (end, restore points, state's digest)."""
    tier = engine.tier
    if tier is None:
        return {}
    tier.flush()
    entries = {}
    for key in list(tier._disk) + list(tier._ram):
        entry, _ = tier._fetch(key)
        if entry is not None:
            digest = hashlib.sha256(bytes(entry.state)).hexdigest()
            entries[str(len(entry.tokens))] = {"points": sorted(entry.points), "state": digest}
    files = sorted(tier.directory.glob("*.kv")) if tier.directory else []
    return {"namespace": tier.namespace, "stats": tier.stats(), "entries": entries, "files": len(files)}


def _phase(group: Any, spec: dict, prompts: list[str], **kv: Any) -> dict:
    """One engine on every rank: the head runs ``prompts`` (greedy), followers follow; this rank's report."""
    engine = _engine(group, spec, **kv)
    if engine.rank != 0:
        engine.follow()
        out = _tier(engine)
    else:
        out = {"runs": [run(engine, text) for text in prompts]}
        out |= _tier(engine) | {"batch": engine.health()["batch"]}
        engine.shutdown()
    if engine.tier is not None:
        engine.tier.close()
    return out


def _one(group: Any, spec: dict, work: Path) -> dict:
    rank = group.rank()
    texts: list[str] = []
    if rank == 0:
        probe = MlxEngine(spec["model"], parallel=1)  # one process, no ring: only to cut the prompts
        whole = _text(probe, "", 2 * CHUNK + 100)
        texts = [whole, whole + " And then " + _sentences(500)[:600]]
        lengths = [len(probe.tokenize(Request(model="tiny", raw_prompt=t))) for t in texts]
        probe.shutdown()
    # the texts travel to the follower only as tokens, inside the head's batch operations: it needs none
    whole_only, both = texts[:1], texts
    name = f"{spec['mode']}-{'shared' if spec['shared'] else 'apart'}"
    own = work / f"{name}-kv" if spec["shared"] else work / f"{name}-kv-{rank}"
    disk = {"kv_dir": str(own), "kv_disk": 1 << 30}
    out: dict[str, Any] = {"cold": _phase(group, spec, both)}
    out["kept"] = _phase(group, spec, whole_only, **disk)
    out["restarted"] = _phase(group, spec, both, **disk)
    fresh = {"kv_dir": str(own.with_name(own.name + "-cold")), "kv_disk": 1 << 30}
    out["cold_longer"] = _phase(group, spec, both[1:], **fresh)
    if spec["mode"] == "pipeline":
        lost = {"kv_dir": str(own.with_name(own.name + "-lost")) if rank else str(own), "kv_disk": 1 << 30}
        out["lost"] = _phase(group, spec, whole_only * 2, kv_ram=1 << 30, **lost)
    if rank == 0:
        alone = MlxEngine(spec["model"], parallel=1, kv_dir=str(own), kv_disk=1 << 30)
        out["alone"] = {"runs": [run(alone, whole_only[0])]} | _tier(alone)
        alone.shutdown()
        out["lengths"] = lengths
    return out


def main() -> None:
    group = mx.distributed.init(strict=True, backend="ring")
    specs, work = json.loads(sys.argv[1]), Path(sys.argv[2])
    done = [_one(group, spec, work) for spec in specs]
    print(json.dumps({"rank": group.rank(), "runs": done}), flush=True)
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
