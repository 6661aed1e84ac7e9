"""``meshgate place``'s progress: follow ``GET /instances/{id}/events`` until the instance is ready or has failed
for good, and say each change in words to a person (stderr), with the time since it was placed.

The events are server-sent, one per change of the stored instance (``gateway.http.routes.cluster``): the event name
is the state (``starting``, ``ready``, ``failed``, ``deleted``) and the data the whole instance. What changes while
it starts is each node's runner (``starting`` -> ``ready``, or ``failed`` with its error) and, after a failure, the
re-placement (``attempts``, ``epoch``); those are what is printed. Imports httpx and the standard library only.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import httpx

__all__ = ["describe_placement", "follow", "sse_events"]


def sse_events(lines: Iterable[str]) -> Iterator[tuple[str, str]]:
    """``(event, data)`` for each server-sent event in ``lines`` (comments skipped, multi-line data joined)."""
    event = "message"
    data: list[str] = []
    for line in lines:
        if not line:
            if data:
                yield event, "\n".join(data)
            event, data = "message", []
        elif line.startswith(":"):
            continue
        elif line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data:
        yield event, "\n".join(data)


def describe_placement(instance: dict[str, Any]) -> str:
    """``gemma3:270m as instance 1a2b: llama_cpp single on vm[0:18] (550 MiB)``."""
    where = instance["placement"]
    shards = ", ".join(
        f"{s['node_id']}[{s['layer_start']}:{s['layer_end']}]"
        f" ({where['memory_per_node'].get(s['node_id'], 0) / 2**20:.0f} MiB)"
        for s in where["shards"]
    )
    return f"{instance['model']} as instance {instance['id']}: {where['backend']} {where['strategy']} on {shards}"


def _changes(before: dict[str, Any] | None, now: dict[str, Any]) -> list[str]:
    """What differs between two snapshots of an instance, in words."""
    out = []
    state = now["state"]
    if before is None or before["state"] != state:
        out.append(f"{state['state']}" + (f": {state['reason']}" if state.get("reason") else ""))
    if before is not None and before.get("attempts") != now.get("attempts"):
        out.append(f"re-placing (attempt {now['attempts']} of 3): {describe_placement(now)}")
    old = (before or {}).get("runners", {})
    for node, runner in sorted(now.get("runners", {}).items()):
        if old.get(node, {}).get("state") != runner["state"] or old.get(node, {}).get("epoch") != runner.get("epoch"):
            detail = f" ({runner['error']})" if runner.get("error") else ""
            out.append(f"runner on {node} {runner['state']}{detail}")
    return out


def follow(http: httpx.Client, instance_id: str, say: Callable[[str], None]) -> dict[str, Any] | None:
    """Print each change of instance ``instance_id`` until its event stream ends (ready, or failed for good);
    returns the last snapshot (``None`` if it was deleted meanwhile).

    Raises:
        httpx.HTTPStatusError: the gateway refused the event stream (unknown instance, not an admin key).
    """
    started, last = time.monotonic(), None
    # no read timeout: a big model may take minutes between two changes; the server ends the stream (10 minutes)
    with http.stream("GET", f"/instances/{instance_id}/events", timeout=httpx.Timeout(30.0, read=None)) as response:
        if response.status_code != 200:
            response.read()
            response.raise_for_status()
        for event, data in sse_events(response.iter_lines()):
            if event == "deleted":
                say(f"[{time.monotonic() - started:6.1f}s] the instance was deleted")
                return None
            now = json.loads(data)
            for change in _changes(last, now):
                say(f"[{time.monotonic() - started:6.1f}s] {change}")
            last = now
    return last
