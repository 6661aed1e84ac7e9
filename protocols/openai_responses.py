"""The OpenAI Responses API (``POST /v1/responses``): text in, text out, streamed and not (OAI-6, OAI-65, OAI-66).

Pure translation between ``protocols.model`` and the Responses API's JSON. This module is the response side:
``encode_response`` (a whole Response object) and ``encode_response_stream`` (SSE frames). The request side,
``ResponsesRequest`` and ``responses_to_internal``, lives in ``protocols.openai_responses_request`` and is
re-exported here, so callers import one codec. Errors before the stream starts use the OpenAI error envelope
(``protocols.openai_wire.error_body``, applied by the route), which is the same for both APIs.

Imports only ``protocols.model``, ``protocols.openai_responses_request`` (its own request half), ``openai_wire``,
``protocols.sse`` (SSE framing), msgspec and the standard library. Must not import the other protocol modules
(it is listed in the independence contract). No I/O.

Decisions worth knowing (the request side's are in ``protocols.openai_responses_request``):

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

from meshgate.protocols import sse
from meshgate.protocols.model import (
    BackendProtocolError,
    Event,
    Failed,
    Finished,
    GatewayError,
    InvalidRequest,
    KeepAlive,
    Meta,
    RateLimited,
    ReasoningDelta,
    Response,
    TextDelta,
    ToolCall,
    ToolCallDelta,
    Usage,
    error_from_info,
)
from meshgate.protocols.openai_responses_request import ResponsesRequest, responses_to_internal
from meshgate.protocols.openai_wire import tier_echo

__all__ = ["ResponsesRequest", "encode_response", "encode_response_stream", "responses_to_internal"]

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
        **({"service_tier": tier_echo(meta.priority)} if meta.priority is not None else {}),
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
