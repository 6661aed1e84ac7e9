"""Tool-call ids per protocol (issue step 15, part 4, item 2): an Anthropic client sees ``toolu_...`` ids, an
OpenAI client ``call_...``, and the id a client sends back with its tool result meets its call inside the backend.
The scripted backend mints ``call_abc`` (as llama.cpp's ``call_<hex>``) and answers a tool result with the call it
found by that result's id."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}


@pytest.fixture(scope="module")
def ant(scripted_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=scripted_server.url, api_key="unused", max_retries=0)


def test_anthropic_tool_use_ids_are_toolu_and_a_tool_result_meets_its_call(ant):
    tools = [{"name": "get_weather", "description": "Weather of a city", "input_schema": SCHEMA}]
    ask = {"role": "user", "content": "tool"}
    forced = {"type": "tool", "name": "get_weather"}
    answer = ant.messages.create(model="scripted", max_tokens=64, messages=[ask], tools=tools, tool_choice=forced)
    (call,) = [block for block in answer.content if block.type == "tool_use"]
    assert call.id == "toolu_abc" and call.input == {"city": "Paris"}
    with ant.messages.stream(model="scripted", max_tokens=64, messages=[ask], tools=tools, tool_choice=forced) as s:
        streamed = s.get_final_message()
    assert [b.id for b in streamed.content if b.type == "tool_use"] == ["toolu_abc"]

    result = {"type": "tool_result", "tool_use_id": call.id, "content": "15 degrees"}
    history = [ask, {"role": "assistant", "content": answer.content}, {"role": "user", "content": [result]}]
    after = ant.messages.create(model="scripted", max_tokens=64, messages=history, tools=tools)
    assert after.content[0].text == "result for toolu_abc answers toolu_abc get_weather: 15 degrees"


def test_openai_tool_call_ids_are_call_and_a_tool_message_meets_its_call(scripted_server):
    oai = openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="unused", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": SCHEMA}}]
    ask = {"role": "user", "content": "tool"}
    answer = oai.chat.completions.create(model="scripted", messages=[ask], tools=tools, tool_choice="required")
    (call,) = answer.choices[0].message.tool_calls
    assert call.id == "call_abc"
    history = [
        ask,
        answer.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "15 degrees"},
    ]
    after = oai.chat.completions.create(model="scripted", messages=history, tools=tools)
    assert after.choices[0].message.content == "result for call_abc answers call_abc get_weather: 15 degrees"


def test_ollama_results_meet_their_calls_without_ids(scripted_server):
    """ollama-python drops ids (OLL-25): the result is paired with the call by its tool's name."""
    client = ollama.Client(host=scripted_server.url)
    ask = {"role": "user", "content": "tool"}
    answer = client.chat(model="scripted", messages=[ask])
    history = [ask, answer.message, {"role": "tool", "tool_name": "get_weather", "content": "15 degrees"}]
    after = client.chat(model="scripted", messages=history)
    assert after.message.content.startswith("result for ") and after.message.content.endswith(
        " get_weather: 15 degrees"
    )
    assert "answers no call" not in after.message.content
