"""The OpenAI wire pieces that more than one OpenAI endpoint uses, kept once.

Chat completions (``protocols.openai``), legacy completions (``protocols.openai_completions``) and the Responses
API (``protocols.openai_responses``) each import what they share from here, and never one another:

- the documented value ranges as msgspec constraints (``Temperature``, ``Probability``, ``Penalty``,
  ``TokenLimit``, ``TopLogprobs``), the request Structs' base ``Wire`` and ``StreamOptions``;
- request helpers of chat and legacy completions: ``sampling``, ``stop_sequences``, ``only_one`` and
  ``wants_usage`` (``stream_options.include_usage``, OAI-52);
- ``service_tier`` both ways (chat and the Responses API): ``ServiceTier``, ``tier_priority`` (a request's
  ``auto``/``default``/``priority``/``fast``/``scale`` are interactive, ``flex`` is batch) and ``tier_echo`` (the
  tier a response says it ran at: ``default`` or ``flex``);
- the ``usage`` object of chat and legacy completions (``usage_body``; the Responses API spells usage its own way);
- SSE framing: ``frame`` (one ``data:`` frame, no ``event:`` line, OAI-40, OAI-41) and ``DONE``
  (``data: [DONE]``); the keep-alive comment is ``protocols.sse.KEEPALIVE``;
- the error envelope ``{"error": {message, type, param, code}}`` (OAI-57): ``error_body`` before a response
  started (the Responses API's route uses it too) and ``stream_error_frame`` after (OAI-62).

Imports only ``protocols.model``, ``protocols.sse`` (SSE framing), sse-starlette's ``ServerSentEvent``, msgspec and
the standard library; never a protocol module (they import it). No I/O.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, Protocol

import msgspec
from msgspec import UnsetType
from sse_starlette.event import ServerSentEvent

from meshgate.protocols import sse
from meshgate.protocols.model import (
    UNSET,
    AuthenticationFailed,
    ContextLengthExceeded,
    GatewayError,
    InvalidRequest,
    NotFound,
    OutputTooLarge,
    Overloaded,
    Priority,
    RateLimited,
    Sampling,
    UnknownModel,
    Usage,
)

__all__ = [
    "DONE",
    "Penalty",
    "ServiceTier",
    "Probability",
    "SamplingFields",
    "StreamOptions",
    "Streamed",
    "Temperature",
    "TokenLimit",
    "TopLogprobs",
    "Wire",
    "error_body",
    "frame",
    "only_one",
    "sampling",
    "stop_sequences",
    "stream_error_frame",
    "tier_echo",
    "tier_priority",
    "usage_body",
    "wants_usage",
]

Temperature = Annotated[float, msgspec.Meta(ge=0, le=2)]
Probability = Annotated[float, msgspec.Meta(ge=0, le=1)]
Penalty = Annotated[float, msgspec.Meta(ge=-2, le=2)]
TokenLimit = Annotated[int, msgspec.Meta(ge=1)]
TopLogprobs = Annotated[int, msgspec.Meta(ge=0, le=20)]


class Wire(msgspec.Struct, kw_only=True):
    """Base of the request Structs: keyword-only, unknown fields ignored."""


class StreamOptions(Wire):
    include_obfuscation: bool | None = None
    include_usage: bool | None = None


# ---------------------------------------------------------------------------------------------------- requests


class SamplingFields(Protocol):
    """The request fields ``sampling`` reads (chat and legacy completions have them all)."""

    temperature: float | None | UnsetType
    top_p: float | None | UnsetType
    top_k: int | None | UnsetType
    min_p: float | None | UnsetType
    seed: int | None | UnsetType
    presence_penalty: float | None | UnsetType
    frequency_penalty: float | None | UnsetType
    repeat_penalty: float | None | UnsetType


class Streamed(Protocol):
    """A request with ``stream_options`` (chat and legacy completions)."""

    stream_options: StreamOptions | None


ServiceTier = Literal["auto", "default", "flex", "scale", "priority", "fast"]
"""The ``service_tier`` values a request may send (``oai: types/chat/completion_create_params.py``)."""


def tier_priority(tier: str | None) -> Priority | UnsetType:
    """The class a request's ``service_tier`` asks for: ``flex`` is batch, any other tier interactive; none sent is
    ``UNSET`` (the caller's key or the gateway's setting decides)."""
    if tier is None:
        return UNSET
    return "batch" if tier == "flex" else "interactive"


def tier_echo(priority: Priority | None) -> str | None:
    """The ``service_tier`` a response reports, the processing mode that served it: ``flex`` for the batch class,
    ``default`` for the interactive one (a request that asked for ``priority`` ran as everyone's interactive
    requests do); ``None`` when no class is known."""
    if priority is None:
        return None
    return "flex" if priority == "batch" else "default"


def wants_usage(wire: Streamed) -> bool:
    """Whether the client asked for the final usage chunk (``stream_options.include_usage``, OAI-52)."""
    return bool(wire.stream_options and wire.stream_options.include_usage)


def only_one(value: int | None, param: str) -> None:
    """Refuse ``n``/``best_of`` other than 1 (one choice per request is served)."""
    if value is not None and value != 1:
        raise InvalidRequest(f"{param}={value} is not supported: only {param}=1 is served; omit it", param=param)


def sampling(wire: SamplingFields) -> Sampling:
    """The request's sampling values, ``UNSET`` kept apart from an explicit ``null``."""
    return Sampling(
        temperature=wire.temperature,
        top_p=wire.top_p,
        top_k=wire.top_k,
        min_p=wire.min_p,
        seed=wire.seed,
        presence_penalty=wire.presence_penalty,
        frequency_penalty=wire.frequency_penalty,
        repeat_penalty=wire.repeat_penalty,
    )


def stop_sequences(stop: str | list[str] | None) -> tuple[str, ...]:
    """``stop`` as one string or a list, as a tuple."""
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


# ---------------------------------------------------------------------------------------------------- responses


def usage_body(usage: Usage) -> dict[str, Any]:
    """The ``usage`` object of chat and legacy completions (OAI-35): cached tokens in ``prompt_tokens_details``."""
    body: dict[str, Any] = {
        "prompt_tokens": usage.prompt_tokens,
        "completion_tokens": usage.completion_tokens,
        "total_tokens": usage.prompt_tokens + usage.completion_tokens,
    }
    if usage.cached_tokens:
        body["prompt_tokens_details"] = {"cached_tokens": usage.cached_tokens}
    return body


DONE = ServerSentEvent(data="[DONE]").encode()
"""The ``data: [DONE]`` frame that ends a chat or legacy completions stream."""


def frame(payload: dict[str, Any]) -> bytes:
    """One ``data:`` frame and no ``event:`` line (OAI-40, OAI-41)."""
    return sse.frame(msgspec.json.encode(payload))


# ---------------------------------------------------------------------------------------------------- errors

_CODES: dict[type[GatewayError], str] = {
    AuthenticationFailed: "invalid_api_key",
    RateLimited: "rate_limit_exceeded",
    ContextLengthExceeded: "context_length_exceeded",
}


def _error_type(status: int) -> str:
    """OpenAI's ``type``: a 404 (unknown model, unknown route) is an ``invalid_request_error`` there too."""
    if status == 401:
        return "authentication_error"
    if status == 429:
        return "rate_limit_error"
    return "invalid_request_error" if 400 <= status < 500 else "api_error"


def _error_code(err: GatewayError) -> str | None:
    """OpenAI's own code where one exists, else the error class in snake_case; ``None`` for the base class."""
    if isinstance(err, NotFound) and err.param == "model":
        return "model_not_found"
    for cls, code in _CODES.items():
        if isinstance(err, cls):
            return code
    if type(err) is GatewayError:
        return None
    return re.sub(r"(?<!^)(?=[A-Z])", "_", type(err).__name__).lower()


def _message(err: GatewayError) -> str:
    """OpenAI's own wording for an unknown model, a context overflow (clients match on it) and too large a
    ``max_tokens``; the error's message otherwise."""
    if isinstance(err, UnknownModel):
        return f"The model `{err.model}` does not exist or you do not have access to it."
    if isinstance(err, OutputTooLarge) and err.limit:
        return (
            f"max_tokens is too large: {err.asked}. This model supports at most {err.limit} completion tokens, "
            f"whereas you provided {err.asked}."
        )
    if not isinstance(err, ContextLengthExceeded) or not err.context:
        return err.message
    limit = f"This model's maximum context length is {err.context} tokens."
    if err.completion_tokens is None:
        return (
            f"{limit} However, your messages resulted in {err.prompt_tokens} tokens. Please reduce the length "
            "of the messages."
        )
    return (
        f"{limit} However, you requested {err.prompt_tokens + err.completion_tokens} tokens ({err.prompt_tokens} "
        f"in the messages, {err.completion_tokens} in the completion). Please reduce the length of the messages "
        "or completion."
    )


def _status(err: GatewayError) -> int:
    """A full queue is 429 (with ``retry-after``), which the SDK retries after waiting (OAI-61)."""
    return 429 if isinstance(err, Overloaded) else err.status


def _envelope(err: GatewayError) -> dict[str, Any]:
    """OAI-57: ``{"error": {message, type, param, code}}``."""
    param = None if isinstance(err, UnknownModel) else err.param  # OpenAI's own 404 names no param
    error = {"message": _message(err), "type": _error_type(_status(err)), "param": param, "code": _error_code(err)}
    return {"error": error}


def error_body(err: GatewayError) -> tuple[int, bytes]:
    """The HTTP status and JSON body for an error found before the response started (OAI-57, OAI-63)."""
    return _status(err), msgspec.json.encode(_envelope(err))


def stream_error_frame(err: GatewayError) -> bytes:
    """The ``data: {"error": {...}}`` frame for an error after the stream started (OAI-62)."""
    return frame(_envelope(err))
