"""Function calling on the Responses API as pure functions: what Codex CLI sends, and the items it reads back.

Requests are shaped like Codex CLI's (function tools beside hosted ``web_search`` and a ``namespace`` group;
``function_call`` and ``function_call_output`` items replayed in ``input``); every encoded event and Response is
validated with the openai SDK's own types and accumulated with its ``ResponseStream`` helper.
"""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response as SDKResponse

from meshgate.protocols import openai_responses as resp
from meshgate.protocols.model import (
    Finished,
    InvalidRequest,
    Response,
    TextDelta,
    TextPart,
    ToolCall,
    ToolCallDelta,
    ToolCallPart,
    ToolResultPart,
    Usage,
    collect,
)
from tests.protocols.test_openai_responses import META, body, events_of, feed, internal, sdk_final, stream

EXEC = {
    "type": "function",
    "name": "exec_command",
    "description": "Runs a command in a PTY.",
    "strict": False,
    "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]},
}
CODEX_TOOLS = [
    EXEC,
    {"type": "function", "name": "get_goal", "description": "Get the goal.", "strict": False, "parameters": None},
    {"type": "namespace", "name": "multi_agent_v1", "description": "Sub-agents.", "tools": [EXEC]},
    {"type": "web_search", "external_web_access": False},
]


def test_only_function_tools_are_offered():
    request = internal(tools=CODEX_TOOLS, tool_choice="auto", parallel_tool_calls=True)
    assert [t.name for t in request.tools] == ["exec_command", "get_goal"]
    assert request.tools[0].description == "Runs a command in a PTY."
    assert request.tools[0].parameters["required"] == ["cmd"]
    assert request.tools[1].parameters == {"type": "object", "properties": {}}
    assert (request.tool_choice.mode, request.tool_choice.parallel) == ("auto", True)


@pytest.mark.parametrize(
    ("choice", "mode", "name"),
    [
        ("none", "none", None),
        ("required", "required", None),
        ({"type": "function", "name": "exec_command"}, "tool", "exec_command"),
        ({"type": "web_search"}, "auto", None),
    ],
)
def test_tool_choice(choice, mode, name):
    request = internal(tools=CODEX_TOOLS, tool_choice=choice)
    assert (request.tool_choice.mode, request.tool_choice.name) == (mode, name)


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": CODEX_TOOLS, "tool_choice": {"type": "function", "name": "rm_rf"}}, "tool_choice"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "function", "description": "no name"}]}, "tools[0]"),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input[0].call_id"),
        ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, "input[0].name"),
        ({"input": [{"type": "function_call_output", "output": "ok"}]}, "input[0].call_id"),
    ],
)
def test_bad_tools_and_calls_name_the_field(fields, param):
    with pytest.raises(InvalidRequest) as exc:
        internal(**fields)
    assert exc.value.param == param
    assert exc.value.status == 400


def test_calls_and_outputs_in_input_become_assistant_calls_and_tool_results():
    request = internal(
        tools=CODEX_TOOLS,
        input=[
            {"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "Be brief."}]},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List files"}]},
            {"type": "reasoning", "summary": [], "encrypted_content": None},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Looking."}]},
            {"type": "function_call", "call_id": "call_1", "name": "exec_command", "arguments": '{"cmd":"ls"}'},
            {"type": "function_call", "call_id": "call_2", "name": "get_goal", "arguments": ""},
            {"type": "function_call_output", "call_id": "call_1", "output": "a.txt\nb.txt"},
            {"type": "function_call_output", "call_id": "call_2", "output": [{"type": "input_text", "text": "none"}]},
        ],
    )
    roles = [m.role for m in request.messages]
    assert roles == ["system", "user", "assistant", "tool", "tool"]
    assert request.messages[2].parts == (
        TextPart(text="Looking."),
        ToolCallPart(id="call_1", name="exec_command", arguments='{"cmd":"ls"}'),
        ToolCallPart(id="call_2", name="get_goal", arguments="{}"),
    )
    assert request.messages[3].parts == (
        ToolResultPart(call_id="call_1", name="exec_command", content=(TextPart(text="a.txt\nb.txt"),)),
    )
    assert request.messages[4].parts[0].content == (TextPart(text="none"),)


def test_unknown_fields_codex_sends_are_ignored():
    wire = body(
        input="hi",
        prompt_cache_key="01a2338b",
        client_metadata={"k": "v"},
        include=["reasoning.encrypted_content"],
        store=False,
        reasoning={"summary": "auto"},
    )
    assert resp.responses_to_internal(wire).messages[0].text == "hi"


# ---------------------------------------------------------------------------------------------------- responses

CALLED = [
    Usage(prompt_tokens=9),
    ToolCallDelta(index=0, id="call_a", name="exec_command", arguments='{"cmd":'),
    ToolCallDelta(index=0, arguments=' "ls"}'),
    ToolCallDelta(index=1, id="call_b", name="get_goal"),
    Usage(prompt_tokens=9, completion_tokens=12),
    Finished(reason="stop"),
]


def test_calls_are_function_call_items_without_an_empty_message():
    calls = (ToolCall(id="call_a", name="exec_command", arguments='{"cmd": "ls"}'),)
    raw = json.loads(resp.encode_response(Response(tool_calls=calls), META))
    assert raw["output"] == [
        {
            "id": "fc_abc123_0",
            "type": "function_call",
            "status": "completed",
            "call_id": "call_a",
            "name": "exec_command",
            "arguments": '{"cmd": "ls"}',
        }
    ]
    assert raw["status"] == "completed"
    parsed = SDKResponse.model_validate(raw)
    assert parsed.output[0].type == "function_call" and parsed.output[0].call_id == "call_a"


def test_text_then_calls_is_a_message_then_calls():
    calls = (ToolCall(id="c1", name="f", arguments="{}"), ToolCall(id="c2", name="g", arguments="{}"))
    raw = json.loads(resp.encode_response(Response(text="On it.", tool_calls=calls), META))
    assert [(i["type"], i["id"]) for i in raw["output"]] == [
        ("message", "msg_abc123_0"),
        ("function_call", "fc_abc123_1"),
        ("function_call", "fc_abc123_2"),
    ]
    assert SDKResponse.model_validate(raw).output_text == "On it."


async def test_streamed_calls_exact_events():
    events = events_of(await stream(CALLED))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert events[2]["item"] == {
        "id": "fc_abc123_0",
        "type": "function_call",
        "status": "in_progress",
        "call_id": "call_a",
        "name": "exec_command",
        "arguments": "",
    }
    assert events[3] == {
        "type": "response.function_call_arguments.delta",
        "sequence_number": 3,
        "item_id": "fc_abc123_0",
        "output_index": 0,
        "delta": '{"cmd":',
    }
    assert events[5]["arguments"] == '{"cmd": "ls"}' and events[5]["name"] == "exec_command"
    assert events[6]["item"]["arguments"] == '{"cmd": "ls"}' and events[6]["item"]["status"] == "completed"
    assert events[9]["item"]["call_id"] == "call_b" and events[9]["item"]["arguments"] == ""
    assert [i["type"] for i in events[-1]["response"]["output"]] == ["function_call", "function_call"]


async def test_streamed_calls_and_plain_agree():
    completed = events_of(await stream(CALLED))[-1]["response"]
    plain = json.loads(resp.encode_response(await collect(feed(CALLED)), META))
    assert completed["output"][0] == plain["output"][0]
    assert completed["output"][1]["call_id"] == plain["output"][1]["call_id"] == "call_b"


async def test_sdk_stream_helper_accumulates_text_and_calls():
    seen, helper = sdk_final(await stream([TextDelta(text="Running ls."), *CALLED[1:]]))
    final = helper.get_final_response()
    assert final.output_text == "Running ls."
    calls = [item for item in final.output if item.type == "function_call"]
    assert [(c.call_id, c.name, c.arguments) for c in calls] == [
        ("call_a", "exec_command", '{"cmd": "ls"}'),
        ("call_b", "get_goal", ""),
    ]
    assert any(e.type == "response.function_call_arguments.done" for e in seen)
