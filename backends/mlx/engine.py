"""The MLX engine that runs inside the runner process (and in every rank of a distributed runner).

Owns the token loop instead of ``mlx_lm.stream_generate`` so that it can stop between any two tokens
(cancellation, stop strings), serve several requests at once and, over several ranks, feed every rank the same
tokens. ``batch.py`` holds the loop: one scheduler thread owns the model and a batched KV cache, admits new
requests between steps and advances every running one by a token per forward pass (``parallel`` at once; the
runner's server then calls ``generate`` from one thread per request, each reading its own picks). Rank 0 (the
head, which serves HTTP) schedules, samples and sends each batch operation to the followers (``follow``), which
run the same forward passes on their shard, so batching works across the ring too. ``lockstep.py`` holds the
wire between ranks (sums of small int32 arrays); ``sharding.py`` splits the model, by tensor (every layer over
all ranks) or by pipeline (each rank its own range of layers; only the head computes logits, followers pass
hidden states on).

Greedy when temperature is 0; otherwise mlx-lm's sampling filters and a random key of the request's own, seeded
with its seed (the same draws alone or in a batch). Response formats (JSON object, JSON schema) are enforced with
llguidance (``structured.py``: a matcher per sequence masks its logits row before the pick); tools and logprobs
answer ``UnsupportedFeature``. Every text delta carries the ids of the tokens it holds, so a stream whose replica
fails resumes on another (``Request.resume``: those ids are the new sequence's first picks, ``batch.py``).

A runner may keep prompts' KV in a tier (``kv_ram``, ``kv_dir``/``kv_disk``: ``runner.kvtier``, the llama.cpp
runners' own): ``generate`` looks the prompt up, the scheduler restores the hit and keeps cold prompts
(``kvcache``); restored tokens are the usage's ``cached_tokens``. A runner of one process also has the tier's
peers and ``/kv`` routes (it may fetch a longer entry from a peer, ``runner.kvpeers``). Over a ring every rank
keeps its own shard of each entry in a tier of its own, under a namespace that names the shard (``kv_namespace``:
an entry never loads into another shard or a runner of one process); the head decides what is kept and restored
and the followers do the same at the same step (``batch.Follower``), restoring only when every rank holds the
entry. A ring has no peers (another instance's followers would lack the head's entries). A model whose cache the
tier cannot keep has none.

Runs only in the runner process; imports protocols and mlx/mlx_lm, never the gateway.
"""

from __future__ import annotations

import hashlib
import json
import random
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec

from meshgate.backends.mlx import kvcache
from meshgate.backends.mlx.batch import CHUNK, Batch, Follower, Sampler, Scheduler, Sequence
from meshgate.backends.mlx.lockstep import Lockstep
from meshgate.backends.mlx.structured import Grammars
from meshgate.backends.runner.kvpeers import Peers
from meshgate.backends.runner.kvtier import KVTier
from meshgate.backends.runner.stops import StopMatcher
from meshgate.protocols.model import (
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
from meshgate.protocols.prefix import prefix_key, request_prefix

__all__ = ["MlxEngine", "kv_namespace"]

PUBLISHED = 256
"""Prefix keys of its KV tier's entries a runner's ``/health`` lists, most recently used first (for routing)."""

_DEFAULTS = {"temperature": 0.8, "top_p": 0.95, "top_k": 40, "min_p": 0.05}


def _value(sampling: Any, name: str) -> Any:
    value = getattr(sampling, name, UNSET)
    return _DEFAULTS[name] if value is UNSET or value is None else value


class Count(msgspec.Struct):
    """The ``/tokenize`` answer."""

    count: int


class MlxEngine:
    """One mlx-lm model, whole or sharded over a distributed group, generating for up to ``parallel`` requests
    at once (``generate`` may be called from that many threads)."""

    def __init__(
        self,
        path: str,
        *,
        group: Any = None,
        mode: str = "single",
        layers: tuple[int, int] | None = None,
        n_ctx: int = 4096,
        dtype: str | None = None,
        parallel: int = 1,
        kv_ram: int = 0,
        kv_dir: str | None = None,
        kv_disk: int = 0,
        digest: str = "",
    ) -> None:
        """Load ``path``; over a ``group`` of more than one rank, shard it by ``mode`` (``tensor`` or
        ``pipeline``; ``single`` runs the whole model on this rank alone, as does any mode without a group).

        ``layers``: this rank's ``[start, end)`` layer range in pipeline mode (the placement's; rank 0 starts at
        0, the ranges tile the model in rank order); ``None`` splits evenly. ``dtype``: compute in this float
        type (``float32`` on CPUs, which have no fast bfloat16: faster there, and tensor-parallel partial sums
        then match one process exactly); ``None`` keeps the checkpoint's. ``parallel``: the most requests
        decoded together (the head's; followers run whatever batch the head sends).

        ``kv_ram`` bytes of host memory and ``kv_disk`` bytes of ``kv_dir`` keep prompts' KV (``runner.kvtier``), on
        every rank alike (each its shard); ``digest`` names the weights for the tier's namespace (else the
        checkpoint's files' paths, sizes and mtimes).
        """
        import mlx.core as mx

        self._mx = mx
        started = time.perf_counter_ns()
        if group is None or group.size() < 2 or mode == "single":
            group, mode = None, "single"
        if mode not in ("single", "tensor", "pipeline"):
            raise ValueError(f"unknown sharding mode {mode!r}")
        self.model, self.tokenizer, self.layers = self._load(path, group, mode, layers, dtype)
        self.load_ns = time.perf_counter_ns() - started
        self.lockstep = Lockstep(group)
        self.path, self.mode, self.n_ctx = path, mode, n_ctx
        batch = Batch(self._forward, self._make_cache)
        self.parallel = max(1, parallel) if batch.can_batch else 1  # a cache mlx-lm cannot merge: one at a time
        self.tier: KVTier | None = None
        self.kv_peers: Peers | None = None
        wanted = kv_ram > 0 or bool(kv_dir and kv_disk > 0)
        if wanted and kvcache.supported(self._make_cache()):
            shard = None
            if self.lockstep.size > 1:  # this rank's part of the cache: another rank's or shape's is another cache
                shard = {"sharding": mode, "rank": self.rank, "ranks": self.lockstep.size, "layers": self.layers}
            namespace = kv_namespace(path, digest, dtype, shard)
            self.tier = KVTier(namespace, ram_budget=kv_ram, directory=kv_dir, disk_budget=kv_disk)
            if shard is None:
                self.kv_peers = Peers(self.tier, CHUNK)
        self.scheduler = Scheduler(batch, self.lockstep, self.parallel, tier=self.tier)
        self.grammars = Grammars(self.tokenizer)
        self._tokenizing = threading.Lock()  # a fast tokenizer may refuse two calls at once ("Already borrowed")
        self._first_request = True

    def _load(
        self, path: str, group: Any, mode: str, layers: tuple[int, int] | None, dtype: str | None
    ) -> tuple[Any, Any, Any]:
        """The model (lazily read, sharded, then only this rank's weights evaluated), its tokenizer and this
        rank's layer range (``None`` unless pipelined)."""
        mx = self._mx
        from mlx.utils import tree_flatten
        from mlx_lm.models.cache import make_prompt_cache
        from mlx_lm.utils import load_model, load_tokenizer

        from meshgate.backends.mlx import sharding

        model, config = load_model(Path(path), lazy=True)
        tokenizer = load_tokenizer(Path(path), eos_token_ids=config.get("eos_token_id"))
        self._forward, self._make_cache = sharding.last_logits(model), lambda: make_prompt_cache(model)
        if dtype is not None:  # still lazy: each weight is cast as it is read below; before sharding, which
            model.set_dtype(getattr(mx, dtype))  # sizes what travels between stages by the weights' type
        if mode == "tensor":
            sharding.shard_tensor(model, group)
        elif mode == "pipeline":
            n_layers = len(model.layers)
            layers = layers or sharding.even_split(n_layers, group.size(), group.rank())
            stage = sharding.shard_pipeline(model, group, *layers)
            self._forward, self._make_cache = stage, stage.make_cache
        for _, weight in tree_flatten(model.parameters()):  # one at a time: a tensor shard reads its whole
            mx.eval(weight)  # source tensor first, and the peak stays at one source tensor over the shard
        self.weight_bytes = sharding.parameter_bytes(model)
        mx.clear_cache()  # buffers freed while loading (the checkpoint's own dtype before a cast) go back now
        if group is not None:  # every rank loaded before any serves (a slow peer would time out a transfer)
            mx.eval(mx.distributed.all_sum(mx.array(1.0), group=group, stream=mx.cpu))
        return model, tokenizer, tuple(layers) if mode == "pipeline" and layers else None

    @property
    def rank(self) -> int:
        return self.lockstep.rank

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.path,
            "n_ctx": self.n_ctx,
            "family": self.model.model_type,
            "ranks": self.lockstep.size,
            "sharding": self.mode,
            "layers": list(self.layers) if self.layers else None,
            "batch": self.scheduler.stats(),
            **({"kv_tier": {**self.tier.stats(), "prefixes": self.tier.tags(PUBLISHED)}} if self.tier else {}),
        }

    def count_tokens(self, request: Request, cancel: threading.Event) -> Count:
        return Count(count=len(self.tokenize(request)))

    def tokenize(self, request: Request) -> list[int]:
        with self._tokenizing:
            return self._tokenize(request)

    def _tokenize(self, request: Request) -> list[int]:
        if request.raw_prompt is not None:
            return list(self.tokenizer.encode(request.raw_prompt))  # with BOS where the model wants one, as
            # llama.cpp reads raw prompts
        messages = []
        for m in request.messages:
            if any(not isinstance(p, TextPart) for p in m.parts):
                raise UnsupportedFeature("the MLX runner reads text parts only")
            text = "".join(p.text for p in m.parts if isinstance(p, TextPart))
            messages.append({"role": m.role, "content": text})
        ids = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=not request.prefill, continue_final_message=request.prefill
        )
        return list(ids["input_ids"] if isinstance(ids, dict) else ids)

    def generate(self, request: Request, cancel: threading.Event) -> Iterator[Event]:
        """The head's side (rank 0): the request joins the running batch; its picks come back one at a time."""
        if request.tools and request.tool_choice.mode != "none":
            raise UnsupportedFeature("the MLX runner does not call tools", param="tools")
        if request.logprobs:
            raise UnsupportedFeature("the MLX runner does not report logprobs")
        tokens = self.tokenize(request)
        if len(tokens) >= self.n_ctx:
            raise RequestTooLarge(
                f"the prompt has {len(tokens)} tokens but the context holds {self.n_ctx}; shorten the conversation"
            )
        if not tokens:
            raise InvalidRequest("the prompt is empty")
        room = self.n_ctx - len(tokens)
        limit = room if request.max_tokens is None else min(request.max_tokens, room)
        if limit < 1:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        constraint = self.grammars.constraint(request)
        load_ns, self._first_request = (self.load_ns if self._first_request else 0), False
        s = request.sampling
        seed = s.seed if isinstance(s.seed, int) else random.randrange(2**31)
        seed = (seed + len(request.resume)) % 2**31  # a resumed request draws afresh after what was sent
        temp = float(_value(s, "temperature"))
        yield Usage(prompt_tokens=len(tokens), load_ns=load_ns)

        stopper = StopMatcher(request.stop)
        detok = self.tokenizer.detokenizer
        eos = set(self.tokenizer.eos_token_ids)
        sampler = (
            None
            if temp <= 0
            else Sampler(temp, float(_value(s, "top_p")), float(_value(s, "min_p")), int(_value(s, "top_k")), seed)
        )
        seq = Sequence(tokens, limit, eos, sampler, cancel, constraint, forced=list(request.resume))
        if self.tier is not None:  # looked up here, on the request's thread: a disk entry is read off the loop
            seq.scope = request.cache_scope
            key = prefix_key(*request_prefix(request))
            seq.tag = key.hex() if key is not None else ""
            seq.restore = self.tier.find(request.cache_scope, tokens, usable=CHUNK)
            if self.kv_peers is not None:
                rate = self.scheduler.prompt_rate
                seq.restore, seq.note = self.kv_peers.improve(request.cache_scope, tokens, seq.restore, rate)
        started = first_token_at = time.perf_counter_ns()
        count, finish = 0, Finished(reason="length")
        picked: list[int] = []
        ids: list[int] = []  # picked since the last delta: the next delta carries them (a stream that moves to
        # another replica resumes from the ids its client was sent)
        self.scheduler.submit(seq)
        try:
            while (token := seq.next()) is not None:
                if count == 0:
                    first_token_at = time.perf_counter_ns()
                if cancel.is_set() or token in eos:
                    finish = Finished(reason="stop")
                    break
                count += 1
                picked.append(token)
                ids.append(token)
                detok.add_token(token)
                text, matched = stopper.feed(detok.last_segment)
                if text:
                    yield TextDelta(text=text, tokens=tuple(ids))
                    ids.clear()
                if matched is not None:
                    finish = Finished(reason="stop_sequence", stop_sequence=matched)
                    break
                if count >= limit:
                    break
        finally:  # every way out (end, stop, cancel, error, a closed generator) frees the row at the next step
            seq.close()
            self.last_tokens = picked  # the picks of the latest generation to end, for tests and debugging
        if cancel.is_set():
            return
        if finish.reason != "stop_sequence":
            detok.finalize()
            rest = stopper.feed(detok.last_segment)[0] + stopper.flush()
            if rest:
                yield TextDelta(text=rest, tokens=tuple(ids))
        ended = time.perf_counter_ns()
        yield Usage(
            prompt_tokens=len(tokens),
            completion_tokens=count,
            cached_tokens=seq.cached,  # restored from the KV tier, not prefilled
            cache_note=seq.note,
            load_ns=load_ns,
            prompt_ns=first_token_at - started,
            eval_ns=ended - first_token_at,
        )
        yield finish

    def follow(self) -> None:
        """A follower's life: run the head's batch operations (and KV tier decisions) in lockstep until the head
        says shut down."""
        follower = Follower(Batch(self._forward, self._make_cache), self.lockstep, self.tier)
        while (message := self.lockstep.receive())[0] != "shutdown":
            follower.run(*message)

    def shutdown(self) -> None:
        """Head only: stop the scheduler, tell followers to exit, then drain and barrier so no rank leaves a peer
        mid-transfer."""
        self.scheduler.close()


def kv_namespace(path: str, digest: str, dtype: str | None, shard: dict[str, Any] | None = None) -> str:
    """What makes two runners' KV comparable: the weights (their digest, else the checkpoint's files as they are
    now), mlx and mlx-lm, the compute dtype and the prefill chunks (``CHUNK``); over a ring, the ``shard`` a rank
    holds (sharding, rank, ranks, layer range: a runner of one process has none, so its namespace stays the
    same)."""
    import mlx.core as mx
    import mlx_lm

    if not digest:
        root = Path(path)
        files = sorted(root.glob("*.safetensors")) + [root / "config.json"] if root.is_dir() else [root]
        digest = ";".join(f"{p.resolve()}:{p.stat().st_size}:{p.stat().st_mtime_ns}" for p in files if p.exists())
    settings = {"weights": digest, "mlx": mx.__version__, "mlx_lm": mlx_lm.__version__, "dtype": dtype or ""}
    settings |= {"chunk": CHUNK, "runtime": "mlx"} | ({"shard": shard} if shard is not None else {})
    return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=16).hexdigest()
