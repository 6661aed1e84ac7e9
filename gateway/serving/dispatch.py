"""Model name -> replica -> runner: runs a request and hands its event stream to the protocol encoders.

    open_stream(request)
      resolve the model and its backend; prepare the request (``gateway.serving.prepare``, one pure function)
      ``retry.RetryLoop``: the one retry loop                  (also for embeddings and token counts)
        route to a replica (``Replicas.acquire``: placed if there is none), wait until it is ready
        ``start.Starter.begin``: check the context (``gateway.serving.context_fit``), take a place in the
          replica's queue (``gateway.serving.admission``), wait for a slot, start the runner's stream and take
          its first event; or answer ``Bigger``: the next pass goes to a replica with a bigger context
        a replica that cannot be reached is failed (so it is re-placed) and the loop goes to another
      ``serve.served``: resumable on another replica (``gateway.serving.resume``), relayed (``streams.relay``)
      -> an ``EventStream`` that frees the slot when it is closed

The first event is awaited before anything is sent to the client, so a failure to start (unknown model,
unsupported feature, nothing fits, a full queue) is a real HTTP error status; a failure after that travels in the
stream as ``Failed``. A streaming request that has to wait (a replica coming up, its turn in the queue) gets
keep-alives from then on, and its failures to start become ``Failed`` too; a non-streaming one waits. A runner
that cannot be reached at the start of a request fails its replica and the request goes to another, up to
``retry.START_RETRIES`` times; a stream whose replica fails after it started is resumed through the same loop.

A request that sets no ``num_ctx`` (nor does its model's Modelfile) and whose whole prompt does not fit its
replica's context moves, when ``grow_context`` is on (``Settings.n_ctx`` unset), to a replica with the context it
needs (``context_fit.needed_context``: doubled until it holds the prompt and some output, at most the model's
own), placed beside the others if none holds it yet; what fits nowhere is then refused (or trimmed) by the
protocol's rule. So a 4,096-token default keeps small requests on many slots while an Open WebUI chat with its
tool definitions, or an agent's long preamble, still gets an answer.

Counting a prompt's tokens costs the runner CPU time in proportion to its size (about 2 s for 1 MB of text), and
only prompts whose size does not already show they fit are counted. Those counts (and Anthropic's count_tokens)
go through a second fair queue per replica, one count at a time (``start.Starter.counter``): a client sending
many huge prompts waits for its own counts, while another client's request is counted after at most one of them.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Callable, Sequence
from typing import TypeVar

import msgspec

from meshgate.backends.base import Backend, Capabilities, ModelCard, check_embeddings
from meshgate.backends.registry import UserModel
from meshgate.gateway.cluster.loads import LoadBoard
from meshgate.gateway.cluster.records import Instance
from meshgate.gateway.serving.admission import Admission
from meshgate.gateway.serving.catalog import Catalog
from meshgate.gateway.serving.context_fit import Fit
from meshgate.gateway.serving.model_defaults import apply_defaults
from meshgate.gateway.serving.prepare import prepare
from meshgate.gateway.serving.retry import Replicas, RetryLoop
from meshgate.gateway.serving.serve import served
from meshgate.gateway.serving.start import (
    Bigger,
    Job,
    Started,
    Starter,
    Visit,
    abandon,
    connect,
    keepalive_until,
    request_routing,
)
from meshgate.gateway.serving.streams import EventStream
from meshgate.gateway.telemetry import record as telemetry
from meshgate.protocols.model import (
    Embeddings,
    EmbedRequest,
    GatewayError,
    NoCapacity,
    Request,
    UnknownModel,
    Usage,
)

__all__ = ["Dispatcher"]

log = logging.getLogger("meshgate.dispatch")
T = TypeVar("T")


class Dispatcher:
    """Resolves models, finds or places their replicas, opens event streams."""

    def __init__(
        self,
        catalog: Catalog,
        backends: Sequence[Backend],
        choose,
        instances: Replicas,
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
        self.keepalive = keepalive
        self.starter = Starter(admission or Admission(), max_tokens)
        self.admission = self.starter.admission  # each replica's generation queue (``/metrics``, ``/instances``)
        self.backends = list(backends)
        self._choose = choose
        self.instances = instances
        self.loads = loads  # the shared load: its tallies count what this gateway streams per instance
        self.retry = RetryLoop(instances, loads)

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
        """Unload ``name``'s replicas (Ollama's ``keep_alive: 0``): the idle ones now, the busy ones once idle."""
        card = self.resolve(name)
        loads = self.loads
        await self.instances.unload(card.name, busy=lambda iid: loads is not None and loads.load(iid) > 0)
        return card

    async def keep_alive(self, name: str, seconds: float | None) -> None:
        """Apply a request's ``keep_alive`` to ``name``'s replicas once the request is done: unload them (0), keep
        them for good (None, infinite), or let them expire ``seconds`` from now."""
        if seconds == 0:
            await self.unload(name)
            return
        card = self.resolve(name)
        until = None if seconds is None or math.isinf(seconds) else time.time() + seconds
        await self.instances.keep(card.name, until)

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
        cache_scope: str = "",
        weight: float = 1.0,
    ) -> EventStream:
        """Start ``request``; raise its ``GatewayError`` if it fails before the first event (or, streaming, before
        it has to wait). Whoever opens the stream closes it (``EventStream.aclose``): that frees its slot.

        ``caller`` (an API key or a client address) is the line it waits in; ``fit`` the protocol's context rule;
        ``clamp_output`` cuts a ``max_tokens`` above the ``max_tokens`` setting to it (Ollama) instead of raising
        ``OutputTooLarge``. ``may_use`` restricts the models (a key's list); ``on_usage`` gets the last ``Usage``
        when the stream ends (a key's token budget); ``cache_scope`` whose cached prompts it may use
        (``Request.cache_scope``: its key's tenant). ``request.priority`` is the class it waits in (unset:
        interactive) and ``weight`` its caller's share within the class (``gateway.serving.admission``).
        """
        if cache_scope:
            request = msgspec.structs.replace(request, cache_scope=cache_scope)
        telemetry.note_class("batch" if request.priority == "batch" else "interactive")
        card = self.resolve(request.model, may_use)
        backend = self.backend_for(card)
        ready = prepare(
            request,
            model=card.name,
            user_model=self.user_models(card.name),
            capabilities=backend.capabilities(card),
            max_tokens=self.starter.max_tokens,
            clamp_output=clamp_output,
        )
        job = Job(
            card=card,
            backend=backend,
            request=ready.request,
            caller=caller,
            fit=fit,
            routing=request_routing(ready.request),
            grow=self.grow_context and not isinstance(ready.request.num_ctx, int),
            weight=weight,
        )

        async def restart(again: Job, failed: tuple[Instance, GatewayError]) -> Started:
            return await self._start(again, failed=failed)

        def serve(started: Started) -> EventStream:
            return served(
                job,
                started,
                restart=restart,
                loads=self.loads,
                resume_wait=self.resume_wait,
                keepalive=self.keepalive,
                on_usage=on_usage,
                end_turn=ready.defaults_end_turn,
            )

        async def start(waiting: Callable[[], object] | None = None) -> Started:
            return await self._start(job, context=ready.context, waiting=waiting)

        if not request.stream:
            return serve(await start())
        waits: asyncio.Future[Started] = asyncio.get_running_loop().create_future()  # resolved when it must wait

        def waiting() -> None:
            if not waits.done():
                waits.set_result(None)  # type: ignore[arg-type]  # only done-ness is read

        starting = asyncio.ensure_future(start(waiting))
        try:
            await asyncio.wait({starting, waits}, return_when=asyncio.FIRST_COMPLETED)
        except BaseException:  # cancelled (the client went away): nothing may keep the slot
            await abandon(starting)
            raise
        if starting.done():
            return serve(starting.result())
        return EventStream(keepalive_until(starting, serve, self.keepalive), lambda: abandon(starting))

    async def _start(
        self,
        job: Job,
        *,
        context: int | None = None,
        waiting: Callable[[], object] | None = None,
        failed: tuple[Instance, GatewayError] | None = None,
    ) -> Started:
        """``job`` started on a replica (``start.Starter.begin``) by the retry loop; a resume (``failed``: the
        replica it comes from) waits patiently."""

        async def begin(instance: Instance, visit: Visit) -> Started | Bigger:
            return await self.starter.begin(job, instance, visit)

        patient = failed is not None
        return await self.retry.run(
            job.card, begin, context=context, routing=job.routing, waiting=waiting, failed=failed, patient=patient
        )

    # ------------------------------------------------------------------------------------------- embeddings, counts

    async def embed(self, request: EmbedRequest, may_use: Callable[[str], bool] | None = None) -> Embeddings:
        """``request``'s vectors, placing the model and waiting for it if needed; raise its ``GatewayError``.

        No inputs only loads the model (Ollama's empty ``input``) and returns no vectors. The tokens embedded go
        to the request's telemetry record (its log line's ``prompt_tokens``), as a stream's ``Usage`` does.
        """
        card = self.resolve(request.model, may_use)
        backend = self.backend_for(card)
        check_embeddings(backend.capabilities(card), card.name)

        async def call(instance: Instance, visit: Visit) -> Embeddings:
            if not request.inputs:
                return Embeddings()
            return await connect(instance, card, backend).embed(request)

        result = await self.retry.run(card, call, retries=1)
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

        async def call(instance: Instance, visit: Visit) -> int:
            runner = connect(instance, card, backend)
            return await self.starter.counter(instance.id, caller, runner)(request)

        return await self.retry.run(card, call, retries=1)
