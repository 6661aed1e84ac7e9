"""Forced tool calls in the llama.cpp backend as plain functions (issue 18): which tool a request forces, the
call prefix and schema the model is held to, and ``CallGate`` streaming a forced call as compact tool-call deltas
whether or not the output limit cuts it short.
"""

from __future__ import annotations

import json

import pytest

from meshgate.backends.llama_cpp.tools import CallGate, call_prefix, call_schema, forced_schema
from meshgate.protocols.model import (
    Finished,
    Message,
    Request,
    TextDelta,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCallDelta,
    ToolChoice,
)
from tests.llama.test_grammar import takes

WEATHER = Tool(
    name="get_weather",
    parameters={
        "type": "object",
        "properties": {"city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
)
CLOCK = Tool(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}})
GAUGE = Tool(name="get_wind", parameters={"type": "object", "properties": {}})  # shares "get_w" with WEATHER
ASK = (Message(role="user", parts=(TextPart(text="Weather in Paris?"),)),)


def request(mode: str, name: str | None = None, tools=(WEATHER, CLOCK), **kw) -> Request:
    return Request(model="m", messages=ASK, tools=tools, tool_choice=ToolChoice(mode=mode, name=name), **kw)


def feed_all(gate: CallGate, pieces: list[str]) -> list:
    return [event for piece in pieces for event in gate.feed(piece)]


def joined(events: list) -> tuple[str | None, str]:
    calls = [e for e in events if isinstance(e, ToolCallDelta)]
    return calls[0].name if calls else None, "".join(c.arguments for c in calls)


# ------------------------------------------------------------------------------------------------- which tool


@pytest.mark.parametrize(
    ("mode", "name", "tools", "forced"),
    [
        ("tool", "get_time", (WEATHER, CLOCK), CLOCK),
        ("required", None, (WEATHER,), WEATHER),
        ("required", None, (WEATHER, CLOCK), None),
        ("auto", None, (WEATHER,), None),
        ("none", None, (WEATHER,), None),
        ("required", None, (), None),
    ],
)
def test_forced_tool_is_the_named_or_the_only_required_tool(mode, name, tools, forced):
    req = request(mode, name, tools=tools)
    assert req.forced_tool == forced
    assert req.calls_forced == (mode in ("tool", "required") and bool(tools))


def test_call_prefix_starts_the_call_of_the_forced_tool_only():
    assert call_prefix(request("tool", "get_time")) == '{"name": "get_time", "arguments": '
    assert call_prefix(request("required", tools=(WEATHER,))) == '{"name": "get_weather", "arguments": '
    assert call_prefix(request("required")) == call_prefix(request("auto")) == call_prefix(request("none")) == ""


def test_forced_schema_is_the_tools_parameters_with_their_defs_at_the_root():
    tool = Tool(
        name="put",
        parameters={"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}},
    )
    schema = forced_schema(request("tool", "put", tools=(WEATHER, tool)))
    assert schema == {"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}}
    assert forced_schema(request("required")) == call_schema(request("required"))


def test_forced_grammars_take_a_call_and_refuse_another_tool(grammars):
    named, required = request("tool", "get_weather"), request("required")
    assert takes(grammars, forced_schema(named), '{"city": "Paris", "unit": "celsius"}')
    assert not takes(grammars, forced_schema(named), '{"city": "Paris", "unit": "kelvin"}')
    assert takes(grammars, forced_schema(required), '{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert not takes(grammars, forced_schema(required), '{"name": "get_wind", "arguments": {}}')


# ------------------------------------------------------------------------------------------------- gate


def test_named_call_streams_the_head_then_argument_fragments():
    gate = CallGate(request("tool", "get_weather"))
    events = feed_all(gate, ['{"', "city", '":"', "Paris", '"}'])
    head, *fragments = events
    assert isinstance(head, ToolCallDelta) and head.name == "get_weather" and head.id.startswith("call_")
    assert head.arguments == "" and all(f.id is None and f.name is None for f in fragments)
    assert "".join(f.arguments for f in fragments) == '{"city":"Paris"}' and gate.done
    rest, finish = gate.close(Finished(reason="stop"))
    assert rest == [] and finish == Finished(reason="tool_calls")


def test_arguments_go_out_compact_with_the_whitespace_inside_strings_kept():
    gate = CallGate(request("tool", "get_weather"))
    events = feed_all(gate, ['{"', "city", '": "', "New York", ' \\"', 'NY\\" ', '",', ' "unit', '": "c', '" }'])
    assert joined(events) == ("get_weather", '{"city":"New York \\"NY\\" ","unit":"c"}')
    assert json.loads(joined(events)[1]) == {"city": 'New York "NY" ', "unit": "c"} and gate.done


def test_call_cut_short_is_still_a_call_with_the_length_finish():
    gate = CallGate(request("required", tools=(WEATHER,), logprobs=True))
    events = [*gate.feed('{"city":"Pa', (TokenLogprob(token='{"', logprob=-1.0),))]
    assert not gate.done
    rest, finish = gate.close(Finished(reason="length"))
    assert finish == Finished(reason="length")
    assert joined(events + rest) == ("get_weather", '{"city":"Pa')
    assert not any(isinstance(e, TextDelta) for e in events + rest)  # a call carries no logprobs


def test_cut_short_before_any_argument_is_a_call_with_empty_arguments():
    gate = CallGate(request("tool", "get_time"))
    events, finish = gate.close(Finished(reason="length"))
    assert joined(events) == ("get_time", "") and finish.reason == "length"


def test_required_call_written_with_spaces_is_read_compact():
    gate = CallGate(request("required"))
    events = feed_all(gate, ['{"name": "get_time", ', '"arguments": {"tz": "UTC"}', " }"])
    rest, finish = gate.close(Finished(reason="stop"))
    assert joined(events + rest) == ("get_time", '{"tz":"UTC"}') and finish.reason == "tool_calls"


def test_required_among_tools_sends_the_head_once_the_name_is_written():
    gate = CallGate(request("required"))
    assert feed_all(gate, ['{"', "name", '":"', "get", "_"]) == []
    events = feed_all(gate, ["time", '","', "arguments", '":{"', "tz", '":"', "UTC", '"}'])
    assert joined(events) == ("get_time", '{"tz":"UTC"')  # the last "}" may be the call's own
    assert not gate.done
    events += gate.feed("}")
    assert gate.done
    rest, finish = gate.close(Finished(reason="stop"))
    assert joined(events + rest) == ("get_time", '{"tz":"UTC"}') and finish.reason == "tool_calls"


def test_required_nested_braces_are_not_taken_for_the_call_end():
    tool = Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "object"}}})
    gate = CallGate(request("required", tools=(tool, CLOCK)))
    events = feed_all(gate, ['{"name":"f","arguments":{"a":{}', "}"])
    assert joined(events) == ("f", '{"a":{}') and not gate.done
    events += gate.feed("}")
    rest, finish = gate.close(Finished(reason="stop"))
    assert joined(events + rest)[1] == '{"a":{}}' and json.loads('{"a":{}}') and finish.reason == "tool_calls"


def test_required_cut_short_in_the_name_is_a_call_when_only_one_tool_fits():
    gate = CallGate(request("required"))
    gate.feed('{"name":"get_t')
    events, finish = gate.close(Finished(reason="length"))
    assert joined(events) == ("get_time", "") and finish.reason == "length"


def test_required_cut_short_in_a_shared_name_prefix_is_text():
    gate = CallGate(request("required", tools=(WEATHER, GAUGE)))
    gate.feed('{"name":"get_w')
    events, finish = gate.close(Finished(reason="length"))
    assert events == [TextDelta(text='{"name":"get_w')] and finish.reason == "length"


def test_required_cut_short_inside_the_arguments_keeps_a_trailing_brace():
    tool = Tool(name="f", parameters={"type": "object", "properties": {"a": {"type": "object"}}})
    gate = CallGate(request("required", tools=(tool, CLOCK)))
    events = feed_all(gate, ['{"name":"f","arguments":{"a":{}'])
    rest, finish = gate.close(Finished(reason="length"))
    assert joined(events + rest) == ("f", '{"a":{}') and finish.reason == "length"
