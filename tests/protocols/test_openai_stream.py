"""OpenAI streaming as pure functions: SSE framing, chunk shapes, the SDK's own parsers (OAI-40..OAI-56, OAI-62)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletionChunk

from meshgate.protocols import openai_completions as oac
from meshgate.protocols.model import (
    BackendTimeout,
    BackendUnavailable,
    Failed,
    Finished,
    KeepAlive,
    ReasoningDelta,
    TextDelta,
    ToolCallDelta,
    Usage,
)
from tests.protocols.openai_wire import (
    META,
    accumulate,
    chat_stream,
    feed,
    payloads,
    sdk_stream,
)

# ---------------------------------------------------------------------------------------------------- streams


async def test_oai_40_41_data_only_frames_ending_in_done():
    events = [Usage(prompt_tokens=3), TextDelta(text="Hi"), Usage(prompt_tokens=3, completion_tokens=1), Finished()]
    raw = await chat_stream(events)
    head = '{"id":"chatcmpl-abc123","object":"chat.completion.chunk","created":1741569952,"model":"gemma-3-270m",'
    assert raw == (
        b"data: " + head.encode()
        + b'"choices":[{"index":0,"delta":{"role":"assistant","content":"Hi"},'
        + b'"logprobs":null,"finish_reason":null}]}\r\n\r\n'
        + b"data: " + head.encode()
        + b'"choices":[{"index":0,"delta":{},"logprobs":null,"finish_reason":"stop"}]}\r\n\r\n'
        + b"data: [DONE]\r\n\r\n"
    )  # fmt: skip
    assert b"event:" not in raw


async def test_oai_44_keepalive_is_an_sse_comment_the_sdk_skips():
    raw = await chat_stream([KeepAlive(), TextDelta(text="Hi"), KeepAlive(), Finished()])
    assert raw.startswith(b": keep-alive\r\n\r\ndata: ")
    assert [c.choices[0].delta.content for c in sdk_stream(raw)] == ["Hi", None]


async def test_oai_45_46_every_chunk_shares_id_created_model_and_object():
    call = ToolCallDelta(index=0, id="call_1", name="f", arguments="{}")
    events = [TextDelta(text="a"), ReasoningDelta(text="r"), call, Finished()]
    chunks = [p for p in payloads(await chat_stream(events, include_usage=True)) if p != "[DONE]"]
    assert len(chunks) == 5
    assert all(ChatCompletionChunk.model_validate(c).object == "chat.completion.chunk" for c in chunks)
    assert {(c["id"], c["object"], c["created"], c["model"]) for c in chunks} == {
        ("chatcmpl-abc123", "chat.completion.chunk", 1741569952, "gemma-3-270m")
    }


async def test_oai_47_role_only_in_first_delta():
    raw = await chat_stream([TextDelta(text="Hel"), TextDelta(text="lo"), Finished()])
    deltas = [p["choices"][0]["delta"] for p in payloads(raw)[:-1]]
    assert deltas == [{"role": "assistant", "content": "Hel"}, {"content": "lo"}, {}]
    final = accumulate(sdk_stream(raw))
    assert final.choices[0].message.role == "assistant"
    assert final.choices[0].message.content == "Hello"


async def test_oai_47_empty_answer_still_sends_the_role_once():
    raw = await chat_stream([Usage(prompt_tokens=3), Finished()])
    deltas = [p["choices"][0]["delta"] for p in payloads(raw)[:-1]]
    assert deltas == [{"role": "assistant", "content": ""}, {}]
    assert accumulate(sdk_stream(raw)).choices[0].message.role == "assistant"


async def test_oai_48_49_tool_call_head_only_in_first_delta_of_each_index():
    events = [
        ToolCallDelta(index=0, id="call_abc", name="get_current_weather", arguments='{"location": '),
        ToolCallDelta(index=0, arguments='"Boston, MA"}'),
        ToolCallDelta(index=1, id="call_def", name="get_current_weather"),
        ToolCallDelta(index=1, arguments='{"location": "Paris"}'),
        Finished(),
    ]
    raw = await chat_stream(events)
    calls = [p["choices"][0]["delta"].get("tool_calls") for p in payloads(raw)[:-1]]
    assert calls == [
        [
            {
                "index": 0,
                "id": "call_abc",
                "type": "function",
                "function": {"name": "get_current_weather", "arguments": '{"location": '},
            }
        ],
        [{"index": 0, "function": {"arguments": '"Boston, MA"}'}}],
        [
            {
                "index": 1,
                "id": "call_def",
                "type": "function",
                "function": {"name": "get_current_weather", "arguments": ""},
            }
        ],
        [{"index": 1, "function": {"arguments": '{"location": "Paris"}'}}],
        None,
    ]
    final = accumulate(sdk_stream(raw))
    assert final.choices[0].finish_reason == "tool_calls"
    tool_calls = final.choices[0].message.tool_calls
    assert [(c.id, c.function.name) for c in tool_calls] == [
        ("call_abc", "get_current_weather"),
        ("call_def", "get_current_weather"),
    ]
    assert [json.loads(c.function.arguments) for c in tool_calls] == [{"location": "Boston, MA"}, {"location": "Paris"}]


async def test_oai_48_missing_backend_tool_call_id_gets_one():
    raw = await chat_stream([ToolCallDelta(index=0, name="now", arguments="{}"), Finished()])
    assert payloads(raw)[0]["choices"][0]["delta"]["tool_calls"][0]["id"] == "call_0"


async def test_oai_51_final_chunk_has_finish_reason_and_empty_delta():
    raw = await chat_stream([TextDelta(text="a b c"), Finished(reason="length")])
    assert payloads(raw)[-2]["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert payloads(raw)[-1] == "[DONE]"


async def test_oai_52_53_usage_chunk_last_with_empty_choices():
    final_usage = Usage(prompt_tokens=9, completion_tokens=2, cached_tokens=4)
    events = [Usage(prompt_tokens=9), TextDelta(text="Hi"), final_usage, Finished()]
    parsed = payloads(await chat_stream(events, include_usage=True))
    assert [("usage" in p) if p != "[DONE]" else p for p in parsed] == [False, False, True, "[DONE]"]
    assert parsed[2]["choices"] == []
    assert parsed[2]["usage"] == {
        "prompt_tokens": 9,
        "completion_tokens": 2,
        "total_tokens": 11,
        "prompt_tokens_details": {"cached_tokens": 4},
    }
    chunks = sdk_stream(await chat_stream(events, include_usage=True))
    assert chunks[-1].usage.total_tokens == 11
    assert accumulate(chunks).usage.completion_tokens == 2


async def test_oai_52_no_usage_chunk_unless_asked():
    raw = await chat_stream([Usage(prompt_tokens=9), TextDelta(text="Hi"), Finished()])
    assert all("usage" not in p for p in payloads(raw)[:-1])


async def test_oai_reasoning_streams_as_reasoning_content():
    raw = await chat_stream([ReasoningDelta(text="think"), TextDelta(text="done"), Finished()])
    deltas = [p["choices"][0]["delta"] for p in payloads(raw)[:-1]]
    assert deltas == [{"role": "assistant", "reasoning_content": "think"}, {"content": "done"}, {}]


async def test_oai_62_failed_mid_stream_is_an_error_frame_then_done():
    events = [TextDelta(text="Hel"), Failed(error=BackendUnavailable("runner on node-2 went away").info())]
    raw = await chat_stream(events, include_usage=True)
    parsed = payloads(raw)
    assert parsed[1:] == [
        {
            "error": {
                "message": "runner on node-2 went away",
                "type": "api_error",
                "param": None,
                "code": "backend_unavailable",
            }
        },
        "[DONE]",
    ]
    with pytest.raises(openai.APIError) as exc:
        sdk_stream(raw)
    assert type(exc.value) is openai.APIError
    assert exc.value.message == "runner on node-2 went away"


async def test_oai_62_stream_without_terminal_event_ends_in_an_error_frame():
    parsed = payloads(await chat_stream([TextDelta(text="Hel")]))
    assert parsed[-2]["error"]["type"] == "api_error"
    assert parsed[-2]["error"]["code"] == "backend_protocol_error"
    assert parsed[-1] == "[DONE]"


async def test_oai_56_legacy_completion_stream():
    events = [
        Usage(prompt_tokens=5),
        TextDelta(text="This is"),
        KeepAlive(),
        TextDelta(text=" a test."),
        Usage(prompt_tokens=5, completion_tokens=7),
        Finished(reason="length"),
    ]
    frames = [f async for f in oac.encode_completion_stream(feed(events), META, include_usage=True)]
    assert frames[1] == b": keep-alive\r\n\r\n"
    parsed = payloads(b"".join(frames))
    assert [p["choices"] for p in parsed[:-1]] == [
        [{"index": 0, "text": "This is", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": " a test.", "logprobs": None, "finish_reason": None}],
        [{"index": 0, "text": "", "logprobs": None, "finish_reason": "length"}],
        [],
    ]
    assert {(p["id"], p["object"]) for p in parsed[:-1]} == {("cmpl-abc123", "text_completion")}
    assert parsed[3]["usage"] == {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
    assert parsed[-1] == "[DONE]"
    assert Completion.model_validate(parsed[2]).choices[0].finish_reason == "length"
    assert "".join(c.choices[0].text for c in sdk_stream(b"".join(frames), Completion)[:2]) == "This is a test."


async def test_oai_62_legacy_completion_stream_error_frame():
    events = feed([Failed(error=BackendTimeout("too slow").info())])
    frames = [f async for f in oac.encode_completion_stream(events, META, include_usage=False)]
    assert payloads(b"".join(frames)) == [
        {"error": {"message": "too slow", "type": "api_error", "param": None, "code": "backend_timeout"}},
        "[DONE]",
    ]
