"""Batched decoding for the MLX engine: one scheduler thread owns the model and a batched KV cache and advances
every request in flight by one token per forward pass.

``Batch`` is the model's side, identical on every rank: ``admit`` prefills one chunk of a new prompt (``CHUNK``
tokens, cut from the prompt's start) on that prompt's own fresh cache, exactly as the prompt alone is prefilled,
and after its last chunk adds that cache to the batch as its last row (a sequence alone keeps its plain cache
and runs the one-at-a-time code; with two or more the caches are mlx-lm's ``BatchKVCache`` /
``BatchRotatingKVCache``, rows left-padded to the batch's length); ``step`` feeds one token per row through one
forward pass; ``keep`` drops the other rows (a finished or cancelled sequence leaves before the next step).

``Scheduler`` is the head's side: ``submit`` hands it a ``Sequence`` (a request's prompt, limit and sampler); its
thread takes waiting sequences (up to ``parallel`` rows, prefilling ones included) and runs steps: one decode
pass over the rows, then prompt chunks, up to ``CHUNK`` prompt tokens a step, shortest remaining prompt first
(ties first come, first served), as the llama.cpp scheduler does (``backends.llama_cpp.batch``: the order with
the lowest mean time to first token, and a long prompt cannot starve since what it has left only shrinks). So a
short prompt waits for at most the one chunk in flight, never for a long prompt's whole prefill, and running
rows keep decoding while a long prompt is prefilled. It samples each row (greedy rows by one
argmax over the batch; a sampled row with its own seeded key, drawn as ``mx.random.seed(seed)`` then mlx-lm's
sampler would draw, so a seed gives the same text under any load; a row with a structured-output ``Constraint``
first has the logits its grammar forbids set to ``-inf``) and hands each pick to its sequence's queue,
which the request's own ``generate`` thread reads. Over several ranks it sends every operation over the
lockstep before running it; followers run ``Batch.run`` on what they receive.

Why greedy text does not depend on load: alone, a sequence runs the plain cache (and a merged batch left with
one row computes bit for bit what the plain cache does: checked on both test families and Gemma 3 270M); with
several rows the masked padding and wider matmuls may sum
in another order (logits moved by up to ~1.3e-5 on the tiny gemma3, not at all on the tiny llama or, for the
prompts checked, on Gemma 3 270M), so a greedy pick can change only where two logits are that close: a near-tie.
Over several ranks the head sends each operation before running it, so every rank holds the same batch; the
tests check pipeline and tensor sharding batched against one process.

Chunks are cut at the same places alone and under load, so a prompt's numbers do not depend on what else runs;
a prompt longer than ``CHUNK`` gets other numbers than the one-piece prefill before chunking (as mlx-lm's own
``generate_step``, which prefills in chunks of 2048). A chunk in flight is not stopped (an MLX evaluation cannot
be): a short prompt may wait for one.

Prefix reuse between requests goes through the KV tier only (``kvcache``, ``runner.kvtier``): a sequence whose
``restore`` (a tier hit, found by the engine) holds part of its prompt starts from that cache at admission, its
``fed`` tokens a multiple of ``CHUNK``, so its prefill goes on in the chunks cold prefill cuts; one that holds the
whole prompt joins the rows at once and takes its first pick from the logits kept with it (no forward pass). As a
prompt's prefill (from nothing or from a restore: every prefill here is cold's) passes its restore points and
ends, its cache is kept (``kvcache.Keeper.passed``, before the cache joins the batch).

Over a ring every rank has a tier of its own holding its shard of each entry (its namespace names the shard:
``engine.kv_namespace``), and the head decides for all. Before a new sequence's first chunk the head sends ``kv``
(``[key, n, scope's length, *scope (UTF-8 bytes), *prompt]``) when its prompt is long enough to keep or it has a
hit: each follower (``Follower``) then keeps that prompt's shard as its chunks pass, as the head keeps its own.
With a hit of ``n`` tokens (that the head's own tier could load) every rank looks up the same ``n`` tokens in its
tier, loads them, and all vote (``Lockstep.agree``): only when every rank could does every rank restore;
otherwise every rank drops what it loaded and the prompt is prefilled cold on all (and kept again, so a rank
that had lost its shard holds it afterwards). No rank ever restores while another prefills.

A resumed sequence (its stream moved here from a replica that failed, ``Request.resume``) takes the tokens it had
sent as its first picks, one decode step each, as they were generated: greedy text then goes on exactly as the
undisturbed run's, and its grammar (if any) is advanced through them.

Runs only in MLX processes; imports mlx, mlx_lm and numpy (lazily) and protocols; of ours, ``kvcache`` (lazily)
and ``structured`` and ``runner.kvtier`` for types only.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshgate.protocols.model import BackendUnavailable

if TYPE_CHECKING:
    from meshgate.backends.mlx.structured import Constraint
    from meshgate.backends.runner.kvtier import Hit, KVTier

__all__ = ["Batch", "Follower", "Sampler", "Scheduler", "Sequence"]

log = logging.getLogger("meshgate.mlx.batch")

_POLL_S = 0.05  # how often a waiting ``generate`` looks at its cancel flag

CHUNK = 512
"""Prompt tokens per forward pass and per step (a prompt's chunks start at its first token)."""

_MORE, _LAST, _DROP = 0, 1, -1  # ``admit``'s second value: more chunks follow, the last chunk, drop the cache


def _last(logits: Any) -> Any:
    """Each row's logits at its last position, as a ``(rows, vocab)`` array."""
    return logits[:, -1, :]


class Batch:
    """The KV cache of every running sequence and the forward passes over it (``forward(inputs, cache)``,
    ``make_cache()`` per rank: a whole model, a tensor shard or a pipeline stage, whose followers get ``None``
    back for logits).

    One sequence alone keeps its plain cache, so it runs exactly the one-at-a-time code; the caches merge into
    batch caches when a second joins. ``can_batch`` is false for a model whose cache mlx-lm cannot merge (then
    the scheduler runs one sequence at a time).
    """

    def __init__(self, forward: Callable[..., Any], make_cache: Callable[[], list[Any]]) -> None:
        self._forward, self._make_cache = forward, make_cache
        self.cache: list[Any] | None = None
        self.pending: dict[int, list[Any]] = {}  # the caches of prompts still being prefilled, by key
        self.rows = 0
        self.merged = False
        self.can_batch = all(c is None or hasattr(type(c), "merge") for c in make_cache())

    def run(self, op: str, values: list[int]) -> Any:
        """A follower's way in: the operation the head sent."""
        return getattr(self, op)(values)

    def admit(self, values: list[int], seen: Callable[[list[Any], Any], None] | None = None) -> Any:
        """``[key, then, *tokens]``: prefill ``tokens`` on prompt ``key``'s own cache (made at its first chunk, or
        put in ``pending`` restored from the KV tier); ``then`` is ``_LAST`` after the prompt's last chunk (its cache
        becomes the batch's last row), ``_MORE`` before, ``_DROP`` to forget the cache of a prompt given up part
        way. The logits of the chunk's last token. ``seen`` (the head's, with a KV tier) is shown the prompt's cache
        and those logits after the chunk, before the cache joins the batch."""
        import mlx.core as mx

        key, then, tokens = values[0], values[1], values[2:]
        if then == _DROP:
            self.pending.pop(key, None)
            return None
        cache = self.pending.pop(key, None) or self._make_cache()
        logits = self._eval(self._forward(mx.array(tokens)[None], cache=cache))
        if seen is not None:
            seen(cache, logits)
        if then == _MORE:
            self.pending[key] = cache
            return logits
        self.join(cache)
        return logits

    def join(self, cache: list[Any]) -> None:
        """Add a whole prompt's plain ``cache`` to the batch as its last row."""
        if self.cache is None:
            self.cache, self.merged = cache, False
        else:
            if not self.merged:
                self.cache, self.merged = self._merge(self.cache), True
            for mine, new in zip(self.cache, self._merge(cache), strict=True):
                if mine is not None:
                    mine.extend(new)
        self.rows += 1

    @staticmethod
    def _merge(cache: list[Any]) -> list[Any]:
        """One sequence's plain cache as a batch cache of one row (mlx-lm's ``BatchKVCache`` and friends)."""
        return [None if c is None else type(c).merge([c]) for c in cache]

    def keep(self, rows: list[int]) -> None:
        """Keep only ``rows`` (in this order), dropping the others' caches."""
        if not rows:
            self.cache, self.rows = None, 0
        elif rows != list(range(self.rows)):
            import mlx.core as mx

            index = mx.array(rows)
            for c in self.cache or ():
                if c is not None:
                    c.filter(index)
            self.rows = len(rows)

    def step(self, tokens: list[int]) -> Any:
        """One forward pass feeding ``tokens[i]`` to row ``i``; the logits (``rows``, 1, vocab)."""
        import mlx.core as mx

        if len(tokens) != self.rows:
            raise RuntimeError(f"a step of {len(tokens)} tokens for a batch of {self.rows} rows")
        return self._eval(self._forward(mx.array(tokens)[:, None], cache=self.cache))

    @staticmethod
    def _eval(logits: Any) -> Any:
        """Run the pass now (a tensor follower's collectives must match the head's); ``None`` passes through."""
        if logits is not None:
            import mlx.core as mx

            logits = _last(logits)[:, None, :]
            mx.eval(logits)
        return logits


class Sampler:
    """Temperature sampling with top-p, min-p and top-k (mlx-lm's filters, in mlx-lm's order) from a key of
    its own: the draws ``mx.random.seed(seed)`` and mlx-lm's ``make_sampler`` would make, whatever else runs."""

    def __init__(self, temp: float, top_p: float, min_p: float, top_k: int, seed: int) -> None:
        import mlx.core as mx

        self.temp, self.top_p, self.min_p, self.top_k = temp, top_p, min_p, top_k
        self.key = mx.random.key(seed)

    def __call__(self, logits: Any) -> Any:
        import mlx.core as mx
        from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p

        if 0 < self.top_p < 1:
            logits = apply_top_p(logits, self.top_p)
        if self.min_p != 0:
            logits = apply_min_p(logits, self.min_p, 1)
        if self.top_k > 0:
            logits = apply_top_k(logits, self.top_k)
        self.key, draw = mx.random.split(self.key)  # as mlx's global key sequence does per draw
        return mx.random.categorical(logits * (1 / self.temp), key=draw)


class Sequence:
    """One request in the batch, shared by its ``generate`` thread (which reads picks) and the scheduler.

    The scheduler stops feeding it after an end token or ``limit`` other tokens; the request's side may end
    it sooner (``close``: a stop string, a closed stream) or cancel it (its ``cancel`` flag).
    """

    def __init__(
        self,
        tokens: list[int],
        limit: int,
        eos: set[int],
        sampler: Sampler | None,
        cancel: threading.Event,
        constraint: Constraint | None = None,
        forced: list[int] | None = None,
    ) -> None:
        self.tokens, self.limit, self.eos, self.sampler, self.cancel = tokens, limit, eos, sampler, cancel
        self.constraint = constraint
        # a resumed request's tokens so far (``Request.resume``): its first picks, each decoded one step as it
        # was generated (the same numbers as the undisturbed run, so greedy text goes on as it would have)
        self.forced = collections.deque(forced or ())
        self.picks: queue.SimpleQueue[int | BaseException] = queue.SimpleQueue()
        self.last = -1  # the latest pick: the next step's input
        self.count = 0
        self.fed = 0  # prompt tokens prefilled
        self.key = 0  # its prompt's cache while prefilling (``Batch.pending``), numbered in order of arrival
        self.ended = self.closed = False
        # the KV tier: set by the engine (the head's, over a ring) before ``submit``
        self.restore: Hit | None = None  # a hit to start from, taken at admission
        self.scope: str | None = None  # the tier scope its prompt's cache is kept under (``None``: not kept)
        self.tag = ""  # its prompt's prefix key (``protocols.prefix``): kept with its entry, for routing
        self.note = ""  # where its restored KV came from, when a peer's was weighed (``Usage.cache_note``)
        self.cached = 0  # prompt tokens restored instead of prefilled
        self.points: dict[int, bytearray] = {}  # restore points its prefill passed, for its entry
        self.mirrored = False  # over a ring: the followers keep its prompt's shard (``kv`` sent, not yet done)

    @property
    def over(self) -> bool:
        return self.ended or self.closed or self.cancel.is_set()

    def deliver(self, pick: int) -> None:
        if self.constraint is not None:
            try:
                self.constraint.advance(pick)
            except Exception as exc:  # this sequence fails, the batch runs on
                self.ended = True
                self.picks.put(exc)
                return
        self.last = pick
        if pick in self.eos:
            self.ended = True
        else:
            self.count += 1
            self.ended = self.count >= self.limit
        self.picks.put(pick)

    def next(self) -> int | None:
        """The next pick (waiting for it), or ``None`` once ``cancel`` is set; re-raises the scheduler's error."""
        while True:
            try:
                item = self.picks.get(timeout=_POLL_S)
            except queue.Empty:
                if self.cancel.is_set():
                    return None
                continue
            if isinstance(item, BaseException):
                raise item
            return item

    def close(self) -> None:
        self.closed = True


class Scheduler:
    """The head's batching loop over ``batch``, at most ``parallel`` rows, mirrored to followers by ``lockstep``.

    ``steps`` counts decode passes, ``decoded`` the rows they advanced, ``widest`` the most rows in one pass.
    With a KV ``tier`` sequences start from their ``restore`` hits and prompts are kept (over a ring, with every
    rank's agreement: ``Follower``); ``restored`` counts the prompt tokens restored, ``ring_refused`` the hits not
    restored because a follower could not, ``prompt_rate`` is a moving average of prompt tokens prefilled per
    second (what a peer's entry is weighed against).
    """

    def __init__(self, batch: Batch, lockstep: Any, parallel: int, tier: KVTier | None = None) -> None:
        from meshgate.backends.mlx.kvcache import SAVED, Keeper

        self.batch, self.lockstep, self.parallel = batch, lockstep, max(1, parallel)
        self._saved = SAVED
        self.keeper = Keeper(tier, CHUNK) if tier is not None else None
        self.steps = self.decoded = self.widest = self.restored = self.ring_refused = 0
        self.prompt_rate = 200.0
        self._rows: list[Sequence] = []
        self._prefilling: list[Sequence] = []
        self._current: Sequence | None = None  # the sequence whose prompt chunk is being evaluated
        self._keys = 0
        self._waiting: collections.deque[Sequence] = collections.deque()
        self._wake = threading.Condition()
        self._thread: threading.Thread | None = None
        self._closing = False
        self._dead: BaseException | None = None

    def stats(self) -> dict[str, int]:
        return {
            "parallel": self.parallel,
            "running": len(self._rows),
            "prefilling": len(self._prefilling),
            "waiting": len(self._waiting),
            "steps": self.steps,
            "decoded": self.decoded,
            "widest": self.widest,
            "restored_tokens": self.restored,
            **({"ring_refused": self.ring_refused} if self.lockstep.size > 1 else {}),
        }

    def submit(self, seq: Sequence) -> None:
        with self._wake:
            if self._dead is not None:
                raise BackendUnavailable(f"this MLX runner cannot generate any more ({self._dead!r})")
            if self._closing:
                raise BackendUnavailable("this MLX runner is shutting down")
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="mlx-batch", daemon=True)
                self._thread.start()
            self._waiting.append(seq)
            self._wake.notify()

    def close(self) -> None:
        """Stop the loop (the waiting and running sequences fail), then shut the followers down."""
        with self._wake:
            self._closing = True
            self._wake.notify()
            thread = self._thread
        if thread is not None:
            thread.join()
        if self._dead is None:
            self.lockstep.shutdown()

    def _run(self) -> None:
        while (new := self._take()) is not None:
            for seq in new:
                self._keys += 1
                seq.key = self._keys
            self._prefilling += new
            try:
                self._restore(new)
                self._leave()
                if self._rows:
                    self._step()
                self._prefill()
            except Exception as exc:  # the running sequences and those with chunks in the cache fail with it
                untouched = [seq for seq in self._prefilling if not seq.fed and seq is not self._current]
                self._current = None
                self._fail(exc, [*self._rows, *[seq for seq in self._prefilling if seq not in untouched]])
                self._rows, self._prefilling = [], []
                with self._wake:
                    self._waiting.extendleft(reversed(untouched))
                    if self.lockstep.size > 1:  # followers stand at an unknown point: this ring is done
                        self._dead = exc
                        self._fail(exc, list(self._waiting))
                        self._waiting.clear()
                        return
                self.batch.keep([])  # one process: start again with an empty batch
                self.batch.pending.clear()

    def _take(self) -> list[Sequence] | None:
        """Wait for work; the sequences to admit now (``None``: closing)."""
        with self._wake:
            while not (self._waiting or self._rows or self._prefilling or self._closing):
                self._wake.wait()
            if self._closing:
                closing = [*self._rows, *self._prefilling, *self._waiting]
                self._fail(BackendUnavailable("this MLX runner is shutting down"), closing)
                return None
            new: list[Sequence] = []
            while self._waiting and len(self._rows) + len(self._prefilling) + len(new) < self.parallel:
                if not (seq := self._waiting.popleft()).over:
                    new.append(seq)
            return new

    def _fail(self, exc: BaseException, seqs: list[Sequence]) -> None:
        for seq in seqs:
            seq.picks.put(exc)

    def _leave(self) -> None:
        for seq in [seq for seq in self._prefilling if seq.over]:
            if seq.fed or seq.mirrored:  # its cache holds chunks, or followers keep it: forget them
                self.lockstep.send("admit", [seq.key, _DROP])
                self.batch.admit([seq.key, _DROP])
            self._prefilling.remove(seq)
        keep = [i for i, seq in enumerate(self._rows) if not seq.over]
        if len(keep) < len(self._rows):
            self.lockstep.send("keep", keep)
            self.batch.keep(keep)
            self._rows = [self._rows[i] for i in keep]

    def _restore(self, new: list[Sequence]) -> None:
        """Start the ``new`` sequences that have a KV tier hit from it: a part of the prompt goes to its pending
        cache (prefill goes on from there), a whole prompt joins the rows with its first pick. Over a ring, tell
        the followers what to keep and restore, and restore only if every rank can."""
        ring = self.lockstep.size > 1
        for seq in new:
            hit, seq.restore = seq.restore, None
            if self.keeper is None or (ring and seq.scope is None):  # followers hear of prompts kept in a scope
                continue
            cache, n, logits = self.keeper.restore(hit, len(seq.tokens)) if hit is not None else (None, 0, None)
            if ring and seq.scope is not None and (cache is not None or len(seq.tokens) >= self._saved):
                self.lockstep.send("kv", [seq.key, n, *_scope_values(seq.scope), *seq.tokens])
                seq.mirrored = True
                if cache is not None and not self.lockstep.agree(True):
                    log.info("KV tier: a rank of the ring lacks %d tokens the head holds; prefilled on all", n)
                    self.ring_refused += 1
                    cache = None
            if cache is None:
                continue
            self.keeper.tier.restored(n)
            seq.fed = seq.cached = n
            self.restored += n
            if n < len(seq.tokens):
                self.batch.pending[seq.key] = cache
                self._keep(seq, n, cache, None)  # a restore point of its own entry too
                continue
            self.batch.join(cache)
            seq.mirrored = False  # nothing to prefill: followers joined theirs too
            self._prefilling.remove(seq)
            self._rows.append(seq)
            seq.deliver(self._pick([seq], logits)[0])

    def _keep(self, seq: Sequence, end: int, cache: list[Any], logits: Any) -> None:
        """Show the KV tier ``seq``'s prompt cache at ``end`` (a failure there is logged, never the sequence's)."""
        if self.keeper is None or seq.scope is None:
            return
        try:
            self.keeper.passed(cache, seq.tokens, end, seq.points, seq.scope, seq.tag, logits)
        except Exception:
            log.exception("KV tier: a prompt's cache could not be kept")
            seq.points.clear()

    def _prefill(self) -> None:
        """Up to ``CHUNK`` prompt tokens, shortest remaining prompt first; a prompt done joins the rows."""
        budget = CHUNK
        for seq in sorted(self._prefilling, key=lambda seq: (len(seq.tokens) - seq.fed, seq.key)):
            if budget <= 0:
                break
            chunk = seq.tokens[seq.fed : seq.fed + CHUNK]
            then = _LAST if seq.fed + len(chunk) == len(seq.tokens) else _MORE
            seen = functools.partial(self._keep, seq, seq.fed + len(chunk)) if seq.scope is not None else None
            self._current = seq
            self.lockstep.send("admit", [seq.key, then, *chunk])
            started = time.perf_counter()
            values = [seq.key, then, *chunk]
            logits = self.batch.admit(values, seen) if seen is not None else self.batch.admit(values)
            self.prompt_rate = 0.8 * self.prompt_rate + 0.2 * len(chunk) / max(time.perf_counter() - started, 1e-6)
            self._current = None
            seq.fed += len(chunk)
            budget -= len(chunk)
            if then == _LAST:
                seq.mirrored = False  # a follower forgets the prompt after its last chunk
                self._prefilling.remove(seq)
                self._rows.append(seq)
                seq.deliver(self._pick([seq], logits)[0])

    def _step(self) -> None:
        tokens = [seq.last for seq in self._rows]
        self.lockstep.send("step", tokens)
        logits = self.batch.step(tokens)
        for seq, pick in zip(self._rows, self._pick(self._rows, logits), strict=True):
            seq.deliver(pick)
        self.steps += 1
        self.decoded += len(tokens)
        self.widest = max(self.widest, len(tokens))

    @staticmethod
    def _pick(rows: list[Sequence], logits: Any) -> list[int]:
        import mlx.core as mx

        last = _last(logits)
        if any(seq.constraint is not None for seq in rows):  # the grammar's disallowed tokens out, then pick
            import numpy as np

            width = last.shape[-1]
            allowed = np.ones((len(rows), width), dtype=bool)
            for i, seq in enumerate(rows):
                if seq.constraint is not None:
                    allowed[i] = seq.constraint.mask(width)
            last = mx.where(mx.array(allowed), last, -mx.inf)
        if all(seq.sampler is None for seq in rows):
            picks = mx.argmax(last, axis=-1)
        else:
            picks = mx.concatenate(
                [
                    mx.argmax(last[i : i + 1], axis=-1) if seq.sampler is None else seq.sampler(last[i : i + 1])
                    for i, seq in enumerate(rows)
                ]
            )
        mx.eval(picks)
        chosen = picks.tolist()
        for i, seq in enumerate(rows):
            if seq.forced:  # a resumed sequence replays what it had sent before its own picks
                chosen[i] = seq.forced.popleft()
        return chosen


def _scope_values(scope: str) -> list[int]:
    """A tier scope as lockstep values: its UTF-8 length, then its bytes."""
    raw = scope.encode()
    return [len(raw), *raw]


class _Mirrored:
    """A follower's record of a prompt the head keeps: its scope, its tokens, how far its prefill went, the
    restore points it passed."""

    def __init__(self, scope: str, tokens: list[int], fed: int) -> None:
        self.scope, self.tokens, self.fed = scope, tokens, fed
        self.points: dict[int, bytearray] = {}


class Follower:
    """A follower rank's side of the scheduler: runs the head's operations on its ``batch`` and, with a KV
    ``tier`` of its own, keeps and restores its shard of the prompts the head says (``kv``), as the head does.

    Whatever happens here, a restore's vote is cast (a follower that cannot load says no) and every operation
    runs: a rank that stopped would leave the ring waiting.
    """

    def __init__(self, batch: Batch, lockstep: Any, tier: KVTier | None) -> None:
        from meshgate.backends.mlx.kvcache import Keeper

        self.batch, self.lockstep = batch, lockstep
        self.keeper = Keeper(tier, CHUNK) if tier is not None else None
        self.mirrored: dict[int, _Mirrored] = {}  # by sequence key

    def run(self, op: str, values: list[int]) -> None:
        if op == "kv":
            self.kv(values)
        elif op == "admit" and values[0] in self.mirrored:
            self._admit(values)
        else:
            self.batch.run(op, values)

    def kv(self, values: list[int]) -> None:
        """``[key, n, scope's length, *scope, *prompt]``: keep prompt ``key`` (its shard); with ``n``, restore its
        first ``n`` tokens too if every rank can (the vote)."""
        key, n, length = values[0], values[1], values[2]
        scope, prompt = bytes(values[3 : 3 + length]).decode(), values[3 + length :]
        keeper, cache = self.keeper, None
        try:
            if n and keeper is not None and (hit := keeper.find(scope, prompt, n)) is not None:
                cache = keeper.restore(hit, len(prompt), logits=False)[0]
        except Exception:  # counted as "could not": every rank then prefills
            log.exception("KV tier: a follower could not restore %d tokens", n)
        if n and not self.lockstep.agree(cache is not None):
            cache = None
        if keeper is None:  # no tier here: nothing to keep (and the vote said no)
            return
        record = _Mirrored(scope, prompt, n if cache is not None else 0)
        if cache is None:
            self.mirrored[key] = record
            return
        keeper.tier.restored(n)
        if n == len(prompt):
            self.batch.join(cache)
            return
        self.batch.pending[key] = cache
        self.mirrored[key] = record
        self._keep(record, n, cache)

    def _admit(self, values: list[int]) -> None:
        key, then = values[0], values[1]
        record = self.mirrored[key]
        if then == _DROP:
            del self.mirrored[key]
            self.batch.admit(values)
            return
        record.fed += len(values) - 2
        self.batch.admit(values, lambda cache, _: self._keep(record, record.fed, cache))
        if then == _LAST:
            del self.mirrored[key]

    def _keep(self, record: _Mirrored, end: int, cache: list[Any]) -> None:
        if self.keeper is None:
            return
        try:
            self.keeper.passed(cache, record.tokens, end, record.points, record.scope, "", None)
        except Exception:  # as the head's: logged, never the sequence's
            log.exception("KV tier: a prompt's cache could not be kept on a follower")
            record.points.clear()
