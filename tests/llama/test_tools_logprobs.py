"""The llama.cpp backend's tool-call and logprob plumbing as plain functions (no model loaded): the tools prompt
block, the call schema and its grammar, the gate between the token loop and the events in ``auto`` mode (forced
calls: ``test_forced_calls.py``), and logprobs kept with their text past the stop matcher (OAI-21, OAI-36, OAI-49;
docs/protocols.md 4.4 items 5 to 8).
"""

from __future__ import annotations

import json

import pytest

from meshgate.backends.llama_cpp.engine import StopMatcher
from meshgate.backends.llama_cpp.logprobs import LogprobAligner
from meshgate.backends.llama_cpp.prompt import flatten, render_gemma
from meshgate.backends.llama_cpp.tools import CallGate, call_mode, call_schema, parse_call, tools_block
from meshgate.protocols.model import (
    Finished,
    Message,
    Request,
    TextDelta,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
)
from tests.llama.test_grammar import takes

WEATHER = Tool(
    name="get_weather",
    description="Weather for a city.",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CLOCK = Tool(name="get_time", parameters={"type": "object", "properties": {"tz": {"type": "string"}}})
ASK = (Message(role="user", parts=(TextPart(text="Weather in Paris?"),)),)


def request(mode: str = "auto", name: str | None = None, tools=(WEATHER, CLOCK), **kw) -> Request:
    return Request(model="m", messages=ASK, tools=tools, tool_choice=ToolChoice(mode=mode, name=name), **kw)


# ------------------------------------------------------------------------------------------------- prompt


def test_oai_21_tools_block_names_every_tool_and_the_call_format():
    block = tools_block(request("required"))
    assert "get_weather: Weather for a city." in block and "get_time" in block
    assert json.dumps(WEATHER.parameters) in block
    assert '{"name": "<tool name>", "arguments": {' in block and "must call one of the tools" in block
    assert "must call the tool get_time" in tools_block(request("tool", "get_time"))
    assert tools_block(request("none")) == "" and tools_block(request(tools=())) == ""


def test_oai_21_tools_block_follows_the_system_prompts_in_the_first_user_turn():
    messages = (Message(role="system", parts=(TextPart(text="Be brief."),)), *ASK)
    turns = flatten(messages, tools_block(request()))
    assert len(turns) == 1 and turns[0][0] == "user"
    assert turns[0][1].startswith("Be brief.\n\nYou can call these tools:")
    assert turns[0][1].endswith("Weather in Paris?")
    assert "You can call these tools" not in render_gemma(Request(model="m", messages=messages))


def test_oai_18_19_history_calls_render_as_call_json_and_results_name_their_tool():
    call = ToolCallPart(id="call_1", name="get_weather", arguments='{"city":"Paris"}')
    result = ToolResultPart(call_id="call_1", content=(TextPart(text="18 C"),))
    messages = (*ASK, Message(role="assistant", parts=(call,)), Message(role="tool", parts=(result,)))
    turns = flatten(messages)
    assert turns[1] == ("assistant", '{"name": "get_weather", "arguments": {"city": "Paris"}}')
    assert turns[2] == ("user", "Result of get_weather: 18 C")


def test_oai_18_history_call_with_broken_arguments_still_renders():
    call = ToolCallPart(id="c", name="f", arguments='{"a": ')
    assert flatten((*ASK, Message(role="assistant", parts=(call,))))[1][1] == '{"name": "f", "arguments": {"a": }'


# ------------------------------------------------------------------------------------------------- schema


def test_oai_21_modes():
    assert [
        call_mode(request(m, "get_time" if m == "tool" else None)) for m in ("auto", "none", "required", "tool")
    ] == ["auto", "off", "forced", "forced"]
    assert call_mode(request("required", tools=())) == "off"


def test_oai_21_required_schema_is_an_any_of_with_one_branch_per_tool():
    schema = call_schema(request("required"))
    assert [b["properties"]["name"] for b in schema["anyOf"]] == [{"const": "get_weather"}, {"const": "get_time"}]
    assert schema["anyOf"][0]["properties"]["arguments"] == WEATHER.parameters
    assert all(b["required"] == ["name", "arguments"] for b in schema["anyOf"])


def test_oai_21_named_schema_admits_only_that_tool_and_lifts_defs():
    tool = Tool(
        name="put",
        parameters={"type": "object", "properties": {"p": {"$ref": "#/$defs/P"}}, "$defs": {"P": {"type": "string"}}},
    )
    schema = call_schema(request("tool", "put", tools=(WEATHER, tool)))
    assert schema["properties"]["name"] == {"const": "put"}
    assert "$defs" not in schema["properties"]["arguments"] and schema["$defs"] == {"P": {"type": "string"}}


def test_oai_49_call_schemas_hold_the_model_to_an_offered_name(grammars):
    for req in (request("required"), request("tool", "get_time")):
        assert takes(grammars, call_schema(req), '{"name": "get_time", "arguments": {}}')
    assert not takes(grammars, call_schema(request("tool", "get_time")), '{"name": "get_weather", "arguments": {}}')


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ('{"name": "get_weather", "arguments": {"city": "Paris"}}', ("get_weather", '{"city":"Paris"}')),
        ('{"name":"get_time","arguments":{}}', ("get_time", "{}")),
        ('{"name": "nope", "arguments": {}}', None),
        ('{"name": "get_time", "arguments": "{}"}', None),
        ('{"name": "get_time", "arguments": {}, "extra": 1}', None),
        ('{"name": "get_time", "arguments": {}} and more', None),
        ("[1, 2]", None),
        ("Sunny.", None),
    ],
)
def test_oai_49_parse_call_takes_exactly_a_call_of_an_offered_tool(text, expected):
    assert parse_call(text, (WEATHER, CLOCK)) == expected


# ------------------------------------------------------------------------------------------------- gate


def _lp(token: str) -> TokenLogprob:
    return TokenLogprob(token=token, logprob=-1.0)


def test_oai_21_auto_streams_text_that_cannot_be_a_call():
    gate = CallGate(request("auto"))
    assert gate.feed("  ") == []
    assert gate.feed("It is") == [TextDelta(text="  It is")]
    assert gate.feed(" sunny.") == [TextDelta(text=" sunny.")]
    assert gate.close(Finished()) == ([], Finished())


def test_oai_21_auto_json_that_is_not_a_call_is_text():
    gate = CallGate(request("auto"))
    assert gate.feed('{"city": "Paris"}') == [] and not gate.done
    assert gate.close(Finished()) == ([TextDelta(text='{"city": "Paris"}')], Finished())


def test_oai_21_auto_exact_call_becomes_a_call():
    gate = CallGate(request("auto"))
    gate.feed('\n{"name": "get_time", "arguments": {"tz": "UTC"}}')
    assert gate.done
    events, finish = gate.close(Finished())
    assert [(e.name, e.arguments) for e in events] == [("get_time", '{"tz":"UTC"}')] and finish.reason == "tool_calls"


def test_oai_36_off_gate_passes_text_and_ends_asked_for_logprobs_with_an_empty_delta():
    gate = CallGate(request("none", logprobs=True))
    assert gate.feed("Hi", (_lp("Hi"),)) == [TextDelta(text="Hi", logprobs=(_lp("Hi"),))]
    assert gate.close(Finished()) == ([TextDelta(text="", logprobs=())], Finished())
    plain = CallGate(Request(model="m", messages=ASK))
    assert plain.feed("Hi", ()) == [TextDelta(text="Hi")] and plain.close(Finished()) == ([], Finished())


# ------------------------------------------------------------------------------------------------- logprobs


def _run(pieces: list[str], stops: tuple[str, ...]) -> tuple[list[tuple[str, tuple[str, ...]]], str | None]:
    """Feed ``pieces`` (one per token) through a stop matcher and an aligner as the engine does."""
    stopper, aligner, out = StopMatcher(stops), LogprobAligner(), []
    matched = None
    for piece in pieces:
        aligner.add(piece, _lp(piece))
        text, matched = stopper.feed(piece)
        out.append((text, tuple(e.token for e in aligner.take(text))))
        if matched:
            return out, matched
    rest = stopper.flush()
    out.append((rest, tuple(e.token for e in aligner.rest())))
    return out, matched


def test_oai_36_logprobs_go_out_with_the_text_of_their_token():
    out, _ = _run(["Hel", "lo", " world"], ())
    assert out == [("Hel", ("Hel",)), ("lo", ("lo",)), (" world", (" world",)), ("", ())]


def test_oai_36_logprobs_wait_with_text_the_stop_matcher_holds_back():
    out, matched = _run(["Hel", "lo", " E", "ND", "!"], ("END!",))
    assert matched == "END!"
    # "E" is held (it may start "END!") while " " goes out, and with it the entry of " E", whose first character
    # it is; "ND" and "!" stay held and are dropped with the match
    assert out == [("Hel", ("Hel",)), ("lo", ("lo",)), (" ", (" E",)), ("", ()), ("", ())]


def test_oai_36_tokens_inside_a_matched_stop_sequence_have_no_entry():
    out, _ = _run(["a", "ST", "OP", "b"], ("STOP",))
    assert [e for _, entries in out for e in entries] == ["a"]


def test_oai_36_a_held_back_prefix_that_is_not_a_stop_goes_out_with_its_entries():
    out, _ = _run(["x", "E", "Y"], ("END",))
    assert out == [("x", ("x",)), ("", ()), ("EY", ("E", "Y")), ("", ())]


def test_oai_36_a_token_without_text_of_its_own_goes_with_the_next_character():
    aligner = LogprobAligner()
    aligner.add("", _lp("\\xe2\\x80"))  # the first bytes of a UTF-8 character
    assert aligner.take("") == ()
    aligner.add("…", _lp("\\xa6"))
    assert [e.token for e in aligner.take("…")] == ["\\xe2\\x80", "\\xa6"]
