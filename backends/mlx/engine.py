"""The MLX engine that runs inside the runner process (and in every rank of a distributed runner).

Owns the token loop instead of ``mlx_lm.stream_generate`` so that it can stop between any two tokens
(cancellation, stop strings) and so that, over several ranks, every rank feeds the model the same token: rank 0
(the head, which serves HTTP) samples and broadcasts each token; followers (``follow``) run the same forward
passes on their shard. ``lockstep.py`` holds the wire between ranks (sums of small int32 arrays).

Greedy when temperature is 0; otherwise mlx-lm's sampler with the request's seed. Free text only for now: tools,
response formats and logprobs answer ``UnsupportedFeature``.

Runs only in the runner process; imports protocols and mlx/mlx_lm, never the gateway.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from backends.runner.stops import StopMatcher
from backends.mlx.lockstep import Lockstep
from protocols.model import (
    UNSET,
    Event,
    Finished,
    InvalidRequest,
    Request,
    RequestTooLarge,
    TextDelta,
    TextPart,
    UnsupportedFeature,
    Usage,
)

__all__ = ["MlxEngine"]

_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}


def _value(sampling: Any, name: str) -> Any:
    value = getattr(sampling, name, UNSET)
    return _DEFAULTS[name] if value is UNSET or value is None else value


class Count(msgspec.Struct):
    """The ``/tokenize`` answer."""

    count: int


class MlxEngine:
    """One mlx-lm model, whole or sharded over a distributed group, generating for one request at a time."""

    def __init__(self, path: str, *, group: Any = None, mode: str = "tensor", n_ctx: int = 4096) -> None:
        """Load ``path``; with a ``group`` of more than one rank, shard it (``mode``: ``tensor``)."""
        import mlx.core as mx
        from mlx_lm.utils import load, sharded_load

        self._mx = mx
        started = time.perf_counter_ns()
        if group is not None and group.size() > 1:
            if mode != "tensor":
                raise ValueError(f"unknown sharding mode {mode!r}")
            self.model, self.tokenizer = sharded_load(path, tensor_group=group)
        else:
            group = None
            self.model, self.tokenizer = load(path)
        self.load_ns = time.perf_counter_ns() - started
        self.lockstep = Lockstep(group)
        self.path, self.mode, self.n_ctx = path, mode if group is not None else "single", n_ctx
        self._first_request = True

    @property
    def rank(self) -> int:
        return self.lockstep.rank

    def health(self) -> dict[str, Any]:
        return {"status": "ok", "model": self.path, "n_ctx": self.n_ctx, "family": self.model.model_type,
                "ranks": self.lockstep.size, "sharding": self.mode}

    def count_tokens(self, request: Request, cancel: threading.Event) -> Count:
        return Count(count=len(self.tokenize(request)))

    def tokenize(self, request: Request) -> list[int]:
        if request.raw_prompt is not None:
            return list(self.tokenizer.encode(request.raw_prompt, add_special_tokens=False))
        messages = []
        for m in request.messages:
            if any(not isinstance(p, TextPart) for p in m.parts):
                raise UnsupportedFeature("the MLX runner reads text parts only")
            text = "".join(p.text for p in m.parts if isinstance(p, TextPart))
            messages.append({"role": m.role, "content": text})
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=not request.prefill,
                                                 continue_final_message=request.prefill)
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def generate(self, request: Request, cancel: threading.Event) -> Iterator[Event]:
        """The head's side (rank 0): every forward pass here is matched by one in ``follow`` on each follower."""
        if request.tools and request.tool_choice.mode != "none" or request.response_format.kind != "text":
            raise UnsupportedFeature("the MLX runner generates free text only (no tools, no response formats)")
        if request.logprobs:
            raise UnsupportedFeature("the MLX runner does not report logprobs")
        tokens = self.tokenize(request)
        if len(tokens) >= self.n_ctx:
            raise RequestTooLarge(f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx}; "
                                  "shorten the conversation")
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        room = self.n_ctx - len(tokens)
        limit = room if request.max_tokens is None else min(request.max_tokens, room)
        if limit < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        load_ns, self._first_request = (self.load_ns if self._first_request else 0), False
        s = request.sampling
        seed = s.seed if isinstance(s.seed, int) else random.randrange(2**31)
        temp = float(_value(s, "temperature"))
        yield Usage(prompt_tokens=len(tokens), load_ns=load_ns)

        self.lockstep.start(tokens)
        stopper = StopMatcher(request.stop)
        detok = self.tokenizer.detokenizer
        detok.reset()
        eos = set(self.tokenizer.eos_token_ids)
        sampler = self._sampler(temp, s, seed)
        started = first_token_at = time.perf_counter_ns()
        count, finish = 0, Finished(reason="length")
        self.last_tokens: list[int] = []  # the picks of the latest generation, for tests and debugging
        try:
            for token in self._steps(tokens, sampler):
                if count == 0:
                    first_token_at = time.perf_counter_ns()
                if cancel.is_set() or token in eos:
                    finish = Finished(reason="stop")
                    break
                count += 1
                self.last_tokens.append(token)
                detok.add_token(token)
                text, matched = stopper.feed(detok.last_segment)
                if text:
                    yield TextDelta(text=text)
                if matched is not None:
                    finish = Finished(reason="stop_sequence", stop_sequence=matched)
                    break
                if count >= limit:
                    break
                self.lockstep.step(token)  # followers feed the same token on
        finally:  # every way out (end, stop, cancel, error, a closed generator) releases the followers
            self.lockstep.stop()
        if cancel.is_set():
            return
        if finish.reason != "stop_sequence":
            detok.finalize()
            rest = stopper.feed(detok.last_segment)[0] + stopper.flush()
            if rest:
                yield TextDelta(text=rest)
        ended = time.perf_counter_ns()
        yield Usage(prompt_tokens=len(tokens), completion_tokens=count, load_ns=load_ns,
                    prompt_ns=first_token_at - started, eval_ns=ended - first_token_at)
        yield finish

    def follow(self) -> None:
        """A follower's life: run the head's generations in lockstep until the head says shut down."""
        while (tokens := self.lockstep.wait_start()) is not None:
            for _ in self._steps(tokens, lambda logits: self._mx.argmax(logits, axis=-1)):
                if (nxt := self.lockstep.wait_step()) is None:
                    break
                self._feed = nxt

    def shutdown(self) -> None:
        """Head only: tell followers to exit, then drain and barrier so no rank leaves a peer mid-transfer."""
        self.lockstep.shutdown()

    def _sampler(self, temp: float, s: Any, seed: int) -> Any:
        mx = self._mx
        if temp <= 0:
            return lambda logits: mx.argmax(logits, axis=-1)
        from mlx_lm.sample_utils import make_sampler

        mx.random.seed(seed)
        return make_sampler(temp=temp, top_p=float(_value(s, "top_p")), min_p=float(_value(s, "min_p")),
                            top_k=int(_value(s, "top_k")))

    def _steps(self, tokens: list[int], sampler: Any) -> Iterator[int]:
        """Prefill ``tokens``, then yield one token per forward pass; the caller's ``self._feed`` (a follower's
        copy of the head's pick), when set, replaces the local pick as the next input."""
        mx = self._mx
        from mlx_lm.models.cache import make_prompt_cache

        cache = make_prompt_cache(self.model)
        inputs = mx.array(tokens)[None]
        while True:
            logits = self.model(inputs, cache=cache)[:, -1, :]
            token = sampler(logits)
            mx.eval(token)
            self._feed = None
            pick = int(token.item())
            yield pick
            inputs = mx.array([[self._feed if self._feed is not None else pick]])
