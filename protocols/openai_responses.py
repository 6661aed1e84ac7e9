"""The OpenAI Responses API (``POST /v1/responses``): text in, text out, streamed and not (OAI-6, OAI-65, OAI-66).

Pure translation between the Responses API's JSON and ``protocols.model``: ``ResponsesRequest`` and
``responses_to_internal`` going in; ``encode_response`` (a whole Response object) and ``encode_response_stream``
(SSE frames) going out. Errors before the stream starts use the OpenAI error envelope
(``protocols.openai_wire.error_body``, applied by the route), which is the same for both APIs.

Imports only ``protocols.model``, ``protocols.openai_wire`` (value ranges, the Structs' base), ``protocols.sse``
(SSE framing), msgspec and the standard library. Must not import the other protocol modules (it is listed in the
independence contract). No I/O.

Decisions worth knowing:

- Served: ``input`` as a string or a list of message items (role ``user``, ``system``, ``developer`` or
  ``assistant``; content a string or ``input_text``/``output_text``/``refusal`` parts), ``instructions`` (a system
  message first), ``max_output_tokens``, ``temperature``, ``top_p``, ``text.format`` (``json_object`` and
  ``json_schema``), ``reasoning.effort`` (``"none"`` turns reasoning off, any other value on) and the chat API's
  ``extra_body`` keys ``top_k``, ``min_p``, ``repeat_penalty``.
- Function calling, as agents such as Codex CLI use it: ``function`` tools, ``tool_choice`` (``auto``, ``none``,
  ``required``, ``{"type": "function", "name"}``), ``parallel_tool_calls``, and ``function_call`` /
  ``function_call_output`` input items (each output gets the name of the call it answers). Hosted tools
  (``web_search``, ``file_search``, ...), ``custom`` tools and ``namespace`` groups are not offered to the model
  (the client sends them with every request; only functions the client runs can be called here).
- Refused with a 400 (``UnsupportedFeature``) because meshgate keeps no response state: ``previous_response_id``,
  ``conversation``, ``prompt``, ``background: true``; and input items other than messages and function calls
  (``item_reference``, ``custom_tool_call``, ...), and content parts other than text (``input_image``,
  ``input_file``, ``input_audio``).
- Accepted and ignored: ``store`` (nothing is stored, whatever it says), ``metadata``, ``user``, ``include``,
  ``truncation``, ``service_tier``, ``stream_options``, ``prompt_cache_key``, and
  ``reasoning`` items in ``input`` (earlier reasoning is not replayed, as chat templates also drop it).
- The Response echoes none of the request's settings: it carries the fields the SDK's ``Response`` type requires
  (``parallel_tool_calls``, ``tool_choice``, ``tools``, ...) with neutral values, plus status, output and usage.
- ``output`` is one ``message`` item, preceded by a ``reasoning`` item when the model reasoned and followed by a
  ``function_call`` item per call (the message is left out when the model only called). Finish reason
  ``length`` (or ``content_filter``) gives status ``incomplete`` with ``incomplete_details.reason``
  ``max_output_tokens`` (or ``content_filter``); the stream then ends in ``response.incomplete``.
- A failure after the stream started ends it with ``response.failed`` (its ``response.error`` holds the message;
  open items are listed with status ``incomplete``). No separate ``error`` event is sent: openai-python 1.x wraps
  events whose name does not start with ``response.`` into ``{"data", "event"}`` and cannot type them.
- Item ids are ``msg_``, ``rs_`` or ``fc_`` + ``<id>_<output index>``; the response id is ``resp_<id>``. A
  streamed call is ``output_item.added`` (arguments empty), ``function_call_arguments.delta`` per fragment,
  ``function_call_arguments.done`` and ``output_item.done``.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator
from typing import Any, Literal, TypeAlias

import msgspec
from msgspec import UNSET, UnsetType

from meshgate.protocols import sse
from meshgate.protocols.model import (
    BackendProtocolError,
    Event,
    Failed,
    Finished,
    GatewayError,
    InvalidRequest,
    KeepAlive,
    Message,
    Meta,
    RateLimited,
    ReasoningDelta,
    Request,
    Response,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    UnsupportedFeature,
    Usage,
    error_from_info,
)
from meshgate.protocols.openai_wire import Probability, Temperature, TokenLimit, Wire

__all__ = ["ResponsesRequest", "encode_response", "encode_response_stream", "responses_to_internal"]

# ---------------------------------------------------------------------------------------------------- requests


class ContentPart(Wire):
    """One input content part. Kept loose (``type`` is any string) so unsupported kinds are refused by name."""

    type: str
    text: str | None = None
    refusal: str | None = None


class InputItem(Wire):
    """One ``input`` item: a message (which may omit ``type``, ``EasyInputMessageParam``), a ``function_call`` the
    model made earlier or the ``function_call_output`` answering it; other kinds are refused."""

    type: str = "message"
    role: Literal["user", "system", "developer", "assistant"] | None = None
    content: str | list[ContentPart] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[ContentPart] | None = None


class FunctionTool(Wire):
    """A ``tools`` entry of type ``function`` (flat, unlike the chat API's ``{"function": {...}}``)."""

    name: str
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class TextFormat(Wire, tag_field="type", tag="text"):
    pass


class JSONObjectFormat(Wire, tag_field="type", tag="json_object"):
    pass


class JSONSchemaFormat(Wire, tag_field="type", tag="json_schema"):
    """Flat, unlike the chat API's ``response_format``: ``name`` and ``schema`` sit beside ``type``."""

    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(Wire):
    format: TextFormat | JSONObjectFormat | JSONSchemaFormat | None = None
    verbosity: str | None = None


class ReasoningConfig(Wire):
    effort: str | None = None
    summary: str | None = None


class ResponsesRequest(Wire):
    """The body of ``POST /v1/responses`` (the SDK's ``response_create_params``), the fields acted on."""

    model: str
    input: str | list[InputItem] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    instructions: str | None = None
    max_output_tokens: TokenLimit | None = None
    previous_response_id: str | None = None
    prompt: dict[str, Any] | None = None
    reasoning: ReasoningConfig | None = None
    stream: bool | None = None
    temperature: Temperature | None | UnsetType = UNSET
    text: TextConfig | None = None
    tool_choice: str | dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    parallel_tool_calls: bool | None = None
    top_p: Probability | None | UnsetType = UNSET
    # extra_body keys, as on the chat API (OAI-26)
    top_k: int | None | UnsetType = UNSET
    min_p: float | None | UnsetType = UNSET
    repeat_penalty: float | None | UnsetType = UNSET


def responses_to_internal(wire: ResponsesRequest) -> Request:
    """Translate a Responses API body into a ``Request``.

    Raises:
        InvalidRequest: no ``input``, an empty input list, a message item without a role, a function tool or
            call without a name, or a ``tool_choice`` naming no offered function.
        UnsupportedFeature: stored-state features (``previous_response_id``, ``conversation``, ``prompt``,
            ``background``), input items other than messages and function calls and their outputs, and
            non-text content parts.
    """
    _refuse_state(wire)
    tools = _tools(wire.tools or [])
    messages: list[Message] = []
    if wire.instructions:
        messages.append(Message(role="system", parts=(TextPart(text=wire.instructions),)))
    messages.extend(_input(wire.input))
    effort = wire.reasoning.effort if wire.reasoning else None
    return Request(
        model=wire.model,
        messages=tuple(messages),
        response_format=_response_format(wire.text.format if wire.text else None),
        sampling=Sampling(
            temperature=wire.temperature,
            top_p=wire.top_p,
            top_k=wire.top_k,
            min_p=wire.min_p,
            repeat_penalty=wire.repeat_penalty,
        ),
        max_tokens=wire.max_output_tokens,
        stream=bool(wire.stream),
        reasoning=UNSET if effort is None else effort != "none",
        tools=tools,
        tool_choice=_tool_choice(wire.tool_choice, wire.parallel_tool_calls, tools),
    )


def _tools(wire: list[dict[str, Any]]) -> tuple[Tool, ...]:
    """The ``function`` tools; hosted tools (``web_search``, ``file_search``, ...), ``custom`` (free-form) tools
    and ``namespace`` groups are not offered to the model: it can call only functions the client runs."""
    tools = []
    for i, raw in enumerate(wire):
        if raw.get("type") != "function":
            continue
        try:
            tool = msgspec.convert(raw, FunctionTool)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(f"tools[{i}]: {exc}; a function tool needs a 'name'", param=f"tools[{i}]") from exc
        if tool.parameters is None:
            tools.append(Tool(name=tool.name, description=tool.description))
        else:
            tools.append(Tool(name=tool.name, description=tool.description, parameters=tool.parameters))
    return tuple(tools)


def _tool_choice(choice: str | dict[str, Any] | None, parallel: bool | None, tools: tuple[Tool, ...]) -> ToolChoice:
    """``auto``, ``none``, ``required`` or ``{"type": "function", "name": ...}``; a hosted tool's choice (which
    is never offered) reads ``auto``."""
    parallel_flag: bool | UnsetType = UNSET if parallel is None else parallel
    if choice is None or isinstance(choice, str):
        if choice == "required" and not tools:
            raise InvalidRequest("tool_choice 'required' needs function tools; send tools", param="tool_choice")
        mode: Literal["auto", "none", "required"] = "none" if choice == "none" else "auto"
        return ToolChoice(mode="required" if choice == "required" else mode, parallel=parallel_flag)
    if choice.get("type") != "function":
        return ToolChoice(parallel=parallel_flag)
    name = choice.get("name")
    if name not in {t.name for t in tools}:
        raise InvalidRequest(f"tool_choice names '{name}', which is not among the function tools", param="tool_choice")
    return ToolChoice(mode="tool", name=name, parallel=parallel_flag)


def _refuse_state(wire: ResponsesRequest) -> None:
    """Features that need responses stored on the server, which meshgate does not keep."""
    if wire.previous_response_id:
        message = "previous_response_id is not supported: responses are not stored; send the conversation as input"
        raise UnsupportedFeature(message, param="previous_response_id")
    if wire.conversation:
        message = "conversation is not supported: conversations are not stored; send the conversation as input"
        raise UnsupportedFeature(message, param="conversation")
    if wire.prompt:
        raise UnsupportedFeature("prompt templates are not supported; send input instead", param="prompt")
    if wire.background:
        raise UnsupportedFeature("background responses are not supported; omit background", param="background")


def _input(wire: str | list[InputItem] | None) -> list[Message]:
    if wire is None:
        raise InvalidRequest("input is required: a string or a list of message items", param="input")
    if isinstance(wire, str):
        return [Message(role="user", parts=(TextPart(text=wire),))]
    if not wire:
        raise InvalidRequest("input must contain at least one item", param="input")
    messages: list[Message] = []
    names: dict[str, str] = {}  # call id -> function name, for the outputs
    for i, item in enumerate(wire):
        if item.type == "reasoning":
            continue
        if item.type == "function_call":
            call = _call(item, i)
            names[call.id] = call.name
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":  # text, then calls: one assistant turn
                messages[-1] = Message(role="assistant", parts=(*last.parts, call))
            else:
                messages.append(Message(role="assistant", parts=(call,)))
            continue
        if item.type == "function_call_output":
            messages.append(_output(item, i, names))
            continue
        if item.type != "message":
            message = f"input items of type '{item.type}' are not supported; send message or function_call items"
            raise UnsupportedFeature(message, param=f"input[{i}].type")
        if item.role is None:
            raise InvalidRequest("a message item needs a role", param=f"input[{i}].role")
        role = "system" if item.role == "developer" else item.role
        messages.append(Message(role=role, parts=_parts(item.content, f"input[{i}].content")))
    return messages


def _call(item: InputItem, i: int) -> ToolCallPart:
    if not item.call_id or not item.name:
        field = "call_id" if not item.call_id else "name"
        raise InvalidRequest(f"a function_call item needs '{field}'", param=f"input[{i}].{field}")
    return ToolCallPart(id=item.call_id, name=item.name, arguments=item.arguments or "{}")


def _output(item: InputItem, i: int, names: dict[str, str]) -> Message:
    if not item.call_id:
        raise InvalidRequest("a function_call_output item needs 'call_id'", param=f"input[{i}].call_id")
    content = _parts(item.output if item.output is not None else "", f"input[{i}].output")
    result = ToolResultPart(call_id=item.call_id, name=names.get(item.call_id), content=content)
    return Message(role="tool", parts=(result,))


def _parts(content: str | list[ContentPart] | None, at: str) -> tuple[TextPart, ...]:
    if content is None:
        return ()
    if isinstance(content, str):
        return (TextPart(text=content),)
    parts = []
    for j, part in enumerate(content):
        if part.type in ("input_text", "output_text") and part.text is not None:
            parts.append(TextPart(text=part.text))
        elif part.type == "refusal" and part.refusal is not None:
            parts.append(TextPart(text=part.refusal))
        elif part.type in ("input_text", "output_text", "refusal"):
            field = "refusal" if part.type == "refusal" else "text"
            raise InvalidRequest(f"a {part.type} part needs '{field}'", param=f"{at}[{j}].{field}")
        else:
            message = f"content parts of type '{part.type}' are not supported on /v1/responses; send input_text"
            raise UnsupportedFeature(message, param=f"{at}[{j}].type")
    return tuple(parts)


def _response_format(fmt: TextFormat | JSONObjectFormat | JSONSchemaFormat | None) -> ResponseFormat:
    match fmt:
        case JSONObjectFormat():
            return ResponseFormat(kind="json_object")
        case JSONSchemaFormat(name=name, schema=schema):
            return ResponseFormat(kind="json_schema", schema=schema, name=name)
    return ResponseFormat()


# ---------------------------------------------------------------------------------------------------- responses

Status: TypeAlias = Literal["in_progress", "completed", "incomplete", "failed"]

_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}


Kind: TypeAlias = Literal["message", "reasoning", "function_call"]
_PREFIX = {"message": "msg", "reasoning": "rs", "function_call": "fc"}


class _Item:
    """One output item (a ``message`` or ``reasoning`` item with its single text part, or a ``function_call``
    whose text is its arguments), as it grows."""

    def __init__(self, kind: Kind, index: int, meta: Meta, call: ToolCall | None = None) -> None:
        self.kind = kind
        self.index = index
        self.id = f"{_PREFIX[kind]}_{meta.id}_{index}"
        self.texts: list[str] = []
        self.status: Status = "in_progress"
        self.call = call  # a function_call's id and name (its arguments are ``texts``)

    @property
    def text(self) -> str:
        return "".join(self.texts)

    def part(self, text: str) -> dict[str, Any]:
        if self.kind == "message":
            return {"type": "output_text", "text": text, "annotations": []}
        return {"type": "reasoning_text", "text": text}

    def body(self, *, with_content: bool = True) -> dict[str, Any]:
        if self.call is not None:
            arguments = self.text if with_content else ""
            return {
                "id": self.id,
                "type": "function_call",
                "status": self.status,
                "call_id": self.call.id,
                "name": self.call.name,
                "arguments": arguments,
            }
        content = [self.part(self.text)] if with_content else []
        if self.kind == "message":
            return {"id": self.id, "type": "message", "status": self.status, "role": "assistant", "content": content}
        return {"id": self.id, "type": "reasoning", "status": self.status, "summary": [], "content": content}


def _usage(usage: Usage) -> dict[str, Any]:
    """OAI-65: ``input_tokens``, ``output_tokens``, ``total_tokens`` and their details objects."""
    return {
        "input_tokens": usage.prompt_tokens,
        "input_tokens_details": {"cached_tokens": usage.cached_tokens, "cache_write_tokens": 0},
        "output_tokens": usage.completion_tokens,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }


def _response(
    meta: Meta,
    status: Status,
    output: list[dict[str, Any]],
    *,
    usage: Usage | None = None,
    incomplete: str | None = None,
    error: dict[str, str] | None = None,
) -> dict[str, Any]:
    """A Response object (OAI-65) with every field the SDK's ``Response`` type requires."""
    return {
        "id": f"resp_{meta.id}",
        "object": "response",
        "created_at": int(meta.created),
        "status": status,
        "error": error,
        "incomplete_details": {"reason": incomplete} if incomplete else None,
        "model": meta.model,
        "output": output,
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": _usage(usage) if usage is not None else None,
    }


def _finish_status(finish: Finished) -> tuple[Status, str | None]:
    """``completed``, or ``incomplete`` with its ``incomplete_details.reason``."""
    reason = _INCOMPLETE.get(finish.reason)
    return ("incomplete", reason) if reason else ("completed", None)


def encode_response(response: Response, meta: Meta) -> bytes:
    """A whole Response object: a reasoning item if any, one message item (left out when the model only called
    functions), then a ``function_call`` item per call (OAI-65)."""
    status, incomplete = _finish_status(response.finish)
    items = []
    if response.reasoning:
        reasoning = _Item("reasoning", 0, meta)
        reasoning.texts.append(response.reasoning)
        reasoning.status = "completed"
        items.append(reasoning)
    if response.text or not response.tool_calls:
        message = _Item("message", len(items), meta)
        message.texts.append(response.text)
        message.status = status
        items.append(message)
    for call in response.tool_calls:
        item = _Item("function_call", len(items), meta, call)
        item.texts.append(call.arguments)
        item.status = status
        items.append(item)
    output = [item.body() for item in items]
    return msgspec.json.encode(_response(meta, status, output, usage=response.usage, incomplete=incomplete))


# ---------------------------------------------------------------------------------------------------- streams

_DELTA = {
    "message": "response.output_text.delta",
    "reasoning": "response.reasoning_text.delta",
    "function_call": "response.function_call_arguments.delta",
}
_DONE = {
    "message": "response.output_text.done",
    "reasoning": "response.reasoning_text.done",
    "function_call": "response.function_call_arguments.done",
}


def _error(err: GatewayError) -> dict[str, str]:
    """``response.error``: ``code`` must be one of the SDK's ``ResponseError`` literals."""
    if isinstance(err, RateLimited):
        code = "rate_limit_exceeded"
    elif isinstance(err, InvalidRequest):
        code = "invalid_prompt"
    else:
        code = "server_error"
    return {"code": code, "message": err.message}


class _Frames:
    """Encoder state for one stream: the sequence number and the output items opened so far."""

    def __init__(self, meta: Meta) -> None:
        self.meta = meta
        self.sequence = 0
        self.items: list[_Item] = []
        self.open: _Item | None = None
        self.calls: dict[int, _Item] = {}  # function call index -> its item
        self.usage = Usage()

    def frame(self, kind: str, **fields: Any) -> bytes:
        """One SSE frame: ``event: <type>`` and the same ``type`` plus ``sequence_number`` in the JSON (OAI-66)."""
        payload = {"type": kind, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return sse.frame(msgspec.json.encode(payload), kind)

    def lifecycle(self, kind: str, status: Status, **extra: Any) -> bytes:
        """A frame carrying the whole Response; usage only once it is final (not ``in_progress``)."""
        output = [item.body() for item in self.items]
        usage = None if status == "in_progress" else self.usage
        return self.frame(kind, response=_response(self.meta, status, output, usage=usage, **extra))

    def call(self, event: ToolCallDelta) -> list[bytes]:
        """A fragment of function call ``event.index``: its first one opens a ``function_call`` item."""
        frames = []
        if self.open is None or self.open.call is None or self.calls.get(event.index) is not self.open:
            frames += self.close("completed")
            call = ToolCall(id=event.id or f"call_{self.meta.id}_{event.index}", name=event.name or "")
            frames += self.start("function_call", call)
            self.calls[event.index] = self.items[-1]
        item = self.items[-1]
        if event.arguments:
            item.texts.append(event.arguments)
            at = {"item_id": item.id, "output_index": item.index}
            frames.append(self.frame(_DELTA["function_call"], **at, delta=event.arguments))
        return frames

    def delta(self, kind: Literal["message", "reasoning"], text: str) -> list[bytes]:
        frames = []
        if self.open is None or self.open.kind != kind:
            frames += self.close("completed")
            frames += self.start(kind)
        item = self.items[-1]
        item.texts.append(text)
        extra: dict[str, list] = {"logprobs": []} if kind == "message" else {}
        frames.append(
            self.frame(_DELTA[kind], item_id=item.id, output_index=item.index, content_index=0, delta=text, **extra)
        )
        return frames

    def start(self, kind: Kind, call: ToolCall | None = None) -> list[bytes]:
        item = self.open = _Item(kind, len(self.items), self.meta, call)
        self.items.append(item)
        added = self.frame("response.output_item.added", output_index=item.index, item=item.body(with_content=False))
        if call is not None:
            return [added]
        return [
            added,
            self.frame(
                "response.content_part.added",
                item_id=item.id,
                output_index=item.index,
                content_index=0,
                part=item.part(""),
            ),
        ]

    def close(self, status: Status) -> list[bytes]:
        item, self.open = self.open, None
        if item is None:
            return []
        item.status = status
        if item.call is not None:
            at = {"item_id": item.id, "output_index": item.index}
            return [
                self.frame(_DONE["function_call"], **at, name=item.call.name, arguments=item.text),
                self.frame("response.output_item.done", output_index=item.index, item=item.body()),
            ]
        at = {"item_id": item.id, "output_index": item.index, "content_index": 0}
        extra: dict[str, list] = {"logprobs": []} if item.kind == "message" else {}
        return [
            self.frame(_DONE[item.kind], **at, text=item.text, **extra),
            self.frame("response.content_part.done", **at, part=item.part(item.text)),
            self.frame("response.output_item.done", output_index=item.index, item=item.body()),
        ]

    def finish(self, finish: Finished) -> list[bytes]:
        status, incomplete = _finish_status(finish)
        frames = []
        called = bool(self.calls)
        if self.open is None or (self.open.kind == "reasoning" and not called):
            frames += self.close("completed")
            if not called:  # an answer is at least one (maybe empty) message
                frames += self.start("message")
        frames += self.close(status)
        kind = "response.completed" if status == "completed" else "response.incomplete"
        return [*frames, self.lifecycle(kind, status, incomplete=incomplete)]

    def fail(self, err: GatewayError) -> bytes:
        if self.open is not None:
            self.open.status = "incomplete"
        return self.lifecycle("response.failed", "failed", error=_error(err))


async def encode_response_stream(events: AsyncIterable[Event], meta: Meta) -> AsyncIterator[bytes]:
    """SSE frames of Responses API events (OAI-66), starting at once with ``response.created``.

    Order: ``response.created``, ``response.in_progress``, then per output item ``output_item.added``,
    ``content_part.added``, text deltas, text done, ``content_part.done``, ``output_item.done``; last
    ``response.completed``, ``response.incomplete`` (length) or ``response.failed``. No ``[DONE]``.

    Args:
        events: the backend's event stream; it ends in one ``Finished`` or ``Failed``.
        meta: id, model and timestamp of the response.
    """
    frames = _Frames(meta)
    yield frames.lifecycle("response.created", "in_progress")
    yield frames.lifecycle("response.in_progress", "in_progress")
    async for event in events:
        match event:
            case TextDelta(text=text) if text:
                for frame in frames.delta("message", text):
                    yield frame
            case ReasoningDelta(text=text) if text:
                for frame in frames.delta("reasoning", text):
                    yield frame
            case ToolCallDelta():
                for frame in frames.call(event):
                    yield frame
            case Usage():
                frames.usage = event
            case KeepAlive():
                yield sse.KEEPALIVE
            case Finished():
                for frame in frames.finish(event):
                    yield frame
                return
            case Failed(error=info):
                yield frames.fail(error_from_info(info))
                return
    yield frames.fail(BackendProtocolError("the backend's stream ended without finishing"))
