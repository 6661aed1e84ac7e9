"""Model name -> backend -> runner; runs a request and hands its event stream to the protocol encoders.

The first event is awaited before anything is sent to the client, so a failure to start (unknown model,
unsupported feature, a runner that will not come up) is a real HTTP error status; a failure after that travels
in the stream as ``Failed``. Runners are started lazily, one per model, and replaced when they die.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Sequence

from backends.base import Backend, ModelCard, ModelSource, Runner, check_capabilities
from protocols.model import (
    Event,
    Failed,
    GatewayError,
    NoCapacity,
    Request,
    UnknownModel,
    error_from_info,
)

__all__ = ["Dispatcher", "normalize_model_name"]

log = logging.getLogger("meshgate.dispatch")


def normalize_model_name(name: str) -> str:
    """Ollama-style names: ``name:tag`` with ``latest`` implied."""
    return name if ":" in name.rsplit("/", 1)[-1] else f"{name}:latest"


class Dispatcher:
    """Resolves models, owns the runners, opens event streams."""

    def __init__(self, backends: Sequence[Backend], sources: Sequence[ModelSource], choose) -> None:
        self.backends = list(backends)
        self.sources = list(sources)
        self._choose = choose
        self._cards: dict[str, ModelCard] = {}
        self._runners: dict[str, Runner] = {}
        self._locks: dict[str, asyncio.Lock] = {}

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

    def backend_for(self, card: ModelCard) -> Backend:
        backend = self._choose(card=card, backends=self.backends)
        if backend is None:
            raise NoCapacity(f"no backend can serve model '{card.name}' (format {card.format})")
        return backend

    def loaded(self) -> list[Runner]:
        return [r for r in self._runners.values() if r.alive]

    async def _runner(self, card: ModelCard, backend: Backend) -> Runner:
        lock = self._locks.setdefault(card.name, asyncio.Lock())
        async with lock:
            runner = self._runners.get(card.name)
            if runner is not None and runner.alive:
                return runner
            if runner is not None:
                log.warning("runner for %s has exited; starting a fresh one", card.name)
                await runner.close()
            runner = await backend.start(card)
            self._runners[card.name] = runner
            return runner

    async def load(self, name: str) -> ModelCard:
        """Start ``name``'s runner if it is not running (Ollama's empty-prompt load)."""
        card = self.resolve(name)
        await self._runner(card, self.backend_for(card))
        return card

    async def unload(self, name: str) -> ModelCard:
        """Stop ``name``'s runner if one runs (Ollama's ``keep_alive: 0``)."""
        card = self.resolve(name)
        async with self._locks.setdefault(card.name, asyncio.Lock()):
            runner = self._runners.pop(card.name, None)
            if runner is not None:
                await runner.close()
        return card

    async def open_stream(self, request: Request) -> AsyncIterator[Event]:
        """Start ``request``; raise its ``GatewayError`` if it fails before the first event."""
        card = self.resolve(request.model)
        backend = self.backend_for(card)
        check_capabilities(request, backend.capabilities(card), card.name)
        runner = await self._runner(card, backend)
        events = runner.generate(request)
        first = await anext(events)
        if isinstance(first, Failed):
            await events.aclose()
            raise error_from_info(first.error)
        return _chain(first, events)

    async def close(self) -> None:
        runners, self._runners = list(self._runners.values()), {}
        await asyncio.gather(*(r.close() for r in runners), return_exceptions=True)


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
