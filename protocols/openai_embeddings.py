"""The OpenAI embeddings endpoint (``POST /v1/embeddings``; OAI-5, OAI-28..30): pure codecs.

``EmbeddingRequest`` and ``embeddings_to_internal`` going in, ``encode_embeddings`` going out. Errors use the
chat API's envelope (``protocols.openai.error_body``, applied by the route). Kept apart from ``protocols.openai``,
which is already past the 450-line aim.

Imports only ``protocols.model``, msgspec and the standard library. Must not import the other protocol modules
(it is listed in the independence contract). No I/O.

Decisions worth knowing:

- ``input`` is a string, an array of strings, an array of token ids (one input) or an array of token-id arrays
  (OAI-28). Refused with a 400 on ``input``, as OpenAI does: an empty string, an empty array or token array, an
  array mixing those kinds, and more than 2,048 inputs. Token ids are passed to the model as given.
- ``encoding_format`` defaults to ``float`` (the API's default); the SDK itself sends ``base64`` when the caller
  does not choose, and decodes it (OAI-29): the little-endian float32 bytes of each vector, base64 encoded.
- ``dimensions`` must be at least 1 (a decoder constraint, so the error names the field); the backend keeps that
  many leading components and renormalizes, or refuses a value above the model's size (400).
- An input longer than the model's context is a 400 (``truncate`` off), like OpenAI's maximum-context error;
  Ollama's endpoint truncates instead.
- ``user`` is accepted and ignored. ``usage.total_tokens`` equals ``prompt_tokens`` (nothing is generated).
"""

from __future__ import annotations

import base64
import struct
from typing import Annotated, Any, Literal

import msgspec

from meshgate.protocols.model import Embeddings, EmbedRequest, InvalidRequest

__all__ = ["MAX_INPUTS", "EmbeddingRequest", "embeddings_to_internal", "encode_embeddings"]

MAX_INPUTS = 2048
"""The most inputs one request may carry (OpenAI's limit)."""

EncodingFormat = Literal["float", "base64"]


class EmbeddingRequest(msgspec.Struct, kw_only=True):
    """``POST /v1/embeddings`` (OAI-28); unknown fields are ignored."""

    model: str
    input: str | list[str | int | list[int]]
    dimensions: Annotated[int, msgspec.Meta(ge=1)] | None = None
    encoding_format: EncodingFormat | None = None
    user: str | None = None


_KINDS = "a string, an array of strings, an array of token ids or an array of token-id arrays"


def embeddings_to_internal(wire: EmbeddingRequest) -> EmbedRequest:
    """The internal request; ``InvalidRequest`` (param ``input``) for inputs OpenAI refuses too."""
    return EmbedRequest(model=wire.model, inputs=_inputs(wire.input), dimensions=wire.dimensions, truncate=False)


def _inputs(value: str | list[str | int | list[int]]) -> tuple[str | tuple[int, ...], ...]:
    if isinstance(value, str):
        value = [value]
    if not value:
        raise InvalidRequest("'input' must not be an empty array", param="input")
    if len(value) > MAX_INPUTS:
        raise InvalidRequest(f"'input' holds {len(value)} items; at most {MAX_INPUTS} are allowed", param="input")
    if all(isinstance(item, int) for item in value):
        return (tuple(value),)  # type: ignore[arg-type]  # kind checked above: a list of ints
    for kind in (str, list):
        if all(isinstance(item, kind) for item in value):
            if any(len(item) == 0 for item in value):  # type: ignore[arg-type]  # kind checked above: a list
                what = "an empty string" if kind is str else "an empty token array"
                raise InvalidRequest(f"'input' must not contain {what}", param="input")
            return tuple(item if kind is str else tuple(item) for item in value)  # type: ignore[misc,arg-type]  # kind checked above
    raise InvalidRequest(f"'input' must be {_KINDS}, not a mix of them", param="input")


def encode_embeddings(result: Embeddings, model: str, encoding_format: EncodingFormat | None = None) -> bytes:
    """The reply (OAI-30): ``{"object": "list", "data": [...], "model", "usage"}``, one item per input in order."""
    as_base64 = encoding_format == "base64"
    data: list[dict[str, Any]] = [
        {"object": "embedding", "index": i, "embedding": _base64(vector) if as_base64 else vector}
        for i, vector in enumerate(result.vectors)
    ]
    usage = {"prompt_tokens": result.prompt_tokens, "total_tokens": result.prompt_tokens}
    return msgspec.json.encode({"object": "list", "data": data, "model": model, "usage": usage})


def _base64(vector: tuple[float, ...]) -> str:
    """OAI-29: little-endian float32 bytes, base64 encoded."""
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")
