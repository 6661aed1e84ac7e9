"""The internal language of meshgate: requests, messages, the event stream, errors.

Every client protocol translates into these types and every backend speaks them. Vendor-neutral: no field
here is named after one wire protocol's spelling.

Must not import anything of ours (it is the bottom of the import graph) and does no I/O.

Shape:

- ``Request``: ``messages`` made of ``Message(role, parts)``; parts are a tagged union (``TextPart``,
  ``ImagePart``, ``ToolCallPart``, ``ToolResultPart``, ``ReasoningPart``). Sampling values default to
  ``msgspec.UNSET`` ("backend default"), which differs from an explicit ``None``.
- The event stream: an async iterator of ``Event`` that ends in exactly one ``Finished`` or ``Failed``.
  ``Usage`` snapshots are cumulative (the last one wins). ``KeepAlive`` carries no content.
- ``collect(events)`` folds a stream into a ``Response``; non-streaming endpoints use it, never a second path.
- Embeddings are request/response, not a stream: ``EmbedRequest`` in, ``Embeddings`` (unit vectors) out.

Error tree (status on the class)::

    GatewayError (500)
    ├── InvalidRequest (400)
    │   ├── UnsupportedFeature (400)
    │   ├── ContextLengthExceeded (400)  the prompt (plus the output asked for) does not fit the context
    │   └── OutputTooLarge (400)         more output asked for than the gateway allows one request
    ├── AuthenticationFailed (401)
    ├── NotFound (404)
    │   └── UnknownModel (404)
    ├── RequestTooLarge (413)
    ├── Unprocessable (422)
    ├── RateLimited (429)
    ├── NoCapacity (503)          no placement fits / overloaded
    │   ├── Overloaded (503)      the instance's queue is full; retry after ``retry_after`` seconds
    │   └── StoreUnavailable (503) the cluster's state store did not answer in time; retry after ``retry_after``
    ├── BackendUnavailable (503)  runner down, crashed or unreachable
    ├── BackendProtocolError (502)
    └── BackendTimeout (504)
"""

from __future__ import annotations

import array
import itertools
import re
from collections.abc import AsyncIterable
from typing import Any, ClassVar, Literal, TypeAlias, TypeVar

import msgspec
from msgspec import UNSET, UnsetType

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

T = TypeVar("T")

JsonSchema: TypeAlias = dict[str, Any]
"""A JSON Schema document, kept as parsed JSON (tool parameters, response formats)."""

Role = Literal["system", "user", "assistant", "tool"]
FinishReason = Literal["stop", "stop_sequence", "length", "tool_calls", "content_filter"]


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


class ErrorInfo(_Frozen, frozen=True):
    """A serializable error: ``kind`` is a ``GatewayError`` subclass name; ``param`` the field it is about;
    ``detail`` the numbers a protocol words its own message from (``ContextLengthExceeded``'s token counts), so
    an error that reaches a client mid-stream reads as it would have as an HTTP error."""

    kind: str
    message: str
    param: str | None = None
    detail: dict[str, int | None] | None = None


class Failed(_Frozen, frozen=True, tag="failed"):
    error: ErrorInfo


Event: TypeAlias = TextDelta | ReasoningDelta | ToolCallDelta | Usage | KeepAlive | Finished | Failed
TERMINAL = (Finished, Failed)


# ---------------------------------------------------------------------------------------------------- errors


class GatewayError(Exception):
    """Base of every error meshgate reports to a client. ``status`` is the HTTP status it maps to."""

    status: ClassVar[int] = 500

    def __init__(self, message: str, *, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param

    def info(self) -> ErrorInfo:
        return ErrorInfo(kind=type(self).__name__, message=self.message, param=self.param)


class InvalidRequest(GatewayError):
    status = 400


class UnsupportedFeature(InvalidRequest):
    status = 400


class ContextLengthExceeded(InvalidRequest):
    """The prompt, or the prompt plus the output the client asked for, does not fit the model's context.

    ``completion_tokens`` is the output asked for, or ``None`` when only the prompt was checked (the output is
    then capped by the room left). Rebuilt from an ``ErrorInfo`` (a ``Failed`` event) it keeps only the message
    (``context`` is then 0); protocols render their own wording from the numbers when they have them.
    """

    status = 400

    def __init__(
        self,
        message: str | None = None,
        *,
        prompt_tokens: int = 0,
        completion_tokens: int | None = None,
        context: int = 0,
        param: str | None = "messages",
    ) -> None:
        if message is None:
            asked = "" if completion_tokens is None else f" and {completion_tokens} asked for the output"
            message = (
                f"the prompt has {prompt_tokens} tokens{asked}, but the model's context holds {context}; "
                f"shorten the prompt{'' if completion_tokens is None else ' or ask for less output'}"
            )
        super().__init__(message, param=param)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = completion_tokens
        self.context = context

    def info(self) -> ErrorInfo:
        detail = {"prompt_tokens": self.prompt_tokens, "completion_tokens": self.completion_tokens}
        return msgspec.structs.replace(super().info(), detail={**detail, "context": self.context})


class OutputTooLarge(InvalidRequest):
    """A request asks for more output tokens (``asked``) than the gateway allows one request (``limit``).

    Protocols that refuse it render their own wording from the numbers; rebuilt from an ``ErrorInfo`` it keeps
    only the message (``limit`` is then 0).
    """

    status = 400

    def __init__(
        self,
        message: str | None = None,
        *,
        asked: int = 0,
        limit: int = 0,
        model: str = "",
        param: str | None = "max_tokens",
    ) -> None:
        if message is None:
            message = (
                f"max_tokens is {asked}, more than the {limit} output tokens one request may ask of "
                f"{model or 'this model'}; ask for fewer"
            )
        super().__init__(message, param=param)
        self.asked = asked
        self.limit = limit
        self.model = model


class AuthenticationFailed(GatewayError):
    status = 401


class PermissionDenied(GatewayError):
    """A valid key without the scope an endpoint needs."""

    status = 403


class NotFound(GatewayError):
    status = 404


class UnknownModel(NotFound):
    def __init__(self, model: str) -> None:
        super().__init__(f"model '{model}' not found", param="model")
        self.model = model


class RequestTooLarge(GatewayError):
    status = 413


class RateLimited(GatewayError):
    status = 429

    def __init__(self, message: str, *, param: str | None = None, retry_after: float = 1.0) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after


class Unprocessable(GatewayError):
    """Well-formed, but the content cannot be processed (e.g. a JSON schema the model cannot be held to)."""

    status = 422


class NoCapacity(GatewayError):
    status = 503


class Overloaded(NoCapacity):
    """Too many requests already wait for the model; ``retry_after`` is a fair guess in seconds."""

    def __init__(self, message: str, *, param: str | None = None, retry_after: float = 1.0) -> None:
        super().__init__(message, param=param)
        self.retry_after = retry_after


class StoreUnavailable(NoCapacity):
    """The cluster's state store (Redis) did not answer within its timeout, or refused the connection. The message
    never names the store's address; ``retry_after`` is a fair guess in seconds."""

    def __init__(self, message: str = "", *, param: str | None = None, retry_after: float = 2.0) -> None:
        super().__init__(message or "the cluster's state store is unreachable; retry shortly", param=param)
        self.retry_after = retry_after


class BackendUnavailable(GatewayError):
    status = 503


class BackendProtocolError(GatewayError):
    status = 502


class BackendTimeout(GatewayError):
    status = 504


def _subclasses(cls: type[GatewayError]) -> dict[str, type[GatewayError]]:
    found = {cls.__name__: cls}
    for sub in cls.__subclasses__():
        found.update(_subclasses(sub))
    return found


def error_from_info(info: ErrorInfo) -> GatewayError:
    """Rebuild the exception a ``Failed`` event describes (unknown kinds become ``GatewayError``)."""
    cls = _subclasses(GatewayError).get(info.kind, GatewayError)
    if cls is UnknownModel:
        err: GatewayError = NotFound(info.message, param="model")
    elif cls is ContextLengthExceeded and info.detail:
        err = ContextLengthExceeded(info.message, **info.detail)  # type: ignore[arg-type]  # its own info()'s keys
    else:
        err = cls(info.message)
        err.param = info.param
    return err


# ---------------------------------------------------------------------------------------------------- context


class Meta(_Frozen, frozen=True):
    """What a protocol needs to frame an answer besides the events: an id, the model name, a timestamp.

    ``id`` is bare (protocols add their own prefix such as ``chatcmpl-``); ``created`` is unix seconds.
    """

    id: str
    model: str
    created: float


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


MAX_JSON_DEPTH = 128
"""How deeply a request body may nest JSON arrays and objects. Python's recursion limit (about 1,000 frames, shared
with the code on the stack) stops every JSON decoder, encoder and schema walker somewhere below that; a body that
decodes here must still encode for a runner and turn into a grammar there."""

MAX_MESSAGES = 10_000
"""The most messages (Responses API: input items) one request may hold; OpenAI's chat completions keep their own
2,048. Rendering and counting a prompt is linear in them, yet a chat of 100,000 empty messages still cost seconds
of CPU per count and 37-60 s before an answer; no model's context holds that many turns, and a client that sends
more is refused before any work is done, told the bound."""


def too_many_messages(count: int, param: str = "messages") -> InvalidRequest | None:
    """The ``InvalidRequest`` for a request of ``count`` messages when that is more than ``MAX_MESSAGES``."""
    if count <= MAX_MESSAGES:
        return None
    return InvalidRequest(
        f"{param} holds {count:,} messages; at most {MAX_MESSAGES:,} are allowed: drop or summarize the oldest",
        param=param,
    )


_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')
_BRACKET_STEPS = bytes.maketrans(b"[{]}", b"\x01\x01\xff\xff")  # +1 / -1 as signed bytes
_NOT_BRACKETS = bytes(b for b in range(256) if b not in b"[]{}")


def json_depth(body: bytes) -> int:
    """How deeply ``body``, valid JSON, nests arrays and objects (brackets inside strings do not count).

    Linear and mostly in C: the strings are cut out and the brackets left are summed (0.4 s for 32 MB of them).
    """
    steps = _JSON_STRING.sub(b"", body).translate(_BRACKET_STEPS, _NOT_BRACKETS)
    return max(itertools.accumulate(array.array("b", steps)), default=0)


def decode_body(body: bytes, into: type[T]) -> T:
    """Decode a JSON request body into a wire Struct; bad JSON or a bad field becomes ``InvalidRequest``.

    The message names the offending field (``Object missing required field `max_tokens```,
    ``Expected `str`, got `int` - at `$.messages[0].content```). JSON nested deeper than ``MAX_JSON_DEPTH`` is
    refused, even in fields that are otherwise taken as they come.
    """
    try:
        wire = msgspec.json.decode(body, type=into)
    except msgspec.ValidationError as exc:
        raise InvalidRequest(f"invalid request body: {exc}", param=_param_of(str(exc))) from exc
    except msgspec.DecodeError as exc:
        raise InvalidRequest(f"request body is not valid JSON: {exc}") from exc
    except RecursionError as exc:  # deeper than the decoder's stack allows
        raise InvalidRequest(
            f"request body nests JSON too deeply; at most {MAX_JSON_DEPTH} levels are allowed"
        ) from exc
    # Measured on valid JSON only (every string closed, so the scan is linear). A body with fewer opening brackets
    # than the limit cannot nest deeper than it and is not scanned.
    if body.count(b"[") + body.count(b"{") > MAX_JSON_DEPTH and (depth := json_depth(body)) > MAX_JSON_DEPTH:
        raise InvalidRequest(f"request body nests JSON {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")
    return wire


def _param_of(message: str) -> str | None:
    """The field a msgspec error names: ``messages[0].role`` from "... - at `$.messages[0].role`"."""
    if "`" not in message:
        return None
    at = message.rsplit(" - at `$.", 1)[1].rstrip("`") if " - at `$." in message else None
    if message.startswith("Object missing required field"):
        field = message.split("`")[1]
        return f"{at}.{field}" if at else field
    return at or message.split("`")[1]


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
