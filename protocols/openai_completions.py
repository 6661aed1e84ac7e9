"""The legacy OpenAI completions endpoint (``POST /v1/completions``, OAI-27, OAI-38, OAI-56).

Pure translation like ``protocols.openai``, with which it shares the wire types and framing helpers of
``protocols.openai_wire``: a plain prompt in (``Request.raw_prompt``, no chat template), ``text_completion`` objects
and chunks out. Imports ``protocols.openai_wire``, ``protocols.sse``, ``protocols.model``, msgspec and the standard
library only; never ``protocols.openai``.

Refused with a 400: token-id prompts, several prompts, ``echo``, ``suffix``, ``n``/``best_of`` other than 1.
There is no 16-token default: an absent ``max_tokens`` means no limit. ``logprobs`` is accepted and ignored.
"""

from __future__ import annotations

from collections.abc import AsyncIterable, AsyncIterator

import msgspec
from msgspec import UNSET, UnsetType

from meshgate.protocols.model import (
    BackendProtocolError,
    Event,
    Failed,
    Finished,
    InvalidRequest,
    KeepAlive,
    Meta,
    Request,
    Response,
    TextDelta,
    UnsupportedFeature,
    Usage,
    error_from_info,
)
from meshgate.protocols.openai_wire import (
    DONE,
    Penalty,
    Probability,
    StreamOptions,
    Temperature,
    TokenLimit,
    Wire,
    frame,
    only_one,
    sampling,
    stop_sequences,
    stream_error_frame,
    usage_body,
)
from meshgate.protocols.sse import KEEPALIVE

__all__ = ["CompletionRequest", "completion_to_internal", "encode_completion_response", "encode_completion_stream"]


class CompletionRequest(Wire):
    """The body of the legacy ``POST /v1/completions`` (OAI-27)."""

    model: str
    prompt: str | list[str | int | list[int]] | None
    best_of: int | None = None
    echo: bool | None = None
    frequency_penalty: Penalty | None | UnsetType = UNSET
    logit_bias: dict[str, int] | None = None
    logprobs: int | None = None
    max_tokens: TokenLimit | None = None
    n: int | None = None
    presence_penalty: Penalty | None | UnsetType = UNSET
    seed: int | None | UnsetType = UNSET
    stop: str | list[str] | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    suffix: str | None = None
    temperature: Temperature | None | UnsetType = UNSET
    top_p: Probability | None | UnsetType = UNSET
    user: str | None = None
    # extra_body keys (OAI-26)
    top_k: int | None | UnsetType = UNSET
    min_p: float | None | UnsetType = UNSET
    repeat_penalty: float | None | UnsetType = UNSET


def completion_to_internal(wire: CompletionRequest) -> Request:
    """Translate a legacy completions body into a ``Request`` with ``raw_prompt`` set.

    Raises:
        InvalidRequest: a prompt that is not one string, or ``n``/``best_of`` other than 1.
        UnsupportedFeature: token-id prompts, ``echo`` or ``suffix``.
    """
    only_one(wire.n, "n")
    only_one(wire.best_of, "best_of")
    if wire.echo:
        raise UnsupportedFeature("echo is not supported; omit it or set it to false", param="echo")
    if wire.suffix:
        raise UnsupportedFeature("suffix is not supported; omit it", param="suffix")
    prompt = wire.prompt
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]
    if isinstance(prompt, list) and any(not isinstance(p, str) for p in prompt):
        raise UnsupportedFeature("token-id prompts are not supported; send the prompt as a string", param="prompt")
    if not isinstance(prompt, str):
        raise InvalidRequest("prompt must be one string; several prompts per request are not served", param="prompt")
    return Request(
        model=wire.model,
        raw_prompt=prompt,
        sampling=sampling(wire),
        stop=stop_sequences(wire.stop),
        max_tokens=wire.max_tokens,
        stream=bool(wire.stream),
    )


def _completion_finish_reason(finish: Finished) -> str:
    return finish.reason if finish.reason in ("length", "content_filter") else "stop"


def encode_completion_response(response: Response, meta: Meta) -> bytes:
    """A whole legacy ``text_completion`` object (OAI-38)."""
    finish_reason = _completion_finish_reason(response.finish)
    choice = {"index": 0, "text": response.text, "logprobs": None, "finish_reason": finish_reason}
    return msgspec.json.encode(
        {
            "id": f"cmpl-{meta.id}",
            "object": "text_completion",
            "created": int(meta.created),
            "model": meta.model,
            "choices": [choice],
            "usage": usage_body(response.usage),
        }
    )


async def encode_completion_stream(
    events: AsyncIterable[Event], meta: Meta, *, include_usage: bool
) -> AsyncIterator[bytes]:
    """SSE frames of legacy ``text_completion`` chunks, ending in ``data: [DONE]`` (OAI-56).

    Args:
        events: the backend's event stream; only text, usage and the terminal event matter here.
        meta: id, model and timestamp shared by every chunk.
        include_usage: send one ``choices: []`` chunk with usage after the finish chunk.
    """
    head = {"id": f"cmpl-{meta.id}", "object": "text_completion", "created": int(meta.created), "model": meta.model}

    def chunk(text: str, finish_reason: str | None = None) -> bytes:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}
        return frame({**head, "choices": [choice]})

    usage = Usage()
    async for event in events:
        match event:
            case TextDelta(text=text) if text:
                yield chunk(text)
            case Usage():
                usage = event
            case KeepAlive():
                yield KEEPALIVE
            case Finished():
                yield chunk("", _completion_finish_reason(event))
                if include_usage:
                    yield frame({**head, "choices": [], "usage": usage_body(usage)})
                yield DONE
                return
            case Failed(error=info):
                yield stream_error_frame(error_from_info(info))
                yield DONE
                return
    yield stream_error_frame(BackendProtocolError("the backend's stream ended without finishing"))
    yield DONE
