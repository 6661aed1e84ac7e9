"""The request bodies of the protocol endpoints, added to the app's OpenAPI schema (``/schema/openapi.json``).

The protocol handlers read the raw body and decode it with ``protocols.model.decode_body`` into a wire Struct
(so a bad body is a 400 in the protocol's own envelope), which leaves Litestar nothing to describe. ``BODIES``
names the Struct each ``(method, path)`` decodes; ``describe_request_bodies`` turns those Structs into JSON
Schema with ``msgspec.json.schema_components`` and sets them as required ``application/json`` bodies, with the
Structs under ``components/schemas``. Wire Structs are tolerant readers, and so are their schemas: no
``additionalProperties: false``.

A path added to a router with a body belongs in ``BODIES``; ``describe_request_bodies`` fails loudly on a
path or method the app does not serve, so the map cannot go stale silently.

Imports ``protocols`` wire modules, msgspec and Litestar's OpenAPI spec objects; nothing imports this but
``gateway.http.app``.
"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import msgspec
from litestar.openapi.spec import (
    Discriminator,
    OpenAPI,
    OpenAPIFormat,
    OpenAPIMediaType,
    OpenAPIType,
    Reference,
    RequestBody,
    Schema,
)

from meshgate.protocols import (
    anthropic,
    ollama,
    ollama_embeddings,
    ollama_models,
    openai,
    openai_completions,
    openai_embeddings,
    openai_responses_request,
)

__all__ = ["BODIES", "describe_request_bodies"]

BODIES: dict[tuple[str, str], type[msgspec.Struct]] = {
    ("post", "/v1/chat/completions"): openai.ChatRequest,
    ("post", "/chat/completions"): openai.ChatRequest,
    ("post", "/v1/completions"): openai_completions.CompletionRequest,
    ("post", "/v1/responses"): openai_responses_request.ResponsesRequest,
    ("post", "/responses"): openai_responses_request.ResponsesRequest,
    ("post", "/v1/embeddings"): openai_embeddings.EmbeddingRequest,
    ("post", "/embeddings"): openai_embeddings.EmbeddingRequest,
    ("post", "/v1/messages"): anthropic.MessagesRequest,
    ("post", "/v1/messages/count_tokens"): anthropic.CountTokensRequest,
    ("post", "/api/chat"): ollama.ChatRequest,
    ("post", "/api/generate"): ollama.GenerateRequest,
    ("post", "/api/embed"): ollama_embeddings.EmbedBody,
    ("post", "/api/embeddings"): ollama_embeddings.EmbeddingsBody,
    ("post", "/api/show"): ollama_models.ShowRequest,
    ("post", "/api/copy"): ollama_models.CopyRequest,
    ("delete", "/api/delete"): ollama_models.DeleteRequest,
    ("post", "/api/create"): ollama_models.CreateRequest,
    ("post", "/api/pull"): ollama_models.PullRequest,
    ("post", "/api/push"): ollama_models.PullRequest,
}
"""``(method, path)`` -> the wire Struct its handler decodes, for every route of ours that reads a body."""

_REF = "#/components/schemas/{name}"


def describe_request_bodies(openapi: OpenAPI, bodies: dict[tuple[str, str], type[msgspec.Struct]] = BODIES) -> None:
    """Set the request body of each operation in ``bodies`` on ``openapi`` (Litestar's built schema), in place.

    Raises:
        KeyError: ``bodies`` names a path or method that ``openapi`` does not have.
        ValueError: a Struct's JSON Schema uses a keyword that Litestar's ``Schema`` cannot hold, or a Struct's
            name is taken by a schema Litestar generated.
    """
    keys = list(bodies)
    refs, components = msgspec.json.schema_components([bodies[k] for k in keys], ref_template=_REF)
    paths = openapi.paths or {}
    for (method, path), ref in zip(keys, refs, strict=True):
        operation = getattr(paths[path], method)
        if operation is None:
            raise KeyError(f"{method.upper()} {path} is not in the OpenAPI schema")
        operation.request_body = RequestBody(
            content={"application/json": OpenAPIMediaType(schema=_schema(ref))}, required=True
        )
    schemas = openapi.components.schemas
    for name, schema in components.items():
        if name in schemas:
            raise ValueError(f"two schemas named {name!r}: a wire Struct and a type Litestar described")
        schemas[name] = _schema(schema)  # type: ignore[assignment]  # a Struct's schema is never a bare $ref


# --------------------------------------------------------------------------- JSON Schema -> Litestar's objects


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(part.title() for part in rest)


_FIELDS = {f.metadata.get("alias", _camel(f.name)): f.name for f in fields(Schema)}
"""JSON Schema keyword -> ``Schema`` attribute (``anyOf`` -> ``any_of``, ``not`` -> ``schema_not``)."""
_ONE = {
    "items",
    "not",
    "contains",
    "propertyNames",
    "if",
    "then",
    "else",
    "contentSchema",
    "unevaluatedItems",
    "unevaluatedProperties",
}
_MANY = {"anyOf", "oneOf", "allOf", "prefixItems"}
_NAMED = {"properties", "patternProperties", "dependentSchemas"}


def _schema(doc: dict[str, Any]) -> Schema | Reference:
    """One JSON Schema object, as produced by msgspec, as Litestar's ``Schema`` (or ``Reference`` for ``$ref``)."""
    if "$ref" in doc:
        return Reference(ref=doc["$ref"], description=doc.get("description"))
    kwargs: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in _FIELDS:
            raise ValueError(f"JSON Schema keyword {key!r} has no place in Litestar's OpenAPI Schema")
        if key in _ONE or (key == "additionalProperties" and isinstance(value, dict)):
            value = _schema(value)
        elif key in _MANY:
            value = [_schema(v) for v in value]
        elif key in _NAMED:
            value = {k: _schema(v) for k, v in value.items()}
        elif key == "type":
            value = [OpenAPIType(t) for t in value] if isinstance(value, list) else OpenAPIType(value)
        elif key == "format":
            value = OpenAPIFormat(value)
        elif key == "discriminator":
            value = Discriminator(property_name=value["propertyName"], mapping=value.get("mapping"))
        kwargs[_FIELDS[key]] = value
    return Schema(**kwargs)
