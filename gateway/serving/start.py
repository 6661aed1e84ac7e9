"""Starting one generation on one ready replica (``Starter.begin``), for the dispatcher's retry loop.

``begin`` checks the prompt against the replica's context (``gateway.serving.context_fit``), takes a place in the
replica's fair queue (``gateway.serving.admission``), waits for a slot, and starts the runner's stream up to its
first event. It returns what happened as a value: ``Started`` (the slot and the first event), or ``Bigger``
when the request should move to a replica with a bigger context (``grow``, the dispatcher's module docstring).

Counting a prompt's tokens costs the runner CPU time in proportion to its size, so counts go through a second
fair queue per replica, one at a time (``counter``); only prompts whose size does not already show they fit are
counted, each request object once (``remembered``).

Imports the backends' interface, the protocols' model and the serving modules below it; the dispatcher imports
this.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass

from meshgate.backends.base import Backend, ModelCard, Runner
from meshgate.gateway.cluster.records import Instance
from meshgate.gateway.cluster.routing import Routing, prefix_blocks
from meshgate.gateway.serving import streams
from meshgate.gateway.serving.admission import Admission, Ticket
from meshgate.gateway.serving.context_fit import Fit, cap_output, fit_context, grown_context, needed_context
from meshgate.protocols.model import Event, Failed, GatewayError, KeepAlive, Priority, Request, error_from_info
from meshgate.protocols.prefix import prefix_key, request_prefix

__all__ = ["Bigger", "Job", "Started", "Starter", "Visit", "abandon", "connect", "keepalive_until", "request_routing"]


@dataclass(frozen=True)
class Job:
    """One generation on its way to a runner: what runs it, for whom, and the protocol's context rule."""

    card: ModelCard
    backend: Backend
    request: Request
    caller: str
    fit: Fit
    routing: Routing  # what routing reads of the prompt (``request_routing``)
    grow: bool  # may move to a replica with a bigger context (the dispatcher's module docstring)
    fitted: bool = False  # the request was fitted to a replica's context already (a resume)
    weight: float = 1.0  # the caller's share of its class's slots (``admission``)

    @property
    def priority(self) -> Priority:
        """The class the request waits in (``interactive`` unless it was settled as ``batch``)."""
        return "batch" if self.request.priority == "batch" else "interactive"


@dataclass(frozen=True)
class Started:
    """A generation that has its slot and its first event on ``instance``; the request as it was sent."""

    instance: Instance
    request: Request
    ticket: Ticket
    first: Event
    events: AsyncIterator[Event]

    async def close(self) -> None:
        self.ticket.release()
        await streams.aclose(self.events)


@dataclass(frozen=True)
class Bigger:
    """The request needs a replica with ``context`` tokens: the retry loop routes its next pass there."""

    context: int


class Visit:
    """One pass of the retry loop at a replica: ``settle`` tells the shared load, once, that the routed request
    reached the replica's queue (or left before); ``waiting`` that what comes next may take long."""

    __slots__ = ("_settle", "_waiting")

    def __init__(self, waiting: Callable[[], object] | None) -> None:
        self._waiting = waiting
        self._settle: Callable[[], None] | None = None

    def routed(self, settle: Callable[[], None]) -> None:
        self._settle = settle

    def settle(self) -> None:
        settle, self._settle = self._settle, None
        if settle is not None:
            settle()

    def waiting(self) -> None:
        if self._waiting is not None:
            self._waiting()


class Starter:
    """What starting a generation needs of the gateway: the replicas' generation queues (``admission``) and
    counting queues (``counting``), and the ``max_tokens`` setting."""

    def __init__(self, admission: Admission, max_tokens: int) -> None:
        self.admission = admission
        self.counting = Admission(parallel=1, max_queue=admission.max_queue)
        self.max_tokens = max_tokens
        self._longest_token: dict[str, int] = {}  # model -> Backend.token_bytes

    async def begin(self, job: Job, instance: Instance, visit: Visit) -> Started | Bigger:
        """``job`` on ``instance``: its prompt checked against the replica's context (``Bigger`` when it should
        move to a bigger one, once: never past the model's own, nor to what it has), a place in the replica's
        queue, the slot, the runner's first event. A first event that says the runner is gone raises
        ``BackendUnavailable`` (the loop moves on); any other failure raises its error."""
        runner = connect(instance, job.card, job.backend)
        request = job.request
        if not job.fitted:
            count = remembered(self.counter(instance.id, job.caller, runner))
            token_bytes = await self.token_bytes(job.card, job.backend)
            context, limit = instance.placement.context, job.card.context_length
            if job.grow:
                needed = await needed_context(request, context, limit, count, job.fit, token_bytes)
                bigger = grown_context(context, needed, limit) if needed else context
                if bigger > context:
                    return Bigger(bigger)
            request = await fit_context(request, context, count, job.fit, token_bytes)
            request = cap_output(request, self.max_tokens, clamp=True, context=context)
        placement = instance.placement
        ticket = self.admission.enter(
            instance.id,
            job.caller,
            placement.sequences,
            priority=job.priority,
            weight=job.weight,
            spares=placement.spares,
        )
        visit.settle()
        if not ticket.granted:
            visit.waiting()
        first, events = await streams.begin(runner, request, ticket)
        if isinstance(first, Failed):
            raise error_from_info(first.error)
        return Started(instance=instance, request=request, ticket=ticket, first=first, events=events)

    async def token_bytes(self, card: ModelCard, backend: Backend) -> int:
        """``backend.token_bytes(card)``, read once per model in a worker thread (it may read the model's files)."""
        key = f"{card.name}\0{card.path}"
        known = self._longest_token.get(key)
        if known is None:
            read = getattr(backend, "token_bytes", None)  # a Backend not derived from the base class may lack it
            known = self._longest_token[key] = await asyncio.to_thread(read, card) if read else 0
        return known

    def counter(self, instance_id: str, caller: str, runner: Runner) -> Callable[[Request], Awaitable[int]]:
        """``runner.count_tokens`` in ``caller``'s turn on the replica's counting queue; a full counting queue is
        ``Overloaded``, a caller that goes away leaves it."""

        async def count(request: Request) -> int:
            ticket = self.counting.enter(instance_id, caller)
            try:
                await ticket.wait()
                return await runner.count_tokens(request)
            finally:
                ticket.release()

        return count


async def keepalive_until(
    starting: asyncio.Future[Started], served: Callable[[Started], AsyncIterator[Event]], every: float
) -> AsyncIterator[Event]:
    """A streaming request's events while it starts: a keep-alive every ``every`` seconds until ``starting`` has its
    replica's first event (the replica came up, the request's turn came), then the ``served`` events; a failure to
    start as ``Failed``."""
    while not starting.done():
        await asyncio.wait({starting}, timeout=every)
        if not starting.done():
            yield KeepAlive()
    try:
        started = starting.result()
    except GatewayError as exc:
        yield Failed(error=exc.info())
        return
    events = served(started)
    async with streams.closing(events):
        async for event in events:
            yield event


async def abandon(starting: asyncio.Future[Started]) -> None:
    """A stream closed while (or after) it was starting: stop the start, or free what it got."""
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
    if not starting.cancelled() and starting.exception() is None:
        await starting.result().close()


def connect(instance: Instance, card: ModelCard, backend: Backend) -> Runner:
    """The runner of ``instance``, as its backend connects to the URLs its nodes reported."""
    urls = {node: status.url for node, status in instance.runners.items() if status.url}
    return backend.connect(card, instance.placement, urls)


def request_routing(request: Request) -> Routing:
    """What routing reads of ``request``, worked out when a router first asks: its prefix key (its system prompt
    and tools, and its first other message; a plain completion: its prompt) and the blocks of its whole text in
    order (``routing.prefix_blocks``)."""

    def derive() -> tuple[bytes | None, tuple[int, ...]]:
        preamble, first = request_prefix(request)
        if request.raw_prompt is not None:
            return prefix_key(preamble, first), prefix_blocks((request.raw_prompt,))
        turns = (f"{m.role}\x1f{m.text}" for m in request.messages if m.role != "system")
        return prefix_key(preamble, first), prefix_blocks([*preamble, *turns])

    return Routing(derive=derive)


def remembered(count: Callable[[Request], Awaitable[int]]) -> Callable[[Request], Awaitable[int]]:
    """``count`` that counts the same request object once (``needed_context``, then ``fit_context``)."""
    seen: list[tuple[Request, int]] = []

    async def once(request: Request) -> int:
        for known, tokens in seen:
            if known is request:
                return tokens
        tokens = await count(request)
        seen.append((request, tokens))
        return tokens

    return once
