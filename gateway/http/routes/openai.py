"""OpenAI API handlers, served with and without the ``/v1`` prefix (OAI-7).

``GET /v1/models`` is shared with Anthropic clients, who always send ``anthropic-version``: they get
Anthropic's listing shape and error envelope, everyone else OpenAI's.
"""

from __future__ import annotations

from urllib.parse import unquote

from litestar import Request as HttpRequest
from litestar import Response, Router, get, post
from litestar.di import NamedDependency

from meshgate.gateway.http.routes.common import (
    body,
    classify,
    json_response,
    may_use,
    model_infos,
    new_meta,
    serve_generation,
)
from meshgate.gateway.serving.context_fit import Fit
from meshgate.gateway.serving.dispatch import Dispatcher
from meshgate.protocols import anthropic, openai, openai_completions, openai_embeddings, openai_responses
from meshgate.protocols.model import UnknownModel


def _is_anthropic(request: HttpRequest) -> bool:
    """Anthropic's SDKs send ``anthropic-version`` on every call: they get Anthropic's model listing."""
    return "anthropic-version" in request.headers


@post(
    ["/v1/chat/completions", "/chat/completions"],
    status_code=200,
    opt={"limited": True},
    dependencies=body(openai.ChatRequest),
)
async def chat_completions(
    request: HttpRequest, wire: NamedDependency[openai.ChatRequest], dispatcher: NamedDependency[Dispatcher]
) -> Response:
    internal = classify(request, openai.chat_to_internal(wire))
    meta = new_meta(internal.model, internal.priority or None)
    return await serve_generation(
        request,
        dispatcher,
        internal,
        fit=Fit.PROMPT_AND_OUTPUT,
        stream=lambda events: openai.encode_chat_stream(events, meta, include_usage=openai.wants_usage(wire)),
        whole=lambda answer: openai.encode_chat_response(answer, meta),
    )


@post(
    ["/v1/completions"], status_code=200, opt={"limited": True}, dependencies=body(openai_completions.CompletionRequest)
)
async def completions(
    request: HttpRequest,
    wire: NamedDependency[openai_completions.CompletionRequest],
    dispatcher: NamedDependency[Dispatcher],
) -> Response:
    internal = openai_completions.completion_to_internal(wire)
    meta = new_meta(internal.model)
    usage = openai.wants_usage(wire)
    return await serve_generation(
        request,
        dispatcher,
        internal,
        fit=Fit.PROMPT_AND_OUTPUT,
        stream=lambda events: openai_completions.encode_completion_stream(events, meta, include_usage=usage),
        whole=lambda answer: openai_completions.encode_completion_response(answer, meta),
    )


@post(
    ["/v1/responses", "/responses"],
    status_code=200,
    opt={"limited": True},
    dependencies=body(openai_responses.ResponsesRequest),
)
async def responses(
    request: HttpRequest,
    wire: NamedDependency[openai_responses.ResponsesRequest],
    dispatcher: NamedDependency[Dispatcher],
) -> Response:
    internal = classify(request, openai_responses.responses_to_internal(wire))
    meta = new_meta(internal.model, internal.priority or None)
    return await serve_generation(
        request,
        dispatcher,
        internal,
        fit=Fit.PROMPT_AND_OUTPUT,
        stream=lambda events: openai_responses.encode_response_stream(events, meta),
        whole=lambda answer: openai_responses.encode_response(answer, meta),
    )


@post(
    ["/v1/embeddings", "/embeddings"],
    status_code=200,
    opt={"limited": True},
    dependencies=body(openai_embeddings.EmbeddingRequest),
)
async def embeddings(
    request: HttpRequest,
    wire: NamedDependency[openai_embeddings.EmbeddingRequest],
    dispatcher: NamedDependency[Dispatcher],
) -> Response:
    result = await dispatcher.embed(openai_embeddings.embeddings_to_internal(wire), may_use(request))
    return json_response(openai_embeddings.encode_embeddings(result, wire.model, wire.encoding_format))


@get(["/v1/models", "/models"], sync_to_thread=False)
def list_models(request: HttpRequest, dispatcher: NamedDependency[Dispatcher]) -> Response[bytes]:
    models = model_infos(dispatcher, request)
    return json_response((anthropic if _is_anthropic(request) else openai).encode_models(models))


@get(["/v1/models/{model_id:path}", "/models/{model_id:path}"], sync_to_thread=False)
def get_model(request: HttpRequest, model_id: str, dispatcher: NamedDependency[Dispatcher]) -> Response[bytes]:
    name = unquote(model_id.lstrip("/"))
    card = dispatcher.resolve(name, may_use(request))
    info = next((m for m in model_infos(dispatcher) if m.name == card.name), None)
    if info is None:
        raise UnknownModel(name)
    return json_response((anthropic if _is_anthropic(request) else openai).encode_model(info))


router = Router(
    path="/",
    route_handlers=[chat_completions, completions, responses, embeddings, list_models, get_model],
    tags=["openai"],
    opt={"scope": "inference"},
)
