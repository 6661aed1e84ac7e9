"""Model name -> replica -> runner: runs a request and hands its event stream to the protocol encoders.

    open_stream(request)
      resolve the model and its backend; prepare the request (``gateway.serving.prepare``, one pure function)
      _on_replica: the one retry loop                          (also for embeddings and token counts)
        route to a replica (``InstanceManager.acquire``: placed if there is none), wait until it is ready
        _begin: check the context (``gateway.serving.context_fit``), take a place in the replica's queue
          (``gateway.serving.admission``), wait for a slot, start the runner's stream and take its first event
        a replica that cannot be reached is failed (so it is re-placed) and the loop goes to another
      wrap the events: resumable on another replica (``gateway.serving.resume``), relayed (``streams.relay``)
      -> an ``EventStream`` that frees the slot when it is closed

The first event is awaited before anything is sent to the client, so a failure to start (unknown model,
unsupported feature, nothing fits, a full queue) is a real HTTP error status; a failure after that travels in the
stream as ``Failed``. A streaming request that has to wait (a replica coming up, its turn in the queue) gets
keep-alives from then on, and its failures to start become ``Failed`` too; a non-streaming one waits. A runner
that cannot be reached at the start of a request fails its replica and the request goes to another, up to
``START_RETRIES`` times; a stream whose replica fails after it started is resumed through the same loop.

A request that sets no ``num_ctx`` (nor does its model's Modelfile) and whose whole prompt does not fit its
replica's context moves, when ``grow_context`` is on (``Settings.n_ctx`` unset), to a replica with the context it
needs (``context_fit.needed_context``: doubled until it holds the prompt and some output, at most the model's
own), placed beside the others if none holds it yet; what fits nowhere is then refused (or trimmed) by the
protocol's rule. So a 4,096-token default keeps small requests on many slots while an Open WebUI chat with its
tool definitions, or an agent's long preamble, still gets an answer.

Counting a prompt's tokens costs the runner CPU time in proportion to its size (about 2 s for 1 MB of text), and
only prompts whose size does not already show they fit are counted. Those counts (and Anthropic's count_tokens)
go through a second fair queue per replica, one count at a time (``counting``): a client sending many huge
prompts waits for its own counts, while another client's request is counted after at most one of them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TypeVar

import msgspec

from meshgate.backends.base import Backend, Capabilities, ModelCard, Runner, check_embeddings
from meshgate.backends.registry import UserModel
from meshgate.gateway.cluster.instances import InstanceManager, given_up
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.records import Draining, Instance, Ready
from meshgate.gateway.cluster.routing import Routing, prefix_blocks, prefix_key
from meshgate.gateway.serving import streams
from meshgate.gateway.serving.admission import Admission, Ticket
from meshgate.gateway.serving.catalog import Catalog
from meshgate.gateway.serving.context_fit import Fit, cap_output, fit_context, grown_context, needed_context
from meshgate.gateway.serving.model_defaults import apply_defaults, end_turn_at_default_stops
from meshgate.gateway.serving.prepare import prepare
from meshgate.gateway.serving.resume import Resume, resumable
from meshgate.gateway.serving.streams import EventStream
from meshgate.gateway.telemetry import record as telemetry
from meshgate.protocols.model import (
    BackendTimeout,
    BackendUnavailable,
    Embeddings,
    EmbedRequest,
    Event,
    Failed,
    GatewayError,
    KeepAlive,
    NoCapacity,
    Request,
    UnknownModel,
    Usage,
    error_from_info,
)

__all__ = ["Dispatcher", "request_routing"]

log = logging.getLogger("meshgate.dispatch")
T = TypeVar("T")


START_RETRIES = 3
"""Replicas a request that finds its runner unreachable at its start moves on to (each reported, so re-placed):
during a node's restart a second replica may be going too."""

_UNREACHABLE = (BackendUnavailable,)
"""What sends a request to another replica: the runner (or its replica's placement) cannot be reached."""

_NOT_YET = (BackendUnavailable, BackendTimeout, NoCapacity)
"""What a resume waits through (its caller bounds the wait): a replica going too, or nowhere to go yet. Of these
only ``_UNREACHABLE`` fails the replica: a full queue (``Overloaded``) or no room is load, and a busy replica is
healthy."""


@dataclass(frozen=True)
class _Job:
    """One generation on its way to a runner: what runs it, for whom, and the protocol's context rule."""

    card: ModelCard
    backend: Backend
    request: Request
    caller: str
    fit: Fit
    routing: Routing  # what routing reads of the prompt (``request_routing``)
    grow: bool  # may move to a replica with a bigger context (the module docstring)
    fitted: bool = False  # the request was fitted to a replica's context already (a resume)


@dataclass(frozen=True)
class _Started:
    """A generation that has its slot and its first event on ``instance``; the request as it was sent."""

    instance: Instance
    request: Request
    ticket: Ticket
    first: Event
    events: AsyncIterator[Event]

    async def close(self) -> None:
        self.ticket.release()
        await streams.aclose(self.events)


class _Grow(Exception):
    """The request needs a replica with ``context`` tokens (``_begin``): the loop routes it there and makes
    ``then``, the same call that may not grow again."""

    def __init__(self, context: int, then: Callable[[Instance, _Visit], Awaitable[_Started]]) -> None:
        self.context, self.then = context, then


class Dispatcher:
    """Resolves models, finds or places their replicas, opens event streams."""

    def __init__(
        self,
        catalog: Catalog,
        backends: Sequence[Backend],
        choose,
        instances: InstanceManager,
        *,
        keepalive: float = 2.0,
        admission: Admission | None = None,
        max_tokens: int = 65536,
        user_models: Callable[[str], UserModel | None] = lambda name: None,
        loads: LoadBoard | None = None,
        grow_context: bool = False,
        resume_wait: float = 60.0,
    ) -> None:
        self.catalog = catalog
        self.resume_wait = resume_wait  # how long a stream whose replica failed may wait for another (0: never)
        self.grow_context = grow_context  # a request without num_ctx may get a bigger replica (module docstring)
        self.user_models = user_models  # a user model's stored defaults, by name (gateway.serving.model_defaults)
        self.max_tokens = max_tokens
        self.keepalive = keepalive
        self.admission = admission or Admission()
        self.counting = Admission(parallel=1, max_queue=self.admission.max_queue)
        self._longest_token: dict[str, int] = {}  # model -> Backend.token_bytes
        self.backends = list(backends)
        self._choose = choose
        self.instances = instances
        self.loads = loads  # the shared load: its tallies count what this gateway streams per instance

    # ------------------------------------------------------------------------------------------- models

    def models(self) -> list[ModelCard]:
        return self.catalog.models()

    def resolve(self, name: str, may_use: Callable[[str], bool] | None = None) -> ModelCard:
        """The model ``name`` names; ``UnknownModel`` when there is none or ``may_use`` (the caller's key) allows
        neither the name asked for nor the model's own."""
        telemetry.note_model(name)  # the request log's model, and the metrics' label once resolved
        card = self.catalog.resolve(name)
        if may_use is not None and not (may_use(name) or may_use(card.name)):
            raise UnknownModel(name)
        return card

    def backend_for(self, card: ModelCard) -> Backend:
        backend = self._choose(card=card, backends=self.backends)
        if backend is None:
            raise NoCapacity(f"no backend can serve model '{card.name}' (format {card.format})")
        return backend

    def capabilities(self, name: str, may_use: Callable[[str], bool] | None = None) -> Capabilities:
        """What the backend serving ``name`` can do for it; ``UnknownModel`` / ``NoCapacity`` as ``resolve`` and
        ``backend_for``."""
        card = self.resolve(name, may_use)
        return self.backend_for(card).capabilities(card)

    async def load(self, name: str, may_use: Callable[[str], bool] | None = None) -> Instance:
        """Place ``name`` if needed and wait until it is ready (Ollama's empty-prompt load)."""
        card = self.resolve(name, may_use)
        instance = await self.instances.acquire(card)
        return await self.instances.wait_ready(instance.id)

    async def unload(self, name: str) -> ModelCard:
        """Delete ``name``'s idle replicas now and the busy ones once idle (Ollama's ``keep_alive: 0``): another
        client's stream on a replica is never cut by it, and a deployment an admin pinned keeps its
        ``min_replicas`` (``InstanceManager.beyond_minimum``)."""
        card = self.resolve(name)
        busy = False
        left = await self.instances.beyond_minimum(card.name)
        for instance in self.instances.cached(card.name):
            if left <= 0:
                break
            if isinstance(instance.state, Draining) or given_up(instance):
                continue
            if self.loads is not None and self.loads.load(instance.id) > 0:
                busy = True
                continue
            with contextlib.suppress(GatewayError):
                await self.instances.delete(instance.id)
                left -= 1
        if busy and left > 0:
            await self.instances.set_expiry(card.name, time.time())  # the reconcile loop expires them when idle
        return card

    # ------------------------------------------------------------------------------------------- generation

    async def open_stream(
        self,
        request: Request,
        *,
        caller: str = "-",
        fit: Fit = Fit.PROMPT_AND_OUTPUT,
        clamp_output: bool = False,
        may_use: Callable[[str], bool] | None = None,
        on_usage: Callable[[Usage], None] | None = None,
    ) -> EventStream:
        """Start ``request``; raise its ``GatewayError`` if it fails before the first event (or, streaming, before
        it has to wait). Whoever opens the stream closes it (``EventStream.aclose``): that frees its slot.

        ``caller`` (an API key or a client address) is the line it waits in; ``fit`` the protocol's context rule;
        ``clamp_output`` cuts a ``max_tokens`` above the ``max_tokens`` setting to it (Ollama) instead of raising
        ``OutputTooLarge``. ``may_use`` restricts the models (a key's list); ``on_usage`` gets the last ``Usage``
        when the stream ends (a key's token budget).
        """
        card = self.resolve(request.model, may_use)
        backend = self.backend_for(card)
        ready = prepare(
            request,
            model=card.name,
            user_model=self.user_models(card.name),
            capabilities=backend.capabilities(card),
            max_tokens=self.max_tokens,
            clamp_output=clamp_output,
        )
        job = _Job(
            card=card,
            backend=backend,
            request=ready.request,
            caller=caller,
            fit=fit,
            routing=request_routing(ready.request),
            grow=self.grow_context and not isinstance(ready.request.num_ctx, int),
        )

        def served(started: _Started) -> EventStream:
            return self._served(job, started, on_usage=on_usage, end_turn=ready.defaults_end_turn)

        start = partial(self._on_replica, card, partial(self._begin, job), context=ready.context, routing=job.routing)
        if not request.stream:
            return served(await start())
        waits: asyncio.Future[_Started] = asyncio.get_running_loop().create_future()  # resolved when it must wait

        def waiting() -> None:
            if not waits.done():
                waits.set_result(None)  # type: ignore[arg-type]  # only done-ness is read

        starting = asyncio.ensure_future(start(waiting=waiting))
        try:
            await asyncio.wait({starting, waits}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (the client went away): nothing may keep the slot
            await _abandon(starting)
            raise
        if starting.done():
            return served(starting.result())
        return EventStream(self._keepalive_until(starting, served), partial(_abandon, starting))

    async def _on_replica(
        self,
        card: ModelCard,
        call: Callable[[Instance, _Visit], Awaitable[T]],
        *,
        context: int | None = None,
        routing: Routing | None = None,
        retries: int = START_RETRIES,
        waiting: Callable[[], object] | None = None,
        failed: tuple[Instance, GatewayError] | None = None,
        patient: bool = False,
    ) -> T:
        """The one retry loop: ``call(replica, visit)`` on a ready replica of ``card``.

        Each pass routes to a replica holding ``context`` tokens (``routing`` picks among them for a generation;
        one is placed when there is none) and waits until it is ready. A replica that cannot be reached (its
        placement fails, its runner does not answer, its first event says so) is failed, so it is re-placed, and
        the next pass goes to another replica or the re-placed one: ``retries`` times, or, ``patient`` (a resume,
        which its caller bounds in time), until one takes it, through ``_NOT_YET`` too. ``_Grow`` from ``call``
        routes the next pass to a bigger context, once. ``waiting`` is told before anything that may take long
        (``call`` tells it through ``visit`` too); ``failed`` is the replica (and why) a resume comes from.
        """
        retry_on = _NOT_YET if patient else _UNREACHABLE
        while True:
            if failed is not None:
                gone, error = failed
                log.warning("instance %s unreachable (%s); re-placing", gone.id, error.message)
                await self.instances.report_unreachable(gone, error.message)
                context = gone.placement.context
                if waiting is not None:
                    waiting()
            instance: Instance | None = None
            visit = _Visit(waiting)
            try:
                instance = await self.instances.acquire(card, context=context, routing=routing)
                if routing is not None:
                    visit.routed(partial(self._settle, instance.id))
                if not isinstance(instance.state, Ready):
                    visit.waiting()
                    instance = await self.instances.wait_ready(instance.id)
                return await call(instance, visit)
            except _Grow as grow:
                context, call = grow.context, grow.then  # type: ignore[assignment]  # T is _Started here
                continue
            except retry_on as error:
                if not patient and retries <= 0:
                    raise
                retries -= 1
                failed = (instance, error) if instance is not None and isinstance(error, _UNREACHABLE) else None
                await asyncio.sleep(0.5 if patient else 0.2 * (START_RETRIES - retries - 1))
            finally:
                visit.settle()

    async def _begin(self, job: _Job, instance: Instance, visit: _Visit) -> _Started:
        """``job`` on ``instance``: its prompt checked against the replica's context (``_Grow`` when it needs a
        bigger one), a place in the replica's queue, the slot, the runner's first event. A first event that says
        the runner is gone raises ``BackendUnavailable`` (the loop moves on); any other failure raises its error."""
        runner = self._connect(instance, job.card, job.backend)
        request = job.request
        if not job.fitted:
            count = _remembered(self._counter(instance.id, job.caller, runner))
            token_bytes = await self._token_bytes(job.card, job.backend)
            context, limit = instance.placement.context, job.card.context_length
            if job.grow:
                needed = await needed_context(request, context, limit, count, job.fit, token_bytes)
                if needed:
                    raise _Grow(grown_context(context, needed, limit), partial(self._begin, replace(job, grow=False)))
            request = await fit_context(request, context, count, job.fit, token_bytes)
            request = cap_output(request, self.max_tokens, clamp=True, context=context)
        ticket = self.admission.enter(instance.id, job.caller, instance.placement.sequences)
        visit.settle()
        if not ticket.granted:
            visit.waiting()
        first, events = await streams.begin(runner, request, ticket)
        if isinstance(first, Failed):
            raise error_from_info(first.error)
        return _Started(instance=instance, request=request, ticket=ticket, first=first, events=events)

    def _served(
        self, job: _Job, started: _Started, *, on_usage: Callable[[Usage], None] | None, end_turn: bool
    ) -> EventStream:
        """``started``'s events as the client reads them: resumed on another replica when this one fails
        (``gateway.serving.resume``), relayed (slot, telemetry, load, a key's budget), a default stop made a plain
        end of turn (``prepare.Prepared.defaults_end_turn``)."""
        telemetry.note_served(job.card.name, started.instance.id)
        events = started.events
        if self.resume_wait > 0:
            resume = self._resumer(job, started)
            events = resumable(events, resume, wait=self.resume_wait, keepalive=self.keepalive, seen=started.first)
        tally = self.loads.tally(started.instance.id) if self.loads is not None else None
        events = streams.relay(
            started.first, events, started.ticket.release, record=telemetry.current(), tally=tally, on_usage=on_usage
        )
        if end_turn:
            events = end_turn_at_default_stops(events)
        return EventStream(events, started.close)

    def _resumer(self, job: _Job, started: _Started) -> Resume:
        """``job``'s ``Resume``: through the retry loop, patiently, from the replica that broke off, with the request
        as it was sent and the tokens already sent as its ``resume``."""
        serving = [started.instance]

        async def resume(tokens: tuple[int, ...], error: GatewayError) -> AsyncIterator[Event]:
            # the lost stream's slot is free now: re-placed, its replica keeps its id and gate, and the resume must
            # not queue behind its own ticket (a moved stream's ticket is freed when ``resumable`` closes it)
            started.ticket.release()
            again = replace(job, request=msgspec.structs.replace(started.request, resume=tokens), fitted=True)
            moved = await self._on_replica(
                job.card,
                partial(self._begin, again),
                routing=job.routing,
                failed=(serving[0], error),
                patient=True,
            )
            serving[0] = moved.instance
            telemetry.note_served(job.card.name, moved.instance.id)
            return EventStream(streams.released(moved.first, moved.events, moved.ticket.release), moved.close)

        return resume

    async def _keepalive_until(
        self, starting: asyncio.Future[_Started], served: Callable[[_Started], EventStream]
    ) -> AsyncIterator[Event]:
        """Keep-alives until ``starting`` has its replica's first event (the replica came up, the request's turn
        came), then the served events; a failure to start as ``Failed``."""
        while not starting.done():
            await asyncio.wait({starting}, timeout=self.keepalive)
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

    def _connect(self, instance: Instance, card: ModelCard, backend: Backend) -> Runner:
        urls = {node: status.url for node, status in instance.runners.items() if status.url}
        return backend.connect(card, instance.placement, urls)

    def _settle(self, instance_id: str | None) -> None:
        if self.loads is not None and instance_id is not None:
            self.loads.settled(instance_id)

    # ------------------------------------------------------------------------------------------- embeddings, counts

    async def embed(self, request: EmbedRequest, may_use: Callable[[str], bool] | None = None) -> Embeddings:
        """``request``'s vectors, placing the model and waiting for it if needed; raise its ``GatewayError``.

        No inputs only loads the model (Ollama's empty ``input``) and returns no vectors. The tokens embedded go
        to the request's telemetry record (its log line's ``prompt_tokens``), as a stream's ``Usage`` does.
        """
        card = self.resolve(request.model, may_use)
        backend = self.backend_for(card)
        check_embeddings(backend.capabilities(card), card.name)

        async def call(instance: Instance, visit: _Visit) -> Embeddings:
            if not request.inputs:
                return Embeddings()
            return await self._connect(instance, card, backend).embed(request)

        result = await self._on_replica(card, call, retries=1)
        telemetry.note_embedded(card.name, result.prompt_tokens)
        return result

    async def count_tokens(
        self, request: Request, may_use: Callable[[str], bool] | None = None, caller: str = "-"
    ) -> int:
        """Tokens of ``request``'s prompt as the model reads it (Anthropic's count_tokens), counted in turn with
        every other count on the replica (``caller``'s line). A user model's stored system prompt is counted
        when the request has none, as ``open_stream`` would send it (``gateway.serving.model_defaults``)."""
        card = self.resolve(request.model, may_use)
        request = apply_defaults(request, self.user_models(card.name))
        backend = self.backend_for(card)

        async def call(instance: Instance, visit: _Visit) -> int:
            runner = self._connect(instance, card, backend)
            return await self._counter(instance.id, caller, runner)(request)

        return await self._on_replica(card, call, retries=1)

    async def _token_bytes(self, card: ModelCard, backend: Backend) -> int:
        """``backend.token_bytes(card)``, read once per model in a worker thread (it may read the model's files)."""
        key = f"{card.name}\0{card.path}"
        known = self._longest_token.get(key)
        if known is None:
            read = getattr(backend, "token_bytes", None)  # a Backend not derived from the base class may lack it
            known = self._longest_token[key] = await asyncio.to_thread(read, card) if read else 0
        return known

    def _counter(self, instance_id: str, caller: str, runner: Runner) -> Callable[[Request], Awaitable[int]]:
        """``runner.count_tokens`` in ``caller``'s turn on the replica's counting queue (see the module
        docstring); a full counting queue is ``Overloaded``, a caller that goes away leaves it."""

        async def count(request: Request) -> int:
            ticket = self.counting.enter(instance_id, caller)
            try:
                await ticket.wait()
                return await runner.count_tokens(request)
            finally:
                ticket.release()

        return count


async def _abandon(starting: asyncio.Future[_Started]) -> None:
    """A stream closed while (or after) it was starting: stop the start, or free what it got."""
    if not starting.done():
        starting.cancel()
        with contextlib.suppress(BaseException):
            await starting
    if not starting.cancelled() and starting.exception() is None:
        await starting.result().close()


class _Visit:
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


def request_routing(request: Request) -> Routing:
    """What routing reads of ``request``, worked out when a router first asks: its prefix key (its system prompt
    and tools, and its first other message; a plain completion: its prompt) and the blocks of its whole text in
    order (``routing.prefix_blocks``)."""

    def derive() -> tuple[bytes | None, tuple[int, ...]]:
        if request.raw_prompt is not None:
            return prefix_key((), request.raw_prompt), prefix_blocks((request.raw_prompt,))
        system = [m.text for m in request.messages if m.role == "system"][:1]
        preamble = system + [f"{t.name}\0{t.description or ''}" for t in request.tools]
        first = next((m.text for m in request.messages if m.role != "system"), "")
        turns = (f"{m.role}\x1f{m.text}" for m in request.messages if m.role != "system")
        return prefix_key(preamble, first), prefix_blocks([*preamble, *turns])

    return Routing(derive=derive)


def _remembered(count: Callable[[Request], Awaitable[int]]) -> Callable[[Request], Awaitable[int]]:
    """``count`` that counts the same request object once (``needed_context``, then ``fit_context``)."""
    seen: list[tuple[Request, int]] = []

    async def remembered(request: Request) -> int:
        for known, tokens in seen:
            if known is request:
                return tokens
        tokens = await count(request)
        seen.append((request, tokens))
        return tokens

    return remembered
