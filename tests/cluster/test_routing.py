"""The routing rule as a table (``gateway.cluster.routing``): affinity under bounded loads, spill, power of two
choices; and the prefix key of a request (``gateway.serving.start.request_routing``). Pure functions, no
processes."""

from __future__ import annotations

import random
import time
from collections import Counter

import pytest

from meshgate.gateway.cluster.routing import (
    EPSILON,
    MIN_PREFIX,
    Choice,
    PrefixTable,
    Replica,
    prefix_blocks,
    prefix_key,
    route,
)
from meshgate.gateway.serving.start import request_routing
from meshgate.protocols.model import Message, Request, TextPart, Tool

SYSTEM = "You are a coding agent. Read the code before you change it. " * 12  # ~700 characters
KEY = prefix_key([SYSTEM], "Fix the bug in main.py")
assert KEY is not None


def _conversation(n: int) -> bytes:
    key = prefix_key([SYSTEM], f"conversation {n}")
    assert key is not None
    return key


def _first_choice(key: bytes, ids: list[str]) -> str:
    return route([Replica(i, 0) for i in ids], key, random.Random(0)).id


def test_one_replica_takes_everything() -> None:
    assert route([Replica("a", 99)], KEY).rule == "only"


def test_a_key_keeps_its_replica_whatever_the_order_or_the_gateway() -> None:
    first = _first_choice(KEY, ["a", "b", "c"])
    assert _first_choice(KEY, ["c", "a", "b"]) == first  # rendezvous hashing: no shared table, no order
    assert route([Replica("a", 0), Replica("b", 0), Replica("c", 0)], KEY).rule == "affinity"


def test_removing_another_replica_does_not_move_a_key() -> None:
    ids = ["a", "b", "c", "d"]
    keys = [_conversation(n) for n in range(200)]
    before = {k: _first_choice(k, ids) for k in keys}
    after = {k: _first_choice(k, [i for i in ids if i != "d"]) for k in keys}
    assert all(after[k] == before[k] for k in keys if before[k] != "d")
    assert all(after[k] != "d" for k in keys)


def test_keys_spread_over_replicas() -> None:
    counts = Counter(_first_choice(_conversation(n), ["a", "b"]) for n in range(400))
    assert 150 < counts["a"] < 250


@pytest.mark.parametrize(
    ("home", "other", "rule"),
    [  # the bound with two replicas: ceil(1.5 * (total + 1) / 2); home takes one more while within it
        (0, 0, "affinity"),  # bound 1
        (1, 0, "affinity"),  # bound 2
        (2, 0, "affinity"),  # bound 3
        (3, 0, "spill"),  # bound 3: a fourth would exceed it
        (6, 4, "affinity"),  # bound 9
        (15, 4, "spill"),  # bound 15
    ],
)
def test_affinity_holds_until_the_bound_then_spills(home: int, other: int, rule: str) -> None:
    assert EPSILON == 0.5
    first = _first_choice(KEY, ["r1", "r2"])
    second = "r2" if first == "r1" else "r1"
    choice = route([Replica(first, home), Replica(second, other)], KEY)
    assert (choice.rule, choice.id) == (rule, first if rule == "affinity" else second)


def test_without_a_key_the_less_loaded_of_two_wins_and_ties_spread() -> None:
    rng = random.Random(1)
    assert {route([Replica("a", 5), Replica("b", 1)], None, rng).id for _ in range(20)} == {"b"}
    ties = Counter(route([Replica("a", 2), Replica("b", 2)], None, rng).id for _ in range(200))
    assert ties["a"] > 50 and ties["b"] > 50  # two gateways seeing the same snapshot do not herd
    many = [Replica(f"r{n}", 10) for n in range(7)] + [Replica("idle", 0)]
    picks = Counter(route(many, None, rng).id for _ in range(400))
    assert picks["idle"] > 400 / 8  # drawn in ~1/4 of the pairs, always chosen then
    assert all(route(many, None, rng).rule == "least_loaded" for _ in range(5))


def test_under_steady_arrivals_bounded_affinity_keeps_loads_near_the_mean() -> None:
    """One hot key (an agent's shared preamble) sent 200 times while nothing finishes: loads stay within the
    bound of each other instead of piling on the key's replica."""
    loads = {"a": 0, "b": 0, "c": 0}
    for _ in range(200):
        choice = route([Replica(i, n) for i, n in loads.items()], KEY)
        loads[choice.id] += 1
    assert max(loads.values()) <= (1 + EPSILON) * 200 / 3 + 1


def test_routing_costs_microseconds() -> None:
    replicas = [Replica(f"replica-{n:02}", n % 5) for n in range(8)]
    started = time.perf_counter()
    for n in range(2000):
        route(replicas, KEY if n % 2 else None)
    assert (time.perf_counter() - started) / 2000 < 1e-3  # far under a millisecond even on a busy CI box


def _key(request: Request) -> bytes | None:
    return request_routing(request).key


def _chat(system: str, *turns: str, tools: tuple[Tool, ...] = ()) -> Request:
    messages = [Message(role="system", parts=(TextPart(text=system),))] if system else []
    roles = ["user", "assistant"]
    messages += [Message(role=roles[n % 2], parts=(TextPart(text=t),)) for n, t in enumerate(turns)]  # type: ignore[arg-type]
    return Request(model="m", messages=tuple(messages), tools=tools)


def test_every_turn_of_a_conversation_has_its_first_turns_key() -> None:
    one = _key(_chat(SYSTEM, "Tell me about Paris."))
    three = _key(_chat(SYSTEM, "Tell me about Paris.", "Paris is a city.", "And its museums?"))
    assert one is not None and one == three


def test_a_short_prompt_has_no_key_and_goes_to_the_less_loaded() -> None:
    """Nothing worth finding in a cache: hashing it to a replica would only unbalance them."""
    assert _key(_chat("Be brief.", "Tell me about Paris.")) is None
    assert _key(Request(model="m", raw_prompt="Once upon a time")) is None
    assert _key(Request(model="m", raw_prompt="x" * MIN_PREFIX)) is not None
    assert prefix_blocks(["Be brief.", "user\x1fTell me about Paris."]) == ()


def test_conversations_behind_one_system_prompt_have_their_own_keys() -> None:
    system = "You are an agent. " * 300  # longer than a key reads of it
    tools = (Tool(name="read_file", description="Read a file"),)
    a = _key(_chat(system, "Fix the tests", tools=tools))
    b = _key(_chat(system, "Write the docs", tools=tools))
    assert a != b
    assert _key(_chat(SYSTEM, "Hi")) != _key(_chat(SYSTEM, "Hi", tools=tools))  # tools: preamble
    prompt = "Once upon a time " * 40
    assert _key(Request(model="m", raw_prompt=prompt)) == prefix_key([], prompt)


def test_the_replica_that_took_a_prefix_takes_its_continuations_within_the_bound() -> None:
    table = PrefixTable()
    system = "You are an agent with tools. " * 40  # ~1,100 characters: four blocks
    first = request_routing(_chat(system, "Task 1: fix the tests"))
    table.learn(first.blocks, "r2")
    second = request_routing(_chat(system, "Task 2: write the docs"))  # another key, the same preamble
    assert second.key != first.key and table.match(second.blocks, ["r1", "r2"]) == "r2"
    assert table.match(second.blocks, ["r1"]) is None  # r2 gone: nothing known
    replicas = [Replica("r1", 0), Replica("r2", 1)]
    assert route(replicas, second.key, preferred="r2").rule == "prefix"
    assert route([Replica("r1", 0), Replica("r2", 3)], second.key, preferred="r2").rule != "prefix"  # bound 2
    turn = request_routing(_chat(system, "Task 1: fix the tests", "Done.", "Now the docs"))
    assert turn.blocks[: len(first.blocks)] == first.blocks  # a conversation's next turn extends its blocks


def test_a_short_chats_next_turn_finds_the_replica_of_its_history() -> None:
    """Blocks end at every message too: a turn's hashes are all in the next turn's, however short its messages."""
    table = PrefixTable()
    question = "Tell me about the history of Paris, " * 12  # ~430 characters: under MIN_PREFIX alone
    first = request_routing(_chat("Be brief.", question, "Paris was founded " * 10))
    assert first.key is None and first.blocks
    table.learn(first.blocks, "r1")
    second = request_routing(_chat("Be brief.", question, "Paris was founded " * 10, "And its museums?"))
    assert second.blocks[: len(first.blocks)] == first.blocks
    assert table.match(second.blocks, ["r1", "r2"]) == "r1"


def test_prefix_blocks_cover_whole_blocks_and_the_table_stays_bounded() -> None:
    assert prefix_blocks(["x" * (MIN_PREFIX - 1)]) == ()
    assert len(prefix_blocks(["x" * 1024])) == 3  # at 512, 768, 1,024 characters
    assert len(prefix_blocks(["x" * 600])) == 2  # at 512 and at the part's end
    assert prefix_blocks(["ab" * 300, "c"]) != prefix_blocks(["ab" * 300 + "c"])
    table = PrefixTable(limit=100)
    for n in range(50):
        table.learn(prefix_blocks([f"{n} " * 1000]), f"r{n % 3}")
    assert len(table._where) <= 100


def test_a_replica_whose_kv_tier_holds_the_prompt_takes_it_within_the_bound() -> None:
    replicas = [Replica("r0", 0), Replica("r1", 1), Replica("r2", 0)]
    home = route(replicas, KEY).id
    holder = next(r.id for r in replicas if r.id != home)
    assert route(replicas, KEY, cached=[holder]) == Choice(holder, "tier"), "the tier beats a cold affinity"
    assert route(replicas, KEY, preferred=home, cached=[holder]) == Choice(home, "prefix"), "a warm slot beats it"
    busy = [Replica(r.id, 9 if r.id == holder else 0) for r in replicas]
    assert route(busy, KEY, cached=[holder]).rule != "tier", "a holder past the bound is passed over"


def test_a_runner_tags_its_entries_with_the_key_the_gateway_routes_by() -> None:
    from meshgate.protocols.prefix import prefix_key, request_prefix

    request = _chat(SYSTEM, "Task 1: fix the tests", "Done.", "Now the docs")
    assert prefix_key(*request_prefix(request)) == request_routing(request).key
