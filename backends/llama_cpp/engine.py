"""The llama.cpp engine that runs inside the runner process: prompt, sampling, stop strings, events.

Requests run side by side: each ``generate`` call (one thread per request) or ``open_stream`` (the runner
server's event loop) renders and tokenizes its prompt, hands a ``batch.Job`` to the one ``Scheduler`` thread that
decodes every running sequence in one batch per step, and turns the tokens that come back into events
(``relay``): text, stop strings (``StopMatcher``; not for forced calls), tool calls (``tools.CallGate``,
grammar-forced for ``required`` or a named tool, whose prompt then ends in the start of the call:
``tools.call_prefix``) and per-token logprobs (``logprobs.py``, kept with their text past the stop matcher). When
the answer is complete (a stop string, a whole tool call) the job is told to stop and leaves its slot at the next
step. Grammars are checked against each sampled token as llama.cpp's server does (``sampling.py``).
llama-cpp-python's exceptions are mapped here, once.

Runs only in the runner process; imports protocols and llama_cpp, never the gateway.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import numpy as np

from meshgate.backends.llama_cpp.batch import CHUNK, MIN_REUSE, PAUSE_AGING, Job, Scheduler, decode_group
from meshgate.backends.llama_cpp.embed import Embedder
from meshgate.backends.llama_cpp.grammar import FORMAT_OPTIONS, JSON_OBJECT, Grammars
from meshgate.backends.llama_cpp.kvstate import ALIGN
from meshgate.backends.llama_cpp.logprobs import token_logprob
from meshgate.backends.llama_cpp.prompt import render_prompt
from meshgate.backends.llama_cpp.relay import Pushed, TokenEvents, thread_events
from meshgate.backends.llama_cpp.sampling import GrammarStuck, Sampler
from meshgate.backends.llama_cpp.tools import call_mode, call_prefix, forced_schema
from meshgate.backends.runner.kvpeers import Peers
from meshgate.backends.runner.kvtier import KVTier
from meshgate.backends.runner.stops import StopMatcher
from meshgate.protocols.model import (
    UNSET,
    Embeddings,
    EmbedRequest,
    Event,
    GatewayError,
    InvalidRequest,
    Request,
    RequestTooLarge,
    Usage,
)
from meshgate.protocols.prefix import prefix_key, request_prefix

__all__ = ["LlamaEngine", "StopMatcher"]  # StopMatcher re-exported from backends.runner.stops

_DEFAULTS = {
    "temperature": 0.8,
    "top_p": 0.95,
    "top_k": 40,
    "min_p": 0.05,
    "repeat_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
}


def _value(sampling: Any, name: str) -> Any:
    value = getattr(sampling, name)
    return _DEFAULTS[name] if value is UNSET or value is None else value


class Count(msgspec.Struct):
    """The ``/tokenize`` answer."""

    count: int


PUBLISHED = 256
"""Prefix keys of its KV tier's entries a runner's ``/health`` lists, most recently used first (for routing)."""

PARALLEL = 4
"""Sequences a runner decodes together unless told otherwise (``MESHGATE_PARALLEL``)."""

STREAM_INTERVAL = 0.05
"""Seconds a runner holds its streams' next tokens after it sent some, unless told otherwise
(``MESHGATE_LLAMA_STREAM_INTERVAL_MS``; ``pushed.Waker``): a first token and an end go out at once."""


class LlamaEngine:
    """One GGUF loaded with llama-cpp-python, generating for up to ``parallel`` requests at once."""

    def __init__(
        self,
        path: str,
        *,
        n_ctx: int = 4096,
        n_threads: int | None = None,
        shards: Sequence[tuple[str | None, int, int]] = (),
        repack: bool = False,
        parallel: int = PARALLEL,
        spares: int = 0,
        batch_aging: float = PAUSE_AGING,
        exact: bool = True,
        kv_ram: int = 0,
        kv_dir: str | None = None,
        kv_disk: int = 0,
        digest: str = "",
        stream_interval: float = STREAM_INTERVAL,
    ) -> None:
        """Load ``path``; with ``shards`` (``(endpoint or None for local, layer_start, layer_end)`` in pipeline
        order) the blocks are split over llama.cpp RPC workers. ``repack`` lets llama.cpp repack CPU weights
        (faster on some CPUs, but different numerics from a split run). Each of the ``parallel`` sequences holds
        up to ``n_ctx`` tokens, and ``spares`` more sequences hold batch-class requests paused for interactive ones
        (``batch.Scheduler``), ``batch_aging`` seconds at most each; ``exact`` decodes them so each row gets its
        single-sequence numbers: all in one call on ggml's reference matmuls (``cpu_kernels``) when the whole model
        is local and not repacked, else in groups of ``DECODE_GROUP`` while ggml's tiled K-quant kernel is on (see
        ``batch.decode_group``); ``False`` decodes all in one call with the kernels as they are (greedy text may
        then depend on the load).

        ``kv_ram`` bytes of host memory and ``kv_disk`` bytes of ``kv_dir`` keep prompts' KV (``runner.kvtier``);
        ``digest`` names the model's weights for the tiers' namespace (else the file's path, size and mtime). Not
        ``exact``, a prompt that goes on from an entry's whole prompt restores all of it and prefills the rest in
        other chunks than a cold evaluation (next turns restore more; greedy text may differ from cold).

        ``stream_interval``: seconds the runner's streams hold tokens after sending some (``pushed.Waker``)."""
        import llama_cpp

        from meshgate.backends.llama_cpp.gguf import read_metadata
        from meshgate.backends.llama_cpp.rpc import add_rpc_servers, split_kwargs, weight_repacking

        self._llama_cpp = llama_cpp
        started = time.perf_counter_ns()
        split: dict[str, Any] = {"n_gpu_layers": 0}
        remote = [endpoint for endpoint, _, _ in shards if endpoint is not None]
        if remote:
            meta = read_metadata(path)
            n_layers = int(meta.get(f"{meta.get('general.architecture', '')}.block_count", 0))
            split = split_kwargs(shards, n_layers, add_rpc_servers(remote))
        threads = n_threads or os.cpu_count() or 1
        group = decode_group(exact, max(1, parallel))
        with weight_repacking(repack):
            # The model, its tokenizer and metadata; its own context is a token one: the scheduler's decodes.
            self.llm = llama_cpp.Llama(
                model_path=path,
                n_ctx=64,
                n_batch=64,
                n_threads=threads,
                n_threads_batch=threads,
                verbose=False,
                **split,
            )
        self.n_ctx = n_ctx
        self.stream_interval = stream_interval  # read by the runner server's ``Waker``
        self.parallel = max(1, parallel) + max(0, spares)  # generations at once (the runner server's bound)
        self.exact = exact  # inexact: a tier entry's end also serves the prompts that go on from it
        self.tier = None
        self.kv_peers = None
        if kv_ram > 0 or (kv_dir and kv_disk > 0):
            namespace = kv_namespace(path, digest, shards, llama_cpp.__version__)
            self.tier = KVTier(namespace, ram_budget=kv_ram, directory=kv_dir, disk_budget=kv_disk)
            self.kv_peers = Peers(
                self.tier, ALIGN
            )  # restore points: multiples of 512 and tails, all multiples of ALIGN
        self.scheduler = Scheduler(
            self.llm._model.model,
            n_ctx=n_ctx,
            parallel=max(1, parallel),  # decode lanes; the spares hold paused batch jobs
            n_threads=threads,
            is_eog=self._is_eog,
            group=group,
            reference=exact and not remote and not repack,  # RPC workers' and repacked kernels are their own
            tier=self.tier,
            exact=exact,
            spares=spares,
            aging=batch_aging,
        )
        threading.Thread(target=self.scheduler.run, name="llama-scheduler", daemon=True).start()
        self.load_ns = time.perf_counter_ns() - started
        self.path = path
        meta = self.llm.metadata
        self.family = meta.get("general.architecture", "")
        self.chat_template = meta.get("tokenizer.chat_template")
        self._first_request = True
        self._embedder: Embedder | None = None
        vocab = self.llm._model.vocab
        self.grammars = Grammars(vocab)
        eot = llama_cpp.llama_vocab_eot(vocab)
        self._end_token = eot if eot >= 0 else llama_cpp.llama_vocab_eos(vocab)
        self._embed_lock = threading.Lock()
        self._pieces: dict[int, bytes] = {}  # each token's bytes once it has been seen (``_piece``)

    def health(self) -> dict[str, Any]:
        return {
            "status": "ok",
            "model": self.path,
            "n_ctx": self.n_ctx,
            "family": self.family,
            **self.scheduler.stats(),
            **({"kv_tier": {**self.tier.stats(), "prefixes": self.tier.tags(PUBLISHED)}} if self.tier else {}),
        }

    def embed(self, request: EmbedRequest, cancel: threading.Event) -> Embeddings:
        """Mean-pooled unit vectors from a second, embedding-mode context made on the first call (``embed.py``);
        one embedding request at a time, beside the generations."""
        with self._embed_lock:
            load_ns = 0
            if self._embedder is None:
                self._embedder = Embedder(self.llm, n_ctx=self.n_ctx, run=self.scheduler.call)
                load_ns = self._embedder.load_ns
            result = self._embedder.embed(request, cancel)
        return Embeddings(vectors=result.vectors, prompt_tokens=result.prompt_tokens, load_ns=load_ns)

    def _is_eog(self, token: int) -> bool:
        return bool(self._llama_cpp.llama_vocab_is_eog(self.llm._model.vocab, token))

    def count_tokens(self, request: Request, cancel: threading.Event) -> Count:
        """The runner's ``/tokenize``: the prompt's length in tokens."""
        return Count(count=len(self.tokenize(request)))

    def tokenize(self, request: Request) -> list[int]:
        bos = self.llm._model.token_get_text(self.llm.token_bos())
        eos = self.llm._model.token_get_text(self.llm.token_eos())
        prompt = render_prompt(request, self.family, self.chat_template, bos, eos)
        add_bos = not prompt.startswith(bos)
        tokens = self.llm.tokenize(prompt.encode(), add_bos=add_bos, special=request.raw_prompt is None)
        # a forced call's start, tokenized on its own as if the model had written it after its turn opened
        return tokens + self.llm.tokenize(call_prefix(request).encode(), add_bos=False, special=False)

    def generate(self, request: Request, cancel: threading.Event) -> Iterator[Event]:
        """The ``Engine`` protocol's generation, for a thread of its own (``relay.thread_events``)."""
        job, opening, load_ns = self._job(request, cancel)
        yield opening
        started = time.perf_counter_ns()
        self._submit(job)
        try:
            text = TokenEvents(self._piece, request)
            yield from thread_events(text, job, request, cancel, opening.prompt_tokens, load_ns, started)
        finally:
            job.done.set()

    def open_stream(self, request: Request, cancel: threading.Event, wake: Callable[[bool], None]) -> Pushed:
        """The same generation for the runner's event loop (``relay.Pushed``): set up here (on a thread: a KV tier
        entry may be read from disk or fetched from a peer), then submitted; the scheduler calls ``wake`` once a
        step when this job has tokens, and the loop polls them."""
        job, opening, load_ns = self._job(request, cancel)
        job.wake = wake
        stream = Pushed(TokenEvents(self._piece, request), job, request, opening, load_ns)
        self._submit(job)
        return stream

    def _piece(self, token: int) -> bytes:
        """``token``'s bytes, remembered: the same every time (one token, detokenized alone), and a dict lookup costs
        a tenth of llama.cpp's call through ctypes."""
        piece = self._pieces.get(token)
        if piece is None:
            piece = self._pieces[token] = self.llm.detokenize([token])
        return piece

    def _submit(self, job: Job) -> None:
        if job.limit < 1:  # the failed replica had reached max_tokens: only its events are left to send
            job.sampler.close()
            job.out.put(None)
            if job.wake is not None:
                job.wake(True)
        else:
            self.scheduler.submit(job)

    def _job(self, request: Request, cancel: threading.Event) -> tuple[Job, Usage, int]:
        """The request's ``Job`` (not submitted yet), its first event and its load time."""
        tokens = self.tokenize(request)
        resumed = list(request.resume)  # a failed replica's output: taken as this job's own (``Request.resume``)
        n_ctx = self.n_ctx
        if len(tokens) + len(resumed) >= n_ctx:
            raise RequestTooLarge(
                f"the prompt has {len(tokens)} tokens but the context holds {n_ctx}; shorten the conversation"
            )
        room = n_ctx - len(tokens) - len(resumed)
        limit = room if request.max_tokens is None else min(request.max_tokens - len(resumed), room)
        if limit < 1 and not resumed:
            raise InvalidRequest("max_tokens must be at least 1", param="max_tokens")
        load_ns, self._first_request = (self.load_ns if self._first_request else 0), False
        sampler = self._sampler(request)
        try:
            sampler.replay(resumed)  # the grammar and the penalties' history go on from the tokens already sent
        except GrammarStuck as exc:
            sampler.close()
            raise GatewayError(f"structured output failed: {exc}") from exc
        # Greedy text must go on as it would have: the tokens are decoded one step each, as they were generated
        # (``batch.Job.forced``); a sampled one is only a valid continuation, so its tokens are prefilled, faster.
        exact = _value(request.sampling, "temperature") == 0
        prompt, forced = (tokens, resumed) if exact else (tokens + resumed, [])
        job = Job(prompt=prompt, limit=max(limit, 0), sampler=sampler, cancel=cancel, forced=forced)
        job.batch = request.priority == "batch"  # paused for interactive jobs when every lane is taken
        if self.tier is not None:  # read here, on the request's thread: a disk entry is read off the decode loop
            job.scope = request.cache_scope
            key = prefix_key(*request_prefix(request))
            job.tag = key.hex() if key is not None else ""
            # exact: never an entry's end, whose restored sliding-window cells sit where later steps sum them in
            # another order (greedy text then drifts from cold's within a few hundred tokens); its ``tail`` point
            # is restored and the last chunk evaluated again, as cold evaluates it
            inexact = not self.exact
            scope = request.cache_scope
            job.restore = self.tier.find(scope, prompt, usable=MIN_REUSE, ends=inexact, whole=inexact)
            if self.kv_peers is not None:
                rate = self.scheduler.prompt_rate
                job.restore, job.note = self.kv_peers.improve(scope, prompt, job.restore, rate, whole=inexact)
        if request.logprobs:
            top_n, n_vocab = request.top_logprobs, self.llm.n_vocab()
            job.logprob = lambda row, token: token_logprob(
                self.llm, np.ctypeslib.as_array(row, shape=(n_vocab,)), token, top_n
            )
        return job, Usage(prompt_tokens=len(tokens), load_ns=load_ns), load_ns

    def _sampler(self, request: Request) -> Sampler:
        """The request's sampler. A resumed request's seed moves on by the tokens already sent: what follows is
        drawn afresh (a valid continuation, not the draw the failed replica would have made next)."""
        s = request.sampling
        seed = s.seed if isinstance(s.seed, int) else random.randrange(2**31)
        seed = (seed + len(request.resume)) % 2**31
        if _value(s, "repeat_penalty") <= 0:  # llama.cpp divides logits by it: inf, then NaN probabilities
            raise InvalidRequest("repeat_penalty must be greater than 0 (1 is no penalty)", param="repeat_penalty")
        return Sampler(
            self.llm.n_vocab(),
            temp=_value(s, "temperature"),
            top_k=_value(s, "top_k"),
            top_p=_value(s, "top_p"),
            min_p=_value(s, "min_p"),
            repeat_penalty=_value(s, "repeat_penalty"),
            presence_penalty=_value(s, "presence_penalty"),
            frequency_penalty=_value(s, "frequency_penalty"),
            seed=seed,
            grammar=self._grammar(request),
            end_token=self._end_token,
        )

    def _grammar(self, request: Request) -> Any:
        """A forced tool call's schema, else the response format's, as an llguidance matcher (compiled here, on the
        request's thread, or taken from the cache); ``None`` for free text."""
        fmt = request.response_format
        if call_mode(request) == "forced":
            return self.grammars.matcher(forced_schema(request), "the tools' parameter schemas", param="tools")
        if fmt.kind == "json_schema" and fmt.schema:
            return self.grammars.matcher(fmt.schema, "the response format's JSON schema", param="response_format")
        if fmt.kind != "text":
            return self.grammars.matcher(JSON_OBJECT, "json_object", options=FORMAT_OPTIONS)
        return None


def kv_namespace(path: str, digest: str, shards: Sequence[tuple[str | None, int, int]], version: str) -> str:
    """What makes two runners' KV comparable: the weights (their digest, else this file as it is now), the runtime,
    and the settings the numbers depend on (f16 KV, chunks of ``CHUNK``, no flash attention, full sliding window,
    one stream a sequence). A split over RPC workers is another namespace."""
    if not digest:
        stat = os.stat(path)
        digest = f"{os.path.realpath(path)}:{stat.st_size}:{stat.st_mtime_ns}"
    settings = {"weights": digest, "llama_cpp": version, "kv": "f16", "chunk": CHUNK, "tail": ALIGN}
    settings |= {"flash_attn": False}
    settings |= {"swa_full": True, "kv_unified": False, "layers": len(shards) > 1}
    return hashlib.blake2b(json.dumps(settings, sort_keys=True).encode(), digest_size=16).hexdigest()
