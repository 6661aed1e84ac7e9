"""The request bodies of the protocol endpoints, added to the app's OpenAPI schema (``/schema/openapi.json``).

The protocol handlers take their body as ``wire``, a dependency that decodes it with ``protocols.model.decode_body``
into a wire Struct (so a bad body is a 400 in the protocol's own envelope), which leaves Litestar nothing to
describe. Each such route names its Struct where it is declared (``@post("/api/chat",
dependencies=body(ollama.ChatRequest))``, ``gateway.http.routes.common.body``); ``request_bodies`` collects them
from the routers, and ``describe_request_bodies`` turns
those Structs into JSON Schema with ``msgspec.json.schema_components`` and sets them as required
``application/json`` bodies, with the Structs under ``components/schemas``. Wire Structs are tolerant readers,
and so are their schemas: no ``additionalProperties: false``.

Imports msgspec, Litestar's OpenAPI spec objects and the protocol routers; nothing imports this but
``gateway.http.app`` (and the fuzz test, for ``BODIES``).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import fields
from typing import Any

import msgspec
from litestar import Router
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

from meshgate.gateway.http.routes import anthropic as anthropic_routes
from meshgate.gateway.http.routes import ollama as ollama_routes
from meshgate.gateway.http.routes import openai as openai_routes

__all__ = ["BODIES", "describe_request_bodies", "request_bodies"]


def request_bodies(routers: Iterable[Router]) -> dict[tuple[str, str], type[msgspec.Struct]]:
    """``(method, path)`` -> the wire Struct its handler decodes (its ``wire`` dependency), for every handler of
    ``routers`` that has one."""
    bodies: dict[tuple[str, str], type[msgspec.Struct]] = {}
    for router in routers:
        for route in router.routes:
            for handler in getattr(route, "route_handlers", ()):
                provider = (handler.dependencies or {}).get("wire")
                struct = getattr(getattr(provider, "dependency", None), "struct", None)
                if struct is not None:
                    for method in handler.http_methods:
                        bodies[method.lower(), route.path] = struct
    return bodies


BODIES = request_bodies([openai_routes.router, anthropic_routes.router, ollama_routes.router])
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
