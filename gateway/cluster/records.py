"""The records the state store keeps about running models: instances, their lifecycle state, runner reports, events.

An ``Instance`` is one placed model: the chosen placement record (a ``Candidate``), a lifecycle state and the
status each node's agent reports for its runner. The state is a tagged union of frozen Structs, encoded as
``{"state": "ready"}`` or ``{"state": "failed", "reason": "..."}``.

``epoch`` counts re-placements of one instance (0 when first placed): a runner reports the epoch it was
started for, so a report from a superseded placement is recognisable. ``attempts`` counts re-placement tries.
``strategy`` and ``min_nodes`` are the constraints it was created with, kept for re-placement. ``expires_at``
(Unix seconds) is when a ready instance is unloaded (Ollama's ``keep_alive``); ``None``, the default, never.
``note`` says why a replica shares a node with another replica of its model.
A ``Deployment`` is the desired number of a model's replicas (its instances); a ``LoadReport`` one gateway's
current load on one instance, which routers on every gateway read.

All frozen msgspec Structs, serializable as they are (``msgspec.json``). Imports only msgspec, the standard
library and ``backends.placement``.
"""

from __future__ import annotations

from typing import Literal

import msgspec

from meshgate.backends.placement import Candidate, InstanceId, NodeId

__all__ = [
    "STATE_TYPES",
    "Deployment",
    "LoadReport",
    "Draining",
    "Failed",
    "Instance",
    "InstanceState",
    "Ready",
    "RunnerState",
    "RunnerStatus",
    "Starting",
    "StoreEvent",
    "state_tag",
]


class Starting(msgspec.Struct, frozen=True, tag_field="state", tag="starting"):
    """Placed; runners are being started."""


class Ready(msgspec.Struct, frozen=True, tag_field="state", tag="ready"):
    """Every runner reported ready; requests may go to the head."""


class Draining(msgspec.Struct, frozen=True, tag_field="state", tag="draining"):
    """Finishing in-flight requests before it is stopped; takes no new ones (routing skips it on every gateway).
    ``since`` and ``until`` (Unix seconds) bound the grace period: it is stopped once no gateway runs or queues
    anything on it, or at ``until`` whatever still runs (those streams resume on another replica)."""

    since: float = 0.0
    until: float = 0.0
    reason: str = ""
    replaced: bool = False  # its deployment kept its count (its node stops): a replacement is placed elsewhere


class Failed(msgspec.Struct, frozen=True, tag_field="state", tag="failed"):
    """A node left or a runner failed; a gateway may re-place it."""

    reason: str


InstanceState = Starting | Ready | Draining | Failed
STATE_TYPES: tuple[type, ...] = (Starting, Ready, Draining, Failed)

RunnerState = Literal["starting", "ready", "failed", "stopped"]


def state_tag(state: type | InstanceState) -> str:
    """The wire tag of a state class or value (``Ready`` -> ``"ready"``)."""
    cls = state if isinstance(state, type) else type(state)
    if cls not in STATE_TYPES:
        raise TypeError(f"not an instance state: {cls!r}")
    return cls.__struct_config__.tag  # type: ignore[attr-defined]  # msgspec sets it on every Struct class


class RunnerStatus(msgspec.Struct, frozen=True):
    """What one node's agent reports about its runner process for an instance."""

    node_id: NodeId
    state: RunnerState
    url: str | None = None
    pid: int | None = None
    error: str | None = None
    epoch: int = 0


class Instance(msgspec.Struct, frozen=True):
    """One placed model. ``runners`` is keyed by node id; times are Unix seconds."""

    id: InstanceId
    model: str
    placement: Candidate
    state: InstanceState
    created_at: float
    updated_at: float
    runners: dict[str, RunnerStatus] = msgspec.field(default_factory=dict)
    epoch: int = 0
    attempts: int = 0
    strategy: str | None = None
    min_nodes: int | None = None
    expires_at: float | None = None
    note: str | None = None


class StoreEvent(msgspec.Struct, frozen=True):
    """One entry of the audit stream. ``id`` is ordered (``"<ms>-<seq>"``, Redis stream ids); ``at`` Unix seconds."""

    id: str
    at: float
    kind: str
    instance_id: str | None = None
    node_id: str | None = None
    message: str = ""
    data: dict[str, str] | None = None


class Deployment(msgspec.Struct, frozen=True, kw_only=True):
    """How many replicas (instances) of ``model`` the cluster should run: the desired count every gateway, and a
    restarted one, agree on. ``context`` is the tokens each replica holds (``None``: the backend's default);
    ``min_replicas`` and ``max_replicas`` bound autoscaling; ``scaled_at`` is when the autoscaler last changed
    it (its cooldown, shared by every gateway); times are Unix seconds. ``pinned``: an admin placed it or set
    its bounds (``POST /instances``, ``PUT /deployments``), so a request's ``keep_alive`` never takes it below
    ``min_replicas``; one a first request placed (not pinned) unloads whole, as Ollama's does."""

    model: str
    replicas: int = 1
    min_replicas: int = 1
    max_replicas: int = 1
    context: int | None = None
    updated_at: float = 0.0
    scaled_at: float = 0.0
    pinned: bool = False


class LoadReport(msgspec.Struct, frozen=True, array_like=True):
    """One gateway's load on one instance, as it publishes it about four times a second: generations
    ``running`` and ``queued`` for a slot, and since it started, ``tokens`` streamed and ``prefix_hits``
    (generations whose prompt began with tokens the runner still held). ``at`` is the gateway's Unix time."""

    running: int = 0
    queued: int = 0
    tokens: int = 0
    prefix_hits: int = 0
    at: float = 0.0
