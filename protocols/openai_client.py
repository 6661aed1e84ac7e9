"""The OpenAI protocol in the client direction: meshgate calling an OpenAI-compatible server (vLLM's own API
server as a head runner, or any upstream that speaks chat completions).

Pure translation, the reverse pair of ``protocols.openai``: ``encode_request(request, model)`` turns an internal
``Request`` into the path and JSON body to POST (``/v1/chat/completions`` for messages, ``/v1/completions`` for a
raw prompt); ``StreamDecoder`` turns the server's SSE bytes back into internal events, ending in exactly one
``Finished`` or ``Failed``; ``error_from_response`` maps a non-200 answer to a ``GatewayError``.

Imports only ``protocols.model``, ``protocols.formats`` (data URIs), msgspec and the standard library, so it stays
independent of the server-side protocol modules (it keeps its own small response Structs instead of importing
``protocols.openai`` or ``protocols.openai_wire``: they describe the other direction). No I/O.

Decisions worth knowing:

- Always a stream with ``stream_options.include_usage``: a non-streaming client is served by ``collect`` over the
  same events, so there is one code path. The usage chunk comes after the finish chunk, so ``Finished`` is held
  back until ``[DONE]`` (or the end of the body) and goes out after the ``Usage``.
- ``UNSET`` sampling values are omitted (the server's default); an explicit ``None`` goes out as ``null``.
  ``repeat_penalty`` is sent as ``repetition_penalty`` and ``top_k``/``min_p`` as top-level extras (vLLM's names).
- ``prefill`` becomes ``continue_final_message: true`` with ``add_generation_prompt: false`` (vLLM's extras).
- Token ids (vLLM's ``token_ids`` on each choice, sent when the request asks ``return_token_ids``) go on the
  deltas' ``tokens``: those of a chunk whose text was held back ride on the next delta, so a delta carries the
  tokens whose text it completes (what ``Request.resume`` needs).
- A finish with a string ``stop_reason`` (vLLM names the stop string it matched) is ``stop_sequence``.
- Reasoning is read from ``reasoning_content`` or ``reasoning`` on deltas. Reasoning parts of earlier assistant
  turns are not sent back (servers re-render them from the chat template, if at all).
- A body that ends before a finish, a finish reason outside OpenAI's (vLLM's ``abort`` and ``error`` when its
  engine dies), or an error object in the stream, is a ``Failed``; errors map by their HTTP
  code (``error.code`` in the stream, the status otherwise) onto the ``GatewayError`` tree; an upstream's own
  failure (500, e.g. vLLM's dead engine) is ``BackendUnavailable``.
"""

from __future__ import annotations

from typing import Any

import msgspec
from msgspec import UNSET

from meshgate.protocols.formats import encode_data_uri
from meshgate.protocols.model import (
    AuthenticationFailed,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    Event,
    Failed,
    Finished,
    FinishReason,
    GatewayError,
    ImagePart,
    InvalidRequest,
    Message,
    NotFound,
    RateLimited,
    ReasoningDelta,
    Request,
    RequestTooLarge,
    TextDelta,
    TextPart,
    TokenLogprob,
    ToolCallDelta,
    ToolCallPart,
    ToolResultPart,
    TopLogprob,
    Unprocessable,
    Usage,
)

__all__ = [
    "CHAT_PATH",
    "COMPLETIONS_PATH",
    "StreamDecoder",
    "chat_messages",
    "encode_request",
    "error_from_response",
    "request_body",
]

CHAT_PATH = "/v1/chat/completions"
COMPLETIONS_PATH = "/v1/completions"

# ---------------------------------------------------------------------------------------------------- requests


def encode_request(request: Request, model: str) -> tuple[str, bytes]:
    """The path and JSON body to POST for ``request`` to a server that knows the model as ``model``."""
    path = CHAT_PATH if request.raw_prompt is None else COMPLETIONS_PATH
    return path, msgspec.json.encode(request_body(request, model))


def request_body(request: Request, model: str) -> dict[str, Any]:
    """The chat completions body (or, for a raw prompt, the legacy completions body) as plain JSON data."""
    body: dict[str, Any] = {"model": model}
    if request.raw_prompt is not None:
        body["prompt"] = request.raw_prompt
    else:
        body["messages"] = chat_messages(request.messages)
        if request.prefill and request.messages and request.messages[-1].role == "assistant":
            body["continue_final_message"] = True
            body["add_generation_prompt"] = False
        if request.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {"name": t.name, "parameters": t.parameters, **_given(description=t.description)},
                }
                for t in request.tools
            ]
            choice = request.tool_choice
            body["tool_choice"] = (
                {"type": "function", "function": {"name": choice.name}} if choice.mode == "tool" else choice.mode
            )
            if choice.parallel is not UNSET:
                body["parallel_tool_calls"] = choice.parallel
        fmt = request.response_format
        if fmt.kind == "json_object":
            body["response_format"] = {"type": "json_object"}
        elif fmt.kind == "json_schema":
            body["response_format"] = {
                "type": "json_schema",
                "json_schema": {"name": fmt.name or "response", "schema": fmt.schema or {}},
            }
        if request.logprobs:
            body["logprobs"] = True
            body["top_logprobs"] = request.top_logprobs
    sampling = request.sampling
    for ours, theirs in (
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("top_k", "top_k"),
        ("min_p", "min_p"),
        ("seed", "seed"),
        ("presence_penalty", "presence_penalty"),
        ("frequency_penalty", "frequency_penalty"),
        ("repeat_penalty", "repetition_penalty"),
    ):
        value = getattr(sampling, ours)
        if value is not UNSET:
            body[theirs] = value
    if request.stop:
        body["stop"] = list(request.stop)
    if request.max_tokens is not None:
        body["max_tokens"] = request.max_tokens
    body["stream"] = True
    body["stream_options"] = {"include_usage": True}
    return body


def chat_messages(messages: tuple[Message, ...]) -> list[dict[str, Any]]:
    """``messages`` as OpenAI chat messages (a tool message per tool result)."""
    out: list[dict[str, Any]] = []
    for message in messages:
        if message.role == "tool":
            out += [
                {
                    "role": "tool",
                    "tool_call_id": p.call_id or p.name or "",
                    "content": "".join(c.text for c in p.content if isinstance(c, TextPart)),
                }
                for p in message.parts
                if isinstance(p, ToolResultPart)
            ]
        elif message.role == "assistant":
            entry: dict[str, Any] = {"role": "assistant", "content": message.text}
            calls = [
                {"id": p.id, "type": "function", "function": {"name": p.name, "arguments": p.arguments}}
                for p in message.parts
                if isinstance(p, ToolCallPart)
            ]
            if calls:
                entry["tool_calls"] = calls
            out.append(entry)
        elif message.role == "user" and any(isinstance(p, ImagePart) for p in message.parts):
            out.append(
                {
                    "role": "user",
                    "content": [_content_part(p) for p in message.parts if isinstance(p, TextPart | ImagePart)],
                }
            )
        else:
            out.append({"role": message.role, "content": message.text})
    return out


def _content_part(part: TextPart | ImagePart) -> dict[str, Any]:
    if isinstance(part, TextPart):
        return {"type": "text", "text": part.text}
    url = part.url or encode_data_uri(part.data or b"", part.media_type or "image/png")
    return {"type": "image_url", "image_url": {"url": url}}


def _given(**values: Any) -> dict[str, Any]:
    return {k: v for k, v in values.items() if v is not None}


# ---------------------------------------------------------------------------------------------------- responses


class _Wire(msgspec.Struct, kw_only=True):
    """Base of the response Structs: every field optional, unknown fields ignored."""


class _Function(_Wire):
    name: str | None = None
    arguments: str | None = None


class _ToolCall(_Wire):
    index: int = 0
    id: str | None = None
    function: _Function | None = None


class _Top(_Wire):
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None


class _Logprob(_Wire):
    token: str = ""
    logprob: float = 0.0
    bytes: list[int] | None = None
    top_logprobs: list[_Top] | None = None


class _Logprobs(_Wire):
    content: list[_Logprob] | None = None


class _Delta(_Wire):
    content: str | None = None
    reasoning_content: str | None = None
    reasoning: str | None = None
    tool_calls: list[_ToolCall] | None = None


class _Choice(_Wire):
    delta: _Delta | None = None
    text: str | None = None  # legacy completions
    logprobs: _Logprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # vLLM's, with ``return_token_ids``


class _Details(_Wire):
    cached_tokens: int | None = None


class _Usage(_Wire):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_tokens_details: _Details | None = None


class _Error(_Wire):
    message: str = ""
    type: str | None = None
    param: str | None = None
    code: int | str | None = None


class _Chunk(_Wire):
    choices: list[_Choice] | None = None
    usage: _Usage | None = None
    error: _Error | None = None
    object: str | None = None  # "error" in vLLM's older flat error shape
    message: str | None = None
    code: int | str | None = None


_chunk_decoder = msgspec.json.Decoder(_Chunk)
_FINISH: dict[str, FinishReason] = {
    "stop": "stop",
    "length": "length",
    "tool_calls": "tool_calls",
    "function_call": "tool_calls",
    "content_filter": "content_filter",
}
_BY_STATUS: dict[int, type[GatewayError]] = {
    400: InvalidRequest,
    401: AuthenticationFailed,
    403: AuthenticationFailed,
    404: NotFound,
    413: RequestTooLarge,
    422: Unprocessable,
    429: RateLimited,
    502: BackendProtocolError,
    503: BackendUnavailable,
    504: BackendTimeout,
}


def error_from_response(status: int, body: bytes) -> GatewayError:
    """The ``GatewayError`` for an upstream's non-200 answer (its OpenAI error envelope, or any body)."""
    try:
        chunk = _chunk_decoder.decode(body)
    except msgspec.DecodeError:
        chunk = None
    if chunk is not None and (error := _error_of(chunk)) is not None:
        return _error(error, status)
    return _error(_Error(message=body.decode(errors="replace")[:300] or f"HTTP {status}"), status)


def _error_of(chunk: _Chunk) -> _Error | None:
    if chunk.error is not None:
        return chunk.error
    if chunk.object == "error":
        return _Error(message=chunk.message or "", code=chunk.code)
    return None


def _error(error: _Error, status: int | None = None) -> GatewayError:
    code = error.code if isinstance(error.code, int) else status
    cls = _BY_STATUS.get(code or 500, BackendUnavailable if (code or 500) >= 500 else InvalidRequest)
    return cls(f"upstream: {error.message or error.type or 'error'}", param=error.param)


class StreamDecoder:
    """One response's SSE body in, internal events out: ``feed`` each received chunk, ``close`` at the end.

    Both return the events completed so far; after the terminal event (one ``Finished`` or ``Failed``) nothing
    more is returned and ``done`` is true.
    """

    def __init__(self) -> None:
        self._pending = b""
        self._data: list[bytes] = []
        self._finish: Finished | None = None
        self._usage: Usage | None = None
        self._tokens: list[int] = []  # token ids not yet put on a delta (their text was held back)
        self.done = False

    def feed(self, data: bytes) -> list[Event]:
        events: list[Event] = []
        *lines, self._pending = (self._pending + data).split(b"\n")
        for line in lines:
            if self.done:
                break
            line = line.rstrip(b"\r")
            if not line:
                if self._data:
                    payload, self._data = b"\n".join(self._data), []
                    events += self._message(payload)
            elif line.startswith(b"data:"):
                value = line[5:]
                self._data.append(value[1:] if value.startswith(b" ") else value)
            # comments (":"), "event:", "id:" and "retry:" lines carry nothing for us
        return events

    def close(self) -> list[Event]:
        """The body ended: flush a last message without a blank line, then finish or fail."""
        events = self.feed(b"\n\n") if self._pending or self._data else []
        if not self.done:
            events += self._end(BackendUnavailable("the upstream closed the stream before finishing"))
        return events

    def _message(self, payload: bytes) -> list[Event]:
        if payload.strip() == b"[DONE]":
            return self._end(BackendProtocolError("the upstream's stream ended without a finish reason"))
        try:
            chunk = _chunk_decoder.decode(payload)
        except msgspec.DecodeError as exc:
            self.done = True
            return [Failed(error=BackendProtocolError(f"the upstream sent an invalid chunk: {exc}").info())]
        if (error := _error_of(chunk)) is not None:
            self.done = True
            return [Failed(error=_error(error).info())]
        events: list[Event] = []
        for choice in chunk.choices or ():
            events += self._with_tokens(_choice_events(choice), choice.token_ids)
            if choice.finish_reason is not None and choice.finish_reason not in _FINISH:  # vLLM: abort, error
                self.done = True
                why = f"the upstream ended the generation with finish_reason={choice.finish_reason!r}"
                return [*events, Failed(error=BackendUnavailable(why).info())]
            if choice.finish_reason is not None:
                self._finish = _finished(choice)
        if chunk.usage is not None:
            details = chunk.usage.prompt_tokens_details
            self._usage = Usage(
                prompt_tokens=chunk.usage.prompt_tokens,
                completion_tokens=chunk.usage.completion_tokens,
                cached_tokens=(details.cached_tokens or 0) if details else 0,
            )
        return events

    def _with_tokens(self, events: list[Event], token_ids: list[int] | None) -> list[Event]:
        """``events`` with the ids of the tokens since the last delta that carried any on their first delta."""
        self._tokens += token_ids or ()
        for i, event in enumerate(events):
            if isinstance(event, TextDelta | ReasoningDelta | ToolCallDelta) and self._tokens:
                events[i] = msgspec.structs.replace(event, tokens=tuple(self._tokens))
                self._tokens = []
                break
        return events

    def _end(self, otherwise: GatewayError) -> list[Event]:
        self.done = True
        if self._finish is None:
            return [Failed(error=otherwise.info())]
        return [*([self._usage] if self._usage else []), self._finish]


def _choice_events(choice: _Choice) -> list[Event]:
    events: list[Event] = []
    delta = choice.delta
    if delta is not None and (reasoning := delta.reasoning_content or delta.reasoning):
        events.append(ReasoningDelta(text=reasoning))
    text = choice.text if delta is None else delta.content
    logprobs = _logprobs(choice.logprobs)
    if text or logprobs:
        events.append(TextDelta(text=text or "", logprobs=logprobs))
    for call in (delta.tool_calls if delta is not None else None) or ():
        function = call.function or _Function()
        events.append(
            ToolCallDelta(index=call.index, id=call.id, name=function.name, arguments=function.arguments or "")
        )
    return events


def _logprobs(logprobs: _Logprobs | None) -> tuple[TokenLogprob, ...] | None:
    if logprobs is None or not logprobs.content:
        return None
    return tuple(
        TokenLogprob(
            token=e.token,
            logprob=e.logprob,
            bytes=tuple(e.bytes or ()),
            top=tuple(
                TopLogprob(token=t.token, logprob=t.logprob, bytes=tuple(t.bytes or ())) for t in e.top_logprobs or ()
            ),
        )
        for e in logprobs.content
    )


def _finished(choice: _Choice) -> Finished:
    if choice.finish_reason == "stop" and isinstance(choice.stop_reason, str):
        return Finished(reason="stop_sequence", stop_sequence=choice.stop_reason)
    return Finished(reason=_FINISH[choice.finish_reason or "stop"])
