"""Forced tool calls in the three codecs as pure functions (issue 18): which requests force a tool
(``Request.forced_tool``), and a call cut short by the output limit rendered as a call with the length finish
(OpenAI ``finish_reason: "length"``, Anthropic ``stop_reason: "max_tokens"``, Ollama ``done_reason: "length"``),
read back by each official client.
"""

from __future__ import annotations

import json
from typing import Any

import msgspec
import ollama
import pytest
from anthropic.types import Message as SdkMessage
from openai.types.chat import ChatCompletion

from meshgate.protocols import anthropic as ant
from meshgate.protocols import ollama as oll
from meshgate.protocols import openai as oai
from meshgate.protocols.formats import json_object_prefix
from meshgate.protocols.model import (
    Finished,
    InvalidRequest,
    Meta,
    Response,
    ToolCall,
    ToolCallDelta,
    Usage,
    collect,
    decode_body,
)
from tests.protocols.test_anthropic import encode as ant_frames
from tests.protocols.test_anthropic import sdk_stream as ant_sdk_stream
from tests.protocols.test_anthropic import stream_of

META = Meta(id="abc", model="m", created=1_700_000_000.0)
PARAMS = {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}}}
OAI_TOOL = {"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}
OAI_CLOCK = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}}
ANT_TOOL = {"name": "get_weather", "input_schema": PARAMS}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
CUT = [
    Usage(prompt_tokens=20, completion_tokens=5),
    ToolCallDelta(index=0, id="call_1", name="get_weather"),
    ToolCallDelta(index=0, arguments='{"city":"Paris","un'),
    Finished(reason="length"),
]


def body(**fields: Any) -> bytes:
    return json.dumps(fields).encode()


# ------------------------------------------------------------------------------------------------- requests


@pytest.mark.parametrize(
    ("tools", "choice", "forced"),
    [
        ([OAI_TOOL], {"type": "function", "function": {"name": "get_weather"}}, "get_weather"),
        ([OAI_TOOL, OAI_CLOCK], {"type": "function", "function": {"name": "get_time"}}, "get_time"),
        ([OAI_TOOL], "required", "get_weather"),
        ([OAI_TOOL, OAI_CLOCK], "required", None),
        ([OAI_TOOL], "auto", None),
    ],
)
def test_openai_choices_that_force_one_tool(tools, choice, forced):
    wire = decode_body(body(model="m", messages=ASK, tools=tools, tool_choice=choice), oai.ChatRequest)
    request = oai.chat_to_internal(wire)
    assert (request.forced_tool.name if request.forced_tool else None) == forced
    assert request.calls_forced == (choice != "auto")


@pytest.mark.parametrize(
    ("tools", "choice", "forced"),
    [
        ([ANT_TOOL], {"type": "tool", "name": "get_weather"}, "get_weather"),
        ([ANT_TOOL], {"type": "any"}, "get_weather"),
        ([ANT_TOOL, {"name": "get_time", "input_schema": {"type": "object"}}], {"type": "any"}, None),
        ([ANT_TOOL], {"type": "auto"}, None),
    ],
)
def test_anthropic_choices_that_force_one_tool(tools, choice, forced):
    wire = decode_body(
        body(model="m", max_tokens=16, messages=ASK, tools=tools, tool_choice=choice), ant.MessagesRequest
    )
    request = ant.messages_to_internal(wire)
    assert (request.forced_tool.name if request.forced_tool else None) == forced


def test_anthropic_tool_choice_naming_no_offered_tool_is_invalid():
    wire = decode_body(
        body(model="m", max_tokens=16, messages=ASK, tools=[ANT_TOOL], tool_choice={"type": "tool", "name": "nope"}),
        ant.MessagesRequest,
    )
    with pytest.raises(InvalidRequest, match="'nope', which is not among tools") as caught:
        ant.messages_to_internal(wire)
    assert caught.value.param == "tool_choice.name"


@pytest.mark.parametrize("fmt", ["json", PARAMS])
def test_ollama_tools_with_a_format_force_a_call(fmt):
    wire = decode_body(body(model="m", messages=ASK, tools=[OAI_TOOL], format=fmt), oll.ChatRequest)
    request = oll.chat_to_internal(wire)
    assert request.tool_choice.mode == "required" and request.forced_tool.name == "get_weather"
    assert request.response_format.kind == "text"  # the arguments are held to the tool's parameters instead


def test_ollama_format_without_tools_and_tools_without_format_are_unchanged():
    only_format = oll.chat_to_internal(decode_body(body(model="m", messages=ASK, format="json"), oll.ChatRequest))
    assert only_format.response_format.kind == "json_object" and not only_format.calls_forced
    only_tools = oll.chat_to_internal(decode_body(body(model="m", messages=ASK, tools=[OAI_TOOL]), oll.ChatRequest))
    assert only_tools.tool_choice.mode == "auto" and only_tools.forced_tool is None


# ------------------------------------------------------------------------------------------------- answers


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"city":"Paris","un', {"city": "Paris"}),
        ('{"city":"Pa', {}),
        ('{"a":[1,2', {"a": [1, 2]}),
        ('{"a":1}', {"a": 1}),
        ("", {}),
        ("[1]", {}),
        ('{"a" "b"}', {}),
    ],
)
def test_json_object_prefix(text, expected):
    assert json_object_prefix(text) == expected


async def test_openai_call_cut_short_is_a_call_with_finish_length():
    response = await collect(stream_of(CUT))
    completion = ChatCompletion.model_validate(msgspec.json.decode(oai.encode_chat_response(response, META)))
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    assert [(c.function.name, c.function.arguments) for c in choice.message.tool_calls] == [
        ("get_weather", '{"city":"Paris","un')
    ]


async def test_openai_stream_of_a_cut_call_has_tool_call_deltas_and_finish_length():
    from tests.protocols.openai_wire import chat_stream, sdk_stream

    chunks = sdk_stream(await chat_stream(CUT))
    calls = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    assert (calls[0].id, calls[0].function.name) == ("call_1", "get_weather")
    assert "".join(d.function.arguments or "" for d in calls) == '{"city":"Paris","un'
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["length"]


async def test_anthropic_call_cut_short_is_a_tool_use_with_max_tokens():
    response = await collect(stream_of(CUT))
    message = SdkMessage.model_validate(msgspec.json.decode(ant.encode_message_response(response, META)))
    assert message.stop_reason == "max_tokens"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather" and use.input == {"city": "Paris"}


async def test_anthropic_stream_of_a_cut_call_reads_like_the_plain_reply():
    frames = await ant_frames(CUT)
    stream = ant_sdk_stream(frames)
    events = list(stream)
    message = stream.get_final_message()
    assert [e.content_block.type for e in events if e.type == "content_block_start"] == ["tool_use"]
    assert [e.delta.partial_json for e in events if e.type == "content_block_delta"] == ['{"city":"Paris","un']
    assert message.stop_reason == "max_tokens" and message.content[0].input == {"city": "Paris"}


async def test_ollama_call_cut_short_is_a_call_with_done_reason_length():
    response = Response(
        tool_calls=(ToolCall(id="call_1", name="get_weather", arguments='{"city":"Paris","un'),),
        finish=Finished(reason="length"),
    )
    chat = ollama.ChatResponse.model_validate(msgspec.json.decode(oll.encode_chat_response(response, META)))
    assert chat.done_reason == "length" and chat.message.content == ""
    [call] = chat.message.tool_calls
    assert call.function.name == "get_weather" and call.function.arguments == {"city": "Paris"}
    lines = [line async for line in oll.encode_chat_stream(stream_of(CUT), META)]
    streamed = [ollama.ChatResponse.model_validate_json(line) for line in lines]
    assert [c.message.tool_calls[0].function.arguments for c in streamed if c.message.tool_calls] == [{"city": "Paris"}]
    assert streamed[-1].done_reason == "length"
