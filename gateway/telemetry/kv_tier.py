"""A runner's KV cache tier as its ``/health`` reports it: prompt states kept in RAM and on the node's disk.

A llama.cpp runner with a tier answers ``/health`` with ``"kv_tier": {...}``: bytes, budget and entries of each
tier (``ram_*``, ``disk_*``), and since the runner started, lookups served from RAM or disk (``hits_ram``,
``hits_disk``) or not at all (``misses``), the prompt tokens taken from hits (``restored_tokens``), the entries it
kept (``saved``) and the disk files it refused as damaged (``refused``). Runners without a tier (MLX, vLLM,
scripted test backends) leave the key out. ``kv_tier_of`` reads it as a tolerant reader: unknown fields are
ignored, a missing one is 0, and an answer of another shape is no figures at all (``None``).

The gateway polls it (``gateway.cluster.kv_tiers``) and shows it in ``/metrics``, ``/instances`` and
``meshgate ps``. Imports msgspec only.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Annotated

import msgspec

__all__ = ["KvTier", "kv_tier_of"]

Count = Annotated[int, msgspec.Meta(ge=0)]


class KvTier(msgspec.Struct, frozen=True, kw_only=True):
    """One runner's KV tier figures, as it last reported them (byte sizes in bytes; counts since it started)."""

    ram_bytes: Count = 0
    ram_budget: Count = 0
    ram_entries: Count = 0
    disk_bytes: Count = 0
    disk_budget: Count = 0
    disk_entries: Count = 0
    hits_ram: Count = 0
    hits_disk: Count = 0
    misses: Count = 0
    restored_tokens: Count = 0
    saved: Count = 0
    refused: Count = 0


def kv_tier_of(health: Mapping[str, object]) -> KvTier | None:
    """The ``kv_tier`` of a runner's ``/health`` answer; ``None`` when it has none or it is not an object of
    integers of 0 or more."""
    found = health.get("kv_tier")
    if not isinstance(found, Mapping):
        return None
    try:
        return msgspec.convert(found, KvTier)
    except msgspec.ValidationError:
        return None
