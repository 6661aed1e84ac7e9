"""What must hold once an episode's faults have healed and the cluster has had ``SETTLE`` seconds: every
deployment within its bounds with as many ready replicas as it asks for, no replica still failed, no slot or
queue place held at rest, and no per-instance table (a gateway's admission gates, its load board) keeping an
instance that is gone. The checks that hold at every step are where the step happens: the store's audit of each
write (``store.SimStore``), each request's own (``operations.client``)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from meshgate.gateway.cluster.records import Deployment, Failed, Instance, Ready
from meshgate.gateway.cluster.store import deployment_json, instance_json
from tests.sim.clock import now
from tests.sim.shape import GRACE, SETTLE

if TYPE_CHECKING:
    from tests.sim.episode import Episode


def at_rest(ep: Episode) -> None:
    world = ep.world
    if ep.clients:
        world.violate(f"{len(ep.clients)} requests still open {SETTLE:.0f}s after the cluster healed")
    stored: list[Instance] = [instance_json.decode(raw) for raw in world.store.inner._instances.values()]
    deployments: list[Deployment] = [deployment_json.decode(raw) for raw in world.store.inner._deployments.values()]
    for model, at in ep.wiped.items():  # unless a delete or an unload may have removed it since (a drain's grace)
        if ep.lowered.get(model, -math.inf) < at - GRACE - 5 and model not in {d.model for d in deployments}:
            world.violate(f"{model}'s deployment, in the store before it restarted empty, was never put back")
    for deployment in deployments:
        model = deployment.model
        if not deployment.min_replicas <= deployment.replicas <= deployment.max_replicas:
            world.violate(f"{model}: {deployment.replicas} replicas outside {deployment.min_replicas}..")
        ready = [i for i in stored if i.model == model and isinstance(i.state, Ready)]
        if len(ready) < deployment.replicas:
            world.violate(
                f"{model}: {len(ready)} ready of {deployment.replicas} after {SETTLE:.0f}s healed: "
                + ", ".join(f"{i.id} {type(i.state).__name__} attempts {i.attempts}" for i in stored)
            )
    # a gateway forgets a gone instance at its next load pass (every second at most): one deleted in the last two
    # seconds may still be there
    ids = {i.id for i in stored} | {i for i, at in world.deleted_at.items() if now() - at < 2.0}
    for gateway in ep.gateways.values():
        for instance_id, load in gateway.admission.loads().items():
            if load.active or load.queued:
                world.violate(f"{gateway.name}: {load.active} slots, {load.queued} queued on {instance_id} at rest")
            if instance_id not in ids:
                world.violate(f"{gateway.name}: admission still keeps {instance_id}, which is gone")
        for instance_id in gateway.loads._tallies:
            if instance_id not in ids:
                world.violate(f"{gateway.name}: the load board still keeps {instance_id}, which is gone")
    for instance in stored:
        if isinstance(instance.state, Failed):
            world.violate(f"{instance.id} still failed after the cluster healed: {instance.state.reason}")
