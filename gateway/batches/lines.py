"""A batch's lines: read and checked when they arrive, run one at a time through the dispatcher like any request.

``openai_lines(content)`` reads an uploaded JSONL file (each line ``{"custom_id", "method": "POST", "url",
"body"}``); ``anthropic_lines(requests)`` a Message Batch's ``requests``. What makes the whole input unusable (not
JSON, a line that is not an object, a missing or repeated ``custom_id``, a ``url`` other than the batch's
endpoint, too many lines) is refused at once, with the line and what to fix. A line whose ``body`` its endpoint
would refuse (``check``: decoded and translated exactly as the endpoint does, no I/O) fails alone: its result is
the error the endpoint would have answered, in its protocol's envelope, and the other lines run.

``run`` sends one line's body through the same protocol codec and ``Dispatcher`` as an interactive request, at the
batch class, so a greedy line's answer is the same text as the same request sent on its own; the answer (or the
error) is encoded by the same codec. Each line is stored as ``{"custom_id", "body"}`` JSON.

Imports the protocols' codecs, the dispatcher, the batch store's records and the telemetry record.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec

from meshgate.gateway.cluster.batch_store import Job, LineResult, Outcome
from meshgate.gateway.serving.context_fit import Fit
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.gateway.serving.streams import aclose
from meshgate.gateway.telemetry.record import RequestRecord, bind, unbind
from meshgate.protocols import anthropic, openai, openai_completions, openai_embeddings, openai_responses
from meshgate.protocols.model import GatewayError, InvalidRequest, Meta, Overloaded, Request, collect, decode_body

__all__ = ["ENDPOINTS", "Line", "anthropic_lines", "check", "openai_lines", "run"]

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings", "/v1/responses")
"""The OpenAI endpoints a batch may run (Anthropic's batches run ``/v1/messages``)."""


class Line(msgspec.Struct, frozen=True):
    """One line as stored: its id and the body to send."""

    custom_id: str
    body: msgspec.Raw


_line_json = msgspec.json.Decoder(Line)


class _OpenAILine(msgspec.Struct, kw_only=True):
    custom_id: Annotated[str, msgspec.Meta(min_length=1, max_length=512)]
    method: str
    url: str
    body: dict[str, Any]


class _AnthropicRequest(msgspec.Struct, kw_only=True):
    custom_id: Annotated[str, msgspec.Meta(pattern=r"^[a-zA-Z0-9_-]{1,64}$")]
    params: dict[str, Any]


class AnthropicBatchBody(msgspec.Struct, kw_only=True):
    """The body of ``POST /v1/messages/batches``."""

    requests: Annotated[list[_AnthropicRequest], msgspec.Meta(min_length=1)]


def openai_lines(content: bytes, max_lines: int, endpoint: str | None = None) -> list[bytes]:
    """The lines of an OpenAI batch input file, each as a stored ``Line``; ``endpoint``: the batch's, which every
    line's ``url`` must name (``None``: any of ``ENDPOINTS``, as on upload).

    Raises:
        InvalidRequest: the file as a whole cannot run (the module docstring), naming the line and the fix.
    """
    try:
        text = content.decode()
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"the file is not UTF-8 text (byte {exc.start}); upload a JSONL file") from exc
    lines, seen = [], set()
    for number, raw in enumerate(text.splitlines(), 1):
        if not raw.strip():
            continue
        try:
            line = msgspec.json.decode(raw, type=_OpenAILine)
        except msgspec.ValidationError as exc:
            raise InvalidRequest(
                f"line {number}: {exc}; each line must be an object with custom_id, method, url and body",
                param=f"line {number}",
            ) from exc
        except msgspec.DecodeError as exc:
            raise InvalidRequest(f"line {number} is not valid JSON: {exc}", param=f"line {number}") from exc
        if line.method.upper() != "POST":
            raise InvalidRequest(f"line {number}: method must be POST, not {line.method!r}", param=f"line {number}")
        allowed = (endpoint,) if endpoint else ENDPOINTS
        if line.url not in allowed:
            raise InvalidRequest(
                f"line {number}: url {line.url!r} is not the batch's endpoint; every line must use "
                f"{' or '.join(allowed)}",
                param=f"line {number}",
            )
        if line.custom_id in seen:
            raise InvalidRequest(
                f"line {number}: custom_id {line.custom_id!r} is used by an earlier line; each must be unique",
                param=f"line {number}",
            )
        seen.add(line.custom_id)
        lines.append(msgspec.json.encode({"custom_id": line.custom_id, "body": line.body}))
        if len(lines) > max_lines:
            raise InvalidRequest(f"the file has more than {max_lines:,} requests; split it into several batches")
    if not lines:
        raise InvalidRequest("the file holds no requests: one JSON object per line is expected")
    return lines


def anthropic_lines(body: bytes, max_lines: int) -> list[bytes]:
    """The requests of a ``POST /v1/messages/batches`` body, each as a stored ``Line``.

    Raises:
        InvalidRequest: the body does not decode, too many requests, or a ``custom_id`` repeats.
    """
    wire = decode_body(body, AnthropicBatchBody)
    if len(wire.requests) > max_lines:
        raise InvalidRequest(f"requests: at most {max_lines:,} per batch", param="requests")
    seen: set[str] = set()
    for index, item in enumerate(wire.requests):
        if item.custom_id in seen:
            raise InvalidRequest(
                f"requests[{index}].custom_id {item.custom_id!r} is used by an earlier request; each must be unique",
                param=f"requests.{index}.custom_id",
            )
        seen.add(item.custom_id)
    return [msgspec.json.encode({"custom_id": r.custom_id, "body": r.params}) for r in wire.requests]


@dataclass(frozen=True)
class _Endpoint:
    """How one endpoint reads a body, answers it and renders an error."""

    translate: Callable[[bytes], Request | None]  # None: an embeddings body (checked, not a generation)
    encode: Callable[[Any, Meta], bytes]
    errors: Callable[[GatewayError], tuple[int, bytes]]
    fit: Fit = Fit.PROMPT_AND_OUTPUT


def _embeddings(body: bytes) -> None:
    openai_embeddings.embeddings_to_internal(decode_body(body, openai_embeddings.EmbeddingRequest))


_CODECS: dict[str, _Endpoint] = {
    "/v1/chat/completions": _Endpoint(
        lambda b: openai.chat_to_internal(decode_body(b, openai.ChatRequest)),
        openai.encode_chat_response,
        openai.error_body,
    ),
    "/v1/completions": _Endpoint(
        lambda b: openai_completions.completion_to_internal(decode_body(b, openai_completions.CompletionRequest)),
        openai_completions.encode_completion_response,
        openai.error_body,
    ),
    "/v1/responses": _Endpoint(
        lambda b: openai_responses.responses_to_internal(decode_body(b, openai_responses.ResponsesRequest)),
        openai_responses.encode_response,
        openai.error_body,
    ),
    "/v1/embeddings": _Endpoint(_embeddings, lambda answer, meta: answer, openai.error_body),
    "/v1/messages": _Endpoint(
        lambda b: anthropic.messages_to_internal(decode_body(b, anthropic.MessagesRequest)),
        anthropic.encode_message_response,
        anthropic.error_body,
        Fit.PROMPT,
    ),
}


def _request_id() -> str:
    return f"req_{uuid.uuid4().hex[:24]}"


def check(endpoint: str, index: int, line: bytes) -> LineResult | None:
    """``None`` if the endpoint would take the line's body; else the line's result: the endpoint's error."""
    codec = _CODECS[endpoint]
    stored = _line_json.decode(line)
    try:
        codec.translate(bytes(stored.body))
    except GatewayError as exc:
        status, body = codec.errors(exc)
        return LineResult(
            index=index,
            custom_id=stored.custom_id,
            outcome="errored",
            status=status,
            request_id=_request_id(),
            body=msgspec.Raw(body),
        )
    return None


def model_of(line: bytes) -> str | None:
    """The ``model`` a stored line names, if any."""
    model = msgspec.json.decode(bytes(_line_json.decode(line).body)).get("model")
    return model if isinstance(model, str) else None


async def run(
    dispatcher: Dispatcher, job: Job, index: int, line: bytes, report: Callable[[RequestRecord], None] | None = None
) -> LineResult:
    """One line answered through the dispatcher at the batch class, for the job's owner (module docstring).
    ``Overloaded`` is raised (the worker tries the line again later); any other error is the line's result.
    ``report`` (the gateway's request telemetry) gets the line's ``RequestRecord``: its log line and metrics."""
    endpoint = "/v1/messages" if job.api == "anthropic" else job.endpoint
    codec = _CODECS[endpoint]
    stored = _line_json.decode(line)
    may_use: Callable[[str], bool] | None = (lambda name: name in job.models) if job.models else None
    request_id = _request_id()
    record = RequestRecord(request_id) if report is not None else None
    token = bind(record)
    status, error = 500, b""  # until answered: an unexpected error is the worker's (it gives the line back)
    try:
        status, body = 200, await _answer(dispatcher, job, codec, bytes(stored.body), may_use)
    except Overloaded:  # a full queue: not the line's fault
        record = None  # tried again later: the try that answers is the one reported
        raise
    except GatewayError as exc:
        status, body = codec.errors(exc)
        error = body
    finally:
        unbind(token)
        if record is not None and report is not None:
            record.batch = job.id
            record.ended("POST", endpoint, endpoint, status, job.api, error, job.owner)
            report(record)
    outcome: Outcome = "succeeded" if status == 200 else "errored"
    return LineResult(
        index=index,
        custom_id=stored.custom_id,
        outcome=outcome,
        status=status,
        request_id=request_id,
        body=msgspec.Raw(body),
    )


async def _answer(
    dispatcher: Dispatcher, job: Job, codec: _Endpoint, body: bytes, may_use: Callable[[str], bool] | None
) -> bytes:
    caller = job.owner or f"batch:{job.id}"
    if job.endpoint == "/v1/embeddings":
        wire = decode_body(body, openai_embeddings.EmbeddingRequest)
        result = await dispatcher.embed(openai_embeddings.embeddings_to_internal(wire), may_use)
        return openai_embeddings.encode_embeddings(result, wire.model, wire.encoding_format)
    request = codec.translate(body)
    if request is None:  # only embeddings translate to None, answered above
        raise InvalidRequest(f"{job.endpoint} is not a generation endpoint")
    request = msgspec.structs.replace(request, stream=False, priority="batch")
    meta = Meta(id=uuid.uuid4().hex[:24], model=request.model, created=time.time(), priority="batch")
    events = await dispatcher.open_stream(
        request, caller=caller, fit=codec.fit, may_use=may_use, cache_scope=job.tenant, weight=job.weight
    )
    try:
        answer = await collect(events)
    finally:
        await aclose(events)
    return codec.encode(answer, meta)
