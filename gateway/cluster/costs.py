"""The planner's cost model: seconds per decoded token and per prompt of a placement, from measured speeds.

Pure arithmetic over ``backends.placement`` records; no I/O. ``planner`` builds stages and links and asks this
module what they cost. Units: bytes, seconds, bytes/second, FLOP/s.

A node's speed for a backend (``speed``) is that backend's ``Calibration`` on the node, measured by the agent
with the runtime's own kernels (``Backend.calibrate``); a node without one falls back on ``Node.flops`` (a numpy
matmul): ``flops / (2 * PARAMS_PER_BYTE)`` weight bytes per second, nothing per step, ``flops`` for prompts.

Decode, one token of one request (batch size one): the stages run one after another, so

    time = step_seconds (the head's: graph, sampling, the runner's loop)
         + sum over stages of (matmul weight bytes + KV bytes read) / decode_bytes_per_s
         + links: each hop carries one hidden state (latency + bytes / bandwidth) and the last stage returns
           the token's logits (``vocab_size * LOGIT_BYTES``) to the head.

The KV read is what a typical request uses, not the context reserved: ``TYPICAL_PROMPT + TYPICAL_ANSWER / 2``
tokens (the middle of the answer), capped by the context. An untied embedding is a lookup and reads one row.

Prefill of one ``TYPICAL_PROMPT``-token prompt (capped by the context): every prompt token costs its layers'
matmuls, ``2 * params_per_byte * layer bytes`` FLOPs, plus attention over the tokens before it
(``4 * n_heads * head_dim`` FLOPs per position per layer), over ``prefill_flops``; once per prompt the output
layer scores the last token (at the decode rate), one step's overhead is paid, and each hop carries the prompt's
hidden states. ``prompt_tok_s`` = prompt tokens / that time.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

from meshgate.backends.placement import Link, ModelSpec, Node

__all__ = [
    "ACTIVATION_BYTES",
    "LOGIT_BYTES",
    "PARAMS_PER_BYTE",
    "TYPICAL_ANSWER",
    "TYPICAL_PROMPT",
    "Speed",
    "Stage",
    "decode_seconds",
    "kv_tokens",
    "pipeline_links",
    "prefill_seconds",
    "prompt_tokens",
    "speed",
]

PARAMS_PER_BYTE = 2.0
"""Parameters per weight byte where no calibration says (2 for ~4-bit quantized weights, 0.5 for fp16)."""
ACTIVATION_BYTES = 2
"""Bytes per hidden-state element sent between nodes (fp16)."""
LOGIT_BYTES = 4
"""Bytes per logit a last stage returns to the head (float32)."""
TYPICAL_PROMPT = 512
"""Prompt tokens of a typical request: the prompt ``prompt_tok_s`` is estimated for, and KV read in decode."""
TYPICAL_ANSWER = 128
"""Answer tokens of a typical request: decode reads, on average, the KV cache of the prompt and half of these."""


class Speed(NamedTuple):
    """One node's speed for one backend (see ``Calibration``)."""

    decode_bytes_per_s: float
    step_seconds: float
    prefill_flops: float
    params_per_byte: float


class Stage(NamedTuple):
    """What one node computes per token: ``matmul_bytes`` of weights read in a decode (its layers, the output
    layer where it lives), ``layers`` transformer blocks (their KV cache, their prompt matmuls), at ``speed``.
    ``share`` is the fraction of each block it computes (1 in a pipeline, 1/k for a tensor rank)."""

    speed: Speed
    matmul_bytes: float
    layers: int
    share: float = 1.0


def speed(node: Node, backend: str) -> Speed:
    """``node``'s measured speed for ``backend``, else the fallback from ``Node.flops``."""
    c = node.calibration.get(backend)
    if c is not None and c.decode_bytes_per_s > 0 and c.prefill_flops > 0:
        return Speed(c.decode_bytes_per_s, max(c.step_seconds, 0.0), c.prefill_flops, c.params_per_byte or 1.0)
    flops = max(node.flops, 1.0)
    return Speed(flops / (2 * PARAMS_PER_BYTE), 0.0, flops, PARAMS_PER_BYTE)


def kv_tokens(context: int) -> int:
    """KV cache tokens a typical request's decode reads, on average: its prompt and half its answer."""
    return max(0, min(context, TYPICAL_PROMPT + TYPICAL_ANSWER // 2))


def prompt_tokens(context: int) -> int:
    """Tokens of the prompt ``prompt_tok_s`` is estimated for."""
    return max(1, min(context - 1, TYPICAL_PROMPT))


def decode_seconds(spec: ModelSpec, stages: Sequence[Stage], context: int, link_cost: float) -> float:
    """Seconds per decoded token: the head's step, every stage's reads one after another, the links.

    Tensor ranks run at once: pass only the slowest rank's stage (``share`` = 1/k)."""
    if not stages:
        return 0.0
    kv = kv_tokens(context)
    total = stages[0].speed.step_seconds + link_cost
    for stage in stages:
        read = stage.matmul_bytes + spec.kv_bytes(kv, stage.layers) * stage.share
        total += read / stage.speed.decode_bytes_per_s
    return total


def prefill_seconds(spec: ModelSpec, stages: Sequence[Stage], context: int, link_cost: float) -> float:
    """Seconds to read a ``prompt_tokens(context)``-token prompt and score its last token (``link_cost``: what
    the hops cost for the whole prompt, ``pipeline_links(..., tokens=prompt)``)."""
    if not stages:
        return 0.0
    n = prompt_tokens(context)
    attention = 4 * spec.n_heads * spec.head_dim * n / 2  # FLOPs per token per layer, at the mean position
    total = stages[0].speed.step_seconds + link_cost
    for stage in stages:
        s = stage.speed
        matmuls = 2 * s.params_per_byte * stage.layers * spec.layer_bytes * stage.share
        total += n * (matmuls + stage.layers * attention * stage.share) / s.prefill_flops
    last = stages[-1]
    output = spec.output_bytes if not spec.tied_output else spec.embedding_bytes
    total += output * last.share / last.speed.decode_bytes_per_s  # the last token's logits
    return total


def pipeline_links(spec: ModelSpec, hops: Sequence[Link], back: Link | None, tokens: int = 1) -> float:
    """Seconds the links of a pipeline cost for ``tokens`` tokens at once: each hop carries their hidden states,
    and ``back`` (last stage to head; none for one stage) one row of logits."""
    cost = sum(h.latency + tokens * spec.hidden_size * ACTIVATION_BYTES / h.bandwidth for h in hops)
    if back is not None:
        cost += back.latency + spec.vocab_size * LOGIT_BYTES / back.bandwidth
    return cost
