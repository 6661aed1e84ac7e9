"""Model name -> instance -> runner; runs a request and hands its event stream to the protocol encoders.

The first event is awaited before anything is sent to the client, so a failure to start (unknown model,
unsupported feature, nothing fits) is a real HTTP error status; a failure after that travels in the stream as
``Failed``. A model with no instance is placed automatically (``InstanceManager.acquire``); a streaming client
gets keep-alives while it comes up, a non-streaming one waits. A runner that cannot be reached at the start of a
request fails its instance (so it is re-placed) and the request is retried on another replica or the new one, up
to ``START_RETRIES`` times; a stream whose replica fails after it started is resumed (``gateway.serving.resume``).
``embed`` is a plain call that follows the same path (place, wait, connect, retry once if unreachable) and raises
its error.

Before a generation may wait for a slot, its prompt is checked against the instance's context
(``gateway.serving.context_fit``, the protocol's rule); then it takes its place in the instance's bounded, fair queue
(``gateway.serving.admission``, the caller named by the route). What cannot fit and a full queue are refused at once; a
streaming request that waits for its turn gets keep-alives and leaves the queue if its client goes away. The slot
is held until the event stream ends or is closed. Embeddings are not queued.

A request that sets no ``num_ctx`` (nor does its model's Modelfile) and whose whole prompt does not fit its
replica's context is moved, when ``grow_context`` is on (``Settings.n_ctx`` unset), to a replica with the context
it needs (``context_fit.needed_context``: doubled until it holds the prompt and some output, at most the model's
own), placed beside the others if none holds it yet; what fits nowhere is then refused (or trimmed) by the
protocol's rule as before. So a 4,096-token default keeps small requests on many slots while an Open WebUI chat
with its tool definitions, or an agent's long preamble, still gets an answer.

Counting a prompt's tokens costs the runner CPU time in proportion to its size (about 2 s for 1 MB of text), and
only prompts whose size does not already show they fit are counted. Those counts (and Anthropic's count_tokens)
go through a second fair queue per instance, one count at a time (``counting``): a client sending many huge
prompts waits for its own counts, while another client's request is counted after at most one of them and never
competes with a pile of them for the runner's cores.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec

from meshgate.backends.base import (
    Backend,
    Capabilities,
    ModelCard,
    ModelSource,
    Runner,
    check_embeddings,
)
from meshgate.backends.registry import UserModel
from meshgate.gateway.cluster.instances import InstanceManager
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.records import Instance, Ready
from meshgate.gateway.cluster.routing import Routing, prefix_blocks, prefix_key
from meshgate.gateway.serving import streams
from meshgate.gateway.serving.admission import Admission, Ticket
from meshgate.gateway.serving.context_fit import Fit, cap_output, fit_context, grown_context, needed_context
from meshgate.gateway.serving.model_defaults import apply_defaults, end_turn_at_default_stops
from meshgate.gateway.serving.prepare import prepare
from meshgate.gateway.serving.resume import Resume, resumable
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

__all__ = ["Dispatcher", "normalize_model_name", "request_routing"]

log = logging.getLogger("meshgate.dispatch")
T = TypeVar("T")


START_RETRIES = 3
"""Replicas a generation that finds its runner unreachable at its start moves on to (each reported, so re-placed):
during a node's restart a second replica may be going too."""


def normalize_model_name(name: str) -> str:
    """Ollama-style names: ``name:tag`` with ``latest`` implied."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


class Catalog:
    """The models the model sources offer, by name."""

    def __init__(self, sources: Sequence[ModelSource]) -> None:
        self.sources = list(sources)
        self._cards: dict[str, ModelCard] = {}

    def refresh(self) -> list[ModelCard]:
        """Ask every source for its models (blocking: a source may assemble files)."""
        cards: dict[str, ModelCard] = {}
        for source in self.sources:
            try:
                for card in source.models():
                    cards.setdefault(card.name, card)
            except Exception:
                log.exception("model source %r failed; its models are not listed", source.name)
        self._cards = cards
        return list(cards.values())

    def models(self) -> list[ModelCard]:
        return list(self._cards.values())

    def resolve(self, name: str) -> ModelCard:
        """The card for a client's model name; ``UnknownModel`` if none."""
        card = self._cards.get(name) or self._cards.get(normalize_model_name(name))
        if card is None and name.endswith(":latest"):
            card = self._cards.get(name.removesuffix(":latest"))
        if card is None:
            raise UnknownModel(name)
        return card


@dataclass(frozen=True)
class _Job:
    """One generation on its way to a runner: what runs it, for whom, and the protocol's context rule."""

    card: ModelCard
    backend: Backend
    request: Request
    caller: str
    fit: Fit
    on_usage: Callable[[Usage], None] | None = None
    routing: Routing | None = None  # what routing reads of the prompt (``request_routing``)


class Dispatcher:
    """Resolves models, finds or places their instances, opens event streams."""

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
        """Delete ``name``'s idle instances now and the busy ones once idle (Ollama's ``keep_alive: 0``): another
        client's stream on a replica is never cut by it."""
        card = self.resolve(name)
        busy = False
        for instance in self.instances.cached(card.name):
            if self.loads is not None and self.loads.load(instance.id) > 0:
                busy = True
                continue
            with contextlib.suppress(GatewayError):
                await self.instances.delete(instance.id)
        if busy:
            await self.instances.set_expiry(card.name, time.time())  # the reconcile loop expires them when idle
        return card

    async def open_stream(
        self,
        request: Request,
        *,
        caller: str = "-",
        fit: Fit = Fit.PROMPT_AND_OUTPUT,
        clamp_output: bool = False,
        may_use: Callable[[str], bool] | None = None,
        on_usage: Callable[[Usage], None] | None = None,
    ) -> AsyncIterator[Event]:
        """Start ``request``; raise its ``GatewayError`` if it fails before the first event.

        ``caller`` (an API key or a client address) is the line it waits in; ``fit`` the protocol's context rule;
        ``clamp_output`` cuts a ``max_tokens`` above the ``max_tokens`` setting to it (Ollama) instead of raising
        ``OutputTooLarge``. The request is prepared first (``gateway.serving.prepare``: output cap, model defaults,
        capabilities, default stops). Raises ``ContextLengthExceeded`` and ``Overloaded`` before waiting for
        anything but the model itself. ``may_use`` restricts the models (a key's list); ``on_usage`` gets the last
        ``Usage`` when the stream ends (a key's token budget).
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
        request, routing = ready.request, request_routing(ready.request)
        instance = await self.instances.acquire(card, context=ready.context, routing=routing)
        job = _Job(
            card=card, backend=backend, request=request, caller=caller, fit=fit, on_usage=on_usage, routing=routing
        )
        if not isinstance(instance.state, Ready) and request.stream:
            events = self._keepalive_until(lambda: self._start(instance, job))
        else:
            events = await self._start(instance, job)
        return end_turn_at_default_stops(events) if ready.defaults_end_turn else events

    async def _start(
        self, instance: Instance, job: _Job, retry: int = START_RETRIES, grow: bool = True
    ) -> AsyncIterator[Event]:
        """Check the context (moving to a bigger replica when the request may ``grow``), take a place in the
        queue, generate (a waiting stream gets keep-alives). The request was routed to ``instance``: it is settled
        there once in the queue, or on the way out before."""
        settled = False
        try:
            if not isinstance(instance.state, Ready):
                instance = await self.instances.wait_ready(instance.id)
            runner = self._connect(instance, job.card, job.backend)
            try:
                count = _remembered(self._counter(instance.id, job.caller, runner))
                token_bytes = await self._token_bytes(job.card, job.backend)
                if grow and self.grow_context and not isinstance(job.request.num_ctx, int):
                    bigger = await self._bigger(instance, job, count, token_bytes)
                    if bigger is not None:
                        self._settle(instance.id)
                        settled = True
                        if not isinstance(bigger.state, Ready) and job.request.stream:
                            return self._keepalive_until(lambda: self._start(bigger, job, retry, grow=False))
                        return await self._start(bigger, job, retry, grow=False)
                request = await fit_context(job.request, instance.placement.context, count, job.fit, token_bytes)
            except BackendUnavailable as error:
                if not retry:
                    raise
                self._settle(instance.id)
                settled = True
                return await self._start(await self._replace(instance, job.card, error, job), job, retry - 1)
            request = cap_output(request, self.max_tokens, clamp=True, context=instance.placement.context)
            ticket = self.admission.enter(instance.id, job.caller, instance.placement.sequences)
        finally:
            if not settled:
                self._settle(instance.id)
        if not ticket.granted and request.stream:
            stream = self._keepalive_until(lambda: self._generate(instance, job, runner, request, ticket, retry))
            streams.on_drop(stream, ticket.release)  # dropped before it started: leave the queue all the same
            return stream
        return await self._generate(instance, job, runner, request, ticket, retry)

    async def _generate(
        self, instance: Instance, job: _Job, runner: Runner, request: Request, ticket: Ticket, retry: int
    ) -> AsyncIterator[Event]:
        """Wait for ``ticket``'s turn, then start the generation, which frees the slot when its stream ends."""
        first, events = await streams.begin(runner, request, ticket)
        if isinstance(first, Failed):
            error = error_from_info(first.error)
            if retry and isinstance(error, BackendUnavailable):
                await asyncio.sleep(0.2 * (START_RETRIES - retry))  # a node going away: its replicas fail in turn
                return await self._start(await self._replace(instance, job.card, error, job), job, retry - 1)
            raise error
        tally = self.loads.tally(instance.id) if self.loads is not None else None
        if self.resume_wait > 0:  # a replica that fails mid-stream hands the stream on (``gateway.serving.resume``)
            resume = self._resumer(instance, job, request)
            events = resumable(events, resume, wait=self.resume_wait, keepalive=self.keepalive, seen=first)
        return streams.chain(
            first, events, ticket.release, job.on_usage, served=(job.card.name, instance.id), tally=tally
        )

    def _resumer(self, instance: Instance, job: _Job, request: Request) -> Resume:
        """``job``'s ``Resume``: fail the replica that broke off (so it is re-placed), route the request again (to
        another replica, or the re-placed one once ready), wait for a slot there and start the request with the
        tokens already sent as its ``resume``."""
        serving = [instance]

        async def resume(tokens: tuple[int, ...], error: GatewayError) -> AsyncIterator[Event]:
            while True:  # until a replica takes it, or the caller's bound (``resume_wait``) runs out
                await self.instances.report_unreachable(serving[0], error.message)
                context = serving[0].placement.context
                try:
                    replica = await self.instances.acquire(job.card, context=context, routing=job.routing)
                    self._settle(replica.id)
                    if not isinstance(replica.state, Ready):
                        replica = await self.instances.wait_ready(replica.id)
                    serving[0] = replica
                    return await self._continue(replica, job, msgspec.structs.replace(request, resume=tokens))
                except (BackendUnavailable, BackendTimeout, NoCapacity) as exc:  # going too, or nowhere to go yet
                    error = exc
                    await asyncio.sleep(0.5)  # its failure reaches the store; a node may come back

        return resume

    async def _continue(self, replica: Instance, job: _Job, request: Request) -> AsyncIterator[Event]:
        """``request`` (a resume) started on ``replica`` in ``job.caller``'s turn; its events, which free the slot
        when they end. A failure to start raises its ``GatewayError``."""
        runner = self._connect(replica, job.card, job.backend)
        ticket = self.admission.enter(replica.id, job.caller, replica.placement.sequences)
        first, events = await streams.begin(runner, request, ticket)
        if isinstance(first, Failed):
            raise error_from_info(first.error)
        record = telemetry.current()
        if record is not None:
            record.instance = replica.id
        stream = streams.released(first, events, ticket.release)
        streams.on_drop(stream, ticket.release)
        return stream

    async def _bigger(
        self, instance: Instance, job: _Job, count: Callable[[Request], Awaitable[int]], token_bytes: int
    ) -> Instance | None:
        """A replica (routed) with the context ``job``'s whole prompt needs when ``instance``'s is too small and
        the model's own is bigger; ``None`` when it fits, or when no bigger replica can be had."""
        context, limit = instance.placement.context, job.card.context_length
        needed = await needed_context(job.request, context, limit, count, job.fit, token_bytes)
        if not needed:
            return None
        bigger = await self.instances.acquire(
            job.card, context=grown_context(context, needed, limit), routing=job.routing
        )
        if bigger.placement.context > context:
            return bigger
        if job.routing is not None:
            self._settle(bigger.id)  # the largest there is, no bigger than this one: stay
        return None

    def _connect(self, instance: Instance, card: ModelCard, backend: Backend) -> Runner:
        urls = {node: status.url for node, status in instance.runners.items() if status.url}
        return backend.connect(card, instance.placement, urls)

    async def _replace(
        self, instance: Instance, card: ModelCard, error: GatewayError, job: _Job | None = None
    ) -> Instance:
        """Fail an instance whose runner cannot be reached (so it is re-placed); the instance to use now (a
        generation's ``job`` is routed to it)."""
        log.warning("instance %s unreachable (%s); re-placing", instance.id, error.message)
        await self.instances.report_unreachable(instance, error.message)
        routing = job.routing if job is not None else None
        return await self.instances.acquire(card, context=instance.placement.context, routing=routing)

    def _settle(self, instance_id: str) -> None:
        if self.loads is not None:
            self.loads.settled(instance_id)

    async def embed(self, request: EmbedRequest, may_use: Callable[[str], bool] | None = None) -> Embeddings:
        """``request``'s vectors, placing the model and waiting for it if needed; raise its ``GatewayError``.

        No inputs only loads the model (Ollama's empty ``input``) and returns no vectors. The tokens embedded go
        to the request's telemetry record (its log line's ``prompt_tokens``), as a stream's ``Usage`` does.
        """
        card = self.resolve(request.model, may_use)
        backend = self.backend_for(card)
        check_embeddings(backend.capabilities(card), card.name)
        instance = await self.instances.acquire(card)
        result = await self._embed(instance, card, backend, request)
        record = telemetry.current()
        if record is not None:
            record.model, record.prompt_tokens, record.generated_tokens = card.name, result.prompt_tokens, 0
        return result

    async def count_tokens(
        self, request: Request, may_use: Callable[[str], bool] | None = None, caller: str = "-"
    ) -> int:
        """Tokens of ``request``'s prompt as the model reads it (Anthropic's count_tokens), counted in turn with
        every other count on the instance (``caller``'s line). A user model's stored system prompt is counted
        when the request has none, as ``open_stream`` would send it (``gateway.serving.model_defaults``)."""
        card = self.resolve(request.model, may_use)
        request = apply_defaults(request, self.user_models(card.name))
        backend = self.backend_for(card)
        instance = await self.instances.acquire(card)
        return await self._on_ready(
            instance, card, backend, lambda runner: self._counter(instance.id, caller, runner)(request)
        )

    async def _token_bytes(self, card: ModelCard, backend: Backend) -> int:
        """``backend.token_bytes(card)``, read once per model in a worker thread (it may read the model's files)."""
        key = f"{card.name}\0{card.path}"
        known = self._longest_token.get(key)
        if known is None:
            read = getattr(backend, "token_bytes", None)  # a Backend not derived from the base class may lack it
            known = self._longest_token[key] = await asyncio.to_thread(read, card) if read else 0
        return known

    def _counter(self, instance_id: str, caller: str, runner: Runner) -> Callable[[Request], Awaitable[int]]:
        """``runner.count_tokens`` in ``caller``'s turn on the instance's counting queue (see the module
        docstring); a full counting queue is ``Overloaded``, a caller that goes away leaves it."""

        async def count(request: Request) -> int:
            ticket = self.counting.enter(instance_id, caller)
            try:
                await ticket.wait()
                return await runner.count_tokens(request)
            finally:
                ticket.release()

        return count

    async def _embed(self, instance: Instance, card: ModelCard, backend: Backend, request: EmbedRequest) -> Embeddings:
        if not request.inputs:
            if not isinstance(instance.state, Ready):
                await self.instances.wait_ready(instance.id)
            return Embeddings()
        return await self._on_ready(instance, card, backend, lambda runner: runner.embed(request))

    async def _on_ready(
        self,
        instance: Instance,
        card: ModelCard,
        backend: Backend,
        call: Callable[[Runner], Awaitable[T]],
        retry: bool = True,
    ) -> T:
        """``call`` on the instance's runner once it is ready; an unreachable runner fails the instance (so it is
        re-placed) and the call is tried once more on the replacement."""
        if not isinstance(instance.state, Ready):
            instance = await self.instances.wait_ready(instance.id)
        try:
            return await call(self._connect(instance, card, backend))
        except BackendUnavailable as error:
            if not retry:
                raise
            replacement = await self._replace(instance, card, error)
            return await self._on_ready(replacement, card, backend, call, retry=False)

    async def _keepalive_until(self, start: Callable[[], Awaitable[AsyncIterator[Event]]]) -> AsyncIterator[Event]:
        """Keep-alives until ``start()`` gives the event stream (the instance came up, the request's turn came),
        then its events; errors as ``Failed``. Closed early, it cancels ``start()``: a waiting request leaves
        the queue."""
        waiting = asyncio.ensure_future(start())
        try:
            while True:
                done, _ = await asyncio.wait({waiting}, timeout=self.keepalive)
                if done:
                    break
                yield KeepAlive()
            try:
                events = waiting.result()
            except GatewayError as exc:
                yield Failed(error=exc.info())
                return
            async with streams.closing(events):
                async for event in events:
                    yield event
        finally:
            if not waiting.done():
                waiting.cancel()


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
