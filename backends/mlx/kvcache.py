"""One prompt's MLX KV cache in and out of bytes, for the KV tiers (``runner.kvtier``): a whole model's or one rank's.

The scheduler prefills a prompt on its own plain cache (``batch.Batch.pending``): one mlx-lm cache per layer, a
``KVCache`` (a buffer grown ``KVCache.step`` rows at a time, filled up to ``offset``; the rows past it are zeros)
or a ``RotatingKVCache`` (a sliding-window layer's: after a chunk of S tokens it holds the window's last rows before
the chunk and the chunk's, reordered and trimmed as it goes, so it cannot be cut back to an earlier position). A
model with any other cache (quantized, state-space, chunked) has no tier (``supported``). Over a ring each rank
keeps its own shard of the cache in its own tier (``batch.Follower``): a tensor rank's layers hold its KV heads, a
pipeline stage's cache has ``None`` for the layers other ranks hold, kept as ``absent`` layers.

A snapshot (``snapshot``) is a JSON header (per layer: its class, the arrays' dtype and shapes, ``offset``, and a
rotating cache's ``keep``, ``max_size`` and write index) and the arrays' raw bytes (bfloat16 as its uint16 bits:
numpy has no bfloat16), copied when taken: mlx-lm writes the next chunk into the same buffers. A ``KVCache`` keeps
only its ``offset`` rows and is rebuilt (``load``) into a zeroed buffer of the capacity cold prefill grows it to
(``offset`` rounded up to ``KVCache.step``, chunks starting at multiples of it): the restored cache is the one cold
prefill left, byte for byte. A rotating cache just after a chunk holds ``max_size - 1`` rows before it and the
chunk's; it keeps the ``max_size`` rows mlx-lm reads again (its first ``keep`` and its last), as its next update
(another chunk, a decode step) or a batch merge trims them: what they compute is what the untrimmed cache gives.
What a tier entry holds (``Keeper.passed``):

- ``state``: the snapshot at the prompt's end; ``logits``: its last position's (float32; the model's dtype is in
  the header and restored, exactly for float16 and bfloat16);
- restore points at the last ``POINTS`` multiples of ``CHUNK`` inside the prompt (where cold prefill cut a chunk):
  the rotating layers' snapshot there (a ``KVCache`` is cut back from ``state``: its first rows do not change).

A prompt restored at a restore point prefills the rest in the chunks cold prefill cuts (they start at the prompt's
first token) from the very cache cold had there: its numbers are cold's bit for bit; a prompt that is an entry's
whole prompt starts from the kept logits, the cold ones. An entry's end serves a longer prompt only where it is a
multiple of ``CHUNK``: elsewhere the rest would be cut into other chunks than cold's. A follower's entries have no
logits (the head picks): ``Keeper.passed`` with ``logits`` ``None``, ``Keeper.restore`` with ``logits=False``.

Runs only in MLX processes; imports mlx and mlx_lm (lazily), numpy and the tier.
"""

from __future__ import annotations

import json
import logging
import struct
from typing import Any

import numpy as np

from meshgate.backends.runner.kvtier import Entry, Hit, KVTier

__all__ = ["POINTS", "SAVED", "Keeper", "load", "snapshot", "supported"]

log = logging.getLogger("meshgate.mlx.kvcache")

SAVED = 512
"""Prompts shorter than this are not kept in the KV tier: they are prefilled again in well under a second."""
POINTS = 2
"""Restore points a tier entry keeps: the last ``POINTS`` chunk boundaries inside its prompt."""

_LENGTH = struct.Struct("<I")  # the JSON header's length, before it
_STORED = {"float32": "<f4", "float16": "<f2", "bfloat16": "<u2"}  # how each dtype's arrays are stored
_ABSENT = "absent"  # the class of a layer another pipeline stage holds: no arrays
_NOTHING = np.empty((0, 0, 0, 0), dtype=np.float32)


def supported(cache: list[Any]) -> bool:
    """Whether a model's (fresh) ``cache`` is one the tier keeps: every layer this rank holds mlx-lm's ``KVCache`` or
    ``RotatingKVCache`` (not a subclass: another class may hold more than their state); ``None`` for a layer
    another pipeline stage holds."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    held = [c for c in cache if c is not None]
    return bool(held) and all(type(c) in (KVCache, RotatingKVCache) for c in held)


def snapshot(cache: list[Any], *, windows: bool = False, logits: str = "") -> bytearray | None:
    """``cache`` as bytes (copied now); with ``windows``, its rotating layers only (the others cut back from an
    entry's state). ``logits``: the dtype of the logits kept with it. ``None`` when a layer is empty or of a dtype
    not kept."""
    import mlx.core as mx
    from mlx_lm.models.cache import RotatingKVCache

    layers: list[dict[str, Any] | None] = []
    arrays = []
    for c in cache:
        if c is None:  # a layer another pipeline stage holds
            layers.append({"class": _ABSENT})
            continue
        rotating = type(c) is RotatingKVCache
        if windows and not rotating:
            layers.append(None)
            continue
        if c.keys is None:
            return None
        keys, values = c.keys, c.values
        layer: dict[str, Any] = {"class": type(c).__name__, "offset": c.offset}
        if rotating:
            idx = c._idx
            if idx == keys.shape[2] > c.max_size:  # after a chunk: only its ``keep`` and last rows are read again
                keys, values = (
                    mx.concatenate([a[..., : c.keep, :], a[..., c.keep - c.max_size :, :]], 2) for a in (keys, values)
                )
                idx = c.max_size
            layer |= {"keep": c.keep, "max_size": c.max_size, "idx": idx}
        else:  # the rows past ``offset`` are zeros
            keys, values = keys[..., : c.offset, :], values[..., : c.offset, :]
        dtype = _name(keys.dtype)
        if dtype not in _STORED or _name(values.dtype) != dtype:
            return None
        layers.append(layer | {"dtype": dtype, "keys": list(keys.shape), "values": list(values.shape)})
        arrays += [keys, values]
    header = json.dumps({"layers": layers, "logits": logits}).encode()
    out = bytearray(_LENGTH.pack(len(header)) + header)
    for a in arrays:
        out += np.array(a.view(mx.uint16) if a.dtype == mx.bfloat16 else a).data  # np.array copies
    return out


def load(state: Any, n: int, point: Any = None) -> tuple[list[Any], str]:
    """The cache ``state`` (a snapshot of a prompt's end) holds, cut back to ``n`` tokens with ``point`` (the
    rotating layers' snapshot at ``n``, needed unless ``n`` is the end), and the dtype of its logits;
    ``ValueError`` when the bytes do not make one."""
    import mlx.core as mx
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    try:
        header, whole = _parse(state)
        window = _parse(point)[1] if point else [None] * len(whole)
        if len(window) != len(whole):
            raise ValueError("its restore point has another number of layers")
        cache: list[Any] = []
        for at_end, at_n in zip(whole, window, strict=True):
            if at_end is None:
                raise ValueError("its state lacks a layer")
            layer, keys, values = at_n or at_end
            if layer["class"] == _ABSENT:
                cache.append(None)
            elif layer["class"] == "RotatingKVCache":
                if layer["offset"] != n:
                    raise ValueError(f"a sliding-window layer at {layer['offset']} tokens, not {n}")
                k, v = _device(keys, layer["dtype"]), _device(values, layer["dtype"])
                cache.append(RotatingKVCache.from_state((k, v, n, layer["keep"], layer["max_size"], layer["idx"])))
            elif layer["class"] == "KVCache" and 0 < n <= layer["offset"]:
                capacity = -(-n // KVCache.step) * KVCache.step
                k, v = (_device(_grown(a[:, :, :n], capacity), layer["dtype"]) for a in (keys, values))
                cache.append(KVCache.from_state((k, v, n)))
            else:
                raise ValueError(f"a {layer['class']} layer of {layer['offset']} tokens cannot give {n}")
        mx.eval([[c.keys, c.values] for c in cache if c is not None])
        return cache, str(header.get("logits", ""))
    except (KeyError, TypeError, IndexError) as exc:
        raise ValueError(f"not an MLX cache snapshot ({exc!r})") from exc


def _parse(data: Any) -> tuple[dict[str, Any], list[tuple[dict[str, Any], np.ndarray, np.ndarray] | None]]:
    """A snapshot's header and, per layer, ``(its header, keys, values)`` (numpy views of ``data``) or ``None``."""
    view = memoryview(data).cast("B")
    try:
        (length,) = _LENGTH.unpack_from(view)
        header = json.loads(bytes(view[_LENGTH.size : _LENGTH.size + length]))
    except (struct.error, ValueError) as exc:
        raise ValueError(f"its header cannot be read ({exc})") from exc
    at = _LENGTH.size + length
    layers: list[tuple[dict[str, Any], np.ndarray, np.ndarray] | None] = []
    for layer in header["layers"]:
        if layer is None:
            layers.append(None)
            continue
        if layer["class"] == _ABSENT:
            layers.append((layer, _NOTHING, _NOTHING))
            continue
        dtype = np.dtype(_STORED[layer["dtype"]])
        pair = []
        for name in ("keys", "values"):
            shape = tuple(int(d) for d in layer[name])
            count = int(np.prod(shape))
            if len(shape) != 4 or at + count * dtype.itemsize > len(view):
                raise ValueError("its arrays do not fit its bytes")
            pair.append(np.frombuffer(view, dtype=dtype, count=count, offset=at).reshape(shape))
            at += count * dtype.itemsize
        layers.append((layer, pair[0], pair[1]))
    if at != len(view):
        raise ValueError(f"{len(view) - at} bytes past its arrays")
    return header, layers


def _grown(a: np.ndarray, capacity: int) -> np.ndarray:
    """``a`` (batch, heads, rows, dim) in a zeroed buffer of ``capacity`` rows, as ``KVCache`` grows one."""
    out = np.zeros((*a.shape[:2], capacity, a.shape[3]), dtype=a.dtype)
    out[:, :, : a.shape[2]] = a
    return out


def _device(a: np.ndarray, dtype: str) -> Any:
    import mlx.core as mx

    x = mx.array(a)  # a copy
    return x.view(mx.bfloat16) if dtype == "bfloat16" else x


def _name(dtype: Any) -> str:
    return str(dtype).removeprefix("mlx.core.")


class Keeper:
    """The KV tier as the scheduler (or a follower rank) uses it: a hit loaded into a cache, and a prompt's cache
    kept as its (cold) prefill passes its restore points and ends."""

    def __init__(self, tier: KVTier, chunk: int) -> None:
        self.tier = tier
        self.chunk = chunk

    def restore(self, hit: Hit, prompt_length: int, *, logits: bool = True) -> tuple[list[Any] | None, int, Any]:
        """``hit`` as a cache: ``(cache, tokens it holds, the logits (1, 1, vocab) to pick the first token from when
        that is the whole prompt, else None)``; ``(None, 0, None)`` when its bytes do not make a cache (the prompt
        is prefilled cold). No logits with ``logits`` false (a follower's entries keep none). The caller counts
        the tokens restored (``KVTier.restored``) once it uses them: over a ring, once every rank could."""
        import mlx.core as mx

        entry, n = hit.entry, hit.length
        try:
            point = entry.points.get(n) if n < len(entry.tokens) else None
            cache, dtype = load(entry.state, n, point)
            row = None
            if n == prompt_length and logits:
                kept = mx.array(np.frombuffer(entry.logits, dtype=np.float32)).reshape(1, 1, -1)
                row = kept.astype(getattr(mx, dtype)) if dtype else kept
        except (ValueError, AttributeError, RuntimeError) as exc:
            log.warning("KV tier: an entry of %d tokens cannot be restored (%s); prefilled instead", n, exc)
            return None, 0, None
        return cache, n, row

    def find(self, scope: str, prompt: list[int], n: int) -> Hit | None:
        """The entry that restores exactly the first ``n`` tokens of ``prompt`` (where the head's hit is), a
        restore point or an entry's end; ``None`` when this tier holds none."""
        if n < len(prompt):  # the prompt cut one token past ``n``, whose end ``whole=False`` leaves out
            return self.tier.find(scope, prompt[: n + 1], usable=n, ends=True, whole=False)
        return self.tier.find(scope, prompt, usable=n)

    def passed(
        self,
        cache: list[Any],
        prompt: list[int],
        end: int,
        points: dict[int, bytearray],
        scope: str,
        tag: str,
        logits: Any,
    ) -> None:
        """Prefill of ``prompt`` on ``cache`` reached ``end``: at one of its last ``POINTS`` chunk boundaries the
        rotating layers there go to ``points``; at its end (``logits``: the last position's, (1, 1, vocab); ``None``
        on a follower rank, whose entry keeps none), an entry goes to the tier."""
        import mlx.core as mx

        n = len(prompt)
        if n < SAVED:
            return
        first = max(self.chunk, ((n - 1) // self.chunk - POINTS + 1) * self.chunk)
        if end < n and end % self.chunk == 0 and end >= first:
            point = snapshot(cache, windows=True)
            if point is not None:
                points[end] = point
        if end != n:
            return
        if n % self.chunk == 0:
            points[n] = bytearray()  # its end is a restore point too: the state is that position's
        state = snapshot(cache, logits=_name(logits.dtype) if logits is not None else "")
        row = np.array(logits.astype(mx.float32)).reshape(-1) if logits is not None else np.empty(0, np.float32)
        kept: dict[int, bytearray | memoryview] = dict(points)
        tokens = np.asarray(prompt, dtype=np.int32)
        points.clear()
        if state is not None:
            self.tier.put(Entry(scope, tokens, state, bytearray(row.tobytes()), kept, tag=tag))
