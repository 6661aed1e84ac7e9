"""Tool calls from the real Gemma 3 270M through the anthropic and ollama clients (ANT-17, ANT-18, ANT-24, ANT-35,
ANT-37, OLL-13, OLL-24 to OLL-26; docs/protocols.md 4.4 items 5 to 8).

Anthropic can force a call (``tool_choice`` ``any`` or ``tool``), which the llama.cpp backend holds to a grammar.
Ollama has no tool choice (4.4 item 8): a call comes only when the model, in ``auto`` mode, answers with exactly the
call JSON, which Gemma 3 270M does at temperature 0 after one worked example in the history.
"""

from __future__ import annotations

import anthropic
import ollama
import pytest

from tests.conftest import MODEL

ASK = "What is the weather in Paris?"
T0 = {"temperature": 0}  # the anthropic SDK 2.x has no temperature argument
ANT_WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
ANT_CLOCK = {
    "name": "get_time",
    "description": "Get the current time in a timezone.",
    "input_schema": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
}
OLL_WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": ANT_WEATHER["description"],
        "parameters": ANT_WEATHER["input_schema"],
    },
}


@pytest.fixture(scope="module")
def ant(real_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=real_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oll(real_server) -> ollama.Client:
    return ollama.Client(host=real_server.url)


# ------------------------------------------------------------------------------------------------- anthropic


def _tool_use(message) -> anthropic.types.ToolUseBlock:
    assert message.stop_reason == "tool_use"  # ANT-24
    uses = [block for block in message.content if block.type == "tool_use"]
    assert len(uses) == 1
    return uses[0]


def test_ant_18_tool_choice_any_forces_a_call_with_an_object_input(ant):
    message = ant.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=T0,
        tools=[ANT_WEATHER, ANT_CLOCK],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": ASK}],
    )
    use = _tool_use(message)
    assert use.name in ("get_weather", "get_time") and use.id
    key = "city" if use.name == "get_weather" else "timezone"
    assert isinstance(use.input, dict) and set(use.input) == {key} and isinstance(use.input[key], str)


def test_ant_18_tool_choice_tool_calls_the_named_tool(ant):
    message = ant.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=T0,
        tools=[ANT_WEATHER, ANT_CLOCK],
        tool_choice={"type": "tool", "name": "get_time"},
        messages=[{"role": "user", "content": ASK}],
    )
    use = _tool_use(message)
    assert use.name == "get_time" and isinstance(use.input["timezone"], str)


def test_ant_35_37_streamed_forced_call_joins_into_an_input_object(ant):
    with ant.messages.stream(
        model=MODEL,
        max_tokens=64,
        extra_body=T0,
        tools=[ANT_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        messages=[{"role": "user", "content": ASK}],
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert "input_json" in kinds
    use = _tool_use(final)
    assert use.name == "get_weather" and set(use.input) == {"city"} and use.input["city"]


def test_ant_tool_result_fed_back_gives_a_text_answer(ant):
    first = ant.messages.create(
        model=MODEL,
        max_tokens=64,
        extra_body=T0,
        tools=[ANT_WEATHER],
        tool_choice={"type": "any"},
        messages=[{"role": "user", "content": ASK}],
    )
    use = _tool_use(first)
    messages = [
        {"role": "user", "content": ASK},
        {"role": "assistant", "content": first.content},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "18 C and sunny"}]},
    ]
    second = ant.messages.create(model=MODEL, max_tokens=32, extra_body=T0, tools=[ANT_WEATHER], messages=messages)
    assert second.stop_reason in ("end_turn", "max_tokens")
    assert [block.type for block in second.content] == ["text"] and second.content[0].text.strip()


# ------------------------------------------------------------------------------------------------- ollama


def _ollama_history() -> list:
    """A finished call of get_weather for Paris (arguments as a dict, OLL-24), its result, then a new question."""
    call = ollama.Message.ToolCall(
        function=ollama.Message.ToolCall.Function(name="get_weather", arguments={"city": "Paris"})
    )
    return [
        {"role": "user", "content": ASK},
        ollama.Message(role="assistant", content="", tool_calls=[call]),
        {"role": "tool", "content": "18 C and sunny", "tool_name": "get_weather"},
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "What is the weather in London?"},
    ]


def test_oll_24_auto_call_arrives_with_arguments_as_a_dict(oll):
    response = oll.chat(
        model=MODEL, messages=_ollama_history(), tools=[OLL_WEATHER], options={"temperature": 0, "num_predict": 64}
    )
    calls = response.message.tool_calls
    assert calls and len(calls) == 1
    assert calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "London"}
    assert response.done_reason == "stop"  # OLL-26: no tool-specific reason


def test_oll_26_streamed_call_comes_whole_in_one_chunk(oll):
    parts = list(
        oll.chat(
            model=MODEL,
            messages=_ollama_history(),
            tools=[OLL_WEATHER],
            stream=True,
            options={"temperature": 0, "num_predict": 64},
        )
    )
    with_calls = [p for p in parts if p.message.tool_calls]
    assert len(with_calls) == 1 and not with_calls[0].done
    assert with_calls[0].message.tool_calls[0].function.arguments == {"city": "London"}
    assert parts[-1].done and parts[-1].done_reason == "stop"


def test_oll_13_tool_result_fed_back_gives_a_text_answer(oll):
    response = oll.chat(
        model=MODEL, messages=_ollama_history()[:3], tools=[OLL_WEATHER], options={"temperature": 0, "num_predict": 32}
    )
    assert not response.message.tool_calls
    assert response.message.content.strip() and response.done_reason in ("stop", "length")
