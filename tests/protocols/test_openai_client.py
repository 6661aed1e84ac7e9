"""Tests for protocols.openai_client: internal request -> OpenAI body, OpenAI SSE -> internal events.

Pure functions on fixtures shaped like vLLM's and OpenAI's streams; a round trip through meshgate's own server-side
encoder (``protocols.openai.encode_chat_stream``) checks the two directions agree.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from meshgate.protocols import openai as oai
from meshgate.protocols.model import (
    BackendProtocolError,
    BackendUnavailable,
    Failed,
    Finished,
    ImagePart,
    InvalidRequest,
    Message,
    Meta,
    ReasoningDelta,
    Request,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    TopLogprob,
    Usage,
    collect,
)
from meshgate.protocols.openai_client import StreamDecoder, encode_request, error_from_response, request_body


def _sse(*payloads: object, crlf: bool = False) -> bytes:
    end = b"\r\n" if crlf else b"\n"
    frames = [b"data: " + (p if isinstance(p, bytes) else json.dumps(p).encode()) + end + end for p in payloads]
    return b"".join(frames)


def _decode(body: bytes, *, step: int | None = None, close: bool = True) -> list:
    decoder = StreamDecoder()
    events = []
    for i in range(0, len(body), step or len(body) or 1):
        events += decoder.feed(body[i : i + (step or len(body))])
    return events + (decoder.close() if close else [])


def _chunk(delta: dict | None = None, finish: str | None = None, **extra: object) -> dict:
    return {
        "id": "chatcmpl-1",
        "object": "chat.completion.chunk",
        "created": 1,
        "model": "m",
        "choices": [{"index": 0, "delta": delta or {}, "logprobs": None, "finish_reason": finish, **extra}],
    }


USAGE = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [],
    "usage": {
        "prompt_tokens": 7,
        "completion_tokens": 3,
        "total_tokens": 10,
        "prompt_tokens_details": {"cached_tokens": 2},
    },
}


# ---------------------------------------------------------------------------------------------------- requests


def test_chat_body_omits_unset_sampling_and_keeps_explicit_null() -> None:
    request = Request(
        model="alias",
        messages=(
            Message(role="system", parts=(TextPart(text="be brief"),)),
            Message(role="user", parts=(TextPart(text="hi"),)),
        ),
        sampling=Sampling(temperature=0.0, top_p=None, top_k=5, repeat_penalty=1.1, seed=3),
        stop=("\n\n",),
        max_tokens=12,
    )
    path, raw = encode_request(request, "served")
    body = json.loads(raw)
    assert path == "/v1/chat/completions"
    assert body == {
        "model": "served",
        "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}],
        "temperature": 0.0,
        "top_p": None,
        "top_k": 5,
        "seed": 3,
        "repetition_penalty": 1.1,
        "stop": ["\n\n"],
        "max_tokens": 12,
        "stream": True,
        "stream_options": {"include_usage": True},
    }


def test_raw_prompt_goes_to_completions() -> None:
    path, raw = encode_request(Request(model="m", raw_prompt="Once upon", max_tokens=4), "served")
    assert path == "/v1/completions"
    body = json.loads(raw)
    assert body["prompt"] == "Once upon" and "messages" not in body and body["max_tokens"] == 4


def test_tools_history_images_format_logprobs_prefill() -> None:
    messages = (
        Message(role="user", parts=(TextPart(text="look"), ImagePart(data=b"\x89PNG", media_type="image/png"))),
        Message(role="assistant", parts=(ToolCallPart(id="c1", name="get", arguments='{"a":1}'),)),
        Message(role="tool", parts=(ToolResultPart(call_id="c1", content=(TextPart(text="42"),)),)),
        Message(role="assistant", parts=(TextPart(text="The answer is"),)),
    )
    request = Request(
        model="m",
        messages=messages,
        prefill=True,
        logprobs=True,
        top_logprobs=2,
        tools=(Tool(name="get", description="gets"),),
        tool_choice=ToolChoice(mode="tool", name="get", parallel=False),
        response_format=ResponseFormat(kind="json_schema", schema={"type": "object"}, name="out"),
    )
    body = request_body(request, "m")
    assert body["messages"][0]["content"][1] == {
        "type": "image_url",
        "image_url": {"url": "data:image/png;base64,iVBORw=="},
    }
    assert body["messages"][1]["tool_calls"] == [
        {"id": "c1", "type": "function", "function": {"name": "get", "arguments": '{"a":1}'}}
    ]
    assert body["messages"][2] == {"role": "tool", "tool_call_id": "c1", "content": "42"}
    assert body["continue_final_message"] is True and body["add_generation_prompt"] is False
    assert body["tools"][0]["function"]["name"] == "get"
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get"}}
    assert body["parallel_tool_calls"] is False
    assert body["response_format"] == {
        "type": "json_schema",
        "json_schema": {"name": "out", "schema": {"type": "object"}},
    }
    assert body["logprobs"] is True and body["top_logprobs"] == 2


# ---------------------------------------------------------------------------------------------------- streams


@pytest.mark.parametrize("step", [None, 1, 7])
@pytest.mark.parametrize("crlf", [False, True])
def test_text_stream_usage_comes_before_finish(step: int | None, crlf: bool) -> None:
    body = b": ping\n\n" + _sse(
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "Hel"}),
        _chunk({"content": "lo"}),
        _chunk({}, "length"),
        USAGE,
        b"[DONE]",
        crlf=crlf,
    )
    assert _decode(body, step=step) == [
        TextDelta(text="Hel"),
        TextDelta(text="lo"),
        Usage(prompt_tokens=7, completion_tokens=3, cached_tokens=2),
        Finished(reason="length"),
    ]


def test_stop_string_reasoning_and_logprobs() -> None:
    logprobs = {
        "content": [
            {
                "token": "A",
                "logprob": -0.5,
                "bytes": [65],
                "top_logprobs": [{"token": "A", "logprob": -0.5, "bytes": [65]}],
            }
        ]
    }
    body = _sse(
        _chunk({"reasoning_content": "think"}),
        _chunk({"reasoning": " more"}),
        _chunk({"content": "A"}, logprobs=logprobs),
        _chunk({}, "stop", stop_reason="END"),
        b"[DONE]",
    )
    assert _decode(body) == [
        ReasoningDelta(text="think"),
        ReasoningDelta(text=" more"),
        TextDelta(
            text="A",
            logprobs=(
                TokenLogprob(
                    token="A", logprob=-0.5, bytes=(65,), top=(TopLogprob(token="A", logprob=-0.5, bytes=(65,)),)
                ),
            ),
        ),
        Finished(reason="stop_sequence", stop_sequence="END"),
    ]


def test_tool_call_fragments() -> None:
    first = {
        "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "get", "arguments": ""}}]
    }
    more = {"tool_calls": [{"index": 0, "function": {"arguments": '{"a":'}}]}
    body = _sse(_chunk(first), _chunk(more), _chunk({}, "tool_calls"), b"[DONE]")
    assert _decode(body) == [
        ToolCallDelta(index=0, id="call_1", name="get"),
        ToolCallDelta(index=0, arguments='{"a":'),
        Finished(reason="tool_calls"),
    ]


def test_completions_chunks() -> None:
    body = _sse(
        {"object": "text_completion", "choices": [{"index": 0, "text": " there", "finish_reason": None}]},
        {
            "object": "text_completion",
            "choices": [{"index": 0, "text": "", "finish_reason": "stop", "stop_reason": None}],
        },
        b"[DONE]",
    )
    assert _decode(body) == [TextDelta(text=" there"), Finished()]


def test_token_ids_ride_on_the_delta_that_completes_their_text() -> None:
    """vLLM's ``return_token_ids``: a chunk whose text is held back (half a character, a stop string's prefix)
    carries ids with empty content; they go on the next delta, so the deltas' tokens are exactly those sent."""
    body = _sse(
        _chunk({"role": "assistant", "content": ""}),
        _chunk({"content": "He"}, token_ids=[5]),
        _chunk({"content": ""}, token_ids=[6]),
        _chunk({"content": "llo!"}, token_ids=[7, 8]),
        _chunk({"content": ""}, "stop", token_ids=[2]),
        USAGE,
        b"[DONE]",
    )
    events = _decode(body)
    assert [e for e in events if isinstance(e, TextDelta)] == [
        TextDelta(text="He", tokens=(5,)),
        TextDelta(text="llo!", tokens=(6, 7, 8)),
    ]
    assert isinstance(events[-1], Finished) and isinstance(events[-2], Usage)


@pytest.mark.parametrize(
    "error",
    [
        {"error": {"message": "bad", "type": "BadRequestError", "code": 400}},
        {"object": "error", "message": "bad", "type": "BadRequestError", "code": 400},
    ],
)
def test_error_object_in_stream(error: dict) -> None:
    events = _decode(_sse(_chunk({"content": "x"}), error, b"[DONE]"))
    assert events[0] == TextDelta(text="x")
    assert isinstance(events[1], Failed) and events[1].error.kind == "InvalidRequest"
    assert "bad" in events[1].error.message and len(events) == 2


def test_cut_stream_is_backend_unavailable_and_exactly_one_terminal() -> None:
    events = _decode(_sse(_chunk({"content": "x"})) + b'data: {"choi')
    assert len(events) == 2 and isinstance(events[1], Failed)
    assert events[1].error.kind in {"BackendUnavailable", "BackendProtocolError"}
    events = _decode(_sse(_chunk({"content": "x"})))
    assert events[-1] == Failed(error=BackendUnavailable("the upstream closed the stream before finishing").info())
    decoder = StreamDecoder()
    assert decoder.feed(_sse(_chunk({}, "stop"), b"[DONE]", _chunk({"content": "late"}))) == [Finished()]
    assert decoder.done and decoder.close() == []


@pytest.mark.parametrize("reason", ["abort", "error"])
def test_aborted_finish_is_a_failure(reason: str) -> None:
    events = _decode(_sse(_chunk({"content": "x"}), _chunk({}, reason), b"[DONE]"))
    assert events[0] == TextDelta(text="x") and len(events) == 2
    assert events[1].error.kind == "BackendUnavailable" and reason in events[1].error.message


def test_done_without_finish_is_a_protocol_error() -> None:
    events = _decode(_sse(_chunk({"content": "x"}), b"[DONE]"))
    assert events[-1].error.kind == BackendProtocolError.__name__


def test_error_from_response() -> None:
    err = error_from_response(400, b'{"error": {"message": "too long", "type": "BadRequestError", "code": 400}}')
    assert isinstance(err, InvalidRequest) and "too long" in err.message
    assert isinstance(error_from_response(503, b"overloaded"), BackendUnavailable)
    assert isinstance(error_from_response(500, b""), BackendUnavailable)


def test_round_trip_through_the_server_side_encoder() -> None:
    events = [
        ReasoningDelta(text="hm"),
        TextDelta(text="Hi"),
        ToolCallDelta(index=0, id="c", name="f", arguments="{}"),
        Usage(prompt_tokens=3, completion_tokens=2),
        Finished(reason="tool_calls"),
    ]

    async def source():
        for event in events:
            yield event

    async def frames() -> bytes:
        meta = Meta(id="1", model="m", created=0.0)
        return b"".join([f async for f in oai.encode_chat_stream(source(), meta, include_usage=True)])

    decoded = _decode(asyncio.run(frames()))
    assert decoded == events

    async def replay():
        for event in decoded:
            yield event

    response = asyncio.run(collect(replay()))
    assert response.text == "Hi" and response.tool_calls[0].name == "f" and response.usage.prompt_tokens == 3
    assert response.finish == Finished(reason="tool_calls")
