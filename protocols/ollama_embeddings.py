"""The Ollama embedding endpoints, ``POST /api/embed`` and the legacy ``POST /api/embeddings``: pure codecs.

``EmbedBody`` / ``EmbeddingsBody`` (the wire requests, OLL-18, OLL-19) and ``embed_to_internal`` /
``embeddings_to_internal`` going in; ``encode_embed`` (OLL-43) and ``encode_embeddings`` (OLL-44) going out.
Errors are rendered by ``protocols.ollama.error_body`` (applied by the route). Kept apart from
``protocols.ollama``, which is already past the 450-line aim.

Imports only ``protocols.model``, msgspec and the standard library. Must not import the other protocol modules
(it is listed in the independence contract). No I/O.

Decisions worth knowing, following the Ollama server:

- ``input`` is a string or a list of strings. An empty string (or no ``input``) embeds nothing: the model is
  loaded and ``embeddings`` is ``[]``. In a list, every string is an input, empty ones included.
- ``truncate`` defaults to true: an input longer than the context is cut to fit; with ``false`` it is a 400.
- ``dimensions`` of 0 or less means the full size. Ollama ignores a value above the model's size; here it is
  a 400, as on the OpenAI endpoint (one rule for the backend to apply).
- ``options`` are accepted and ignored (the context size is fixed by the placement); ``keep_alive`` is applied
  by the gateway after the call (``protocols.ollama_models.parse_keep_alive``).
- The legacy endpoint embeds ``prompt`` (an empty one only loads the model and answers ``{"embedding": []}``).
  Ollama's legacy vectors are not normalized; these are unit vectors, so only their length differs.
- ``total_duration`` is the gateway's wall time for the request; ``load_duration`` is what the backend spent
  loading for it (its embedding context on the first request); ``prompt_eval_count`` counts embedded tokens.
"""

from __future__ import annotations

from typing import Any

import msgspec

from meshgate.protocols.model import Embeddings, EmbedRequest

__all__ = [
    "EmbedBody",
    "EmbeddingsBody",
    "embed_to_internal",
    "embeddings_to_internal",
    "encode_embed",
    "encode_embeddings",
]


class EmbedBody(msgspec.Struct, kw_only=True):
    """``POST /api/embed`` (OLL-18); unknown fields are ignored."""

    model: str
    input: str | list[str] | None = None
    truncate: bool | None = None
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None
    dimensions: int | None = None


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    """``POST /api/embeddings``, the legacy endpoint (OLL-19)."""

    model: str
    prompt: str = ""
    options: dict[str, Any] | None = None
    keep_alive: float | str | None = None


def embed_to_internal(wire: EmbedBody) -> EmbedRequest:
    if isinstance(wire.input, list):
        inputs: tuple[str, ...] = tuple(wire.input)
    else:
        inputs = (wire.input,) if wire.input else ()
    dimensions = wire.dimensions if wire.dimensions is not None and wire.dimensions > 0 else None
    truncate = True if wire.truncate is None else wire.truncate
    return EmbedRequest(model=wire.model, inputs=inputs, dimensions=dimensions, truncate=truncate)


def embeddings_to_internal(wire: EmbeddingsBody) -> EmbedRequest:
    return EmbedRequest(model=wire.model, inputs=(wire.prompt,) if wire.prompt else ())


def encode_embed(result: Embeddings, model: str, total_ns: int) -> bytes:
    """OLL-43: ``{model, embeddings, total_duration, load_duration, prompt_eval_count}``."""
    return msgspec.json.encode(
        {
            "model": model,
            "embeddings": result.vectors,
            "total_duration": total_ns,
            "load_duration": result.load_ns,
            "prompt_eval_count": result.prompt_tokens,
        }
    )


def encode_embeddings(result: Embeddings) -> bytes:
    """OLL-44: ``{"embedding": [...]}``, the first (only) vector, or ``[]`` for a load-only request."""
    return msgspec.json.encode({"embedding": result.vectors[0] if result.vectors else ()})
