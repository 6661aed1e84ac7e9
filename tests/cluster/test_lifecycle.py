"""The instance lifecycle rule (``lifecycle.plan``) as a table: one instance, the nodes, the load and the time in;
the step a reconcile pass takes for it out."""

from __future__ import annotations

import pytest

from meshgate.backends.placement import NodeId
from meshgate.gateway.cluster.lifecycle import (
    MAX_ATTEMPTS,
    Drain,
    Expire,
    Fail,
    Launch,
    Promote,
    Remove,
    Replace,
    Stop,
    plan,
    shard_plan,
)
from meshgate.gateway.cluster.records import Draining, Failed, Ready, RunnerStatus, Starting
from tests.cluster.test_store import instance

NOW = 1000.0
AB = {NodeId("a"), NodeId("b")}


def ready_runners(epoch: int = 0, **states: str) -> dict[str, RunnerStatus]:
    return {
        n: RunnerStatus(node_id=NodeId(n), state=states.get(n, "ready"), epoch=epoch, error="boom") for n in ("a", "b")
    }


DRAINING = Draining(since=995.0, until=1020.0, reason="deleted")

# (case, instance fields, live nodes, stopping nodes, load, joined, expected step or None, words in its text)
CASES = [
    ("starting, every runner ready", {"runners": ready_runners()}, AB, {}, 0, False, Promote, None),
    ("starting, one runner still starting", {"runners": ready_runners(b="starting")}, AB, {}, 0, False, None, None),
    (
        "a runner of an older epoch failed: no matter",
        {"epoch": 1, "runners": ready_runners(epoch=0, a="failed")},
        AB,
        {},
        0,
        False,
        None,
        None,
    ),
    ("a runner failed", {"runners": ready_runners(a="failed")}, AB, {}, 0, False, Fail, "runner on a failed: boom"),
    ("ready, a node left", {"state": Ready()}, {NodeId("a")}, {}, 0, False, Fail, "node b left the cluster"),
    ("ready, nothing wrong", {"state": Ready(), "runners": ready_runners()}, AB, {}, 3, False, None, None),
    ("ready past keep-alive, idle", {"state": Ready(), "expires_at": 999.0}, AB, {}, 0, False, Expire, None),
    ("ready past keep-alive, serving", {"state": Ready(), "expires_at": 999.0}, AB, {}, 1, False, None, None),
    ("ready on a draining node", {"state": Ready()}, AB, {"b": 1030.0}, 2, False, Drain, "node b is draining"),
    ("starting on a draining node", {}, AB, {"a": 1030.0}, 0, False, Fail, "node a is draining"),
    ("draining, still serving", {"state": DRAINING}, AB, {}, 2, False, None, None),
    ("draining, idle just now", {"state": Draining(since=999.5, until=1020.0)}, AB, {}, 0, False, None, None),
    ("draining, idle", {"state": DRAINING}, AB, {}, 0, False, Remove, "its streams finished in 5.0s"),
    (
        "draining, grace over",
        {"state": Draining(since=990.0, until=999.0, reason="node b is draining")},
        AB,
        {},
        2,
        False,
        Remove,
        "grace ended with 2 running or queued",
    ),
    ("draining, its node left", {"state": DRAINING}, {NodeId("a")}, {}, 2, False, Remove, "node b left"),
    ("failed, tries left", {"state": Failed(reason="x"), "attempts": 1}, AB, {}, 0, False, Replace, None),
    ("failed, no tries left", {"state": Failed(reason="x"), "attempts": MAX_ATTEMPTS}, AB, {}, 0, False, None, None),
    (
        "failed, no tries left, a node joined",
        {"state": Failed(reason="x"), "attempts": MAX_ATTEMPTS},
        AB,
        {},
        0,
        True,
        Replace,
        None,
    ),
]


@pytest.mark.parametrize(
    ("fields", "nodes", "stopping", "load", "joined", "kind", "words"),
    [case[1:] for case in CASES],
    ids=[case[0] for case in CASES],
)
def test_plan_is_a_table(fields, nodes, stopping, load, joined, kind, words) -> None:
    one = instance("i1", **{"state": Starting(), **fields})
    steps = plan([one], nodes, stopping, lambda _: load, NOW, joined)
    if kind is None:
        assert steps == []
        return
    [step] = steps
    assert type(step) is kind and step.instance_id == "i1"
    if words is not None:
        text = getattr(step, "why", None) or getattr(step, "reason", "")
        assert words in text, text
    if isinstance(step, Drain):
        assert step.until == 1030.0
    if isinstance(step, Replace):
        assert step.fresh == joined


def test_plan_keeps_the_order_of_the_instances() -> None:
    ready = instance("r", state=Ready(), expires_at=1.0)
    starting = instance("s", runners=ready_runners())
    assert [type(s) for s in plan([ready, starting], AB, {}, lambda _: 0, NOW)] == [Expire, Promote]


# ------------------------------------------------------------------------------------------- a node's runners


def test_shard_plan_launches_stops_and_reports_deaths() -> None:
    here = NodeId("a")
    mine = instance("mine", nodes=("a",), state=Ready())
    moved = instance("moved", nodes=("b",), state=Ready())  # re-placed off this node
    newer = instance("newer", nodes=("a", "b"), epoch=2)
    dead = instance("dead", nodes=("a",), state=Ready())
    failed = instance("failed", nodes=("a",), state=Failed(reason="x"))
    fresh = instance("fresh", nodes=("a",))
    running = {"mine": (0, True), "moved": (0, True), "newer": (1, True), "dead": (0, False), "gone": (0, True)}
    steps = shard_plan(here, [mine, moved, newer, dead, failed, fresh], running, set(), set())
    assert {(type(s).__name__, getattr(s, "instance_id", None) or s.instance.id) for s in steps} == {
        ("Stop", "moved"),
        ("Stop", "newer"),  # its epoch moved on: the old process goes, the new epoch is launched next pass
        ("Stop", "gone"),
        ("Died", "dead"),
        ("Launch", "fresh"),
    }
    assert shard_plan(here, [fresh], {}, {"fresh"}, set()) == [], "already being launched"
    assert shard_plan(here, [fresh], {}, set(), {("fresh", 0)}) == [], "reported failed for its epoch"
    assert [type(s) for s in shard_plan(here, [newer], {}, set(), {("newer", 1)})] == [Launch]
    assert isinstance(shard_plan(here, [], {"x": (3, True)}, set(), set())[0], Stop)
