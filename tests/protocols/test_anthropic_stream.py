"""Anthropic streaming as pure functions: named events, block indexes, the SDK's own accumulator (ANT-28..ANT-43)."""

from __future__ import annotations

import anthropic
import msgspec
import pytest
from anthropic.types import Message as SdkMessage

from meshgate.protocols.anthropic import encode_message_response
from meshgate.protocols.model import (
    BackendTimeout,
    Failed,
    Finished,
    KeepAlive,
    NoCapacity,
    TextDelta,
    ToolCallDelta,
    Usage,
    collect,
)
from tests.protocols.test_anthropic import (  # noqa: E402 (shared fixtures)
    EVENT_ADAPTER,
    META,
    TOOL_STREAM,
    encode,
    parsed,
    sdk_stream,
    stream_of,
    usage,
)

# ---------------------------------------------------------------------------------------------------- streams


async def test_ant_28_exact_frames_of_a_short_text_stream():
    frames = await encode(
        [Usage(prompt_tokens=25), TextDelta(text="Hello"), Usage(prompt_tokens=25, completion_tokens=1), Finished()]
    )
    usage_start = '{"input_tokens":25,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":0}'
    usage_end = '{"input_tokens":25,"cache_creation_input_tokens":0,"cache_read_input_tokens":0,"output_tokens":1}'
    assert frames == [
        (
            "event: message_start\r\ndata: "
            '{"type":"message_start","message":{"id":"msg_01abc","type":"message","role":"assistant",'
            '"model":"claude-sonnet-4-5","content":[],"stop_reason":null,"stop_sequence":null,'
            f'"usage":{usage_start}}}}}\r\n\r\n'
        ).encode(),
        b'event: content_block_start\r\ndata: {"type":"content_block_start","index":0,'
        b'"content_block":{"type":"text","text":""}}\r\n\r\n',
        b'event: content_block_delta\r\ndata: {"type":"content_block_delta","index":0,'
        b'"delta":{"type":"text_delta","text":"Hello"}}\r\n\r\n',
        b'event: content_block_stop\r\ndata: {"type":"content_block_stop","index":0}\r\n\r\n',
        (
            'event: message_delta\r\ndata: {"type":"message_delta",'
            f'"delta":{{"stop_reason":"end_turn","stop_sequence":null}},"usage":{usage_end}}}\r\n\r\n'
        ).encode(),
        b'event: message_stop\r\ndata: {"type":"message_stop"}\r\n\r\n',
    ]


async def test_ant_29_30_every_frame_has_an_event_line_and_the_same_type_inside():
    events = parsed(await encode([KeepAlive(), *TOOL_STREAM]))
    assert events
    for name, data in events:
        assert name == data["type"]
        if name != "ping":
            EVENT_ADAPTER.validate_python(data)


async def test_ant_31_34_39_event_order_and_gap_free_sequential_indexes():
    events = parsed(await encode(TOOL_STREAM))
    summary = [
        (name, data.get("index"), (data.get("content_block") or data.get("delta") or {}).get("type"))
        for name, data in events
    ]
    assert summary == [
        ("message_start", None, None),
        ("content_block_start", 0, "thinking"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "thinking_delta"),
        ("content_block_delta", 0, "signature_delta"),
        ("content_block_stop", 0, None),
        ("content_block_start", 1, "text"),
        ("content_block_delta", 1, "text_delta"),
        ("content_block_stop", 1, None),
        ("content_block_start", 2, "tool_use"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_delta", 2, "input_json_delta"),
        ("content_block_stop", 2, None),
        ("content_block_start", 3, "tool_use"),
        ("content_block_delta", 3, "input_json_delta"),
        ("content_block_stop", 3, None),
        ("message_delta", None, None),
        ("message_stop", None, None),
    ]


async def test_ant_32_message_start_is_complete_and_takes_input_tokens_from_the_first_usage():
    (name, data), *_ = parsed(await encode(TOOL_STREAM))
    assert name == "message_start"
    assert data["message"] == {
        "id": "msg_01abc",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": usage(input_tokens=472, output_tokens=0),
    }


async def test_ant_32_without_a_leading_usage_message_delta_supplies_input_tokens():
    frames = await encode([TextDelta(text="Hi"), Usage(prompt_tokens=12, completion_tokens=1), Finished()])
    events = parsed(frames)
    assert events[0][1]["message"]["usage"]["input_tokens"] == 0
    assert events[-2][1]["usage"]["input_tokens"] == 12
    final = sdk_stream(frames).get_final_message()
    assert (final.usage.input_tokens, final.usage.output_tokens) == (12, 1)


async def test_ant_33_keepalive_first_sends_message_start_then_ping():
    events = parsed(await encode([KeepAlive(), Usage(prompt_tokens=9), KeepAlive(), TextDelta(text="a"), Finished()]))
    assert [name for name, _ in events[:3]] == ["message_start", "ping", "ping"]
    assert events[1][1] == {"type": "ping"}
    assert events[0][1]["message"]["usage"]["input_tokens"] == 0
    assert events[-2][1]["usage"]["input_tokens"] == 9


async def test_ant_35_block_start_shapes():
    events = parsed(await encode(TOOL_STREAM))
    starts = [data["content_block"] for name, data in events if name == "content_block_start"]
    assert starts == [
        {"type": "thinking", "thinking": "", "signature": ""},
        {"type": "text", "text": ""},
        {"type": "tool_use", "id": "toolu_01T1x1fJ34qAmk2tNTrN7Up6", "name": "get_weather", "input": {}},
        {"type": "tool_use", "id": "toolu_02", "name": "get_time", "input": {}},
    ]


async def test_ant_37_partial_json_joins_into_the_tool_input_in_the_sdk():
    stream = sdk_stream(await encode(TOOL_STREAM))
    seen = [event.type for event in stream]
    final = stream.get_final_message()
    assert "input_json" in seen
    assert [block.type for block in final.content] == ["thinking", "text", "tool_use", "tool_use"]
    assert final.content[2].input == {"location": "San Francisco, CA"}
    assert final.content[2].id == "toolu_01T1x1fJ34qAmk2tNTrN7Up6"
    assert final.content[3].input == {"tz": "PST"}
    assert final.stop_reason == "tool_use"


async def test_ant_38_signature_delta_comes_just_before_the_thinking_stop():
    events = parsed(await encode(TOOL_STREAM))
    stop = events.index(("content_block_stop", {"type": "content_block_stop", "index": 0}))
    assert events[stop - 1][1]["delta"] == {"type": "signature_delta", "signature": "EqQBCgIYAhIM"}
    thinking = sdk_stream(await encode(TOOL_STREAM)).get_final_message().content[0]
    assert (thinking.thinking, thinking.signature) == ("The user wants weather; call the tool.", "EqQBCgIYAhIM")


async def test_ant_40_41_message_delta_has_running_output_total_then_message_stop():
    events = parsed(await encode(TOOL_STREAM))
    assert events[-2] == (
        "message_delta",
        {
            "type": "message_delta",
            "delta": {"stop_reason": "tool_use", "stop_sequence": None},
            "usage": usage(input_tokens=472, output_tokens=89),
        },
    )
    assert events[-1] == ("message_stop", {"type": "message_stop"})


async def test_ant_25_stream_reports_the_matched_stop_sequence():
    stream = sdk_stream(await encode([TextDelta(text="Once"), Finished(reason="stop_sequence", stop_sequence="END")]))
    final = stream.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == ("stop_sequence", "END")
    assert stream.get_final_text() == "Once"


async def test_ant_42_failure_mid_stream_is_an_error_event_the_sdk_raises():
    failure = Failed(error=NoCapacity("GPUs busy").info())
    frames = await encode([Usage(prompt_tokens=3), TextDelta(text="partial"), failure])
    events = parsed(frames)
    assert events[-1] == ("error", {"type": "error", "error": {"type": "overloaded_error", "message": "GPUs busy"}})
    assert "message_stop" not in [name for name, _ in events]
    with pytest.raises(anthropic.APIStatusError) as caught:
        sdk_stream(frames).get_final_message()
    assert caught.value.status_code == 200
    assert caught.value.body == {"type": "error", "error": {"type": "overloaded_error", "message": "GPUs busy"}}


async def test_ant_42_failure_as_the_first_event_is_only_an_error_event():
    events = parsed(await encode([Failed(error=BackendTimeout("runner timed out").info())]))
    assert events == [("error", {"type": "error", "error": {"type": "timeout_error", "message": "runner timed out"}})]


async def test_ant_42_a_stream_that_ends_without_finishing_gets_an_error_event():
    events = parsed(await encode([TextDelta(text="a")]))
    assert events[-1][0] == "error"
    assert events[-1][1]["error"]["type"] == "api_error"


async def test_ant_42_nothing_after_the_terminal_event():
    events = parsed(await encode([TextDelta(text="a"), Finished(), TextDelta(text="late")]))
    assert events[-1][0] == "message_stop"


async def test_ant_43_tool_only_stream_has_a_final_message():
    call = ToolCallDelta(index=0, id="toolu_9", name="get_weather", arguments='{"location": "Paris"}')
    events = [Usage(prompt_tokens=5), call, Finished()]
    final = sdk_stream(await encode(events)).get_final_message()
    assert [(b.type, b.input) for b in final.content] == [("tool_use", {"location": "Paris"})]
    assert final.stop_reason == "tool_use"


async def test_ant_39_interleaved_tool_fragments_still_land_on_their_own_block():
    events = [
        ToolCallDelta(index=0, id="a", name="f", arguments='{"x":'),
        ToolCallDelta(index=1, id="b", name="g", arguments='{"y": 2}'),
        ToolCallDelta(index=0, arguments=" 1}"),
        Finished(reason="tool_calls"),
    ]
    final = sdk_stream(await encode(events)).get_final_message()
    assert [(b.id, b.input) for b in final.content] == [("toolu_a", {"x": 1}), ("toolu_b", {"y": 2})]


async def test_stream_and_collect_tell_the_same_story():
    final = sdk_stream(await encode(TOOL_STREAM)).get_final_message()
    body = msgspec.json.decode(encode_message_response(await collect(stream_of(TOOL_STREAM)), META))
    assert final.model_dump(exclude_none=True) == SdkMessage.model_validate(body).model_dump(exclude_none=True)
