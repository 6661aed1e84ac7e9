"""Model name -> instance -> runner; runs a request and hands its event stream to the protocol encoders.

The first event is awaited before anything is sent to the client, so a failure to start (unknown model,
unsupported feature, nothing fits) is a real HTTP error status; a failure after that travels in the stream as
``Failed``. A model with no instance is placed automatically (``InstanceManager.acquire``); a streaming client
gets keep-alives while it comes up, a non-streaming one waits. A runner that cannot be reached at the start of a
request fails its instance (so it is re-placed) and the request is retried once on the new one. ``embed`` is a
plain call that follows the same path (place, wait, connect, retry once if unreachable) and raises its error.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import TypeVar

from backends.base import Backend, ModelCard, ModelSource, Runner, check_capabilities, check_embeddings
from gateway.cluster.instances import InstanceManager
from gateway.cluster.records import Instance, Ready
from protocols.model import (
    BackendUnavailable,
    EmbedRequest,
    Embeddings,
    Event,
    Failed,
    GatewayError,
    KeepAlive,
    NoCapacity,
    Request,
    UnknownModel,
    error_from_info,
)

__all__ = ["Dispatcher", "normalize_model_name"]

log = logging.getLogger("meshgate.dispatch")
T = TypeVar("T")


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


class Dispatcher:
    """Resolves models, finds or places their instances, opens event streams."""

    def __init__(self, catalog: Catalog, backends: Sequence[Backend], choose, instances: InstanceManager, *,
                 keepalive: float = 2.0) -> None:
        self.catalog = catalog
        self.keepalive = keepalive
        self.backends = list(backends)
        self._choose = choose
        self.instances = instances

    def models(self) -> list[ModelCard]:
        return self.catalog.models()

    def resolve(self, name: str) -> ModelCard:
        return self.catalog.resolve(name)

    def backend_for(self, card: ModelCard) -> Backend:
        backend = self._choose(card=card, backends=self.backends)
        if backend is None:
            raise NoCapacity(f"no backend can serve model '{card.name}' (format {card.format})")
        return backend

    async def load(self, name: str) -> Instance:
        """Place ``name`` if needed and wait until it is ready (Ollama's empty-prompt load)."""
        card = self.resolve(name)
        instance = await self.instances.acquire(card)
        return await self.instances.wait_ready(instance.id)

    async def unload(self, name: str) -> ModelCard:
        """Delete ``name``'s instances (Ollama's ``keep_alive: 0``)."""
        card = self.resolve(name)
        for instance in self.instances.cached(card.name):
            with contextlib.suppress(GatewayError):
                await self.instances.delete(instance.id)
        return card

    async def open_stream(self, request: Request) -> AsyncIterator[Event]:
        """Start ``request``; raise its ``GatewayError`` if it fails before the first event."""
        card = self.resolve(request.model)
        backend = self.backend_for(card)
        check_capabilities(request, backend.capabilities(card), card.name)
        context = request.num_ctx if isinstance(request.num_ctx, int) else None
        instance = await self.instances.acquire(card, context=context)
        if not isinstance(instance.state, Ready) and request.stream:
            return self._after_ready(instance, card, backend, request)
        return await self._start(instance, card, backend, request)

    async def _start(self, instance: Instance, card: ModelCard, backend: Backend, request: Request,
                     retry: bool = True) -> AsyncIterator[Event]:
        if not isinstance(instance.state, Ready):
            instance = await self.instances.wait_ready(instance.id)
        urls = {node: status.url for node, status in instance.runners.items() if status.url}
        events = backend.connect(card, instance.placement, urls).generate(request)
        first = await anext(events)
        if isinstance(first, Failed):
            await events.aclose()
            error = error_from_info(first.error)
            if retry and isinstance(error, BackendUnavailable):
                log.warning("instance %s unreachable (%s); re-placing", instance.id, error.message)
                await self.instances.report_unreachable(instance, error.message)
                replacement = await self.instances.acquire(card)
                return await self._start(replacement, card, backend, request, retry=False)
            raise error
        return _chain(first, events)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """``request``'s vectors, placing the model and waiting for it if needed; raise its ``GatewayError``.

        No inputs only loads the model (Ollama's empty ``input``) and returns no vectors.
        """
        card = self.resolve(request.model)
        backend = self.backend_for(card)
        check_embeddings(backend.capabilities(card), card.name)
        instance = await self.instances.acquire(card)
        return await self._embed(instance, card, backend, request)

    async def count_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt as the model reads it (Anthropic's count_tokens)."""
        card = self.resolve(request.model)
        backend = self.backend_for(card)
        instance = await self.instances.acquire(card)
        return await self._on_ready(instance, card, backend, lambda runner: runner.count_tokens(request))

    async def _embed(self, instance: Instance, card: ModelCard, backend: Backend,
                     request: EmbedRequest) -> Embeddings:
        if not request.inputs:
            if not isinstance(instance.state, Ready):
                await self.instances.wait_ready(instance.id)
            return Embeddings()
        return await self._on_ready(instance, card, backend, lambda runner: runner.embed(request))

    async def _on_ready(self, instance: Instance, card: ModelCard, backend: Backend,
                        call: Callable[[Runner], Awaitable[T]], retry: bool = True) -> T:
        """``call`` on the instance's runner once it is ready; an unreachable runner fails the instance (so it is
        re-placed) and the call is tried once more on the replacement."""
        if not isinstance(instance.state, Ready):
            instance = await self.instances.wait_ready(instance.id)
        urls = {node: status.url for node, status in instance.runners.items() if status.url}
        try:
            return await call(backend.connect(card, instance.placement, urls))
        except BackendUnavailable as error:
            if not retry:
                raise
            log.warning("instance %s unreachable (%s); re-placing", instance.id, error.message)
            await self.instances.report_unreachable(instance, error.message)
            replacement = await self.instances.acquire(card)
            return await self._on_ready(replacement, card, backend, call, retry=False)

    async def _after_ready(self, instance: Instance, card: ModelCard, backend: Backend,
                           request: Request) -> AsyncIterator[Event]:
        """Keep-alives while the instance comes up, then the generation (errors as ``Failed``)."""
        waiting = asyncio.ensure_future(self._start(instance, card, backend, request))
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
            async with contextlib.aclosing(events):
                async for event in events:
                    yield event
        finally:
            if not waiting.done():
                waiting.cancel()


async def _chain(first: Event, rest: AsyncIterator[Event]) -> AsyncIterator[Event]:
    """``first`` then ``rest``; an unexpected exception becomes a ``Failed`` event, never a crash."""
    async with contextlib.aclosing(rest):
        yield first
        try:
            async for event in rest:
                yield event
        except GatewayError as exc:
            yield Failed(error=exc.info())
        except Exception as exc:
            log.exception("backend stream raised")
            yield Failed(error=GatewayError(f"internal error: {exc!r}").info())
