"""The contract between the gateway and a runtime: model cards, sources, backends, runners, capabilities.

A ``ModelSource`` lists ``ModelCard``s; a ``Backend`` says which cards it can serve, how they may be placed,
launches shards on a node (``Launched``, held by the node agent) and gives the gateway a ``Runner`` client that
turns a ``Request`` into an event stream ending in exactly one ``Finished`` or ``Failed`` (and, where
``Capabilities.embeddings``, an ``EmbedRequest`` into ``Embeddings``). Runtimes live in their
own processes, never in the gateway.

Everything the gateway needs of a model besides its card comes through ``Backend`` too: the context a runner gets
(``context``) and what clients are shown (``describe``: Ollama ``/api/show``'s ``model_info``, template,
parameters), so the gateway never reads a model file or knows a backend by name. Both have defaults on the
Protocol, which a backend inherits by subclassing ``Backend`` (``class Mine(meshgate.Backend)``); a backend that
only matches the Protocol structurally must define them.

Imports ``protocols.model`` and ``backends.placement``; must not import the gateway, plugins or a web framework.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

import msgspec

from meshgate.backends.placement import Calibration, Candidate, ModelSpec, Shard, ShardCosts, Strategy
from meshgate.protocols.model import Embeddings, EmbedRequest, Event, ImagePart, Request, UnsupportedFeature

__all__ = [
    "Backend",
    "Capabilities",
    "InProcess",
    "Launched",
    "ModelCard",
    "ModelDescription",
    "ModelSource",
    "Peers",
    "Runner",
    "basic_model_info",
    "check_capabilities",
    "check_embeddings",
]


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
    """What a backend can do for a model; the gateway checks requests against it before calling.

    ``embeddings``: ``Runner.embed`` works (the gateway refuses embedding requests for the model otherwise).
    """

    tools: bool = False
    vision: bool = False
    json_schema: bool = False
    reasoning: bool = False
    raw_prompt: bool = True
    embeddings: bool = False


class ModelDescription(msgspec.Struct, frozen=True, kw_only=True):
    """What clients are shown of a model besides its card (``Backend.describe``): Ollama ``/api/show``'s
    ``model_info``, ``template``, ``parameters`` and ``license``. Its ``details`` (format, family, parameter size,
    quantization) are the ``ModelCard``'s, and ``/api/tags`` and ``/v1/models`` list cards only.

    ``model_info`` and ``parameters`` are open maps because their keys are the model's own (a GGUF header's keys,
    a checkpoint's ``config.json`` under those names); they travel to clients as they are and are never read back.

    Example::

        ModelDescription(model_info={"general.architecture": "gemma3", "gemma3.context_length": 4096},
                         template="{{ .Prompt }}", parameters={"stop": ["<end_of_turn>"]})

    Attributes:
        model_info: The model's metadata under GGUF's key names, as Ollama shows it (``general.architecture``,
            ``<arch>.context_length`` as the context a runner gets, ``<arch>.block_count``, ...); big arrays
            (token tables) as ``None``, as Ollama shows them without ``verbose``.
        template: The chat template the runtime applies (a Go template where the backend renders Ollama's
            format, else the model's own, e.g. a checkpoint's Jinja ``chat_template``); empty when unknown.
        parameters: Default generation parameters under Ollama's names (``stop``, ``temperature``, ...); a user
            model's stored parameters (``/api/create``) are laid over them.
        license: The model's license text, when it carries one.
    """

    model_info: dict[str, Any] = msgspec.field(default_factory=dict)
    template: str = ""
    parameters: dict[str, Any] = msgspec.field(default_factory=dict)
    license: str = ""


def basic_model_info(card: ModelCard, context: int) -> dict[str, Any]:
    """``model_info`` from the card alone: its family as ``general.architecture`` and ``context`` (tokens a runner
    gets; 0 leaves it out) as ``<family>.context_length``; empty without a family."""
    if not card.family:
        return {}
    info: dict[str, Any] = {"general.architecture": card.family}
    if context:
        info[f"{card.family}.context_length"] = context
    return info


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


def check_embeddings(caps: Capabilities, model: str) -> None:
    """Raise ``UnsupportedFeature`` unless ``caps`` says the model computes embeddings."""
    if not caps.embeddings:
        raise UnsupportedFeature(f"model '{model}' does not support embeddings", param="model")


Peers = Callable[[], Awaitable[Mapping[str, str]]]
"""Waits for the other shards of a placement and returns their URLs by node id."""


@runtime_checkable
class Runner(Protocol):
    """The gateway-side client of a placed model's head runner."""

    def generate(self, request: Request) -> AsyncIterator[Event]:
        """Stream events for ``request``; ends in exactly one ``Finished`` or ``Failed``; never raises.

        Closing the iterator early cancels the generation on the runner.
        """
        ...

    async def count_tokens(self, request: Request) -> int:
        """Tokens of ``request``'s prompt as the model reads it (template, system text, tools).

        A backend that cannot count raises ``UnsupportedFeature``.
        """
        ...

    async def embed(self, request: EmbedRequest) -> Embeddings:
        """One unit vector per input of ``request``; raises ``GatewayError`` on failure.

        A backend without embeddings (``Capabilities.embeddings`` false) raises ``UnsupportedFeature``; the
        gateway checks the capability first, so that is only reached by a direct call.
        """
        ...


@runtime_checkable
class Launched(Protocol):
    """The node-side handle of a started shard (a runner or worker process an agent supervises)."""

    url: str | None
    pid: int | None

    @property
    def alive(self) -> bool:
        """False once the process has exited."""
        ...

    async def stop(self) -> None:
        """Stop the process and release its resources."""
        ...


class InProcess:
    """A ``Launched`` for backends that generate inside the gateway process (nothing to start on the node).

    For tests and trivial plugins only: real runtimes run in their own processes.
    """

    url: str | None = "inproc://"
    pid: int | None = None
    alive = True

    async def stop(self) -> None:
        pass


@runtime_checkable
class Backend(Protocol):
    """A runtime: which models it serves, how their shards start on a node, how the gateway reaches them.

    ``launch`` runs in a node agent (on the machine that holds the shard); ``connect`` runs in a gateway.
    ``context`` and ``describe`` have defaults here: subclass ``Backend`` to inherit them (a class that only
    matches the Protocol must define them), and override them where the runtime knows better.
    """

    name: str

    def supports(self, card: ModelCard) -> bool:
        """Whether this backend can serve ``card`` at all."""
        ...

    def capabilities(self, card: ModelCard) -> Capabilities:
        """What this backend can do for ``card``."""
        ...

    def strategies(self, card: ModelCard) -> frozenset[Strategy]:
        """Placement strategies this backend supports for ``card`` (``single``, ``pipeline``, ...)."""
        ...

    def spec(self, card: ModelCard) -> ModelSpec:
        """The model's shape and sizes, for the planner."""
        ...

    def costs(self, card: ModelCard) -> ShardCosts:
        """Memory a shard costs beyond weights and KV cache, for the planner."""
        ...

    async def launch(self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers) -> Launched:
        """Start ``shard`` of ``placement`` on this node, bound to ``host``; raise ``GatewayError`` on failure.

        ``await peers()`` waits until every other shard of the placement is up and returns their URLs by node id
        (a head that must connect to its workers calls it; workers don't).
        """
        ...

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> Runner:
        """A client for the placed model, given each shard's URL by node id."""
        ...

    def context(self, card: ModelCard) -> int:
        """Tokens of context a runner of ``card`` gets unless a placement says otherwise: the planner reserves KV
        cache for them, ``/api/show`` and ``/api/ps`` report them. 0 means the model's own
        (``ModelSpec.context_length``).

        The default (inherited by subclasses of ``Backend``) is the card's ``context_length``.
        """
        return card.context_length

    def describe(self, card: ModelCard) -> ModelDescription:
        """What clients are shown of ``card`` (Ollama ``/api/show``); see ``ModelDescription``.

        May read the model's files (the gateway calls it in a worker thread); a file that has gone or changed
        gives a smaller description, never an error.

        The default (inherited by subclasses of ``Backend``) is ``basic_model_info`` with ``context(card)``, no
        template and no parameters.
        """
        return ModelDescription(model_info=basic_model_info(card, self.context(card)))

    def token_bytes(self, card: ModelCard) -> int:
        """The most bytes of prompt text one of ``card``'s tokens can stand for (its longest vocabulary entry), or
        0 when unknown. The gateway divides a prompt's bytes by it for a lower bound on its tokens, so a prompt
        that cannot fit the context is refused without asking the runner to count it. Called once per model;
        may read the model's files.

        The default (inherited by subclasses of ``Backend``) is 0: every doubtful prompt is counted.
        """
        return 0

    def calibrate(self) -> Calibration | None:
        """This node's speed with the runtime's own kernels (decode bytes/s, a step's overhead, prompt FLOP/s),
        for the planner's tok/s estimates; ``None`` when the backend does not measure.

        Blocking and maybe slow (seconds: a real decode): the node agent calls it once at start, in a worker
        thread, and stores the result with its node record. Cache it (by CPU model and runtime version), so an
        agent's next start is fast; never load the runtime into the calling process if it could crash it.

        The default (inherited by subclasses of ``Backend``) is ``None``: the planner uses ``Node.flops``.
        """
        return None


@runtime_checkable
class ModelSource(Protocol):
    """Somewhere models come from (a packaged GGUF, configured paths, a hub)."""

    name: str

    def models(self) -> Sequence[ModelCard]:
        """The models this source offers now (may prepare files on first call)."""
        ...
