"""Routing: which replica of a model takes a request. A pure function of the request's prefix key and a snapshot
of the replicas' load; no I/O, so the rule is tested as a table.

The rule, in order:

1. **One replica**: it.
2. **Prefix affinity, under bounded loads.** A replica may take a request only while its load stays within the
   bound ``ceil((1 + EPSILON) * (total load + 1) / replicas)`` (consistent hashing with bounded loads, Mirrokni
   et al.). Within it, the request goes to
   a. the replica this gateway last sent the longest prefix of the prompt to (``PrefixTable``: cumulative hashes
      of the prompt's text in ``BLOCK``-character blocks and at the end of each message, as SGLang's router keeps
      a radix tree per worker), when the prefix is at least ``MIN_PREFIX`` characters: a conversation's next turn
      finds the replica holding its history, and an agent's next task the one holding its system prompt and tools;
   b. else the least loaded replica whose KV tier holds entries of the prompt's key (``cached``: runners publish
      the prefix keys of their tiers' entries, ``gateway.cluster.kv_tiers``), which restores the prompt instead
      of prefilling it: an agent whose replica this gateway never saw (another gateway sent it, or this one
      restarted) finds the one holding its system prompt;
   c. else the first replica in the order of rendezvous hashing of the prompt's key (``prefix_key``: its
      preamble and first message, when they are at least ``MIN_PREFIX`` characters), the same order on every
      gateway with no shared table, so a conversation that moves between gateways keeps its replica too, and
      agents behind one long system prompt meet it cached; past the bound, the next one in that order.
3. **Least loaded, power of two choices.** A request without a key (a short prompt: nothing worth finding in a
   cache) goes to the less loaded of two replicas drawn at random; two gateways reading the same snapshot then
   do not herd onto the one least loaded replica. Hashing short prompts to replicas instead cost capacity: 8
   clients with distinct one-line prompts split 5/3 or 6/2 over two replicas (the bound allows 6), for a
   prefix of a few dozen tokens that no other request shares.

A replica's load is its generations running plus those queued for a slot, summed over every gateway
(``gateway.cluster.loads``), this gateway's own counted live (requests routed but not yet in its queue too).

Imports the prefix key (``protocols.prefix``: runners tag their KV tiers' entries with it) and the standard library.
"""

from __future__ import annotations

import hashlib
import itertools
import math
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

from meshgate.protocols.prefix import MIN_PREFIX, PREFIX_CHARS, prefix_key

__all__ = [
    "BLOCK",
    "EPSILON",
    "MIN_PREFIX",
    "PREFIX_CHARS",
    "Choice",
    "PrefixTable",
    "Replica",
    "Routing",
    "prefix_blocks",
    "prefix_key",
    "route",
]

EPSILON = 0.5
"""How far above the mean load (as a fraction of it) a replica still takes the requests whose prefix it holds."""

BLOCK = 256
"""Characters of prompt text per block of ``prefix_blocks`` (about 64 tokens)."""
MAX_CHARS = 256 * 1024
"""Characters of a prompt that routing reads at most."""


class Routing:
    """What routing reads of a request: its prefix ``key`` (``prefix_key``) and its text's ``blocks``; given, or
    worked out by ``derive`` on first use (a model with one ready replica never pays for hashing its prompt)."""

    __slots__ = ("_blocks", "_derive", "_key")

    def __init__(
        self,
        key: bytes | None = None,
        blocks: tuple[int, ...] = (),
        *,
        derive: Callable[[], tuple[bytes | None, tuple[int, ...]]] | None = None,
    ) -> None:
        self._key, self._blocks, self._derive = key, blocks, derive

    def _resolve(self) -> None:
        if self._derive is not None:
            (self._key, self._blocks), self._derive = self._derive(), None

    @property
    def key(self) -> bytes | None:
        self._resolve()
        return self._key

    @property
    def blocks(self) -> tuple[int, ...]:
        self._resolve()
        return self._blocks


@dataclass(frozen=True, slots=True)
class Replica:
    """One ready replica as the router sees it: its instance id and load (running + queued, all gateways)."""

    id: str
    load: int


@dataclass(frozen=True, slots=True)
class Choice:
    """The replica chosen and by which rule: ``only``, ``prefix`` (the replica that took the prompt's longest
    known prefix), ``tier`` (one whose KV tier holds the prompt's start), ``affinity`` (the key's first replica),
    ``spill`` (a later one of the key's order: the first was at its bound) or ``least_loaded``."""

    id: str
    rule: str


def prefix_blocks(parts: Iterable[str]) -> tuple[int, ...]:
    """Cumulative hashes of the text ``parts`` make, one at every ``BLOCK`` characters of a part and one at its
    end, from ``MIN_PREFIX`` characters on: two prompts share the first n hashes when their text is the same up
    to there, so a conversation's next turn (the same messages and more) has all of its last turn's hashes.
    Process-local hashes (Python's ``hash``): a ``PrefixTable`` lives in one gateway."""
    blocks = []
    h = at = 0
    for part in parts:
        for start in range(0, len(part), BLOCK):
            piece = part[start : start + BLOCK]
            h = hash((h, piece))
            at += len(piece)
            if at >= MIN_PREFIX:
                blocks.append(h)
            if at >= MAX_CHARS:
                return tuple(blocks)
        h = hash((h, None))  # the end of a part: ["ab", "c"] is not ["a", "bc"]
    return tuple(blocks)


class PrefixTable:
    """Which replica this gateway last sent each prompt prefix to, by block hash; bounded (oldest out first)."""

    def __init__(self, limit: int = 200_000) -> None:
        self.limit = limit
        self._where: dict[int, str] = {}

    def match(self, blocks: Sequence[int], ids: Iterable[str]) -> str | None:
        """The replica among ``ids`` that took the longest prefix of ``blocks``, if any took one."""
        live = set(ids)
        for h in reversed(blocks):
            found = self._where.get(h)
            if found in live:
                return found
        return None

    def learn(self, blocks: Sequence[int], replica_id: str) -> None:
        where = self._where
        for h in blocks:
            where.pop(h, None)
            where[h] = replica_id
        if len(where) > self.limit:
            for h in list(itertools.islice(where, len(where) - self.limit // 2)):
                del where[h]


def route(
    replicas: Sequence[Replica],
    key: bytes | None,
    rng: random.Random | None = None,
    preferred: str | None = None,
    cached: Iterable[str] = (),
) -> Choice:
    """The replica for a request with prefix ``key`` (``None``: no affinity) among ``replicas`` (not empty);
    ``preferred``: the replica that took the prompt's longest known prefix (``PrefixTable.match``); ``cached``: the
    replicas whose KV tiers hold entries of ``key``."""
    if len(replicas) == 1:
        return Choice(replicas[0].id, "only")
    if key is not None:
        bound = math.ceil((1 + EPSILON) * (sum(r.load for r in replicas) + 1) / len(replicas))
        known = next((r for r in replicas if r.id == preferred), None)
        if known is not None and known.load + 1 <= bound:
            return Choice(known.id, "prefix")
        holders = set(cached)
        tiers = [r for r in replicas if r.id in holders and r.load + 1 <= bound]
        if tiers:
            return Choice(min(tiers, key=lambda r: (r.load, -_score(key, r.id))).id, "tier")
        order = sorted(replicas, key=lambda r: _score(key, r.id), reverse=True)
        for rank, replica in enumerate(order):
            if replica.load + 1 <= bound:
                return Choice(replica.id, "affinity" if rank == 0 else "spill")
    a, b = (rng or random).sample(list(replicas), 2)
    if a.load != b.load:
        return Choice(min(a, b, key=lambda r: r.load).id, "least_loaded")
    return Choice(a.id, "least_loaded")  # a tie: the random draw already broke it


def _score(key: bytes, replica_id: str) -> int:
    return int.from_bytes(hashlib.blake2b(key + replica_id.encode(), digest_size=8).digest(), "big")
