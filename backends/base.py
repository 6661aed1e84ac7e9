"""The contract between the gateway and a runtime: model cards, sources, backends, runners, capabilities.

A ``ModelSource`` lists ``ModelCard``s; a ``Backend`` says which cards it can serve and starts a ``Runner`` for
one; a ``Runner`` turns a ``Request`` into an event stream that ends in exactly one ``Finished`` or ``Failed``.
Runners live in their own processes: the objects here are the gateway-side handles.

Imports only ``protocols.model``; must not import the gateway, plugins or a web framework.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Protocol, runtime_checkable

import msgspec

from protocols.model import Event, ImagePart, Request, UnsupportedFeature

__all__ = ["Backend", "Capabilities", "ModelCard", "ModelSource", "Runner", "check_capabilities"]


class ModelCard(msgspec.Struct, frozen=True, kw_only=True):
    """A model meshgate can serve: where its weights are and what it is.

    ``name`` is the Ollama-style name clients use (``gemma3:270m``); ``path`` the local weights file.
    """

    name: str
    path: str
    format: str = "gguf"
    family: str = ""
    parameter_size: str = ""
    quantization: str = ""
    size: int = 0
    digest: str = ""
    created: float = 0.0
    context_length: int = 0
    source: str = ""


class Capabilities(msgspec.Struct, frozen=True, kw_only=True):
    """What a backend can do for a model; the gateway checks requests against it before calling."""

    tools: bool = False
    vision: bool = False
    json_schema: bool = False
    reasoning: bool = False
    raw_prompt: bool = True


def check_capabilities(request: Request, caps: Capabilities, model: str) -> None:
    """Raise ``UnsupportedFeature`` naming what ``request`` asks for that ``caps`` lacks."""
    if request.tools and request.tool_choice.mode != "none" and not caps.tools:
        raise UnsupportedFeature(f"model '{model}' does not support tools", param="tools")
    if not caps.vision and any(isinstance(p, ImagePart) for m in request.messages for p in m.parts):
        raise UnsupportedFeature(f"model '{model}' does not support images (it has no vision)", param="messages")
    if request.response_format.kind != "text" and not caps.json_schema:
        raise UnsupportedFeature(f"model '{model}' does not support structured output", param="response_format")
    if request.raw_prompt is not None and not caps.raw_prompt:
        raise UnsupportedFeature(f"model '{model}' does not support raw prompts", param="prompt")


@runtime_checkable
class Runner(Protocol):
    """A started model: the gateway-side handle of a runner process."""

    card: ModelCard

    @property
    def alive(self) -> bool:
        """False once the runner process has exited; the gateway then starts a fresh one."""
        ...

    def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream events for ``request``; ends in exactly one ``Finished`` or ``Failed``; never raises.

        Closing the iterator early cancels the generation on the runner.
        """
        ...

    async def close(self) -> None:
        """Stop the runner process and release its resources."""
        ...


@runtime_checkable
class Backend(Protocol):
    """A runtime that can start runners for some models."""

    name: str

    def supports(self, card: ModelCard) -> bool:
        """Whether this backend can serve ``card`` at all."""
        ...

    def capabilities(self, card: ModelCard) -> Capabilities:
        """What this backend can do for ``card``."""
        ...

    async def start(self, card: ModelCard) -> Runner:
        """Start a runner for ``card``; raise a ``GatewayError`` (e.g. ``BackendUnavailable``) on failure."""
        ...


@runtime_checkable
class ModelSource(Protocol):
    """Somewhere models come from (a packaged GGUF, configured paths, a hub)."""

    name: str

    def models(self) -> Sequence[ModelCard]:
        """The models this source offers now (may prepare files on first call)."""
        ...
