"""A replica's head runner's ``/health``, read outside any request (``runner_health``): the source
``gateway.cluster.kv_tiers`` polls.

The runner is reached as the dispatcher reaches it (``start.connect``: the backend chosen for the model, the URLs
its nodes reported). A runner that has a ``health()`` (``ReportsHealth``: llama.cpp's) reports one; any other
(vLLM's, a scripted one) reports none, and nothing is sent to it.

Imports the backends' interface and ``start``; the runtime wires it.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping
from typing import Protocol, runtime_checkable

from meshgate.backends.base import Backend, ModelCard, Runner
from meshgate.gateway.cluster.records import Instance
from meshgate.gateway.serving.start import connect

__all__ = ["ReportsHealth", "health_reporter", "runner_health", "runner_kv"]


@runtime_checkable
class ReportsHealth(Protocol):
    """A runner (or its client) that answers its ``/health``: a JSON object."""

    async def health(self) -> Mapping[str, object]: ...


def health_reporter(runner: Runner) -> ReportsHealth | None:
    """What answers ``runner``'s health (the module docstring), or ``None``."""
    return runner if isinstance(runner, ReportsHealth) else None


def runner_health(
    resolve: Callable[[str], ModelCard], backend_for: Callable[[ModelCard], Backend]
) -> Callable[[Instance], Awaitable[Mapping[str, object] | None]]:
    """``health_of(instance)``: its head runner's ``/health`` answer, ``None`` when the runner reports none; raises
    what the model's resolution (``resolve``), the backend's choice (``backend_for``) or the call raise."""

    async def health_of(instance: Instance) -> Mapping[str, object] | None:
        card = resolve(instance.model)
        reporter = health_reporter(connect(instance, card, backend_for(card)))
        return await reporter.health() if reporter is not None else None

    return health_of


def runner_kv(
    resolve: Callable[[str], ModelCard], backend_for: Callable[[ModelCard], Backend]
) -> Callable[[Instance, str, dict[str, object]], Awaitable[None]]:
    """``tell(instance, action, body)``: tell its head runner's KV tier something (``peers``, ``warm``), when its
    runner has one (a ``kv`` method: llama.cpp's); raises what the call raises."""

    async def tell(instance: Instance, action: str, body: dict[str, object]) -> None:
        card = resolve(instance.model)
        runner = connect(instance, card, backend_for(card))
        call = getattr(runner, "kv", None)
        if call is not None:
            await call(action, body)

    return tell
