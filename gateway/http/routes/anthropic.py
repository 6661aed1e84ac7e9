"""Anthropic Messages API handlers (``/v1/messages``); ``?beta=true`` and any ``anthropic-version`` accepted."""

from __future__ import annotations

from litestar import Request as HttpRequest
from litestar import Response, Router, post
from litestar.di import NamedDependency

from meshgate.gateway.auth.guard import caller_of
from meshgate.gateway.http.routes.common import (
    body,
    classify,
    json_response,
    may_use,
    new_meta,
    serve_generation,
)
from meshgate.gateway.serving.context_fit import Fit
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.protocols import anthropic


@post(["/v1/messages"], status_code=200, opt={"limited": True}, dependencies=body(anthropic.MessagesRequest))
async def messages(
    request: HttpRequest, wire: NamedDependency[anthropic.MessagesRequest], dispatcher: NamedDependency[Dispatcher]
) -> Response:
    internal = classify(request, anthropic.messages_to_internal(wire))
    meta = new_meta(internal.model, internal.priority or None)
    # only the prompt is checked: clients send max_tokens far beyond small contexts, and the runner caps the
    # output at the room left
    return await serve_generation(
        request,
        dispatcher,
        internal,
        fit=Fit.PROMPT,
        stream=lambda events: anthropic.encode_message_stream(events, meta),
        whole=lambda answer: anthropic.encode_message_response(answer, meta),
    )


@post(
    ["/v1/messages/count_tokens"],
    status_code=200,
    opt={"limited": True},  # it costs the runner a tokenization: counted in the caller's requests per minute
    dependencies=body(anthropic.CountTokensRequest),
)
async def count_tokens(
    request: HttpRequest, wire: NamedDependency[anthropic.CountTokensRequest], dispatcher: NamedDependency[Dispatcher]
) -> Response:
    """ANT-3/50/51: system, tools and messages counted with the model's own tokenizer and chat template."""
    count = await dispatcher.count_tokens(
        anthropic.count_tokens_to_internal(wire), may_use(request), caller=caller_of(request).bucket
    )
    return json_response(anthropic.encode_count_tokens(count))


router = Router(
    path="/",
    route_handlers=[messages, count_tokens],
    tags=["anthropic"],
    opt={"scope": "inference"},
)
