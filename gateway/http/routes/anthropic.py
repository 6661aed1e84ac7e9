"""Anthropic Messages API handlers (``/v1/messages``); ``?beta=true`` and any ``anthropic-version`` accepted."""

from __future__ import annotations

from litestar import Request as HttpRequest
from litestar import Response, Router, post

from meshgate.gateway.auth.guard import caller_of
from meshgate.gateway.http.routes.common import (
    dispatcher_of,
    json_response,
    may_use,
    new_meta,
    serve_generation,
)
from meshgate.gateway.serving.context_fit import Fit
from meshgate.protocols import anthropic
from meshgate.protocols.model import decode_body


@post(["/v1/messages"], status_code=200, opt={"body": anthropic.MessagesRequest, "limited": True})
async def messages(request: HttpRequest) -> Response:
    wire = decode_body(await request.body(), anthropic.MessagesRequest)
    internal = anthropic.messages_to_internal(wire)
    meta = new_meta(internal.model)
    # only the prompt is checked: clients send max_tokens far beyond small contexts, and the runner caps the
    # output at the room left
    return await serve_generation(
        request,
        internal,
        fit=Fit.PROMPT,
        stream=lambda events: anthropic.encode_message_stream(events, meta),
        whole=lambda answer: anthropic.encode_message_response(answer, meta),
    )


@post(["/v1/messages/count_tokens"], status_code=200, opt={"body": anthropic.CountTokensRequest})
async def count_tokens(request: HttpRequest) -> Response:
    """ANT-3/50/51: system, tools and messages counted with the model's own tokenizer and chat template."""
    wire = decode_body(await request.body(), anthropic.CountTokensRequest)
    count = await dispatcher_of(request).count_tokens(
        anthropic.count_tokens_to_internal(wire), may_use(request), caller=caller_of(request).bucket
    )
    return json_response(anthropic.encode_count_tokens(count))


router = Router(
    path="/",
    route_handlers=[messages, count_tokens],
    tags=["anthropic"],
    opt={"scope": "inference"},
)
