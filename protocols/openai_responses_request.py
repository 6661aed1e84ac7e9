"""The OpenAI Responses API's request side: ``ResponsesRequest`` read into a ``protocols.model.Request``.

Pure translation of the body of ``POST /v1/responses`` (OAI-6); the response side (the Response object and its
SSE events) is ``protocols.openai_responses``, which re-exports ``ResponsesRequest`` and
``responses_to_internal`` so the codec keeps one import for its callers. Split out only to keep each module
readable in one sitting: the two halves share no code.

Imports only ``protocols.model``, ``protocols.openai_wire`` (value ranges, the Structs' base), msgspec and the
standard library. Must not import the other protocol modules, nor ``protocols.openai_responses``. No I/O.

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
- ``service_tier`` sets the request's class (``openai_wire.tier_priority``: ``flex`` is batch).
- Accepted and ignored: ``store`` (nothing is stored, whatever it says), ``metadata``, ``user``, ``include``,
  ``truncation``, ``stream_options``, ``prompt_cache_key``, and
  ``reasoning`` items in ``input`` (earlier reasoning is not replayed, as chat templates also drop it).
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec
from msgspec import UNSET, UnsetType

from meshgate.protocols.formats import check_tool_name
from meshgate.protocols.model import (
    InvalidRequest,
    Message,
    Request,
    ResponseFormat,
    Sampling,
    TextPart,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    UnsupportedFeature,
    too_many_messages,
)
from meshgate.protocols.openai_wire import Probability, ServiceTier, Temperature, TokenLimit, Wire, tier_priority

__all__ = ["ResponsesRequest", "responses_to_internal"]


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
    service_tier: ServiceTier | None = None
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
        priority=tier_priority(wire.service_tier),
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
        try:
            check_tool_name(tool.name, 64)
        except ValueError as exc:
            raise InvalidRequest(f"Invalid 'tools[{i}].name': {exc}", param=f"tools[{i}].name") from exc
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
    if refused := too_many_messages(len(wire), "input"):
        raise refused
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
