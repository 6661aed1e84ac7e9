"""Tensor and pipeline sharding of mlx-lm decoder models: one mechanism of ours for every family listed here.

mlx-lm 0.32 shards llama by tensor (``Model.shard``) but not gemma3, and pipelines neither. Both families (and
mlx-lm's ``gemma3`` wrapper, whose ``language_model`` is a ``gemma3_text`` model) share one layout, which this
module walks instead of patching each family:

- a causal LM (``lm``) with ``lm.model`` (the decoder: ``embed_tokens``, ``layers``, ``norm``) and either
  ``lm.lm_head`` or a tied head (``embed_tokens.as_linear``);
- decoder layers called ``layer(h, mask, cache)``, each with ``self_attn`` (``q/k/v/o_proj``, ``n_heads``,
  ``n_kv_heads``) and ``mlp`` (``gate/up/down_proj``);
- a layer slides over a window when ``use_sliding`` (llama) or ``self_attn.is_sliding`` (gemma3) says so.

What differs per family is only how the decoder embeds (``_EMBED_SCALE``: gemma multiplies by sqrt(hidden),
rounded to bfloat16 as it does); a family not in that table is refused rather than silently mis-embedded.

``shard_tensor(model, group)``: q/k/v and gate/up split their outputs (all-to-sharded), o and down their
inputs (sharded-to-all); each rank keeps ``n_heads / ranks`` query heads. KV heads split evenly when they
divide by the ranks; otherwise (Gemma 3 270M has one) each rank keeps the one KV head its query heads read.

``shard_pipeline(model, group, start, end)`` returns a ``Stage``: this rank keeps layers ``[start, end)`` and
drops every other layer's weights before they are read (load with ``lazy=True``, then evaluate the parameters).
Rank 0, the head, starts at layer 0 and also keeps the embedding, the final norm and the head; per forward pass
it embeds, runs its layers and sends the hidden state to rank 1, ..., the last stage sends it back to rank 0,
which alone computes logits. Each stage builds its attention masks from its own layers' caches (the family's
own forward reads ``cache[0]`` and a global layer's cache, which a stage may not hold).

Runs only in MLX processes; imports mlx and mlx_lm, nothing of ours.
"""

from __future__ import annotations

import copy
from typing import Any

import mlx.core as mx
import mlx.nn as nn
from mlx.nn.layers.distributed import shard_linear
from mlx.utils import tree_flatten, tree_map
from mlx_lm.models.base import create_attention_mask
from mlx_lm.models.cache import make_prompt_cache

__all__ = ["Stage", "even_split", "parameter_bytes", "shard_pipeline", "shard_tensor"]

# how each family's decoder scales its embeddings (the dtype the family rounds the factor to), by lm module
_EMBED_SCALE: dict[str, Any] = {
    "mlx_lm.models.llama": None,
    "mlx_lm.models.gemma3_text": mx.bfloat16,
}


def _parts(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """The causal LM inside ``model`` (itself, or a multimodal wrapper's ``language_model``) and its decoder."""
    lm = model["language_model"] if "language_model" in model else model
    if type(lm).__module__ not in _EMBED_SCALE:
        raise ValueError(
            f"no sharding for mlx-lm family {type(lm).__module__.rsplit('.', 1)[-1]!r}; "
            f"known: {sorted(m.rsplit('.', 1)[-1] for m in _EMBED_SCALE)}"
        )
    return lm, lm.model


def parameter_bytes(model: nn.Module) -> int:
    """Bytes of the weights ``model`` holds (what a shard costs in memory, before caches)."""
    return sum(a.nbytes for _, a in tree_flatten(model.parameters()))


def even_split(n_layers: int, ranks: int, rank: int) -> tuple[int, int]:
    """Rank ``rank``'s layer range when ``n_layers`` split as evenly as they can, the low ranks taking extras."""
    base, extra = divmod(n_layers, ranks)
    start = rank * base + min(rank, extra)
    return start, start + base + (1 if rank < extra else 0)


# tensor sharding
def _kv_rows(proj: nn.Module, head: int, n_kv: int) -> nn.Module:
    """``proj`` cut down to the output rows of KV head ``head`` of ``n_kv`` (a plain or quantized linear)."""
    rows = proj.weight.shape[0] // n_kv
    proj.update(tree_map(lambda a: mx.contiguous(a[head * rows : (head + 1) * rows]), proj.parameters()))
    return proj


def shard_tensor(model: nn.Module, group: Any) -> nn.Module:
    """Split every decoder layer of ``model`` over ``group`` in place; returns ``model``."""
    n, rank = group.size(), group.rank()
    _, decoder = _parts(model)
    for layer in decoder.layers:
        attn, mlp = layer.self_attn, layer.mlp
        if attn.n_heads % n:
            raise ValueError(f"{attn.n_heads} query heads do not split over {n} tensor ranks")
        attn.q_proj = shard_linear(attn.q_proj, "all-to-sharded", group=group)
        if attn.n_kv_heads % n == 0:
            attn.k_proj = shard_linear(attn.k_proj, "all-to-sharded", group=group)
            attn.v_proj = shard_linear(attn.v_proj, "all-to-sharded", group=group)
            attn.n_kv_heads //= n
        elif n % attn.n_kv_heads == 0:  # fewer KV heads than ranks: this rank's query heads all read one
            head = rank * attn.n_kv_heads // n
            attn.k_proj = _kv_rows(attn.k_proj, head, attn.n_kv_heads)
            attn.v_proj = _kv_rows(attn.v_proj, head, attn.n_kv_heads)
            attn.n_kv_heads = 1
        else:
            raise ValueError(f"{attn.n_kv_heads} KV heads neither split over nor divide {n} tensor ranks")
        attn.o_proj = shard_linear(attn.o_proj, "sharded-to-all", group=group)
        attn.n_heads //= n
        if hasattr(attn, "repeats"):
            attn.repeats = attn.n_heads // attn.n_kv_heads
        mlp.gate_proj = shard_linear(mlp.gate_proj, "all-to-sharded", group=group)
        mlp.up_proj = shard_linear(mlp.up_proj, "all-to-sharded", group=group)
        mlp.down_proj = shard_linear(mlp.down_proj, "sharded-to-all", group=group)
    return model


# pipeline sharding
def _window(decoder: nn.Module, layer: nn.Module) -> int | None:
    """The sliding window ``layer`` attends over, ``None`` for a global layer."""
    if getattr(layer, "use_sliding", False):
        return decoder.sliding_window
    if getattr(layer.self_attn, "is_sliding", False):
        return decoder.window_size
    return None


class Stage:
    """One pipeline stage: ``stage(inputs, cache)`` runs this rank's part of a forward pass.

    Returns the logits on the head (rank 0) and ``None`` elsewhere. Every rank calls it once per forward pass
    with the same ``inputs`` shape (followers know the tokens from the lockstep; only the shape matters there).
    """

    def __init__(self, model: nn.Module, group: Any, start: int, end: int) -> None:
        self.model, self.group = model, group
        self.rank, self.size = group.rank(), group.size()
        self.lm, self.decoder = _parts(model)
        self.start, self.end = start, end
        n_layers = len(self.decoder.layers)
        self._check(n_layers)
        embed = self.decoder.embed_tokens
        self.dtype = getattr(embed, "scales", embed.weight).dtype  # the hidden state's dtype (quantized too)
        self.hidden = self.lm.args.hidden_size
        self._scale = _EMBED_SCALE[type(self.lm).__module__]
        self._empty_cache = make_prompt_cache(model)  # before layers go: a family's make_cache may read them
        self.windows = [_window(self.decoder, layer) for layer in self.decoder.layers]
        self.decoder.layers = [layer if start <= i < end else None for i, layer in enumerate(self.decoder.layers)]
        if self.rank != 0:
            self.decoder.pop("embed_tokens")
            self.decoder.pop("norm")
            if "lm_head" in self.lm:
                self.lm.pop("lm_head")

    def _check(self, n_layers: int) -> None:
        """Every rank's range, in rank order, must tile ``[0, n_layers)``; all ranks raise the same error."""
        ranges = mx.distributed.all_gather(
            mx.array([[self.start, self.end]], dtype=mx.int32), group=self.group, stream=mx.cpu
        ).tolist()
        ends = [0] + [e for _, e in ranges]
        if any(s != ends[r] or e <= s for r, (s, e) in enumerate(ranges)) or ends[-1] != n_layers:
            raise ValueError(
                f"pipeline ranges {[tuple(r) for r in ranges]} do not tile {n_layers} layers in rank order"
            )

    def make_cache(self) -> list[Any]:
        """A fresh cache for every layer index (only this stage's layers ever fill theirs)."""
        return [copy.deepcopy(c) if self.start <= i < self.end else None for i, c in enumerate(self._empty_cache)]

    def _embed(self, inputs: mx.array) -> mx.array:
        h = self.decoder.embed_tokens(inputs)
        if self._scale is not None:
            h = h * mx.array(self.hidden**0.5, self._scale).astype(h.dtype)
        return h

    def __call__(self, inputs: mx.array, cache: list[Any]) -> mx.array | None:
        group, rank, size = self.group, self.rank, self.size
        if rank == 0:
            h = self._embed(inputs)
        else:
            h = mx.distributed.recv((*inputs.shape, self.hidden), self.dtype, rank - 1, group=group)
        masks: dict[tuple[int | None, str], Any] = {}
        for i in range(self.start, self.end):
            window, c = self.windows[i], cache[i]
            key = (window, type(c).__name__)
            if key not in masks:
                masks[key] = create_attention_mask(h, c, window_size=window)
            h = self.decoder.layers[i](h, masks[key], c)
        if rank == size - 1:
            h = h[:, -1:, :]  # the head samples from the last position only: send just that back
        # send now: a lazy send left in the graph could be scheduled after the head's receive below
        mx.eval(mx.distributed.send(h, (rank + 1) % size, group=group))
        if rank != 0:
            return None
        h = self.decoder.norm(mx.distributed.recv((inputs.shape[0], 1, self.hidden), self.dtype, size - 1, group=group))
        return self.lm.lm_head(h) if "lm_head" in self.lm else self.decoder.embed_tokens.as_linear(h)


def last_logits(model: nn.Module) -> Any:
    """``model``'s forward pass with the output head applied to the last position only (a whole or tensor-sharded
    model; what generation needs: with Gemma's 262k-entry head, logits for every prompt position made prefill
    many times slower). Families we do not know keep their own full forward pass."""
    try:
        lm, decoder = _parts(model)
    except ValueError:
        return model

    def forward(inputs: mx.array, cache: list[Any]) -> mx.array:
        h = decoder(inputs, cache=cache)[:, -1:, :]
        return lm.lm_head(h) if "lm_head" in lm else decoder.embed_tokens.as_linear(h)

    return forward


def shard_pipeline(model: nn.Module, group: Any, start: int, end: int) -> Stage:
    """Keep layers ``[start, end)`` of ``model`` on this rank of ``group`` (rank 0 from layer 0); see ``Stage``."""
    return Stage(model, group, start, end)
