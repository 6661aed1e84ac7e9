"""Routing: which replica of a model takes a request. A pure function of the request's prefix key and a snapshot
of the replicas' load; no I/O, so the rule is tested as a table.

The rule, in order:

1. **One replica**: it.
2. **Prefix affinity, under bounded loads.** A request with a prefix key (``prefix_key``: a hash of what its
   prompt starts with) ranks the replicas by rendezvous hashing (highest ``hash(key, replica id)`` first), the
   same order on every gateway with no shared table. It goes to the first replica in that order whose load is
   under the bound ``ceil((1 + EPSILON) * (total load + 1) / replicas)`` (consistent hashing with bounded loads,
   Mirrokni et al.): the replica whose runner still holds the prefix unless it already carries more than its
   share, then the next one in the key's order, whose runner picks the prefix up for the key's later requests.
   Requests of one conversation, or an agent's turns with the same system prompt and tools, keep one replica.
3. **Least loaded, power of two choices.** A request without a key (or when hashing finds nothing under the
   bound, which the bound rules out) goes to the less loaded of two replicas drawn at random; two gateways
   reading the same snapshot then do not herd onto the one least loaded replica.

A replica's load is its generations running plus those queued for a slot, summed over every gateway
(``gateway.cluster.loads``), this gateway's own counted live.

Imports only the standard library.
"""

from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["EPSILON", "PREFIX_CHARS", "Choice", "Replica", "prefix_key", "route"]

EPSILON = 0.5
"""How far above the mean load (as a fraction of it) a replica still takes the requests whose prefix it holds."""

PREFIX_CHARS = 1024
"""Characters of each of the two parts of a prompt's start that make its prefix key: the preamble (system prompt
and tools, an agent's fixed part) and the conversation's first message, which every later turn repeats. Two
conversations behind one long system prompt get different keys, so they spread over the replicas, each of
which soon holds the shared preamble too."""


@dataclass(frozen=True, slots=True)
class Replica:
    """One ready replica as the router sees it: its instance id and load (running + queued, all gateways)."""

    id: str
    load: int


@dataclass(frozen=True, slots=True)
class Choice:
    """The replica chosen and by which rule: ``only``, ``affinity`` (the key's first replica), ``spill`` (a
    later one of the key's order: the first was at its bound) or ``least_loaded``."""

    id: str
    rule: str


def prefix_key(preamble: Iterable[str], first: str) -> bytes:
    """The key of a prompt whose ``preamble`` (system prompt, tool definitions) is followed by the ``first``
    message of its conversation (a plain completion: the prompt itself, no preamble): a hash of the first
    ``PREFIX_CHARS`` characters of each."""
    digest = hashlib.blake2b(digest_size=8)
    left = PREFIX_CHARS
    for part in preamble:
        if left <= 0:
            break
        piece = part[:left]
        digest.update(piece.encode("utf-8", "surrogatepass"))
        left -= len(piece)
    digest.update(b"\0")
    digest.update(first[:PREFIX_CHARS].encode("utf-8", "surrogatepass"))
    return digest.digest()


def route(replicas: Sequence[Replica], key: bytes | None, rng: random.Random | None = None) -> Choice:
    """The replica for a request with prefix ``key`` (``None``: no affinity) among ``replicas`` (not empty)."""
    if len(replicas) == 1:
        return Choice(replicas[0].id, "only")
    if key is not None:
        bound = math.ceil((1 + EPSILON) * (sum(r.load for r in replicas) + 1) / len(replicas))
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
