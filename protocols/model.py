"""The internal language of meshgate: requests, messages, the event stream, errors.

Every client protocol translates into these types and every backend speaks them. Vendor-neutral: no field
here is named after one wire protocol's spelling.

Imports nothing of ours but its own parts, which import nothing else of ours: the errors (``protocols.errors``:
the error tree, ``ErrorInfo``, ``error_from_info``) and the reading of request bodies (``protocols.bodies``),
re-exported here. Does no I/O.

Shape:

- ``Request``: ``messages`` made of ``Message(role, parts)``; parts are a tagged union (``TextPart``,
  ``ImagePart``, ``ToolCallPart``, ``ToolResultPart``, ``ReasoningPart``). Sampling values default to
  ``msgspec.UNSET`` ("backend default"), which differs from an explicit ``None``.
- The event stream: an async iterator of ``Event`` that ends in exactly one ``Finished`` or ``Failed``.
  ``Usage`` snapshots are cumulative (the last one wins). ``KeepAlive`` carries no content.
- ``collect(events)`` folds a stream into a ``Response``; non-streaming endpoints use it, never a second path.
- Embeddings are request/response, not a stream: ``EmbedRequest`` in, ``Embeddings`` (unit vectors) out.
"""

from __future__ import annotations

from collections.abc import AsyncIterable
from typing import Any, Literal, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

from meshgate.protocols.bodies import MAX_JSON_DEPTH, MAX_MESSAGES, decode_body, json_depth, too_many_messages
from meshgate.protocols.errors import (
    AuthenticationFailed,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    ContextLengthExceeded,
    ErrorInfo,
    GatewayError,
    InvalidRequest,
    NoCapacity,
    NotFound,
    OutputTooLarge,
    Overloaded,
    PermissionDenied,
    RateLimited,
    RequestTooLarge,
    StoreUnavailable,
    UnknownModel,
    Unprocessable,
    UnsupportedFeature,
    error_from_info,
)

__all__ = [
    "MAX_JSON_DEPTH",
    "MAX_MESSAGES",
    "UNSET",
    "AuthenticationFailed",
    "PermissionDenied",
    "BackendProtocolError",
    "BackendTimeout",
    "BackendUnavailable",
    "EmbedRequest",
    "Embeddings",
    "ContextLengthExceeded",
    "ErrorInfo",
    "Event",
    "Failed",
    "Finished",
    "FinishReason",
    "GatewayError",
    "ImagePart",
    "InvalidRequest",
    "KeepAlive",
    "Message",
    "Meta",
    "ModelInfo",
    "NoCapacity",
    "NotFound",
    "OutputTooLarge",
    "Overloaded",
    "Part",
    "Priority",
    "RateLimited",
    "ReasoningDelta",
    "ReasoningPart",
    "Request",
    "RequestTooLarge",
    "Response",
    "ResponseFormat",
    "Sampling",
    "StoreUnavailable",
    "TextDelta",
    "TextPart",
    "TokenLogprob",
    "Tool",
    "ToolCall",
    "ToolCallDelta",
    "ToolCallPart",
    "ToolChoice",
    "ToolResultPart",
    "TopLogprob",
    "UnknownModel",
    "Unprocessable",
    "UnsupportedFeature",
    "Usage",
    "collect",
    "decode_body",
    "error_from_info",
    "json_depth",
    "too_many_messages",
]

JsonSchema: TypeAlias = dict[str, Any]
"""A JSON Schema document, kept as parsed JSON (tool parameters, response formats)."""

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "stop_sequence", "length", "tool_calls", "content_filter"]


Priority: TypeAlias = Literal["interactive", "batch"]
"""A request's class: admission serves ``interactive`` requests first; ``batch`` ones (bulk work, batch jobs) take
the capacity left, with aging so that they never starve (``gateway.serving.admission``)."""


class _Frozen(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


# ---------------------------------------------------------------------------------------------------- parts


class TextPart(_Frozen, frozen=True, tag="text"):
    text: str


class ImagePart(_Frozen, frozen=True, tag="image"):
    """An image, either inline bytes (``data`` + ``media_type``) or a URL the client gave."""

    data: bytes | None = None
    media_type: str | None = None
    url: str | None = None


class ToolCallPart(_Frozen, frozen=True, tag="tool_call"):
    """A tool call the assistant made. ``arguments`` is the JSON text of the arguments object."""

    id: str
    name: str
    arguments: str = "{}"


class ToolResultPart(_Frozen, frozen=True, tag="tool_result"):
    call_id: str | None = None
    name: str | None = None
    content: tuple[TextPart | ImagePart, ...] = ()
    is_error: bool = False


class ReasoningPart(_Frozen, frozen=True, tag="reasoning"):
    """Model reasoning. ``provider_metadata`` round-trips opaque data such as a thinking signature."""

    text: str
    provider_metadata: dict[str, str] | None = None


Part: TypeAlias = TextPart | ImagePart | ToolCallPart | ToolResultPart | ReasoningPart


class Message(_Frozen, frozen=True):
    role: Role
    parts: tuple[Part, ...] = ()

    @property
    def text(self) -> str:
        """The concatenated text parts."""
        return "".join(p.text for p in self.parts if isinstance(p, TextPart))


# ---------------------------------------------------------------------------------------------------- request


class Tool(_Frozen, frozen=True):
    name: str
    description: str | None = None
    parameters: JsonSchema = msgspec.field(default_factory=lambda: {"type": "object", "properties": {}})


class ToolChoice(_Frozen, frozen=True):
    """``auto``: the model decides; ``none``: no tool calls; ``required``: at least one; ``tool``: ``name``."""

    mode: Literal["auto", "none", "required", "tool"] = "auto"
    name: str | None = None
    parallel: bool | UnsetType = UNSET


class ResponseFormat(_Frozen, frozen=True):
    kind: Literal["text", "json_object", "json_schema"] = "text"
    schema: JsonSchema | None = None
    name: str | None = None


class Sampling(_Frozen, frozen=True):
    """Sampling values. ``UNSET`` means "backend default"; ``None`` means the client explicitly sent null."""

    temperature: float | None | UnsetType = UNSET
    top_p: float | None | UnsetType = UNSET
    top_k: int | None | UnsetType = UNSET
    min_p: float | None | UnsetType = UNSET
    seed: int | None | UnsetType = UNSET
    presence_penalty: float | None | UnsetType = UNSET
    frequency_penalty: float | None | UnsetType = UNSET
    repeat_penalty: float | None | UnsetType = UNSET


class Request(_Frozen, frozen=True):
    """One generation request, whatever protocol it arrived in.

    ``raw_prompt`` is set for plain completions (no chat template); ``messages`` is then empty.
    ``max_tokens`` ``None`` means no limit beyond the context. ``prefill`` asks the backend to continue the
    last assistant message instead of opening a new turn. ``logprobs`` asks for each output token's log
    probability on the ``TextDelta`` that carries it, with the ``top_logprobs`` most likely alternatives.

    ``resume`` continues a generation whose replica failed mid-stream: the token ids it had generated (as its
    deltas' ``tokens`` carried them). A backend that can resume takes them as its own output (they count toward
    ``max_tokens``, the grammar and stop strings see them), sends their events again, then generates the rest;
    the gateway skips the events its client already has (``gateway.serving.resume``).

    ``cache_scope`` is whose cached prompt states the request may use and add to (the tenant of its API key, set by
    the gateway; ``""``: everyone's): a backend's prompt cache never serves one scope what another put there.

    ``priority`` is the request's class (``Priority``): what its protocol's ``service_tier`` asked for, else
    ``UNSET`` until the gateway settles it from the caller's key or its setting; admission serves ``interactive``
    before ``batch``.
    """

    model: str
    messages: tuple[Message, ...] = ()
    raw_prompt: str | None = None
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    response_format: ResponseFormat = ResponseFormat()
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    max_tokens: int | None = None
    stream: bool = False
    prefill: bool = False
    reasoning: bool | UnsetType = UNSET
    num_ctx: int | UnsetType = UNSET
    logprobs: bool = False
    top_logprobs: int = 0
    resume: tuple[int, ...] = ()
    cache_scope: str = ""
    priority: Priority | UnsetType = UNSET

    @property
    def calls_forced(self) -> bool:
        """Whether the answer must be a tool call: tools offered and ``tool_choice`` ``required`` or ``tool``."""
        return bool(self.tools) and self.tool_choice.mode in ("required", "tool")

    @property
    def forced_tool(self) -> Tool | None:
        """The tool the answer must call when the client leaves the model no choice of tool: the one
        ``tool_choice`` names, or the only tool offered under ``required``. A backend then generates only that
        tool's arguments. ``None`` otherwise (the model picks the name, or need not call at all)."""
        if not self.calls_forced:
            return None
        if self.tool_choice.mode == "tool":
            return next((t for t in self.tools if t.name == self.tool_choice.name), None)
        return self.tools[0] if len(self.tools) == 1 else None


class EmbedRequest(_Frozen, frozen=True):
    """Embed each input: a text, or token ids the client already tokenized (used as given, no BOS added).

    ``dimensions`` ``None`` means the model's full size; a smaller value keeps the first ``dimensions``
    components and renormalizes, a larger one is ``InvalidRequest``. ``truncate`` cuts an input longer than the
    context to fit; without it such an input is ``InvalidRequest``.
    """

    model: str
    inputs: tuple[str | tuple[int, ...], ...] = ()
    dimensions: int | None = None
    truncate: bool = True


class Embeddings(_Frozen, frozen=True):
    """One unit-length (L2-normalized) vector per input, in input order, with float32 precision.

    ``prompt_tokens`` counts the tokens embedded (after truncation); ``load_ns`` is time spent loading for
    this request (the model or its embedding context), else 0.
    """

    vectors: tuple[tuple[float, ...], ...] = ()
    prompt_tokens: int = 0
    load_ns: int = 0


# ---------------------------------------------------------------------------------------------------- events


class TopLogprob(_Frozen, frozen=True):
    """One candidate token at an output position: its text, natural-log probability and UTF-8 bytes."""

    token: str
    logprob: float
    bytes: tuple[int, ...] = ()


class TokenLogprob(_Frozen, frozen=True):
    """The log probability of one output token, with the ``top`` most likely tokens at its position."""

    token: str
    logprob: float
    bytes: tuple[int, ...] = ()
    top: tuple[TopLogprob, ...] = ()


class TextDelta(_Frozen, frozen=True, tag="text"):
    """Output text. ``logprobs`` (only when asked for) covers the tokens whose text starts in this delta.

    ``tokens`` (on every kind of delta): the ids of the tokens generated since the last delta that carried any,
    from a backend that can resume (``Request.resume``); empty from one that cannot. The gateway keeps them and
    never sends them to a client."""

    text: str
    logprobs: tuple[TokenLogprob, ...] | None = None
    tokens: tuple[int, ...] = ()


class ReasoningDelta(_Frozen, frozen=True, tag="reasoning"):
    text: str
    provider_metadata: dict[str, str] | None = None
    tokens: tuple[int, ...] = ()


class ToolCallDelta(_Frozen, frozen=True, tag="tool_call"):
    """A fragment of tool call ``index``. ``id`` and ``name`` come once, on its first fragment."""

    index: int
    id: str | None = None
    name: str | None = None
    arguments: str = ""
    tokens: tuple[int, ...] = ()


class Usage(_Frozen, frozen=True, tag="usage"):
    """Cumulative token counts and timings (nanoseconds); a later ``Usage`` replaces an earlier one."""

    prompt_tokens: int = 0
    completion_tokens: int = 0
    cached_tokens: int = 0
    cache_note: str = ""  # how the cached tokens were had, when a backend weighed sources (for the request log)
    load_ns: int = 0
    prompt_ns: int = 0
    eval_ns: int = 0


class KeepAlive(_Frozen, frozen=True, tag="keepalive"):
    """Nothing happened yet (loading, placing); lets a protocol send its heartbeat."""


class Finished(_Frozen, frozen=True, tag="finished"):
    reason: FinishReason = "stop"
    stop_sequence: str | None = None


class Failed(_Frozen, frozen=True, tag="failed"):
    error: ErrorInfo


Event: TypeAlias = TextDelta | ReasoningDelta | ToolCallDelta | Usage | KeepAlive | Finished | Failed
TERMINAL = (Finished, Failed)


# ---------------------------------------------------------------------------------------------------- context


class Meta(_Frozen, frozen=True):
    """What a protocol needs to frame an answer besides the events: an id, the model name, a timestamp.

    ``id`` is bare (protocols add their own prefix such as ``chatcmpl-``); ``created`` is unix seconds;
    ``priority`` the class the request ran at, which protocols echo as their ``service_tier`` (``None``: none echoed).
    """

    id: str
    model: str
    created: float
    priority: Priority | None = None


class ModelInfo(_Frozen, frozen=True):
    """A model as the listing endpoints show it."""

    name: str
    created: float = 0.0
    size: int = 0
    digest: str = ""
    format: str = "gguf"
    family: str = ""
    parameter_size: str = ""
    quantization: str = ""
    context_length: int = 0


# ---------------------------------------------------------------------------------------------------- collect


class ToolCall(_Frozen, frozen=True):
    id: str
    name: str
    arguments: str = ""


class Response(_Frozen, frozen=True):
    """A whole answer: the collected event stream. ``logprobs`` is ``None`` when the backend sent none."""

    text: str = ""
    reasoning: str = ""
    reasoning_metadata: dict[str, str] | None = None
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage = Usage()
    finish: Finished = Finished()
    logprobs: tuple[TokenLogprob, ...] | None = None


async def collect(events: AsyncIterable[Event]) -> Response:
    """Fold an event stream into a ``Response``; a ``Failed`` event raises its ``GatewayError``."""
    text: list[str] = []
    reasoning: list[str] = []
    metadata: dict[str, str] | None = None
    calls: dict[int, list[str]] = {}
    heads: dict[int, tuple[str, str]] = {}
    logprobs: list[TokenLogprob] | None = None
    usage = Usage()
    async for event in events:
        match event:
            case TextDelta(text=t, logprobs=lp):
                text.append(t)
                if lp is not None:
                    logprobs = logprobs or []
                    logprobs.extend(lp)
            case ReasoningDelta(text=t, provider_metadata=m):
                reasoning.append(t)
                metadata = m or metadata
            case ToolCallDelta(index=i, id=cid, name=name, arguments=args):
                if i not in heads:
                    heads[i] = (cid or f"call_{i}", name or "")
                calls.setdefault(i, []).append(args)
            case Usage():
                usage = event
            case Finished():
                tool_calls = tuple(
                    ToolCall(id=heads[i][0], name=heads[i][1], arguments="".join(calls[i])) for i in sorted(calls)
                )
                return Response(
                    text="".join(text),
                    reasoning="".join(reasoning),
                    reasoning_metadata=metadata,
                    tool_calls=tool_calls,
                    usage=usage,
                    finish=event,
                    logprobs=None if logprobs is None else tuple(logprobs),
                )
            case Failed(error=info):
                raise error_from_info(info)
    raise BackendProtocolError("the backend's stream ended without a finish or failure event")
