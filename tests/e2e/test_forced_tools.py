"""Forced tool calls from the real Gemma 3 270M through the openai, anthropic and ollama clients (issue 18).

When the client forces a tool (OpenAI named ``tool_choice`` or ``required``; Anthropic ``tool`` or ``any``; Ollama
``tools`` with ``format``) the answer is a tool call whatever happens: the model writes only the arguments (or,
among several tools, the name and then the arguments) as compact JSON under the tool's schema, and a call cut
short by ``max_tokens`` still comes back as a call, with the partial arguments and the length finish reason, as
the reference servers do. Also ``HEAD`` on the Ollama probe routes (``/api/version``, ``/api/tags``).
"""

from __future__ import annotations

import json

import httpx
import pytest

from tests.conftest import MODEL

ASK = [{"role": "user", "content": "What is the weather in Paris? Use the get_weather tool."}]
PARAMS = {
    "type": "object",
    "properties": {"location": {"type": "string"}, "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
    "required": ["location", "unit"],
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Current weather.", "parameters": PARAMS},
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ANT_WEATHER = {"name": "get_weather", "description": "Current weather.", "input_schema": PARAMS}
NAMED = {"type": "function", "function": {"name": "get_weather"}}
T0 = {"temperature": 0}
CUT = 5
"""An output limit that cuts the arguments short (``{"location":"Paris","unit":"celsius"}`` takes about 12)."""


def is_json_prefix(text: str) -> bool:
    """Whether ``text`` is the start of some JSON object (closing its open strings and brackets makes it parse)."""
    closers, in_string, escaped = [], False, False
    for c in text:
        if in_string:
            escaped, in_string = (not escaped and c == "\\"), in_string and (escaped or c != '"')
        elif c == '"':
            in_string = True
        elif c in "{[":
            closers.append("}" if c == "{" else "]")
        elif c in "}]":
            closers.pop()
    tail = text + ('"' if in_string else "")
    for suffix in ("", "null", '"":null', ":null"):
        try:
            json.loads(tail.rstrip(",") + suffix + "".join(reversed(closers)))
            return text.startswith("{")
        except ValueError:
            continue
    return False


def check_arguments(arguments: dict) -> None:
    assert set(arguments) == {"location", "unit"}
    assert isinstance(arguments["location"], str) and arguments["unit"] in ("celsius", "fahrenheit")


def test_is_json_prefix():
    assert all(is_json_prefix(t) for t in ('{"location":"Par', '{"a":', '{"a":[1,', "{", '{"u":"x\\"y'))
    assert not any(is_json_prefix(t) for t in ('{"a":}', "nope", '{"a" "b"'))


# ------------------------------------------------------------------------------------------------- openai


def test_openai_named_call_cut_short_is_a_call_with_finish_length(oai):
    completion = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=CUT, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    assert is_json_prefix(call.function.arguments) and not call.function.arguments.startswith("{ ")
    assert completion.usage.completion_tokens == CUT


def test_openai_issue_18_repro_with_16_tokens_is_a_call(oai):
    """The issue's request: 16 tokens held the call's start and answered text; the arguments alone fit."""
    completion = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=16, temperature=0
    )
    choice = completion.choices[0]
    [call] = choice.message.tool_calls
    assert choice.message.content is None and call.function.name == "get_weather"
    if choice.finish_reason == "length":
        assert is_json_prefix(call.function.arguments)
    else:
        assert choice.finish_reason == "tool_calls"
        check_arguments(json.loads(call.function.arguments))


def test_openai_named_call_has_valid_compact_arguments(oai):
    completion = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER], tool_choice=NAMED, max_tokens=200, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    arguments = json.loads(call.function.arguments)
    check_arguments(arguments)
    assert call.function.arguments == json.dumps(arguments, separators=(",", ":"), ensure_ascii=False)


def _stream(oai, **kw):
    chunks = list(oai.chat.completions.create(model=MODEL, messages=ASK, stream=True, temperature=0, **kw))
    deltas = [d for c in chunks if c.choices for d in c.choices[0].delta.tool_calls or ()]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return deltas, finish, text


def test_openai_streamed_call_cut_short_sends_tool_call_deltas(oai):
    deltas, finish, text = _stream(oai, tools=[WEATHER], tool_choice=NAMED, max_tokens=CUT)
    assert finish == ["length"] and text == ""
    assert deltas[0].id.startswith("call_") and deltas[0].function.name == "get_weather"
    assert all(d.id is None and d.function.name is None for d in deltas[1:]) and len(deltas) > 2
    assert is_json_prefix("".join(d.function.arguments for d in deltas))


def test_openai_streamed_required_call_with_one_tool_is_whole(oai):
    deltas, finish, _ = _stream(oai, tools=[WEATHER], tool_choice="required", max_tokens=200)
    assert finish == ["tool_calls"] and deltas[0].function.name == "get_weather"
    check_arguments(json.loads("".join(d.function.arguments for d in deltas)))


def test_openai_required_among_two_tools_cut_short_is_still_a_call(oai):
    completion = oai.chat.completions.create(
        model=MODEL, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=12, temperature=0
    )
    choice = completion.choices[0]
    assert choice.finish_reason == "length"
    [call] = choice.message.tool_calls
    assert call.function.name in ("get_weather", "get_time") and is_json_prefix(call.function.arguments or "{")


def test_openai_required_among_two_tools_streams_the_name_first(oai):
    deltas, finish, _ = _stream(oai, tools=[WEATHER, CLOCK], tool_choice="required", max_tokens=200)
    assert finish == ["tool_calls"] and deltas[0].function.name in ("get_weather", "get_time")
    arguments = json.loads("".join(d.function.arguments for d in deltas))
    if deltas[0].function.name == "get_weather":
        check_arguments(arguments)
    else:
        assert set(arguments) == {"timezone"}


# ------------------------------------------------------------------------------------------------- anthropic


def _ant(ant, max_tokens: int, **kw):
    return ant.messages.create(
        model=MODEL, max_tokens=max_tokens, extra_body=T0, tools=[ANT_WEATHER], messages=ASK, **kw
    )


def test_anthropic_tool_choice_tool_cut_short_is_a_tool_use_with_max_tokens(ant):
    message = _ant(ant, CUT, tool_choice={"type": "tool", "name": "get_weather"})
    assert message.stop_reason == "max_tokens"
    [use] = [b for b in message.content if b.type == "tool_use"]
    assert use.name == "get_weather" and use.id and isinstance(use.input, dict)
    assert set(use.input) <= {"location", "unit"}
    assert not [b for b in message.content if b.type == "text"]


def test_anthropic_tool_choice_any_with_one_tool_has_schema_valid_input(ant):
    message = _ant(ant, 200, tool_choice={"type": "any"})
    assert message.stop_reason == "tool_use"
    [use] = message.content
    assert use.type == "tool_use" and use.name == "get_weather"
    check_arguments(use.input)


def test_anthropic_streamed_forced_call_cut_short(ant):
    with ant.messages.stream(
        model=MODEL,
        max_tokens=CUT,
        extra_body=T0,
        tools=[ANT_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ASK,
    ) as stream:
        events = list(stream)
        message = stream.get_final_message()
    starts = [e for e in events if e.type == "content_block_start"]
    assert [s.content_block.type for s in starts] == ["tool_use"] and starts[0].content_block.name == "get_weather"
    partial = "".join(e.delta.partial_json for e in events if e.type == "content_block_delta")
    assert is_json_prefix(partial) and len(partial) > 5
    assert message.stop_reason == "max_tokens" and message.content[0].type == "tool_use"


def test_anthropic_streamed_forced_call_is_whole(ant):
    with ant.messages.stream(
        model=MODEL,
        max_tokens=200,
        extra_body=T0,
        tools=[ANT_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=ASK,
    ) as stream:
        message = stream.get_final_message()
    assert message.stop_reason == "tool_use"
    check_arguments(message.content[0].input)


def test_anthropic_tool_choice_naming_an_unknown_tool_is_400(ant):
    import anthropic

    with pytest.raises(anthropic.BadRequestError, match="not among tools"):
        _ant(ant, 16, tool_choice={"type": "tool", "name": "nope"})


# ------------------------------------------------------------------------------------------------- ollama


def test_ollama_tools_with_format_cut_short_is_a_call_with_done_reason_length(oll):
    response = oll.chat(
        model=MODEL, messages=ASK, tools=[WEATHER], format="json", options={"temperature": 0, "num_predict": CUT}
    )
    assert response.done_reason == "length" and response.message.content == ""
    [call] = response.message.tool_calls
    assert call.function.name == "get_weather" and set(call.function.arguments) <= {"location", "unit"}


def test_ollama_tools_with_format_gives_a_whole_call(oll):
    response = oll.chat(model=MODEL, messages=ASK, tools=[WEATHER], format=PARAMS, options={"temperature": 0})
    assert response.done_reason == "stop"
    [call] = response.message.tool_calls
    assert call.function.name == "get_weather"
    check_arguments(dict(call.function.arguments))


def test_ollama_streamed_forced_call_comes_whole(oll):
    chunks = list(
        oll.chat(
            model=MODEL,
            messages=ASK,
            tools=[WEATHER],
            format="json",
            stream=True,
            options={"temperature": 0, "num_predict": 200},
        )
    )
    calls = [c for chunk in chunks for c in chunk.message.tool_calls or ()]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    check_arguments(dict(calls[0].function.arguments))
    assert chunks[-1].done and chunks[-1].done_reason == "stop"


# ------------------------------------------------------------------------------------------------- HEAD


@pytest.mark.parametrize("path", ["/api/version", "/api/tags", "/"])
def test_ollama_probe_routes_answer_head_like_get(real_server, path):
    get = httpx.get(real_server.url + path)
    head = httpx.head(real_server.url + path)
    assert (get.status_code, head.status_code) == (200, 200)
    assert head.content == b""
    assert head.headers["content-type"] == get.headers["content-type"]
    assert head.headers["content-length"] == str(len(get.content))
