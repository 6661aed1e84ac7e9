"""Continuous batching on llama.cpp's low-level API: slots, one decode per step for every running sequence.

One thread (``Scheduler.run``) owns a llama.cpp context with ``parallel`` sequences and drives them in steps,
the way llama.cpp's own server drives its slots:

- A step is one decode of the last sampled token of every generating sequence (one token each, its logits
  asked for), then the next chunks of prompts still being prefilled, up to ``CHUNK`` prompt tokens a step. A
  long prompt is prefilled over several steps, so running streams keep decoding; a burst of short prompts is
  prefilled in one step, so none waits behind the others' decodes.
- Prompts are prefilled shortest remaining first (fewest prompt tokens left to evaluate; ties first come, first
  served): the order that gives the lowest mean time to first token (SRPT), so a short prompt never waits for a
  long one; a long prompt cannot starve, since what it has left only shrinks. Before this, the oldest prompt had
  the whole budget: a 2-token request behind a 28,891-token prompt waited 435 s. vLLM's chunked prefill lets short
  prompts jump the queue the same way (``max_long_partial_prefills``, a per-step cap on long prompts); llama.cpp's
  server fills its batch in slot order and has the problem this mends.
- A chunk at depth is slow (Gemma 3 270M on 2 idle cores: ~1 s at the start of a context, ~3.5 s at 8k
  tokens; 28,891 tokens took 438 s, 8 s a chunk on average), so a chunk in flight is preempted: when a job
  that would go first (a shorter prompt than what is left of the chunk's, with a free slot) is submitted, or
  the chunk's own job is cancelled, ggml's abort callback (checked between graph nodes, set only while a prompt
  chunk runs) stops the decode, llama.cpp drops the chunk's cells, and the chunk runs again later on the same
  cells, with the same numbers (checked bit for bit). A chunk is preempted for newcomers at most once
  (``PREEMPTIONS``), so a stream of short requests at most doubles a long prompt's prefill. Running streams
  still get one token per step: while a deep chunk runs, they wait for it.
- Prompts are cut where ``Llama.eval`` cuts them for one sequence (every ``CHUNK`` tokens from the end of the cached
  prefix; a prompt of ``SAVED`` tokens or more has its tokens past its last multiple of 256 cut off into a chunk of
  their own, ``kvstate.tail``, so its KV tier entry can be restored there) and each chunk is decoded on its own:
  llama.cpp's CPU kernels give a token slightly different numbers when the tokens beside it in a ubatch differ (seen on
  Gemma 3 270M: up to 1.1 in a logit), which flips near-ties in greedy output. Decode tokens batched together get
  exactly the numbers they get alone: all in one call, on ggml's reference matmuls while more than ``DECODE_GROUP``
  share it (``cpu_kernels``; ggml's tiled K-quant kernel would take them); where those cannot be had (RPC workers,
  repacked weights, a llama.cpp whose context hides its CPU backend) in groups of up to ``DECODE_GROUP``
  (``decode_group``). So a request's greedy text does not depend on load: with others it is what it is alone.
- A new job joins at the next step. It takes the free slot whose cached tokens share the longest prefix with
  its prompt (chats and agents resend the same history), keeps that prefix in the KV cache and evaluates only
  the rest; at least the last prompt token is evaluated again, for its logits. A prompt cut into other chunks
  than before can get slightly different numbers, so a prefix of fewer than ``MIN_REUSE`` tokens (a chat
  template's opening) is not reused: distinct short prompts always run from an empty sequence.
- Slots share prefixes. Where another slot, busy or not, holds at least ``MIN_REUSE`` tokens more of the
  prompt (an agent's second task beside its first, behind one long system prompt), the job takes the free slot
  used longest ago instead and that slot's KV stream is copied into it: ``llama_memory_seq_cp`` of the whole
  stream (across streams llama.cpp copies only whole ones; the cell layout comes along, the buffers are copied
  at the start of the next ``llama_decode``, before its batch is placed, in both of Gemma 3's iSWA caches), then
  ``llama_memory_seq_rm`` past the shared prefix. A copy of a 4,096-cell stream costs less than one token's
  decode at that depth (~15 ms against ~50 ms; 32 prompt tokens ~520 ms; ``benchmarks/prefix_copy.py``, 1
  thread), so any ``MIN_REUSE`` tokens more pay for it. A slot's tokens are what its KV cache
  holds: of a prompt being prefilled, only its chunks already decoded. So two prompts behind one preamble that
  is still being prefilled compute it once: before each of its chunks a prompt takes again, the same way, what
  another slot has computed of it since; shortest remaining first runs the one with less left (the one ahead),
  and the other, left waiting in its slot, copies the preamble when its turn comes and evaluates only its own
  tail. Waiting costs it nothing: with more left, it would run after the other one anyway. (Whether a
  newcomer stops a chunk in flight is still judged on its whole prompt, before it takes any prefix.)
- A job resumed from a failed replica (``Job.forced``: the tokens it had generated there) decodes those tokens
  after its prompt one step each, as they were generated, instead of as prompt chunks: they get the numbers they
  had, so its greedy text goes on as the undisturbed run's would. It samples once they are all in.
- A finished or cancelled job leaves its slot at once; the slot keeps its tokens for the next job's prefix.
- Classes (``Job.batch``, from ``Request.priority``). The context holds ``spares`` sequences beyond the
  ``parallel`` that run in a step (its decode lanes). Interactive jobs wait before batch ones and are prefilled
  before them; an interactive job's prompt stops a batch job's chunk in flight as a shorter prompt does. When an
  interactive job waits, a slot is free and every lane is taken while batch jobs hold some, the batch job admitted
  last is paused at the step boundary: it keeps its slot and its KV stream untouched, and steps skip it. Paused
  jobs resume, oldest first, as lanes free up with no interactive job waiting for them (waiting batch jobs come
  after them); one paused ``aging`` seconds (``PAUSE_AGING``) takes the next free lane before interactive jobs and
  is not paused again, so a steady interactive load never starves a batch job. Keeping the KV in its own
  sequence is what makes this exact: the job's next decode sees the cells it left, and decode rows do not depend
  on their neighbours (above), so its greedy text is byte for byte the undisturbed run's; restoring a saved
  state elsewhere would not be (the tier's ends, below). A paused job's client sees a longer gap between two
  tokens; cancelled, it leaves at the next step. ``stats`` counts pauses. A decode that holds batch jobs is
  stopped as a chunk is (the abort callback) when an interactive job that could be placed arrives during it, so a
  person's prompt never waits for a step that batch work shares (up to ~60 ms of 8 rows on 2 cores); the stopped
  rows decode again at the next step with the same numbers (``interrupted_steps``). One that holds interactive
  jobs too is not stopped twice in a row, so a running chat's next token waits for one stopped step at most.
- With a KV tier (``kvstate.Keeper``, ``runner.kvtier``), a job whose ``restore`` (a tier hit) holds more of its
  prompt than any slot restores it into the free slot used longest ago and prefills the rest from there: from a
  restore point (a multiple of ``CHUNK``, or where the kept prompt's last chunk started: multiples of 256, so the
  restored sliding-window cells sit where cold's numbers come out), in chunks that start and end at multiples of
  8, which gives every row cold's numbers (``kvstate.ALIGN``). An entry's end, restored, would start a prompt
  that is its whole prompt from the logits kept with it, but later decode steps then sum over sliding-window cells
  laid out elsewhere and greedy text drifts from cold's (probed: 2 of 4 concurrent 200-token answers differed),
  so only the inexact mode restores ends; the exact one restores the last restore point and evaluates the last
  chunk again (at most 256 tokens). A prompt evaluated as cold evaluates it (from nothing, from the tier or from
  a slot's exact reuse, never from a copy: ``Job.exact``) is kept in the tier as it ends.
- Exact slot reuse. In exact mode (the default) a prompt of ``SAVED`` tokens or more takes from a slot only what
  that slot computed as cold does (``_Slot.cold``: its last exact job's prompt, never what it decoded), cut back to
  a multiple of 8 and to where cold starts the prompt's last chunk (``Scheduler._reusable``): the same request
  sent twice, or a conversation's next turn, gets the text a cold evaluation gives, whatever its slot held
  (before, the last prompt token was evaluated alone and 2 of 4 repeated 1,300-token prompts answered
  otherwise). Shorter prompts reuse the whole shared prefix, as ``Llama`` does.
- Every job samples with its own native chain (``sampling.Sampler``) from its own row of the batch's logits;
  log probabilities are read from the same row before the next decode replaces them.

Each sequence has its own KV stream of ``n_ctx`` cells (``kv_unified`` off: the cells of one sequence are
laid out as a single-sequence context lays them out) with the full sliding window (``swa_full``, so a cached
prefix can be cut back anywhere) and no flash attention. A window-sized SWA cache (~2x faster at 8k tokens)
and flash attention prefill faster at depth but give other numbers (``benchmarks/prefill.py``, 8k tokens: the
last token's logits ~1 apart; with either one alone the next 16 greedy tokens differed), so greedy texts
would change: kept off. Every job is held to ``n_ctx`` tokens, so the cache never runs out. Tokens go to
each job's queue as ``(token, logprob or None)``; ``None`` ends the job's tokens (its reason in ``Job.end``).
Text, stop strings and tool calls are the engine's, on the request's own thread.

Runs only in the runner process; imports llama_cpp, numpy and ``sampling``.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import queue
import re
import threading
import time
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

import numpy as np

from meshgate.backends.llama_cpp.cpu_kernels import ReferenceKernels, cpu_backend
from meshgate.backends.llama_cpp.kvstate import ROWS, SAVED, Keeper, tail
from meshgate.backends.llama_cpp.sampling import GrammarStuck, Sampler
from meshgate.backends.runner.kvtier import Hit, KVTier

__all__ = ["DECODE_GROUP", "TILED_ENV", "Job", "Scheduler", "decode_group"]

T = TypeVar("T")

TILED_ENV = "GGML_CPU_TILED_MM"
"""ggml-cpu's switch for its tiled K-quant matmul (``ggml-cpu/tiled/tiled.cpp``, on unless ``0``), read once per
process at the first matmul. The kernel takes a Q2_K-Q6_K/IQ weight times a batch of ``>= 8`` token rows
(``ggml_tiled_min_batch``); fewer rows go through ``vec_dot``, which sums each row's blocks in another order.
So a token decoded beside 7 or more others got other numbers than alone (Gemma 3 270M Q4_K_M: the first to
differ is layer 0's Q4_K ``attn_output`` matmul, 5e-6, up to 1.2 in a logit; ``benchmarks/row_exactness.py``)."""

DECODE_GROUP = 7
"""Sequences decoded in one call at most while the tiled kernel is on and the reference matmuls cannot be had
(below its 8-row gate, every row gets the single-sequence numbers); balanced groups of up to 7."""


def decode_group(exact: bool, parallel: int) -> int:
    """How many sequences to decode in one call.

    ``exact`` with the tiled kernel on (ggml's default: ``TILED_ENV`` unset or not ``0``): balanced groups of up
    to ``DECODE_GROUP``, so every row gets its single-sequence numbers and prompts keep the kernel's numbers, so
    greedy texts are the ones each request gets alone (8 streams: ~0.7x llama.cpp's raw batched decode on
    a 2-core x86-64). The scheduler widens this to every sequence where it can run wide decodes on ggml's
    reference matmuls (``Scheduler(reference=True)``, ``cpu_kernels``). With ``GGML_CPU_TILED_MM=0`` in the
    environment of the runners and RPC workers, every row is bit-identical to the token decoded alone at any
    batch size, so all ``parallel`` sequences share one call (prompts ~10% slower); greedy texts are then those of
    the untiled prompt numbers, as exact but not the same as the default's. Not exact: one call, the kernels as
    they are (greedy text may depend on the load). ggml reads the switch once per process, at the first matmul.
    """
    if not exact:
        return parallel
    value = os.environ.get(TILED_ENV)
    match = re.match(r"\s*[+-]?\d+", value) if value is not None else None  # as ggml's atoi reads it
    tiled = value is None or (match is not None and int(match.group()) != 0)
    return min(parallel, DECODE_GROUP) if tiled else parallel


MIN_REUSE = 32
"""Cached prefixes shorter than this are evaluated again: the few tokens saved are not worth a prompt whose
numbers (and so its greedy text) depend on what the slot held before (see above)."""

CHUNK = 512
"""Prompt tokens per step (``Llama``'s ``n_batch``: the chunks ``Llama.eval`` feeds one sequence's prompt in)."""

PAUSE_AGING = 30.0
"""Seconds a paused batch job waits at most: then it takes the next free lane before waiting interactive jobs and
is not paused again (the gateway's admission ages waiting batch requests the same way: bulk work never starves)."""

PREEMPTIONS = 1
"""Times one prompt chunk may be stopped for a newcomer: each costs up to a chunk's work, done again."""


@dataclass(eq=False)
class Job:
    """One generation: the prompt's tokens, a token budget, a sampler; tokens come out of ``out``."""

    prompt: list[int]
    limit: int
    sampler: Sampler
    cancel: threading.Event
    logprob: Callable[[Any, int], Any] | None = None  # (pointer to the row's logits, token) -> entry
    out: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)
    end: str = "length"  # "length", "stop" (end of generation), "cancelled" or "failed"
    failure: Exception | None = None  # why it failed (``sampling.GrammarStuck``, a decode error, ...)
    fed: int = 0  # prompt tokens in the slot's KV cache
    cached: int = 0  # of those, taken from the slot's cache (prefix reuse)
    count: int = 0  # tokens sampled
    last: int = -1  # the sampled token not yet evaluated
    admitted: int = 0  # order of admission: prompts equally far from done are prefilled first come, first served
    preempted: int = 0  # times the chunk at ``fed`` was stopped for a newcomer
    done: threading.Event = field(default_factory=threading.Event)  # the engine needs no more tokens
    forced: list[int] = field(default_factory=list)  # taken as sampled after the prompt, one step each (a resume)
    restore: Hit | None = None  # a KV tier hit to start from, taken at admission when it saves more than a slot
    scope: str | None = None  # the tier scope its prompt's state is kept under (``None``: not kept)
    exact: bool = True  # its KV so far is what a cold evaluation computes (no slot's reuse or copy went into it)
    points: dict[int, bytearray] = field(default_factory=dict)  # restore points met in its prefill
    logits: np.ndarray | None = None  # a restored whole prompt's last logits: its first token is sampled from them
    note: str = ""  # where its restored KV came from, when a peer's was weighed (``Usage.cache_note``)
    tag: str = ""  # its prompt's prefix key (``protocols.prefix``): kept with its entry, for routing
    wake: Callable[[bool], None] | None = None  # its reader polls: called once a step it has tokens, with whether
    # they are its first or its end (not held back: ``pushed.Waker``; ``relay.Pushed``)
    batch: bool = False  # the batch class: paused for an interactive job when every decode lane is taken
    paused: bool = False  # kept in its slot (its KV with it) and skipped by the steps until a lane frees up
    paused_at: float = 0.0  # monotonic time of its last pause
    aged: bool = False  # resumed after waiting ``PAUSE_AGING``: not paused again

    def gone(self) -> bool:
        """The client went away or the engine has what it needs: the job leaves at the next step."""
        return self.cancel.is_set() or self.done.is_set()

    def left(self) -> int:
        """Prompt tokens still to evaluate."""
        return len(self.prompt) - self.fed


@dataclass(eq=False)
class _Slot:
    seq: int
    tokens: list[int] = field(default_factory=list)  # what the KV cache holds for this sequence, in order
    job: Job | None = None
    used: int = 0  # admission order of its last job: a copied prefix goes to the free slot used longest ago
    cold: int = 0  # its first tokens whose cells a cold evaluation would hold (its last exact job's prompt)


class Scheduler:
    """Runs jobs in ``parallel`` slots of one context; ``submit`` from any thread, ``run`` on its own."""

    def __init__(
        self,
        model: Any,
        *,
        n_ctx: int,
        parallel: int,
        n_threads: int,
        is_eog: Callable[[int], bool],
        group: int = DECODE_GROUP,
        reference: bool = False,
        fair: bool = True,
        tier: KVTier | None = None,
        exact: bool = True,
        spares: int = 0,
        aging: float = PAUSE_AGING,
    ) -> None:
        """``fair=False`` prefills oldest first and never stops a chunk (the policy before this one), to compare
        (``benchmarks/prefill.py``). ``exact``: a long prompt reuses a slot's cache only where that gives cold's
        numbers (``_reusable``). ``spares``: sequences beyond the ``parallel`` that decode each step, where batch
        jobs are paused for interactive ones (``Job.batch``), ``aging`` seconds at most each (``PAUSE_AGING``)."""
        import llama_cpp as lib

        self._lib = lib
        self.n_ctx = n_ctx
        self.parallel = parallel  # decode lanes: sequences that run in one step at most
        self.spares = spares = max(0, spares)
        self.aging = aging
        self.group = max(1, group)  # sequences decoded in one call at most
        self.n_batch = n_batch = CHUNK + parallel
        self.is_eog = is_eog
        params = lib.llama_context_default_params()
        params.n_ctx = n_ctx * (parallel + spares)
        params.n_batch = params.n_ubatch = n_batch
        params.n_seq_max = parallel + spares
        params.kv_unified = False
        params.swa_full = True
        params.n_threads = params.n_threads_batch = n_threads
        params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as ``Llama`` makes it: the same numerics
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not make a context of {n_ctx} x {parallel + spares} tokens")
        self.memory = lib.llama_get_memory(self.ctx)
        self._reference: ReferenceKernels | None = None  # decodes wider than DECODE_GROUP run on ggml's vec_dot
        if reference and self.group < parallel:
            backend = cpu_backend(self.ctx)
            if backend is not None:
                self._reference = ReferenceKernels(backend)
                self.group = parallel
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        self.batch = lib.llama_batch_init(n_batch, 0, 1)
        self.slots = [_Slot(seq) for seq in range(parallel + spares)]
        self.waiting: deque[Job] = deque()
        self.steps = 0  # decodes run; ``stats`` reports them with the widest batch seen
        self.widest = 0
        self.reused = 0  # prompt tokens taken from a slot's cache instead of evaluated
        self.copies = 0  # prefixes copied from another slot's KV stream
        self.preempted = 0  # prompt chunks stopped for a newcomer or a cancel, and evaluated again
        self.pauses = 0  # batch jobs paused for an interactive one
        self.interrupted = 0  # decodes holding batch jobs, stopped for an interactive newcomer and run again
        self._wake = threading.Condition()
        self._closed = False
        self._admitted = 0
        self.fair = fair
        self.exact = exact
        self._inflight: Job | None = None  # the job whose prompt chunk is being decoded (set under ``_wake``)
        self._preempt = False  # stop that chunk: a job that goes first is waiting, or the chunk's job is gone
        self._batch_step = False  # a decode holding batch jobs is in flight (stopped for an interactive newcomer)
        self._stopped = False  # the last decode holding interactive jobs was stopped (not stopped again at once)
        self._abort = lib.ggml_abort_callback(self._should_abort)  # kept alive with the scheduler
        self._no_abort = lib.ggml_abort_callback()
        self.keeper = Keeper(lib, self.ctx, model, tier, CHUNK) if tier is not None else None
        self.restored = 0  # prompt tokens restored from the KV tier instead of evaluated
        self.prompt_rate = 200.0  # prompt tokens/s on chunks, a moving average (peer fetches are weighed on it)
        self._calls: deque[tuple[Callable[..., Any], tuple[Any, ...], Future[Any]]] = deque()  # ``call``'s, in order
        self._woken: dict[Callable[[bool], None], bool] = {}  # readers to wake at the next ``_notify`` (``Job.wake``),
        # and whether one of theirs got its first token or ended

    def submit(self, job: Job) -> None:
        with self._wake:
            if job.batch:
                self.waiting.append(job)
            else:  # interactive jobs wait before batch ones, in their own order
                self.waiting.insert(next((i for i, w in enumerate(self.waiting) if w.batch), len(self.waiting)), job)
            self._wake.notify()
            if (self._inflight is not None and self._jumps(job, self._inflight)) or (
                self._batch_step and self._interrupts(job)
            ):
                self._preempt = True

    def _interrupts(self, job: Job) -> bool:
        """Whether waiting ``job`` stops a decode that holds batch jobs (with the lock held): it is interactive and
        ``_admit`` would place it now (a slot is free, and a lane or a batch job to pause)."""
        return not job.batch and any(slot.job is None for slot in self.slots) and self._room()

    def _jumps(self, job: Job, inflight: Job) -> bool:
        """Whether waiting ``job`` stops ``inflight``'s chunk (with the lock held): it would be prefilled first
        (fewer tokens than ``inflight`` has left, or interactive against a batch job's chunk), ``_admit`` would place
        it now (a slot is free, and a lane, or a batch job to pause for an interactive one), and the chunk was not
        stopped already. (With spares a slot can be free while every lane is taken: a batch job waiting then must
        not stop a chunk it cannot take the place of.)"""
        free = sum(slot.job is None for slot in self.slots)
        ahead = self.waiting.index(job)
        first = len(job.prompt) < inflight.left() or (inflight.batch and not job.batch)
        if not (self.fair and first and ahead < free and inflight.preempted < PREEMPTIONS):
            return False
        if job.batch:  # after every paused job (``_admit``)
            return self._lanes() > 0 and not any(slot.job is not None and slot.job.paused for slot in self.slots)
        return self._room()

    def _room(self) -> bool:
        """Whether an interactive job placed now gets a lane: one is free, or a batch job can be paused for it."""
        return self._lanes() > 0 or bool(self._pausable())

    def _lanes(self) -> int:
        """Decode lanes free: ``parallel`` less the jobs in slots that are not paused."""
        return self.parallel - sum(slot.job is not None and not slot.job.paused for slot in self.slots)

    def _pausable(self) -> list[Job]:
        """Running batch jobs that may be paused for an interactive one (not those resumed by aging)."""
        jobs = [slot.job for slot in self.slots if slot.job is not None]
        return [job for job in jobs if job.batch and not job.paused and not job.aged]

    def _should_abort(self, _data: Any) -> bool:
        """ggml's abort callback, called on the decoding thread between graph nodes of a prompt chunk or of a decode
        that holds batch jobs."""
        job = self._inflight
        return self._preempt or (job is not None and job.gone())

    def stats(self) -> dict[str, int]:
        active = sum(slot.job is not None for slot in self.slots)
        return {
            "slots": self.parallel,
            "spare_sequences": self.spares,
            "active_sequences": active,
            "paused_sequences": sum(slot.job is not None and slot.job.paused for slot in self.slots),
            "paused_batch_jobs": self.pauses,
            "waiting": len(self.waiting),
            "steps": self.steps,
            "widest_batch": self.widest,
            "decode_group": self.group,
            "reused_tokens": self.reused,
            "copied_prefixes": self.copies,
            "preempted_chunks": self.preempted,
            "interrupted_steps": self.interrupted,
            "restored_tokens": self.restored,
        }

    def call(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(*args)`` run on the decoding thread between two steps: what it returns, or what it raises. Every other
        ggml compute of the runner (an embedding's decodes) goes through here. llama.cpp's CPU backend is an OpenMP
        build, where each thread that runs a graph gets a thread team of its own; once libgomp manages more threads
        than the machine has CPUs, it cuts every team's barrier spin to 100 turns before a futex sleep, and ggml
        passes such a barrier between every two nodes of a graph. Embeddings run on the server's pool threads made
        their teams, and every decode after them cost ~40% more on 2 cores (63.5 -> 37-42 tokens/s)."""
        done: Future[T] = Future()
        with self._wake:
            if self._closed:
                raise RuntimeError("the scheduler is closed")
            self._calls.append((fn, args, done))
            self._wake.notify()
        return done.result()

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()

    def run(self) -> None:
        """The decode loop; returns after ``close``."""
        while True:
            with self._wake:
                while not (self._closed or self.waiting or self._calls or any(s.job for s in self.slots)):
                    self._wake.wait()
                calls, self._calls = self._calls, deque()
                if self._closed:
                    for _, _, done in calls:
                        done.set_exception(RuntimeError("the scheduler is closed"))
                    return
                self._admit()
            for fn, args, done in calls:
                try:
                    done.set_result(fn(*args))
                except BaseException as exc:  # the caller's to raise, on its own thread
                    done.set_exception(exc)
            self._step()
            self._notify()

    def _admit(self) -> None:
        """Move waiting jobs into free slots, at most ``parallel`` running (called with the lock held): interactive
        jobs first, pausing the newest running batch job when every lane is taken; then paused batch jobs, oldest
        first; then waiting batch jobs."""
        self._preempt = False
        for job in [job for job in self.waiting if job.gone()]:
            self.waiting.remove(job)
            self._end(job, "cancelled")
        for slot in self.slots:
            if slot.job is not None and slot.job.paused and slot.job.gone():
                self._release(slot, "cancelled")
        overdue = time.monotonic() - self.aging
        while True:
            free = any(slot.job is None for slot in self.slots)
            lanes = self._lanes()
            head = self.waiting[0] if self.waiting else None
            paused = [slot.job for slot in self.slots if slot.job is not None and slot.job.paused]
            aged = [job for job in paused if job.paused_at <= overdue]
            if aged and lanes > 0:  # waited long enough: before interactive jobs, and not paused again
                job = min(aged, key=lambda j: j.admitted)
                job.paused, job.aged = False, True
                continue
            if head is not None and not head.batch and free and (lanes > 0 or self._pause()):
                self._place(self.waiting.popleft())
                continue
            if lanes <= 0:
                return
            if paused:  # its KV never left its sequence: it goes on at its next step as if never stopped
                min(paused, key=lambda j: j.admitted).paused = False
                continue
            if head is None or not head.batch or not free:
                return
            self._place(self.waiting.popleft())

    def _pause(self) -> bool:
        """Pause the running batch job admitted last (it has the least done), if any: it keeps its slot."""
        running = self._pausable()
        if not running:
            return False
        job = max(running, key=lambda j: j.admitted)
        job.paused, job.paused_at = True, time.monotonic()
        self.pauses += 1
        return True

    def _place(self, job: Job) -> None:
        """Give ``job`` the free slot that saves it the most (with the lock held; a slot is free)."""
        free = [slot for slot in self.slots if slot.job is None]
        slot = max(free, key=lambda s: _common(s.tokens, job.prompt))
        keep, cold = self._reusable(slot, job.prompt)
        holder = self._holder(job.prompt, keep, slot)
        hit, job.restore = job.restore, None
        if hit is not None and hit.length > (_usable(holder.tokens, job.prompt) if holder else keep):
            slot = min(free, key=lambda s: s.used)  # the tier holds more than any slot: restore it there
            assert self.keeper is not None
            keep, job.logits = self.keeper.restore(slot.seq, hit, len(job.prompt))
            slot.tokens = job.prompt[:keep]
            slot.cold = keep if keep < len(hit.entry.tokens) else 0  # a restore point: cold's numbers on
            self.restored += keep
        elif holder is not None:  # another slot holds more of the prompt: copy it over the least recently used
            slot = min(free, key=lambda s: s.used)
            keep = self._copy(holder, slot, _usable(holder.tokens, job.prompt))
            job.exact = False
            slot.cold = 0
        elif keep == 0 or not self._lib.llama_memory_seq_rm(self.memory, slot.seq, keep, -1):
            self._lib.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
            keep = slot.cold = 0
        else:
            job.exact = cold  # else the slot's tokens may hold what other chunks (or decodes) computed
            slot.cold = keep if cold else 0
        del slot.tokens[keep:]
        job.fed = job.cached = keep
        self.reused += keep
        self._admitted += 1
        job.admitted = slot.used = self._admitted
        slot.job = job

    def _reusable(self, slot: _Slot, prompt: list[int]) -> tuple[int, bool]:
        """How much of ``prompt`` ``slot``'s cache saves, and whether the rest evaluated from there gets cold's
        numbers. In exact mode a prompt of ``SAVED`` tokens or more keeps only what the slot computed as cold does
        (``cold``), cut back to a multiple of ``ROWS`` and to no later than where cold starts its last chunk
        (``tail``): the rest is then evaluated in chunks that give every row cold's numbers, and the last token its
        cold logits (so greedy text does not depend on what a slot held). Otherwise (shorter prompts, a slot whose
        cache came from a copy, inexact mode) the whole shared prefix, as ``Llama`` reuses it."""
        keep = _usable(slot.tokens, prompt)
        if self.exact and len(prompt) >= SAVED and keep:
            cold = min(keep, slot.cold, tail(len(prompt))) // ROWS * ROWS
            if cold >= MIN_REUSE:
                return cold, True
        return keep, False

    def _holder(self, prompt: list[int], have: int, own: _Slot) -> _Slot | None:
        """The other slot, busy or not, that holds the longest prefix of ``prompt``, if that is ``MIN_REUSE`` tokens
        or more longer than the ``have`` tokens its ``own`` slot gives it (a copy is worth that much)."""
        best = max((s for s in self.slots if s is not own), key=lambda s: _common(s.tokens, prompt), default=None)
        return best if best is not None and _usable(best.tokens, prompt) >= have + MIN_REUSE else None

    def _copy(self, source: _Slot, slot: _Slot, keep: int) -> int:
        """Make ``slot``'s KV stream a copy of ``source``'s, cut back to its first ``keep`` tokens; returns how many
        it keeps (0 if the cut failed). llama.cpp records the copy now and copies the buffers at the start of the
        next ``llama_decode``, before it writes any cell, so ``source`` may change after this call."""
        self._lib.llama_memory_seq_cp(self.memory, source.seq, slot.seq, -1, -1)  # whole streams only
        self.copies += 1
        slot.tokens = source.tokens[:keep]
        if not self._lib.llama_memory_seq_rm(self.memory, slot.seq, keep, -1):
            self._lib.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
            slot.tokens = []
            return 0
        return keep

    def _step(self) -> None:
        """One decode of every generating sequence, then prompt chunks, shortest remaining prompt first; while batch
        jobs generate, interactive prompts go before their decode (a person's first token does not wait for it)."""
        for slot in self.slots:  # a restored whole prompt: its first token from the logits kept with it
            if slot.job is not None and slot.job.logits is not None and not slot.job.gone() and not slot.job.paused:
                self._sample(slot, 0, slot.job.logits)
                if slot.job is not None:
                    slot.job.logits = None
        generating = []
        for slot in self.slots:
            job = slot.job
            if job is None:
                continue
            if job.gone():
                self._release(slot, "cancelled")
            elif job.paused:  # a batch job paused for an interactive one: its KV waits in its sequence
                continue
            elif job.fed == len(job.prompt):  # generating: feed the token sampled last
                generating.append(slot)
        budget = CHUNK
        holds_batch = any(slot.job.batch for slot in generating if slot.job is not None)
        if holds_batch:
            budget = self._prompts(budget, interactive=True)
        interactive = any(slot.job is not None and not slot.job.batch for slot in generating)
        # a decode that holds batch rows is stopped for an interactive newcomer; one that holds interactive rows too,
        # not twice in a row (the running chats' next tokens wait for at most one stopped step each time)
        stoppable = holds_batch and not (interactive and self._stopped)
        groups = -(-len(generating) // self.group)
        for g in range(groups):  # balanced, each of consecutive sequence ids (llama.cpp splits a ubatch at gaps)
            group = generating[len(generating) * g // groups : len(generating) * (g + 1) // groups]
            n = 0
            for slot in group:
                assert slot.job is not None
                n = self._add(n, slot, slot.job.last, True)
            wide = self._reference if self._reference is not None and n > DECODE_GROUP else contextlib.nullcontext()
            with wide:  # ggml's tiled kernel would give these rows other numbers than alone
                decoded = self._decode(n, group, stoppable=stoppable)
            if decoded is None:  # stopped for an interactive newcomer: these rows decode again at the next step
                for slot in group:
                    slot.tokens.pop()
                self._stopped = interactive
                self._notify()
                return
            self._stopped = False
            if decoded:
                for row, slot in enumerate(group):
                    self._sample(slot, row)
        self._notify()  # the decoded tokens go out now, not after this step's prompt chunks
        self._prompts(budget)

    def _prompts(self, budget: int, *, interactive: bool = False) -> int:
        """Prompt chunks, in ``_order``, up to ``budget`` tokens (only interactive jobs' with ``interactive``);
        what is left of the budget (0 when one was stopped for a newcomer)."""
        prompts = [s for s in self.slots if s.job and s.job.left() and not s.job.gone() and not s.job.paused]
        for slot in sorted(prompts, key=self._order):
            if budget <= 0:
                break
            if interactive and slot.job is not None and slot.job.batch:
                continue
            n = self._prefill(slot)
            self._notify()
            if n == 0:  # stopped: admit the newcomer first
                return 0
            budget -= n
        return budget

    def _notify(self) -> None:
        """Wake the readers of the jobs that got tokens (or ended) since the last call: once each, however many of
        their streams did (a runner's event loop reads every stream it serves on one wake)."""
        woken, self._woken = self._woken, {}
        for wake, now in woken.items():
            wake(now)

    def _order(self, slot: _Slot) -> tuple[bool, int, int]:
        job = slot.job
        assert job is not None
        return (job.batch and self.fair), (job.left() if self.fair else 0), job.admitted

    def _prefill(self, slot: _Slot) -> int:
        """Decode the next chunk of ``slot``'s prompt on its own; sample after its last token. Returns its size, or 0
        when it was stopped before it began or while it ran (``_should_abort``): nothing of it is kept."""
        job = slot.job
        assert job is not None
        holder = self._holder(job.prompt, job.fed, slot)
        if holder is not None:  # another slot has computed more of this prompt since: take it instead
            keep = self._copy(holder, slot, _usable(holder.tokens, job.prompt))
            taken = keep - job.fed if keep else 0  # 0 kept: the cut failed and the slot was emptied
            job.fed, job.cached = keep, job.cached + taken if keep else 0
            self.reused += taken
            job.exact = False
        start = job.fed
        end = min(len(job.prompt), start + CHUNK - (start - job.cached) % CHUNK)
        if end == len(job.prompt) and len(job.prompt) >= SAVED and start < tail(end):
            end = tail(end)  # a long prompt's last rows in a chunk of their own: the tier restores up to them
        with self._wake:
            if any(self._jumps(waiting, job) for waiting in self.waiting):  # came in since ``_admit``
                job.preempted += 1  # stopped before it began: not stopped again (``_admit`` places the newcomer)
                return 0
            self._inflight, self._preempt = job, False
        n = 0
        for pos in range(start, end):
            n = self._add(n, slot, job.prompt[pos], pos == len(job.prompt) - 1)
        self._lib.llama_set_abort_callback(self.ctx, self._abort, None)
        started = time.perf_counter()
        try:
            self.batch.n_tokens = n
            code = self._lib.llama_decode(self.ctx, self.batch)
        finally:
            self._lib.llama_set_abort_callback(self.ctx, self._no_abort, None)
            with self._wake:
                self._inflight = None
                stopped = self._preempt and not job.gone()
        self.steps += 1
        self.widest = max(self.widest, 1)
        if code == 2:  # aborted: llama.cpp removed the chunk's cells; it runs again from ``start``
            del slot.tokens[start:]
            self.preempted += 1
            if stopped:  # for a newcomer (not a cancel): this chunk is not stopped again
                job.preempted += 1
            return 0
        if code != 0:
            self._fail_batch(code)
            return n
        job.fed, job.preempted = end, 0
        self.prompt_rate = 0.8 * self.prompt_rate + 0.2 * n / max(time.perf_counter() - started, 1e-6)
        if self.keeper is not None and job.scope is not None and job.exact:  # its KV is cold's: the tier's
            logits = self._lib.llama_get_logits_ith(self.ctx, n - 1) if end == len(job.prompt) else None
            self.keeper.passed(slot.seq, job.prompt, end, job.points, job.scope, job.tag, logits)
        if end == len(job.prompt):
            slot.cold = end if job.exact else 0
            self._sample(slot, n - 1)
        return n

    def _decode(self, n: int, slots: list[_Slot], *, stoppable: bool = False) -> bool | None:
        """Evaluate the batch's first ``n`` tokens (of ``slots``); on failure every job fails and ``False`` is
        returned. ``stoppable`` (it holds batch jobs): an interactive job that ``_admit`` would place, waiting now or
        submitted while it runs, stops it (``None``): llama.cpp drops the step's cells, as a stopped chunk's, and
        the rows decode again with the same numbers (decode rows do not depend on their neighbours), so a person's
        prompt waits for no step that batch work shares."""
        if stoppable:
            with self._wake:
                self._preempt = any(self._interrupts(job) for job in self.waiting)
                if self._preempt:
                    self.interrupted += 1
                    return None
                self._batch_step = True
            self._lib.llama_set_abort_callback(self.ctx, self._abort, None)
        self.batch.n_tokens = n
        try:
            code = self._lib.llama_decode(self.ctx, self.batch)
        finally:
            if stoppable:
                self._lib.llama_set_abort_callback(self.ctx, self._no_abort, None)
                with self._wake:
                    self._batch_step = False
        self.steps += 1
        self.widest = max(self.widest, len(slots))
        if code == 2 and stoppable:
            self.interrupted += 1
            return None
        if code != 0:
            self._fail_batch(code)
            return False
        return True

    def _add(self, n: int, slot: _Slot, token: int, logits: bool) -> int:
        batch = self.batch
        batch.token[n] = token
        batch.pos[n] = len(slot.tokens)
        batch.n_seq_id[n] = 1
        batch.seq_id[n][0] = slot.seq
        batch.logits[n] = logits
        slot.tokens.append(token)
        return n + 1

    def _sample(self, slot: _Slot, row: int, saved: np.ndarray | None = None) -> None:
        """Sample ``slot``'s next token from batch row ``row``'s logits (or the ``saved`` ones)."""
        job = slot.job
        assert job is not None
        if job.gone():
            self._release(slot, "cancelled")
            return
        if job.forced:  # a resumed job's tokens from the replica before: decoded one step each, not sent again
            job.last = job.forced.pop(0)
            return
        try:
            token = job.sampler.sample(self.ctx, row, saved)
        except Exception as exc:  # a grammar that cannot continue, a sampler failure: this job only
            failure = exc if isinstance(exc, GrammarStuck) else RuntimeError(f"sampling failed: {exc}")
            self._release(slot, "failed", failure=failure)
            return
        if self.is_eog(token):
            self._release(slot, "stop")
            return
        entry = None
        if job.logprob is not None:
            row_logits = self._lib.llama_get_logits_ith(self.ctx, row) if saved is None else _pointer(saved)
            entry = job.logprob(row_logits, token)
        job.count += 1
        job.last = token
        job.out.put((token, entry))
        if job.wake is not None:
            self._woken[job.wake] = self._woken.get(job.wake, False) or job.count == 1
        if job.count >= job.limit:
            self._release(slot, "length")

    def _release(self, slot: _Slot, end: str, *, failure: Exception | None = None) -> None:
        job, slot.job = slot.job, None
        if job is not None:
            self._end(job, end, failure=failure)

    def _end(self, job: Job, end: str, *, failure: Exception | None = None) -> None:
        job.end, job.failure = end, failure
        job.sampler.close()
        job.out.put(None)
        if job.wake is not None:
            self._woken[job.wake] = True

    def _fail_batch(self, code: int) -> None:
        """A decode failed: the state of its sequences is unknown, so they are emptied and their jobs fail."""
        why = {1: "no room left in the KV cache", 2: "the decode was aborted"}.get(code, f"llama_decode error {code}")
        for slot in self.slots:
            if slot.job is not None:
                self._lib.llama_memory_seq_rm(self.memory, slot.seq, -1, -1)
                slot.tokens.clear()
                self._release(slot, "failed", failure=RuntimeError(f"the model failed to evaluate the batch: {why}"))

    def free(self) -> None:
        """Free the context (after ``run`` has returned)."""
        self._lib.llama_batch_free(self.batch)
        self._lib.llama_free(self.ctx)


def _usable(tokens: list[int], prompt: list[int]) -> int:
    """How much of ``prompt`` a KV cache holding ``tokens`` saves: the shared prefix, less the last prompt token
    (evaluated again for its logits); 0 below ``MIN_REUSE``."""
    keep = min(_common(tokens, prompt), len(prompt) - 1)
    return keep if keep >= MIN_REUSE else 0


def _common(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i + 256 <= n and a[i : i + 256] == b[i : i + 256]:  # whole blocks compared in C: prompts run to 100k
        i += 256
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _pointer(logits: np.ndarray) -> Any:
    return logits.ctypes.data_as(ctypes.POINTER(ctypes.c_float))
