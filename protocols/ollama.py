"""The Ollama wire protocol (``/api/chat``, ``/api/generate``, ``/api/tags``, ``/api/version``): pure codecs.

Translates Ollama request bodies into ``protocols.model.Request`` and renders the internal event stream as
Ollama's NDJSON (one JSON object per line, each ending in ``\\n``, never a blank line; docs/protocols.md OLL-29..31).
Imports only ``protocols.model``, ``protocols.formats`` (base64, timestamps), ``msgspec`` and the standard library;
no I/O, no web framework.

Ollama-specific choices, each pinned by a test named after its checklist item:

- ``stream`` defaults to **true** when missing (OLL-10).
- ``options`` with a ``null`` value are skipped by the Ollama server (``Options.FromMap``), so here null and
  missing both become ``UNSET`` ("backend default"). ``num_predict`` of 0, -1 or -2 means "no limit".
- Tool call arguments are objects on the wire (OLL-24). Streamed fragments are buffered per call and sent
  whole, in a ``done:false`` chunk, when the next call starts or the stream ends (OLL-26). Arguments cut short
  by ``num_predict`` are sent as the object they hold so far (``formats.json_object_prefix``); arguments that
  are not a JSON object at all are sent as ``{}`` (llama.cpp's policy).
- Ollama has no ``tool_choice`` (4.4 item 8). ``tools`` together with ``format`` asks for structured output
  while offering tools, which here means the answer must be a call: ``tool_choice`` ``required`` (with one
  tool, that tool's arguments only, ``Request.forced_tool``), the arguments held to the tool's parameters
  in place of ``format``.
- Ollama histories carry tool results by ``tool_name`` without ids (OLL-25). Calls without an id get
  ``call_<n>`` (``n`` counts the calls in the conversation, so the id is stable as the history grows), and a
  result without ``tool_call_id`` is paired with the earliest unanswered call of the same name (4.4 item 5).
- Final objects always carry all six metrics, zeros included (the Go server omits zeros; clients accept both).
  Timestamps are UTC with six fractional digits and ``+00:00``, which every ``datetime.fromisoformat`` reads.
- ``/api/generate`` has no tools: tool call events are dropped from its stream.
- ``think`` (true or a level) on a model that cannot think is refused with Ollama's 400,
  ``{"error": "\"<model>\" does not support thinking"}`` (``server/routes.go``); ``think: false`` is accepted.
  Only the gateway knows the model's capabilities, so it asks ``refuses_thinking``.
- Load/unload requests (empty ``messages`` or ``prompt``, OLL-17) are the gateway's business:
  ``is_load_request`` / ``is_unload_request`` tell it, ``encode_load_response`` answers.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Annotated, Any

import msgspec

from meshgate.protocols.formats import check_tool_name, decode_base64, json_object_prefix, parse_data_uri, rfc3339
from meshgate.protocols.model import (
    UNSET,
    ContextLengthExceeded,
    Event,
    Failed,
    Finished,
    GatewayError,
    ImagePart,
    InvalidRequest,
    KeepAlive,
    Message,
    Meta,
    ModelInfo,
    Overloaded,
    ReasoningDelta,
    ReasoningPart,
    Request,
    Response,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    Tool,
    ToolCallDelta,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    UnsupportedFeature,
    Usage,
    error_from_info,
    too_many_messages,
)

__all__ = [
    "ChatRequest",
    "GenerateRequest",
    "chat_to_internal",
    "encode_chat_response",
    "encode_chat_stream",
    "encode_generate_response",
    "encode_generate_stream",
    "encode_load_response",
    "encode_tags",
    "encode_version",
    "error_body",
    "generate_to_internal",
    "is_load_request",
    "is_unload_request",
    "refuses_thinking",
]

# ---------------------------------------------------------------------------------------------------- wire types


MAX_CONTEXT = 1 << 30
"""The largest ``num_ctx`` taken at all (a model's own context caps it further, as Ollama caps it)."""


class Options(msgspec.Struct, kw_only=True):
    """The ``options`` keys meshgate maps (OLL-14); every other key is ignored, as the Ollama server does.

    Values outside their range are a 400 naming the option (``options.num_ctx``): Ollama passes them to its runner
    unchecked, where ``num_ctx: -1`` made ours fail to load. ``num_predict`` is any integer: 0 or less means "until
    the context is full" (the gateway's ``max_tokens`` setting caps it too).
    """

    num_ctx: Annotated[int, msgspec.Meta(ge=1, le=MAX_CONTEXT)] | None = None
    seed: int | None = None
    num_predict: int | None = None
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None = None
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    min_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0)] | None = None
    repeat_penalty: Annotated[float, msgspec.Meta(gt=0)] | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    stop: list[str] | None = None


class WireFunction(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None


class WireTool(msgspec.Struct, kw_only=True):
    """A tool in the OpenAI shape (OLL-13)."""

    type: str = "function"
    function: WireFunction


class WireToolCallFunction(msgspec.Struct, kw_only=True):
    index: int | None = None
    name: str
    arguments: dict[str, Any] | str = msgspec.field(default_factory=dict)


class WireToolCall(msgspec.Struct, kw_only=True):
    id: str | None = None
    function: WireToolCallFunction


class WireMessage(msgspec.Struct, kw_only=True):
    role: str
    content: str | None = None
    thinking: str | None = None
    images: list[str] | None = None
    tool_calls: list[WireToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None


class ChatRequest(msgspec.Struct, kw_only=True):
    """``POST /api/chat`` (OLL-8). ``truncate`` (Ollama 0.12.6+, default true): drop the oldest turns when the
    prompt does not fit the context; ``false`` refuses it instead (the gateway applies it)."""

    model: str
    messages: list[WireMessage] | None = None
    stream: bool | None = None
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None
    tools: list[WireTool] | None = None
    options: Options | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None


class GenerateRequest(msgspec.Struct, kw_only=True):
    """``POST /api/generate`` (OLL-16)."""

    model: str
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    stream: bool | None = None
    raw: bool = False
    format: str | dict[str, Any] | None = None
    keep_alive: float | str | None = None
    images: list[str] | None = None
    options: Options | None = None
    think: bool | str | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    truncate: bool | None = None


# ---------------------------------------------------------------------------------------------------- requests

_ROLES = ("system", "user", "assistant", "tool")
_THINK_LEVELS = ("low", "medium", "high", "max")
_MAGIC = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
)
_ZERO_DURATION = re.compile(r"(?:0+(?:\.0*)?(?:ns|us|µs|ms|s|m|h)?)+")  # "0", "0s", "0m0s", ...


def chat_to_internal(wire: ChatRequest) -> Request:
    """Translate a decoded ``/api/chat`` body into a ``Request``.

    Raises:
        InvalidRequest: an empty model, an unknown role, bad base64 in ``images``, a bad ``format`` or
            ``think`` value, or ``top_logprobs`` outside 0..20.
        UnsupportedFeature: ``logprobs`` was asked for.
    """
    _check_common(wire)
    if refused := too_many_messages(len(wire.messages or ())):
        raise refused
    tools = tuple(_tool(t, i) for i, t in enumerate(wire.tools or ()))
    request = _request(wire, messages=_messages(wire.messages or ()), tools=tools)
    if tools and request.response_format.kind != "text":  # tools with a format: the answer is a call
        return msgspec.structs.replace(
            request, tool_choice=ToolChoice(mode="required"), response_format=ResponseFormat()
        )
    return request


def generate_to_internal(wire: GenerateRequest) -> Request:
    """Translate a decoded ``/api/generate`` body into a ``Request``.

    ``system`` and ``prompt`` become a system message and a user message (with ``images``); with ``raw``
    the prompt goes to ``Request.raw_prompt`` untemplated. ``template`` and ``context`` are ignored.

    Raises:
        InvalidRequest: as ``chat_to_internal``.
        UnsupportedFeature: a non-empty ``suffix`` (fill-in-the-middle), images with ``raw``, or ``logprobs``.
    """
    _check_common(wire)
    if wire.suffix:
        raise UnsupportedFeature("suffix (fill-in-the-middle) is not supported; send the prompt only", param="suffix")
    images = tuple(_image(data, f"images[{j}]") for j, data in enumerate(wire.images or ()))
    if wire.raw:
        if images:
            raise UnsupportedFeature("images cannot be combined with raw=true; drop raw or the images", param="images")
        return _request(wire, raw_prompt=wire.prompt)
    messages = [Message(role="system", parts=(TextPart(text=wire.system),))] if wire.system else []
    messages.append(Message(role="user", parts=(TextPart(text=wire.prompt), *images)))
    return _request(wire, messages=tuple(messages))


def _tool(tool: WireTool, index: int) -> Tool:
    """The internal tool. Ollama checks no tool name; one that is empty or holds a control character is refused."""
    try:
        check_tool_name(tool.function.name, None)
    except ValueError as exc:
        raise InvalidRequest(f"tools[{index}].function.name: {exc}", param=f"tools[{index}].function.name") from exc
    function = tool.function
    if function.parameters is None:
        return Tool(name=function.name, description=function.description)
    return Tool(name=function.name, description=function.description, parameters=function.parameters)


def is_load_request(wire: ChatRequest | GenerateRequest) -> bool:
    """Whether the body only asks to load (or unload) the model: no messages, or an empty prompt (OLL-17)."""
    if isinstance(wire, ChatRequest):
        return not wire.messages
    return wire.prompt == ""


def refuses_thinking(wire: ChatRequest | GenerateRequest, can_think: bool) -> InvalidRequest | None:
    """Ollama's 400 when ``wire`` asks a model that cannot think (``can_think`` false) to think, else ``None``.

    Ollama words it ``"<model>" does not support thinking`` with the name as the client sent it, Go-quoted.
    """
    if can_think or wire.think in (None, False) or is_load_request(wire):
        return None
    return InvalidRequest(f"{_go_quote(wire.model)} does not support thinking", param="think")


def _go_quote(text: str) -> str:
    """``text`` as Go's ``%q`` writes it for printable text: in double quotes, ``"`` and ``\\`` escaped."""
    return msgspec.json.encode(text).decode()


def is_unload_request(wire: ChatRequest | GenerateRequest) -> bool:
    """Whether the body asks to unload the model: a load request with a zero ``keep_alive`` (OLL-15, OLL-17)."""
    keep_alive = wire.keep_alive
    if isinstance(keep_alive, str):
        zero = _ZERO_DURATION.fullmatch(keep_alive.strip()) is not None
    else:
        zero = keep_alive == 0
    return zero and is_load_request(wire)


def _check_common(wire: ChatRequest | GenerateRequest) -> None:
    if not wire.model:
        raise InvalidRequest("model is required", param="model")
    if wire.top_logprobs is not None and not 0 <= wire.top_logprobs <= 20:
        raise InvalidRequest("top_logprobs must be between 0 and 20", param="top_logprobs")
    if wire.logprobs:
        raise UnsupportedFeature("logprobs are not supported; omit logprobs", param="logprobs")


def _request(wire: ChatRequest | GenerateRequest, **fields: Any) -> Request:
    options = wire.options or Options()
    sampling = Sampling(
        **{
            name: value
            for name in (
                "temperature",
                "top_p",
                "top_k",
                "min_p",
                "seed",
                "presence_penalty",
                "frequency_penalty",
                "repeat_penalty",
            )
            if (value := getattr(options, name)) is not None
        }
    )
    return Request(
        model=wire.model,
        response_format=_response_format(wire.format),
        sampling=sampling,
        stop=tuple(options.stop or ()),
        max_tokens=options.num_predict if options.num_predict and options.num_predict > 0 else None,
        stream=wire.stream is not False,
        reasoning=_reasoning(wire.think),
        num_ctx=options.num_ctx if options.num_ctx else UNSET,
        **fields,
    )


def _response_format(value: str | dict[str, Any] | None) -> ResponseFormat:
    if value is None or value == "":
        return ResponseFormat()
    if value == "json":
        return ResponseFormat(kind="json_object")
    if isinstance(value, dict):
        return ResponseFormat(kind="json_schema", schema=value)
    raise InvalidRequest(f'format must be "json" or a JSON schema object, not {value!r}', param="format")


def _reasoning(think: bool | str | None) -> bool | msgspec.UnsetType:
    if think is None:
        return UNSET
    if isinstance(think, bool):
        return think
    if think in _THINK_LEVELS:
        return True
    raise InvalidRequest(
        f"think must be true, false or one of {', '.join(_THINK_LEVELS)}; got {think!r}", param="think"
    )


def _messages(wire_messages: Sequence[WireMessage]) -> tuple[Message, ...]:
    messages: list[Message] = []
    unanswered: list[ToolCallPart] = []
    n_calls = 0
    for i, m in enumerate(wire_messages):
        role = m.role.lower()
        if role not in _ROLES:
            raise InvalidRequest(
                f"messages[{i}].role must be one of {', '.join(_ROLES)}; got {m.role!r}", param=f"messages[{i}].role"
            )
        images = tuple(_image(data, f"messages[{i}].images[{j}]") for j, data in enumerate(m.images or ()))
        text = (TextPart(text=m.content),) if m.content else ()
        if role == "tool":
            call_id = _answer(unanswered, m.tool_call_id, m.tool_name)
            result = ToolResultPart(call_id=call_id, name=m.tool_name, content=(*text, *images))
            messages.append(Message(role="tool", parts=(result,)))
            continue
        calls: list[ToolCallPart] = []
        if role == "assistant":
            for call in m.tool_calls or ():
                arguments = call.function.arguments
                calls.append(
                    ToolCallPart(
                        id=call.id or f"call_{n_calls}",
                        name=call.function.name,
                        arguments=arguments if isinstance(arguments, str) else msgspec.json.encode(arguments).decode(),
                    )
                )
                n_calls += 1
            unanswered = list(calls)
        reasoning = (ReasoningPart(text=m.thinking),) if m.thinking and role == "assistant" else ()
        messages.append(Message(role=role, parts=(*reasoning, *text, *images, *calls)))  # type: ignore[arg-type]  # in _ROLES
    return tuple(messages)


def _answer(unanswered: list[ToolCallPart], call_id: str | None, name: str | None) -> str | None:
    """Pair a tool result with a call: its own ``call_id``, else the earliest unanswered call named ``name``
    (or the earliest of all when the result names none). The paired call is no longer unanswered."""
    if call_id:
        k = next((k for k, call in enumerate(unanswered) if call.id == call_id), None)
    else:
        k = next((k for k, call in enumerate(unanswered) if name is None or call.name == name), None)
    return unanswered.pop(k).id if k is not None else call_id


def _image(data: str, param: str) -> ImagePart:
    """Decode one raw base64 image (OLL-12); a ``data:`` URI is tolerated."""
    media_type = None
    if (uri := parse_data_uri(data)) is not None:
        media_type, data = uri.media_type, uri.payload
    try:
        raw = decode_base64(data)
    except ValueError as exc:
        raise InvalidRequest(f"{param} is not valid base64 image data", param=param) from exc
    return ImagePart(data=raw, media_type=media_type or _sniff(raw))


def _sniff(raw: bytes) -> str | None:
    if raw[:4] == b"RIFF" and raw[8:12] == b"WEBP":
        return "image/webp"
    return next((media_type for magic, media_type in _MAGIC if raw.startswith(magic)), None)


# ---------------------------------------------------------------------------------------------------- responses


def encode_chat_response(response: Response, meta: Meta) -> bytes:
    """The single ``/api/chat`` object for ``stream: false``: content, thinking and tool calls joined (OLL-28)."""
    calls = [_tool_call(i, c.id, c.name, c.arguments) for i, c in enumerate(response.tool_calls)]
    chunk = _chunk(meta, chat=True, text=response.text, thinking=response.reasoning, tool_calls=calls)
    return msgspec.json.encode(_finish(chunk, response.finish, response.usage))


def encode_generate_response(response: Response, meta: Meta) -> bytes:
    """The single ``/api/generate`` object for ``stream: false`` (OLL-27)."""
    chunk = _chunk(meta, chat=False, text=response.text, thinking=response.reasoning)
    return msgspec.json.encode(_finish(chunk, response.finish, response.usage))


def encode_chat_stream(events: AsyncIterable[Event], meta: Meta) -> AsyncIterator[bytes]:
    """Render an event stream as ``/api/chat`` NDJSON lines; a ``Failed`` event becomes an ``error`` line."""
    return _encode_stream(events, meta, chat=True)


def encode_generate_stream(events: AsyncIterable[Event], meta: Meta) -> AsyncIterator[bytes]:
    """Render an event stream as ``/api/generate`` NDJSON lines (``response`` fragments; OLL-27)."""
    return _encode_stream(events, meta, chat=False)


def encode_load_response(model: str, meta: Meta, *, unloaded: bool, chat: bool) -> bytes:
    """The reply to a load or unload request (OLL-17): ``done:true`` with ``done_reason`` ``load``/``unload``."""
    chunk = _chunk(msgspec.structs.replace(meta, model=model), chat=chat)
    chunk["done"] = True
    chunk["done_reason"] = "unload" if unloaded else "load"
    return msgspec.json.encode(chunk)


async def _encode_stream(events: AsyncIterable[Event], meta: Meta, *, chat: bool) -> AsyncIterator[bytes]:
    """One line per text or reasoning delta, whole tool calls (chat only), then the final object or an error
    line; the last ``Usage`` feeds the metrics. ``KeepAlive`` writes one space: never a blank line or a newline
    (OLL-30: clients ``json.loads`` every line), but bytes an idle proxy sees while a request waits for a slot or
    a resumed replica, which every JSON parser skips as the next line's leading whitespace."""
    usage = Usage()
    pending: dict[int, tuple[str, str, list[str]]] = {}  # tool call index -> (id, name, argument fragments)

    def flush() -> list[bytes]:
        lines = [
            _line(_chunk(meta, chat=True, tool_calls=[_tool_call(i, cid, name, "".join(args))]))
            for i, (cid, name, args) in sorted(pending.items())
        ]
        pending.clear()
        return lines

    async for event in events:
        match event:
            case KeepAlive():
                yield b" "
            case TextDelta(text=text) if text:
                yield _line(_chunk(meta, chat=chat, text=text))
            case ReasoningDelta(text=text) if text:
                yield _line(_chunk(meta, chat=chat, thinking=text))
            case ToolCallDelta(index=index) if chat:
                if index not in pending:
                    for line in flush():  # the next call starts: the previous ones are whole
                        yield line
                    pending[index] = (event.id or f"call_{index}", event.name or "", [])
                pending[index][2].append(event.arguments)
            case Usage():
                usage = event
            case Finished():
                for line in flush():
                    yield line
                yield _line(_finish(_chunk(meta, chat=chat), event, usage))
                return
            case Failed(error=info):
                yield _line({"error": error_from_info(info).message})
                return
    yield _line({"error": "the backend's stream ended without a finish or failure event"})


def _chunk(
    meta: Meta, *, chat: bool, text: str = "", thinking: str = "", tool_calls: list[dict[str, Any]] | None = None
) -> dict[str, Any]:
    """One response object, ``done: false``; chat objects always carry ``message`` (OLL-21)."""
    chunk: dict[str, Any] = {"model": meta.model, "created_at": rfc3339(meta.created)}
    if chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        if thinking:
            message["thinking"] = thinking
        if tool_calls:
            message["tool_calls"] = tool_calls
        chunk["message"] = message
    else:
        chunk["response"] = text
        if thinking:
            chunk["thinking"] = thinking
    chunk["done"] = False
    return chunk


def _finish(chunk: dict[str, Any], finish: Finished, usage: Usage) -> dict[str, Any]:
    """Make ``chunk`` the final object: ``done_reason`` (OLL-23, OLL-26) and metrics in nanoseconds (OLL-22)."""
    chunk["done"] = True
    chunk["done_reason"] = "length" if finish.reason == "length" else "stop"
    chunk["total_duration"] = usage.load_ns + usage.prompt_ns + usage.eval_ns
    chunk["load_duration"] = usage.load_ns
    chunk["prompt_eval_count"] = usage.prompt_tokens
    chunk["prompt_eval_duration"] = usage.prompt_ns
    chunk["eval_count"] = usage.completion_tokens
    chunk["eval_duration"] = usage.eval_ns
    return chunk


def _tool_call(index: int, call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A whole tool call with ``arguments`` as an object (OLL-24)."""
    return {"id": call_id, "function": {"index": index, "name": name, "arguments": json_object_prefix(arguments)}}


def _line(obj: dict[str, Any]) -> bytes:
    return msgspec.json.encode(obj) + b"\n"


# ---------------------------------------------------------------------------------------------------- listings, errors


def encode_tags(models: Sequence[ModelInfo]) -> bytes:
    """``GET /api/tags`` (OLL-38..40)."""
    return msgspec.json.encode(
        {
            "models": [
                {
                    "name": m.name,
                    "model": m.name,
                    "modified_at": rfc3339(m.created),
                    "size": m.size,
                    "digest": m.digest,
                    "details": {
                        "parent_model": "",
                        "format": m.format,
                        "family": m.family,
                        "families": [m.family] if m.family else [],
                        "parameter_size": m.parameter_size,
                        "quantization_level": m.quantization,
                    },
                }
                for m in models
            ]
        }
    )


def encode_version(version: str) -> bytes:
    """``GET /api/version`` (OLL-2)."""
    return msgspec.json.encode({"version": version})


def error_body(err: GatewayError) -> tuple[int, bytes]:
    """The status and ``{"error": "<message>"}`` body for an error before streaming starts (OLL-33..35).

    A full queue and a prompt that does not fit use Ollama's own words: its scheduler's ``ErrMaxQueue`` (503) and
    its runner's ``errorInputTooLong`` (400, what it answers with ``truncate: false``).
    """
    if isinstance(err, Overloaded):
        return 503, msgspec.json.encode({"error": "server busy, please try again.  maximum pending requests exceeded"})
    if isinstance(err, ContextLengthExceeded):
        return 400, msgspec.json.encode({"error": "the input length exceeds the context length"})
    return err.status, msgspec.json.encode({"error": err.message})
