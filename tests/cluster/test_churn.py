"""Per-instance structures hold only live instances (issue 37, 12): over thousands of instances created and deleted
(autoscaling, keep-alive, re-placement), a gateway's load board, admission gates and per-instance metrics keep
nothing of the ones that are gone."""

from __future__ import annotations

from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.store import MemoryStore
from meshgate.gateway.serving.admission import Admission
from meshgate.gateway.telemetry.metrics import GatewayMetrics
from meshgate.gateway.telemetry.record import RequestRecord


async def test_a_thousand_instances_come_and_go_and_only_the_live_ones_are_kept():
    live: set[str] = set()
    admission = Admission(parallel=2, max_queue=4)
    board = LoadBoard(MemoryStore(), admission, live=lambda: set(live))
    metrics = GatewayMetrics()
    for n in range(1000):
        instance_id = f"i{n}"
        live.add(instance_id)
        board.routed(instance_id)
        ticket = admission.enter(instance_id, "key:a")
        board.settled(instance_id)
        board.tally(instance_id).tokens += 3
        record = RequestRecord(f"r{n}")
        record.instance, record.prompt_tokens, record.generated_tokens = instance_id, 5, 3
        metrics.observe(record, "openai", "chat", "m", "200", 1.0)
        ticket.release()
        await board.sync()
        if n >= 2:
            live.discard(f"i{n - 2}")  # each lives for two rounds, then is deleted
        board.forget(board.live())  # what the board's loop does each pass
    metrics.forget_instances(live)  # what a scrape does
    assert live == {"i998", "i999"}
    assert set(board._tallies) <= live and set(board._pending) <= live
    assert set(admission.loads()) <= live
    assert {k[1] for k in metrics.instance_requests.values} <= live
    assert {k[1] for k in metrics.prompt_tokens.values} <= live
