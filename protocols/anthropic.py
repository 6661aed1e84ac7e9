"""The Anthropic Messages protocol: wire types and pure translation to and from the internal model.

Covers ``POST /v1/messages`` (plain and streamed), ``POST /v1/messages/count_tokens``, ``GET /v1/models`` and
``GET /v1/models/{id}`` and the error envelope (docs/protocols.md section 2, items ANT-11 to ANT-53).

Imports only ``protocols.model``, ``protocols.sse`` (SSE framing) and ``protocols.formats`` (base64, timestamps) of
ours, plus msgspec and the standard library. No I/O, no web framework, no HTTP client.

Decisions worth knowing:

- Content blocks stay raw JSON objects on the wire Structs and are converted one at a time with
  ``msgspec.convert``: msgspec's tagged unions reject unknown tags, and Anthropic adds block types often.
  Known blocks are still validated strictly (errors name ``messages[i].content[j].field``); unknown ones,
  ``document`` and server-tool blocks included, are ignored, and ``redacted_thinking`` is accepted and dropped.
- The system prompt is one leading ``system`` message: the top-level ``system`` text blocks, then the text of
  any ``role: "system"`` messages, in order (ANT-12, ANT-14). Claude Code's per-request
  ``x-anthropic-billing-header:`` block is dropped, as vLLM does, so prefix caches keep working.
- A user message's ``tool_result`` blocks become one ``tool`` message each, placed before the user's remaining
  content (docs/protocols.md 4.4 item 6); each result gets the tool name of the ``tool_use`` it answers.
- ``tool_use`` ids read ``toolu_...``: a backend's ``call_<x>`` is shown as ``toolu_<x>``, any other id gets the
  prefix (``tool_use_id``). Ids a client sends come in as they are, so a ``tool_result`` names its ``tool_use``
  by the same id inside the request; an OpenAI client sees the backend's own ``call_`` ids.
- Server tools (a dated ``type`` such as ``web_search_20250305``) are refused with ``UnsupportedFeature``.
- A non-streamed reply's ``input`` is the object the arguments hold so far (``formats.json_object_prefix``): a
  call cut short by ``max_tokens`` keeps what the anthropic SDK would have built from the stream, and
  arguments that are not a JSON object (a model can emit broken JSON) read ``{}``, as in llama.cpp; a stream
  forwards the fragments as they came.
- ``tool_choice`` ``{"type": "tool"}`` must name one of ``tools``; ``tool`` (and ``any`` with one tool) makes the
  backend generate that tool's arguments only (``Request.forced_tool``).
- A backend that reports ``stop`` after making tool calls is reported as ``tool_use``: Anthropic clients run
  tools only on that stop reason.
- ``input_tokens`` excludes cached prompt tokens, which go to ``cache_read_input_tokens`` (ANT-27).
- A stream holds ``message_start`` until the first event so that a leading ``Usage`` supplies
  ``input_tokens``; ``message_delta`` repeats the final usage, which the SDK copies into its snapshot (ANT-40).
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Iterable
from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from meshgate.protocols import sse
from meshgate.protocols.formats import check_tool_name, decode_base64, json_object_prefix, rfc3339
from meshgate.protocols.model import (
    BackendProtocolError,
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
    OutputTooLarge,
    Part,
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
    "CountTokensRequest",
    "MessagesRequest",
    "count_tokens_to_internal",
    "encode_count_tokens",
    "encode_message_response",
    "encode_message_stream",
    "encode_model",
    "encode_models",
    "error_body",
    "messages_to_internal",
    "tool_use_id",
]

BILLING_HEADER_PREFIX = "x-anthropic-billing-header:"

# ---------------------------------------------------------------------------------------------------- wire types


class TextBlock(msgspec.Struct, tag_field="type", tag="text", kw_only=True):
    text: str


class Base64Source(msgspec.Struct, tag_field="type", tag="base64", kw_only=True):
    media_type: str
    data: str


class URLSource(msgspec.Struct, tag_field="type", tag="url", kw_only=True):
    url: str


class ImageBlock(msgspec.Struct, tag_field="type", tag="image", kw_only=True):
    source: Base64Source | URLSource


class ToolUseBlock(msgspec.Struct, tag_field="type", tag="tool_use", kw_only=True):
    id: str
    name: str
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag_field="type", tag="tool_result", kw_only=True):
    tool_use_id: str
    content: str | list[dict[str, Any]] = ""
    is_error: bool = False


class ThinkingBlock(msgspec.Struct, tag_field="type", tag="thinking", kw_only=True):
    thinking: str
    signature: str = ""


class RedactedThinkingBlock(msgspec.Struct, tag_field="type", tag="redacted_thinking", kw_only=True):
    data: str = ""


ContentBlock = TextBlock | ImageBlock | ToolUseBlock | ToolResultBlock | ThinkingBlock | RedactedThinkingBlock
_BLOCK_TYPES = frozenset(("text", "image", "tool_use", "tool_result", "thinking", "redacted_thinking"))


class WireMessage(msgspec.Struct, kw_only=True):
    role: Literal["user", "assistant", "system"]
    content: str | list[dict[str, Any]]


class WireTool(msgspec.Struct, kw_only=True):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None


class WireToolChoice(msgspec.Struct, kw_only=True):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(msgspec.Struct, kw_only=True):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class OutputFormat(msgspec.Struct, kw_only=True):
    type: Literal["json_schema"]
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, kw_only=True):
    format: OutputFormat | None = None


class CountTokensRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/messages/count_tokens``: the conversation part of a request, with no ``max_tokens`` (ANT-50)."""

    model: str
    messages: Annotated[list[WireMessage], msgspec.Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: list[WireTool] | None = None
    tool_choice: WireToolChoice | None = None
    thinking: ThinkingConfig | None = None
    output_config: OutputConfig | None = None


class MessagesRequest(CountTokensRequest, kw_only=True):
    """``POST /v1/messages`` (ANT-11 to ANT-20). ``model``, ``max_tokens`` and ``messages`` are required."""

    max_tokens: Annotated[int, msgspec.Meta(ge=1)]
    stop_sequences: list[str] | None = None
    temperature: Annotated[float, msgspec.Meta(ge=0, le=1)] | None | UnsetType = UNSET  # ANT-16: 0.0 to 1.0
    top_p: Annotated[float, msgspec.Meta(ge=0, le=1)] | None | UnsetType = UNSET
    top_k: Annotated[int, msgspec.Meta(ge=0)] | None | UnsetType = UNSET
    stream: bool = False
    service_tier: Literal["auto", "standard_only"] | None = None  # ANT-20: both interactive (``priority``)


# ---------------------------------------------------------------------------------------------------- requests


def messages_to_internal(wire: MessagesRequest) -> Request:
    """Translate a decoded ``/v1/messages`` body into a ``Request``.

    Raises:
        InvalidRequest: a content block is malformed, or no user or assistant message is left.
        UnsupportedFeature: the request asks for a server tool.
    """
    request = count_tokens_to_internal(wire)
    return msgspec.structs.replace(
        request,
        sampling=Sampling(temperature=wire.temperature, top_p=wire.top_p, top_k=wire.top_k),
        stop=tuple(wire.stop_sequences or ()),
        max_tokens=wire.max_tokens,
        stream=wire.stream,
        priority=UNSET if wire.service_tier is None else "interactive",
    )


def count_tokens_to_internal(wire: CountTokensRequest) -> Request:
    """Translate a decoded ``/v1/messages/count_tokens`` body into a ``Request`` (no output limit); more than
    ``MAX_MESSAGES`` messages is ``InvalidRequest``."""
    if refused := too_many_messages(len(wire.messages)):
        raise refused
    messages, prefill = _conversation(wire)
    tools = tuple(_tool(tool, i) for i, tool in enumerate(wire.tools or ()))
    return Request(
        model=wire.model,
        messages=messages,
        tools=tools,
        tool_choice=_tool_choice(wire.tool_choice, tools),
        response_format=_response_format(wire.output_config),
        prefill=prefill,
        reasoning=UNSET if wire.thinking is None else wire.thinking.type != "disabled",
    )


def _conversation(wire: CountTokensRequest) -> tuple[tuple[Message, ...], bool]:
    """The internal messages and whether the last one is an assistant prefill (ANT-12, ANT-13)."""
    system = [TextPart(text=b.text) for b in _blocks_of(wire.system) if not b.text.startswith(BILLING_HEADER_PREFIX)]
    turns: list[tuple[str, list[Part]]] = []
    for i, message in enumerate(wire.messages):
        parts = _parts(message.content, f"messages[{i}]")
        if message.role == "system":
            system.extend(p for p in parts if isinstance(p, TextPart))
        elif turns and turns[-1][0] == message.role:
            turns[-1][1].extend(parts)
        else:
            turns.append((message.role, parts))
    if not turns:
        raise InvalidRequest("messages must hold at least one user or assistant message", param="messages")

    messages = [Message(role="system", parts=tuple(system))] if system else []
    tool_names: dict[str, str] = {}
    for role, parts in turns:
        if role == "assistant":
            tool_names.update((p.id, p.name) for p in parts if isinstance(p, ToolCallPart))
            messages.append(Message(role="assistant", parts=tuple(parts)))
            continue
        results = [p for p in parts if isinstance(p, ToolResultPart)]
        rest = tuple(p for p in parts if not isinstance(p, ToolResultPart))
        messages.extend(
            Message(role="tool", parts=(msgspec.structs.replace(r, name=tool_names.get(r.call_id or "")),))
            for r in results
        )
        if rest or not results:
            messages.append(Message(role="user", parts=rest))
    return tuple(messages), turns[-1][0] == "assistant"


def _blocks_of(system: str | list[TextBlock] | None) -> list[TextBlock]:
    if system is None:
        return []
    return [TextBlock(text=system)] if isinstance(system, str) else system


def _parts(content: str | list[dict[str, Any]], where: str) -> list[Part]:
    """The parts of one message's content; unknown block types are skipped, redacted thinking dropped."""
    if isinstance(content, str):
        return [TextPart(text=content)] if content else []
    parts: list[Part] = []
    for j, raw in enumerate(content):
        if raw.get("type") not in _BLOCK_TYPES:
            continue
        block_where = f"{where}.content[{j}]"
        match _convert_block(raw, block_where):
            case TextBlock(text=text):
                parts.append(TextPart(text=text))
            case ImageBlock(source=source):
                parts.append(_image(source, f"{block_where}.source.data"))
            case ToolUseBlock(id=call_id, name=name, input=arguments):
                parts.append(ToolCallPart(id=call_id, name=name, arguments=msgspec.json.encode(arguments).decode()))
            case ToolResultBlock(tool_use_id=call_id, content=result, is_error=is_error):
                inner = [p for p in _parts(result, block_where) if isinstance(p, TextPart | ImagePart)]
                parts.append(ToolResultPart(call_id=call_id, content=tuple(inner), is_error=is_error))
            case ThinkingBlock(thinking=text, signature=signature):
                parts.append(ReasoningPart(text=text, provider_metadata={"signature": signature}))
    return parts


def _convert_block(raw: dict[str, Any], where: str) -> ContentBlock:
    """Validate one known content block; errors name the field as ``messages[i].content[j].field``."""
    try:
        return msgspec.convert(raw, ContentBlock)
    except msgspec.ValidationError as exc:
        detail, _, path = str(exc).partition(" - at `$")
        if not path and "`" in detail:
            path = "." + detail.split("`")[1]
        param = where + path.rstrip("`")
        raise InvalidRequest(f"invalid request body: {detail} - at `$.{param}`", param=param) from exc


def _image(source: Base64Source | URLSource, where: str) -> ImagePart:
    if isinstance(source, URLSource):
        return ImagePart(url=source.url)
    try:
        data = decode_base64(source.data)
    except ValueError as exc:
        raise InvalidRequest(f"image data is not valid base64: {exc}", param=where) from exc
    return ImagePart(data=data, media_type=source.media_type)


def _tool(tool: WireTool, index: int) -> Tool:
    if tool.type not in (None, "custom"):
        raise UnsupportedFeature(f"server tool type '{tool.type}' is not supported", param=f"tools[{index}].type")
    if tool.input_schema is None:
        raise InvalidRequest("a custom tool needs an input_schema", param=f"tools[{index}].input_schema")
    try:
        check_tool_name(tool.name, 128)
    except ValueError as exc:
        raise InvalidRequest(f"tools.{index}.custom.name: {exc}", param=f"tools[{index}].name") from exc
    return Tool(name=tool.name, description=tool.description, parameters=tool.input_schema)


def _tool_choice(choice: WireToolChoice | None, tools: tuple[Tool, ...]) -> ToolChoice:
    if choice is None:
        return ToolChoice()
    if choice.type == "tool" and not choice.name:
        raise InvalidRequest("tool_choice of type 'tool' needs a name", param="tool_choice.name")
    if choice.type == "tool" and choice.name not in {t.name for t in tools}:
        message = f"tool_choice names '{choice.name}', which is not among tools; name one of the tools you send"
        raise InvalidRequest(message, param="tool_choice.name")
    modes: dict[str, Literal["auto", "none", "required", "tool"]] = {
        "auto": "auto",
        "any": "required",
        "tool": "tool",
        "none": "none",
    }
    mode = modes[choice.type]
    parallel = UNSET if choice.disable_parallel_tool_use is None else not choice.disable_parallel_tool_use
    return ToolChoice(mode=mode, name=choice.name if mode == "tool" else None, parallel=parallel)


def _response_format(config: OutputConfig | None) -> ResponseFormat:
    if config is None or config.format is None:
        return ResponseFormat()
    return ResponseFormat(kind="json_schema", schema=config.format.schema)


# ---------------------------------------------------------------------------------------------------- responses

_STOP_REASONS = {
    "stop": "end_turn",
    "stop_sequence": "stop_sequence",
    "length": "max_tokens",
    "tool_calls": "tool_use",
    "content_filter": "refusal",
}


def _stop(finish: Finished, used_tools: bool) -> dict[str, str | None]:
    """``stop_reason`` and ``stop_sequence`` (ANT-24, ANT-25); ``stop`` after tool calls reads ``tool_use``."""
    reason = _STOP_REASONS[finish.reason]
    if reason == "end_turn" and used_tools:
        reason = "tool_use"
    return {"stop_reason": reason, "stop_sequence": finish.stop_sequence if reason == "stop_sequence" else None}


def _usage(usage: Usage) -> dict[str, int]:
    """Anthropic usage: ``input_tokens`` excludes the cached prompt tokens (ANT-27)."""
    return {
        "input_tokens": max(usage.prompt_tokens - usage.cached_tokens, 0),
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": usage.cached_tokens,
        "output_tokens": usage.completion_tokens,
    }


def _tool_input(arguments: str) -> dict[str, Any]:
    """The arguments as an object: what a call cut short holds so far; ``{}`` for anything not an object."""
    return json_object_prefix(arguments)


def _message(meta: Meta, content: list[dict[str, Any]], stop: dict[str, str | None], usage: Usage) -> dict[str, Any]:
    counted: dict[str, Any] = _usage(usage)
    if meta.priority is not None:  # the tier that served it (``usage.service_tier``): ``standard`` or ``batch``
        counted["service_tier"] = "batch" if meta.priority == "batch" else "standard"
    return {
        "id": f"msg_{meta.id}",
        "type": "message",
        "role": "assistant",
        "model": meta.model,
        "content": content,
        **stop,
        "usage": counted,
    }


def tool_use_id(call_id: str) -> str:
    """The ``tool_use`` id an Anthropic client sees for a backend's call id: ``toolu_<x>`` for ``call_<x>`` (what
    backends mint), ``toolu_`` before any other id, a ``toolu_`` id unchanged."""
    if call_id.startswith("toolu_"):
        return call_id
    return "toolu_" + call_id.removeprefix("call_")


def encode_message_response(response: Response, meta: Meta) -> bytes:
    """A non-streamed ``/v1/messages`` reply: blocks in the order thinking, text, tool_use (ANT-22 to ANT-27)."""
    content: list[dict[str, Any]] = []
    if response.reasoning:
        signature = (response.reasoning_metadata or {}).get("signature", "")
        content.append({"type": "thinking", "thinking": response.reasoning, "signature": signature})
    if response.text or not response.tool_calls:
        content.append({"type": "text", "text": response.text})
    content.extend(
        {"type": "tool_use", "id": tool_use_id(call.id), "name": call.name, "input": _tool_input(call.arguments)}
        for call in response.tool_calls
    )
    stop = _stop(response.finish, bool(response.tool_calls))
    return msgspec.json.encode(_message(meta, content, stop, response.usage))


def encode_count_tokens(n: int) -> bytes:
    """The ``/v1/messages/count_tokens`` reply (ANT-51)."""
    return msgspec.json.encode({"input_tokens": n})


# ---------------------------------------------------------------------------------------------------- streams


def _frame(name: str, payload: dict[str, Any] | None = None) -> bytes:
    """One named SSE event whose JSON also carries ``"type": name`` (ANT-28 to ANT-30)."""
    return sse.frame(msgspec.json.encode({"type": name, **(payload or {})}), name)


class _StreamEncoder:
    """Turns events into frames: blocks one at a time, indexes 0, 1, 2, ... with no gaps (ANT-31 to ANT-42)."""

    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.usage = Usage()
        self.started = False
        self.done = False
        self.next_index = 0
        self.open_kind: str | None = None
        self.open_tool: int | None = None
        self.signature = ""
        self.tool_blocks: dict[int, int] = {}

    def feed(self, event: Event) -> list[bytes]:
        frames: list[bytes] = []
        if not self.started and not isinstance(event, Failed):
            self.usage = event if isinstance(event, Usage) else self.usage
            message = _message(self.meta, [], {"stop_reason": None, "stop_sequence": None}, self.usage)
            frames.append(_frame("message_start", {"message": message}))
            self.started = True
        match event:
            case TextDelta(text=text) if text:
                frames += self._open("text", {"type": "text", "text": ""})
                frames.append(self._delta(self.next_index - 1, {"type": "text_delta", "text": text}))
            case ReasoningDelta(text=text, provider_metadata=metadata) if text or metadata:
                frames += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                self.signature = (metadata or {}).get("signature", self.signature)
                if text:
                    frames.append(self._delta(self.next_index - 1, {"type": "thinking_delta", "thinking": text}))
            case ToolCallDelta():
                frames += self._tool(event)
            case Usage():
                self.usage = event
            case KeepAlive():
                frames.append(_frame("ping"))
            case Finished():
                frames += self._close()
                stop = _stop(event, bool(self.tool_blocks))
                frames.append(_frame("message_delta", {"delta": stop, "usage": _usage(self.usage)}))
                frames.append(_frame("message_stop"))
                self.done = True
            case Failed(error=info):
                _, body = error_body(error_from_info(info))
                frames.append(_frame("error", {"error": msgspec.json.decode(body)["error"]}))
                self.done = True
        return frames

    def _delta(self, index: int, delta: dict[str, Any]) -> bytes:
        return _frame("content_block_delta", {"index": index, "delta": delta})

    def _open(self, kind: str, block: dict[str, Any], tool: int | None = None) -> list[bytes]:
        if self.open_kind == kind and self.open_tool == tool:
            return []
        frames = self._close()
        frames.append(_frame("content_block_start", {"index": self.next_index, "content_block": block}))
        self.open_kind, self.open_tool = kind, tool
        self.next_index += 1
        return frames

    def _close(self) -> list[bytes]:
        if self.open_kind is None:
            return []
        index = self.next_index - 1
        frames = []
        if self.open_kind == "thinking":
            frames.append(self._delta(index, {"type": "signature_delta", "signature": self.signature}))
            self.signature = ""
        frames.append(_frame("content_block_stop", {"index": index}))
        self.open_kind = self.open_tool = None
        return frames

    def _tool(self, event: ToolCallDelta) -> list[bytes]:
        """A tool call fragment. Fragments of a call whose block already closed (a backend that interleaves
        calls) go to that block's index, where the SDK still accumulates them by index."""
        frames: list[bytes] = []
        if event.index not in self.tool_blocks:
            call_id = tool_use_id(event.id) if event.id else f"toolu_{self.meta.id}_{event.index}"
            block = {"type": "tool_use", "id": call_id, "name": event.name or "", "input": {}}
            frames += self._open("tool_use", block, tool=event.index)
            self.tool_blocks[event.index] = self.next_index - 1
        if event.arguments:
            delta = {"type": "input_json_delta", "partial_json": event.arguments}
            frames.append(self._delta(self.tool_blocks[event.index], delta))
        return frames


async def encode_message_stream(events: AsyncIterable[Event], meta: Meta) -> AsyncIterator[bytes]:
    """A streamed ``/v1/messages`` reply as SSE frames; a ``Failed`` event becomes an ``event: error`` frame.

    A stream that ends without ``Finished`` or ``Failed`` is closed with an error frame too.
    """
    encoder = _StreamEncoder(meta)
    async for event in events:
        for frame in encoder.feed(event):
            yield frame
        if encoder.done:
            return
    failure = Failed(error=BackendProtocolError("the backend's stream ended without finishing").info())
    for frame in encoder.feed(failure):
        yield frame


# ---------------------------------------------------------------------------------------------------- models


def _model_info(model: ModelInfo) -> dict[str, Any]:
    info: dict[str, Any] = {
        "type": "model",
        "id": model.name,
        "display_name": model.name,
        "created_at": rfc3339(model.created, fraction=False),
        "lifecycle": "active",
    }
    if model.context_length:
        info["max_input_tokens"] = model.context_length
    return info


def encode_models(models: Iterable[ModelInfo]) -> bytes:
    """The ``GET /v1/models`` reply: one page holding every model, so ``has_more`` is false (ANT-52, ANT-53)."""
    data = [_model_info(model) for model in models]
    first, last = (data[0]["id"], data[-1]["id"]) if data else (None, None)
    return msgspec.json.encode({"data": data, "has_more": False, "first_id": first, "last_id": last})


def encode_model(model: ModelInfo) -> bytes:
    """The ``GET /v1/models/{model_id}`` reply (ANT-52)."""
    return msgspec.json.encode(_model_info(model))


# ---------------------------------------------------------------------------------------------------- errors

_ERROR_TYPES = {
    400: (400, "invalid_request_error"),
    401: (401, "authentication_error"),
    403: (403, "permission_error"),
    404: (404, "not_found_error"),
    413: (413, "request_too_large"),
    422: (422, "invalid_request_error"),
    429: (429, "rate_limit_error"),
    503: (529, "overloaded_error"),
    504: (504, "timeout_error"),
}


def error_body(err: GatewayError) -> tuple[int, bytes]:
    """Status and body in Anthropic's envelope (ANT-44, ANT-45).

    ``NoCapacity`` and ``BackendUnavailable`` (503 internally) become 529 ``overloaded_error``, which the SDK
    retries; any status without an Anthropic type becomes 500 ``api_error``. A full queue (``Overloaded``) is
    529 too: that is what the API answers when it is overloaded as a whole, while 429 ``rate_limit_error`` means
    the caller's own rate limit (``doc-ant-err``); both are retried by the SDK after ``retry-after`` (ANT-48).
    """
    status, kind = _ERROR_TYPES.get(err.status, (500, "api_error"))
    message = err.message
    if isinstance(err, ContextLengthExceeded) and err.context:
        # Anthropic's wording; the most prompt that fits leaves one token of the context for the answer
        message = f"prompt is too long: {err.prompt_tokens} tokens > {err.context - 1} maximum"
    elif isinstance(err, OutputTooLarge) and err.limit:
        message = (
            f"max_tokens: {err.asked} > {err.limit}, which is the maximum allowed number of output tokens "
            f"for {err.model}"
        )
    return status, msgspec.json.encode({"type": "error", "error": {"type": kind, "message": message}})
