"""A state store that restarted empty: how each process finds out, and what it puts back.

Redis without persistence (or with it, after a ``FLUSHALL`` or a failover to an empty replica) comes back with
nothing: no nodes, no instances, no deployments, no keys. The processes around it still hold all of that: each
agent its runners, each gateway its cached view of every instance and the deployments it last read. The store's
``incarnation()`` (a random token the first caller on an empty store makes) tells them it happened:

* a gateway (``InstanceManager``) that sees a new incarnation puts back every deployment and instance it knew
  (``republish``), each only where nothing of that name is stored yet (another gateway may have been first, or a
  client may have created it since), with the same ids, epochs and runner reports: the replicas serve on;
* an agent (``NodeAgent``) keeps the runners placed on it for ``REPUBLISH_WAIT`` seconds while their instances
  are missing from a new store, instead of stopping them as deleted, and re-reports each once it is back;
* nodes come back with their next heartbeat, links with the next probe, the cluster secret with the agents'
  heartbeats (``StateStore.cluster_secret``); keys do not come back: auth stays on (the seal each gateway keeps,
  ``auth.keys``) and only a bootstrap admin key is let in until keys are made again.

A store restarted from its append-only file keeps its incarnation: nothing is republished.

Imports the records and the store's interface only.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from meshgate.gateway.cluster.records import Deployment, Instance
from meshgate.gateway.cluster.store import StateStore

__all__ = ["REPUBLISH_WAIT", "Incarnation", "republish"]

log = logging.getLogger(__name__)

REPUBLISH_WAIT = 30.0
"""Seconds an agent keeps the runners of instances a store that restarted empty no longer has, for a gateway to
put them back; past it they are stopped as deleted."""


class Incarnation:
    """The store's incarnation as this process last accepted it."""

    def __init__(self, store: StateStore) -> None:
        self.store = store
        self.known: str | None = None

    async def new(self) -> str | None:
        """The store's incarnation if it is not the one this process knew (it restarted empty meanwhile); None when
        it is, or when this process knew none (it began on this store). ``accept`` it once dealt with."""
        found = await self.store.incarnation()
        if self.known is None:
            self.known = found
        return None if found == self.known else found

    def accept(self, incarnation: str) -> None:
        self.known = incarnation


async def republish(
    store: StateStore, deployments: Iterable[Deployment], instances: Iterable[Instance], by: str
) -> tuple[int, int]:
    """Put back what a store that restarted empty lost and ``by`` knew: each deployment and instance only where
    none of its model or id is stored now. How many of each it put back."""
    put_deployments = sum([await store.put_deployment(d, if_absent=True) for d in deployments])
    put_instances = sum([await store.put_instance(i, if_absent=True) for i in instances])
    what = f"{put_instances} instances and {put_deployments} deployments"
    log.warning("the state store restarted empty; gateway %s put back the %s it knew", by, what)
    await store.append_event("store.republished", f"the state store restarted empty: gateway {by} put back {what}")
    return put_deployments, put_instances
