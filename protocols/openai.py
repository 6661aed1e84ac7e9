"""The OpenAI wire protocol: chat completions and model listings (legacy completions, embeddings and the Responses
API live in sibling modules; what chat shares with them, the error envelope included, is in ``protocols.openai_wire``
and re-exported here: ``error_body``, ``stream_error_frame``, ``wants_usage``).

Pure translation between OpenAI's JSON and ``protocols.model``: request Structs and ``*_to_internal`` going
in; ``encode_*`` functions that turn a ``Response`` or an event stream into response bytes going out. The
checklist items it implements are docs/protocols.md section 1 (OAI-n, cited where they decide something).

Imports only ``protocols.model``, ``protocols.openai_wire`` (the shared OpenAI pieces), ``protocols.sse`` and
``protocols.formats`` (data URIs), msgspec and the standard library. No I/O, no web framework, no HTTP client.

Decisions worth knowing:

- ``developer`` and ``system`` messages both become role ``system``. The deprecated ``function`` role becomes
  a tool result; an assistant ``function_call`` gets the id ``call_<message index>`` so the two pair up.
- Reasoning goes out as the non-standard ``reasoning_content`` field (llama.cpp's spelling) on the message
  and on deltas, and is read back from ``reasoning_content`` or ``reasoning`` on assistant messages.
- ``logprobs``/``top_logprobs`` (chat) travel on ``TextDelta.logprobs`` and go out as ``choices[].logprobs``
  ``{"content": [...], "refusal": null}`` (OAI-36), on each chunk when streaming; ``null`` when the backend sent
  none. ``top_logprobs`` without ``logprobs: true`` is a 400 (OAI-23).
- Accepted and ignored: ``logit_bias``, ``user``, ``metadata``, image ``detail``, ``json_schema.strict`` and
  ``tools[].function.strict``. Refused with a 400: ``n`` other than 1, audio and file parts.
- Documented ranges (temperature 0..2, top_p 0..1, penalties -2..2, top_logprobs 0..20, token limits >= 1)
  are msgspec constraints, so the decoder's error names the field.
- A stream that ends without ``Finished`` or ``Failed`` is rendered as a ``BackendProtocolError`` frame.
- Longer than the 450-line aim: about half the file is the declarative wire Structs, which read quickly.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator, Sequence
from typing import Any, Literal, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

from meshgate.protocols.formats import check_tool_name, decode_base64, parse_data_uri
from meshgate.protocols.model import (
    BackendProtocolError,
    Event,
    Failed,
    Finished,
    ImagePart,
    InvalidRequest,
    KeepAlive,
    Message,
    Meta,
    ModelInfo,
    Part,
    ReasoningDelta,
    ReasoningPart,
    Request,
    Response,
    ResponseFormat,
    TextDelta,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    UnsupportedFeature,
    Usage,
    error_from_info,
)
from meshgate.protocols.openai_wire import (
    DONE,
    Penalty,
    Probability,
    ServiceTier,
    StreamOptions,
    Temperature,
    TokenLimit,
    TopLogprobs,
    Wire,
    error_body,
    frame,
    only_one,
    sampling,
    stop_sequences,
    stream_error_frame,
    tier_echo,
    tier_priority,
    usage_body,
    wants_usage,
)
from meshgate.protocols.sse import KEEPALIVE

__all__ = [
    "MAX_CHAT_MESSAGES",
    "ChatRequest",
    "chat_to_internal",
    "encode_chat_response",
    "encode_chat_stream",
    "encode_model",
    "encode_models",
    "error_body",
    "stream_error_frame",
    "wants_usage",
]

MAX_CHAT_MESSAGES = 2048
"""OpenAI's own bound on ``messages``; more is refused in OpenAI's words, before any work is done."""


# ---------------------------------------------------------------------------------------------------- content


class TextContent(Wire, tag_field="type", tag="text"):
    text: str


class RefusalContent(Wire, tag_field="type", tag="refusal"):
    refusal: str


class ImageURL(Wire):
    url: str
    detail: str | None = None


class ImageContent(Wire, tag_field="type", tag="image_url"):
    image_url: ImageURL


class AudioContent(Wire, tag_field="type", tag="input_audio"):
    """Read only to refuse it by name; its fields are not kept."""


class FileContent(Wire, tag_field="type", tag="file"):
    """Read only to refuse it by name; its fields are not kept."""


UserContent: TypeAlias = TextContent | ImageContent | AudioContent | FileContent

# ---------------------------------------------------------------------------------------------------- messages


class DeveloperMessage(Wire, tag_field="role", tag="developer"):
    content: str | list[TextContent]
    name: str | None = None


class SystemMessage(Wire, tag_field="role", tag="system"):
    content: str | list[TextContent]
    name: str | None = None


class UserMessage(Wire, tag_field="role", tag="user"):
    content: str | list[UserContent]
    name: str | None = None


class FunctionCall(Wire):
    arguments: str
    name: str


class ToolCall(Wire):
    id: str
    function: FunctionCall
    type: Literal["function"] = "function"


class AssistantMessage(Wire, tag_field="role", tag="assistant"):
    content: str | list[TextContent | RefusalContent] | None = None
    function_call: FunctionCall | None = None
    name: str | None = None
    refusal: str | None = None
    tool_calls: list[ToolCall] | None = None
    reasoning_content: str | None = None  # not OpenAI's: llama.cpp's spelling
    reasoning: str | None = None  # not OpenAI's: vLLM's and Ollama's spelling


class ToolMessage(Wire, tag_field="role", tag="tool"):
    content: str | list[TextContent]
    tool_call_id: str


class FunctionMessage(Wire, tag_field="role", tag="function"):
    content: str | None
    name: str


ChatMessage: TypeAlias = (
    DeveloperMessage | SystemMessage | UserMessage | AssistantMessage | ToolMessage | FunctionMessage
)

# ---------------------------------------------------------------------------------------------------- options


class FunctionDefinition(Wire):
    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(Wire):
    function: FunctionDefinition
    type: Literal["function"] = "function"


class FunctionName(Wire):
    name: str


class NamedToolChoice(Wire):
    function: FunctionName
    type: Literal["function"] = "function"


ToolChoiceOption: TypeAlias = Literal["none", "auto", "required"] | NamedToolChoice


class JSONSchema(Wire):
    name: str
    description: str | None = None
    schema: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Wire, tag_field="type", tag="text"):
    pass


class JSONObjectFormat(Wire, tag_field="type", tag="json_object"):
    pass


class JSONSchemaFormat(Wire, tag_field="type", tag="json_schema"):
    json_schema: JSONSchema


# ---------------------------------------------------------------------------------------------------- requests


class ChatRequest(Wire):
    """The body of ``POST /v1/chat/completions`` (OAI-14..OAI-26)."""

    messages: list[ChatMessage]
    model: str
    frequency_penalty: Penalty | None | UnsetType = UNSET
    logit_bias: dict[str, int] | None = None
    logprobs: bool | None = None
    max_completion_tokens: TokenLimit | None = None
    max_tokens: TokenLimit | None = None
    metadata: dict[str, str] | None = None
    n: int | None = None
    parallel_tool_calls: bool | None | UnsetType = UNSET
    presence_penalty: Penalty | None | UnsetType = UNSET
    reasoning_effort: str | None = None
    response_format: TextFormat | JSONObjectFormat | JSONSchemaFormat | None = None
    seed: int | None | UnsetType = UNSET
    service_tier: ServiceTier | None = None
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    temperature: Temperature | None | UnsetType = UNSET
    tool_choice: ToolChoiceOption | None = None
    tools: list[ToolParam] | None = None
    top_logprobs: TopLogprobs | None = None
    top_p: Probability | None | UnsetType = UNSET
    user: str | None = None
    # extra_body keys (OAI-26)
    top_k: int | None | UnsetType = UNSET
    min_p: float | None | UnsetType = UNSET
    repeat_penalty: float | None | UnsetType = UNSET


# ---------------------------------------------------------------------------------------------------- to internal


def chat_to_internal(wire: ChatRequest) -> Request:
    """Translate a chat completions body into a ``Request``.

    Raises:
        InvalidRequest: no messages or more than ``MAX_CHAT_MESSAGES``, ``n`` other than 1, a bad image URL, a
            ``tool_choice`` that names no offered tool, or ``top_logprobs`` without ``logprobs: true``.
        UnsupportedFeature: audio or file content parts.
    """
    if not wire.messages:
        raise InvalidRequest("messages must contain at least one message", param="messages")
    if len(wire.messages) > MAX_CHAT_MESSAGES:
        raise InvalidRequest(
            f"Invalid 'messages': array too long. Expected an array with maximum length {MAX_CHAT_MESSAGES}, "
            f"but got an array with length {len(wire.messages)} instead.",
            param="messages",
        )
    only_one(wire.n, "n")
    if wire.top_logprobs and not wire.logprobs:
        raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
    tools = tuple(_tool(t.function, i) for i, t in enumerate(wire.tools or ()))
    return Request(
        model=wire.model,
        messages=_messages(wire.messages),
        tools=tools,
        tool_choice=_tool_choice(wire.tool_choice, wire.parallel_tool_calls, tools),
        response_format=_response_format(wire.response_format),
        sampling=sampling(wire),
        stop=stop_sequences(wire.stop),
        max_tokens=wire.max_completion_tokens if wire.max_completion_tokens is not None else wire.max_tokens,
        stream=bool(wire.stream),
        reasoning=UNSET if wire.reasoning_effort is None else wire.reasoning_effort != "none",
        logprobs=bool(wire.logprobs),
        top_logprobs=(wire.top_logprobs or 0) if wire.logprobs else 0,
        priority=tier_priority(wire.service_tier),
    )


def _tool(function: FunctionDefinition, index: int) -> Tool:
    """The internal tool; a name outside OpenAI's ``^[a-zA-Z0-9_-]{1,64}$`` is ``InvalidRequest``."""
    where = f"tools[{index}].function.name"
    try:
        check_tool_name(function.name, 64)
    except ValueError as exc:
        raise InvalidRequest(f"Invalid '{where}': {exc}", param=where) from exc
    if function.parameters is None:
        return Tool(name=function.name, description=function.description)
    return Tool(name=function.name, description=function.description, parameters=function.parameters)


def _tool_choice(
    choice: ToolChoiceOption | None, parallel: bool | None | UnsetType, tools: tuple[Tool, ...]
) -> ToolChoice:
    parallel = UNSET if parallel is None else parallel
    if choice is None:
        return ToolChoice(parallel=parallel)
    if isinstance(choice, str):
        if choice == "required" and not tools:
            message = "tool_choice 'required' needs tools; send tools or drop tool_choice"
            raise InvalidRequest(message, param="tool_choice")
        return ToolChoice(mode=choice, parallel=parallel)
    name = choice.function.name
    if name not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names '{name}', which is not among tools", param="tool_choice")
    return ToolChoice(mode="tool", name=name, parallel=parallel)


def _response_format(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None) -> ResponseFormat:
    match fmt:
        case JSONObjectFormat():
            return ResponseFormat(kind="json_object")
        case JSONSchemaFormat(json_schema=spec):
            return ResponseFormat(kind="json_schema", schema=spec.schema, name=spec.name)
    return ResponseFormat()


def _messages(wire: list[ChatMessage]) -> tuple[Message, ...]:
    function_ids: dict[str, str] = {}  # legacy function_call name -> the id given to it
    messages: list[Message] = []
    for i, msg in enumerate(wire):
        match msg:
            case DeveloperMessage() | SystemMessage():
                messages.append(Message(role="system", parts=_texts(msg.content)))
            case UserMessage():
                messages.append(Message(role="user", parts=_user_parts(msg.content, f"messages[{i}].content")))
            case AssistantMessage():
                messages.append(Message(role="assistant", parts=_assistant_parts(msg, i, function_ids)))
            case ToolMessage():
                result = ToolResultPart(call_id=msg.tool_call_id, content=_texts(msg.content))
                messages.append(Message(role="tool", parts=(result,)))
            case FunctionMessage():
                content = _texts(msg.content or "")
                result = ToolResultPart(call_id=function_ids.get(msg.name), name=msg.name, content=content)
                messages.append(Message(role="tool", parts=(result,)))
    return tuple(messages)


def _texts(content: str | list[TextContent]) -> tuple[TextPart, ...]:
    if isinstance(content, str):
        return (TextPart(text=content),)
    return tuple(TextPart(text=p.text) for p in content)


def _user_parts(content: str | list[UserContent], at: str) -> tuple[Part, ...]:
    if isinstance(content, str):
        return (TextPart(text=content),)
    parts: list[Part] = []
    for j, part in enumerate(content):
        match part:
            case TextContent(text=text):
                parts.append(TextPart(text=text))
            case ImageContent(image_url=image):
                parts.append(_image(image.url, f"{at}[{j}].image_url.url"))
            case AudioContent() | FileContent():
                kind = "input_audio" if isinstance(part, AudioContent) else "file"
                message = f"{kind} content parts are not supported; send text or images"
                raise UnsupportedFeature(message, param=f"{at}[{j}]")
    return tuple(parts)


def _image(url: str, at: str) -> ImagePart:
    """An http(s) URL stays a URL; a ``data:<media type>;base64,<data>`` URI is decoded, whitespace in its data
    ignored (OAI-17)."""
    if url.startswith(("http://", "https://")):
        return ImagePart(url=url)
    uri = parse_data_uri(url)
    if uri is not None and uri.base64:
        try:
            data = decode_base64(uri.payload, wrapped=True)
        except ValueError:
            raise InvalidRequest("image data URI does not hold valid base64", param=at) from None
        return ImagePart(data=data, media_type=uri.media_type)
    raise InvalidRequest("image_url.url must be an http(s) URL or a data:<media type>;base64,<data> URI", param=at)


def _assistant_parts(msg: AssistantMessage, index: int, function_ids: dict[str, str]) -> tuple[Part, ...]:
    parts: list[Part] = []
    if reasoning := msg.reasoning_content or msg.reasoning:
        parts.append(ReasoningPart(text=reasoning))
    content = [TextContent(text=msg.content)] if isinstance(msg.content, str) else msg.content or []
    texts = [p.text if isinstance(p, TextContent) else p.refusal for p in content] + [msg.refusal or ""]
    parts.extend(TextPart(text=text) for text in texts if text)
    for call in msg.tool_calls or ():
        parts.append(ToolCallPart(id=call.id, name=call.function.name, arguments=call.function.arguments or "{}"))
    if msg.function_call is not None:
        call_id = function_ids[msg.function_call.name] = f"call_{index}"
        arguments = msg.function_call.arguments or "{}"
        parts.append(ToolCallPart(id=call_id, name=msg.function_call.name, arguments=arguments))
    return tuple(parts)


# ---------------------------------------------------------------------------------------------------- responses

_FINISH = {
    "stop": "stop",
    "stop_sequence": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "content_filter": "content_filter",
}


def _finish_reason(finish: Finished, has_tool_calls: bool) -> str:
    """OAI-34: a natural stop after tool calls reports ``tool_calls``."""
    if finish.reason == "stop" and has_tool_calls:
        return "tool_calls"
    return _FINISH[finish.reason]


def _logprob_entry(entry: TokenLogprob) -> dict[str, Any]:
    """OAI-36: ``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``."""
    top = [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes)} for t in entry.top]
    return {"token": entry.token, "logprob": entry.logprob, "bytes": list(entry.bytes), "top_logprobs": top}


def _logprobs(logprobs: Sequence[TokenLogprob] | None) -> dict[str, Any] | None:
    """A choice's ``logprobs``: ``null`` when the backend sent none, as when none were asked for (OAI-31, OAI-36)."""
    if logprobs is None:
        return None
    return {"content": [_logprob_entry(e) for e in logprobs], "refusal": None}


def encode_chat_response(response: Response, meta: Meta) -> bytes:
    """A whole ``chat.completion`` object (OAI-31..OAI-35)."""
    message: dict[str, Any] = {"role": "assistant", "content": response.text or (None if response.tool_calls else "")}
    if response.reasoning:
        message["reasoning_content"] = response.reasoning
    if response.tool_calls:
        message["tool_calls"] = [
            {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments or "{}"}}
            for c in response.tool_calls
        ]
    choice = {
        "index": 0,
        "message": message,
        "logprobs": _logprobs(response.logprobs),
        "finish_reason": _finish_reason(response.finish, bool(response.tool_calls)),
    }
    body = {
        "id": f"chatcmpl-{meta.id}",
        "object": "chat.completion",
        "created": int(meta.created),
        "model": meta.model,
        "choices": [choice],
        "usage": usage_body(response.usage),
    }
    if meta.priority is not None:
        body["service_tier"] = tier_echo(meta.priority)
    return msgspec.json.encode(body)


# ---------------------------------------------------------------------------------------------------- streams


class _ChatChunks:
    """Encoder state for one chat stream: the role goes out once (OAI-47), a tool call's head once (OAI-48)."""

    def __init__(self, meta: Meta) -> None:
        self.head = {
            "id": f"chatcmpl-{meta.id}",
            "object": "chat.completion.chunk",
            "created": int(meta.created),
            "model": meta.model,
        }
        if meta.priority is not None:
            self.head["service_tier"] = tier_echo(meta.priority)
        self.role_sent = False
        self.tool_indexes: set[int] = set()

    def delta(
        self, delta: dict[str, Any], finish_reason: str | None = None, logprobs: Sequence[TokenLogprob] | None = None
    ) -> bytes:
        if not self.role_sent:
            delta = {"role": "assistant", **delta}
            self.role_sent = True
        choice = {"index": 0, "delta": delta, "logprobs": _logprobs(logprobs), "finish_reason": finish_reason}
        return frame({**self.head, "choices": [choice]})

    def tool_call(self, event: ToolCallDelta) -> bytes:
        if event.index in self.tool_indexes:
            return self.delta({"tool_calls": [{"index": event.index, "function": {"arguments": event.arguments}}]})
        self.tool_indexes.add(event.index)
        call = {
            "index": event.index,
            "id": event.id or f"call_{event.index}",
            "type": "function",
            "function": {"name": event.name or "", "arguments": event.arguments},
        }
        return self.delta({"tool_calls": [call]})

    def usage(self, usage: Usage) -> bytes:
        return frame({**self.head, "choices": [], "usage": usage_body(usage)})


async def encode_chat_stream(events: AsyncIterable[Event], meta: Meta, *, include_usage: bool) -> AsyncIterator[bytes]:
    """SSE frames of ``chat.completion.chunk`` objects, ending in ``data: [DONE]`` (OAI-40..OAI-53, OAI-62).

    Args:
        events: the backend's event stream; it ends in one ``Finished`` or ``Failed``.
        meta: id, model and timestamp shared by every chunk.
        include_usage: send one ``choices: []`` chunk with usage after the finish chunk (OAI-52).
    """
    chunks = _ChatChunks(meta)
    usage = Usage()
    async for event in events:
        match event:
            case TextDelta(text=text, logprobs=logprobs) if text or logprobs:
                yield chunks.delta({"content": text}, logprobs=logprobs)
            case ReasoningDelta(text=text) if text:
                yield chunks.delta({"reasoning_content": text})
            case ToolCallDelta():
                yield chunks.tool_call(event)
            case Usage():
                usage = event
            case KeepAlive():
                yield KEEPALIVE
            case Finished():
                if not chunks.role_sent:
                    yield chunks.delta({"content": ""})
                yield chunks.delta({}, _finish_reason(event, bool(chunks.tool_indexes)))
                if include_usage:
                    yield chunks.usage(usage)
                yield DONE
                return
            case Failed(error=info):
                yield stream_error_frame(error_from_info(info))
                yield DONE
                return
    yield stream_error_frame(BackendProtocolError("the backend's stream ended without finishing"))
    yield DONE


# ---------------------------------------------------------------------------------------------------- models


def _model(model: ModelInfo) -> dict[str, Any]:
    return {"id": model.name, "object": "model", "created": int(model.created), "owned_by": "meshgate"}


def encode_models(models: Sequence[ModelInfo]) -> bytes:
    """The ``GET /v1/models`` page: ``{"object": "list", "data": [...]}`` (OAI-3, OAI-39)."""
    return msgspec.json.encode({"object": "list", "data": [_model(m) for m in models]})


def encode_model(model: ModelInfo) -> bytes:
    """One model object for ``GET /v1/models/{model}`` (OAI-4, OAI-39)."""
    return msgspec.json.encode(_model(model))
