"""The openai SDK against the real Gemma 3 270M: tool calls, structured output and logprobs (OAI-18..OAI-24, OAI-31..
OAI-36, OAI-48, OAI-49).

Gemma 3 270M is a small base model with no tool-call format of its own: a forced call (``required`` or a named
function) comes from grammar-constrained output, an ``auto`` call only when the model answers with exactly the
call JSON, which it does here after one worked example in the history. Everything runs at temperature 0.
"""

from __future__ import annotations

import json

import openai
import pydantic
import pytest

from tests.conftest import MODEL


class Weather(pydantic.BaseModel, extra="forbid"):
    city: str


class Clock(pydantic.BaseModel, extra="forbid"):
    timezone: str


class Place(pydantic.BaseModel):
    city: str
    country: str


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
CLOCK = {
    "type": "function",
    "function": {
        "name": "get_time",
        "description": "Get the current time in a timezone.",
        "parameters": {"type": "object", "properties": {"timezone": {"type": "string"}}, "required": ["timezone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SETTINGS = {"model": MODEL, "temperature": 0, "max_tokens": 64}


@pytest.fixture(scope="module")
def oai(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0)


def _history(call_id: str = "call_0123456789abcdef01234567") -> list[dict]:
    """A finished call of get_weather for Paris, its result and the assistant's answer."""
    call = {"id": call_id, "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    return [
        *ASK,
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": call_id, "content": "18 C and sunny"},
    ]


def _only_call(message) -> tuple[str, str]:
    assert message.content is None
    assert len(message.tool_calls) == 1
    call = message.tool_calls[0]
    assert call.type == "function"
    assert call.id.startswith("call_") and len(call.id) == len("call_") + 24  # OAI-32
    return call.function.name, call.function.arguments


# ------------------------------------------------------------------------------------------------- tool calls


def test_oai_21_tool_choice_required_gives_a_call_whose_arguments_match_the_schema(oai):
    completion = oai.chat.completions.create(**SETTINGS, messages=ASK, tools=[WEATHER, CLOCK], tool_choice="required")
    choice = completion.choices[0]
    assert choice.finish_reason == "tool_calls"  # OAI-34
    name, arguments = _only_call(choice.message)
    assert name in ("get_weather", "get_time")
    assert isinstance(arguments, str)  # OAI-35: a JSON string
    (Weather if name == "get_weather" else Clock).model_validate_json(arguments)
    assert completion.usage.completion_tokens > 0


def test_oai_21_named_tool_choice_calls_that_tool(oai):
    completion = oai.chat.completions.create(
        **SETTINGS,
        messages=ASK,
        tools=[WEATHER, CLOCK],
        tool_choice={"type": "function", "function": {"name": "get_time"}},
    )
    name, arguments = _only_call(completion.choices[0].message)
    assert name == "get_time"
    assert Clock.model_validate_json(arguments).timezone
    assert completion.choices[0].finish_reason == "tool_calls"


def test_oai_48_49_streamed_forced_call_accumulates_in_the_stream_helper(oai):
    with oai.chat.completions.stream(
        **SETTINGS, messages=ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {"name": "get_weather"}}
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in kinds
    choice = final.choices[0]
    assert choice.finish_reason == "tool_calls"
    name, arguments = _only_call(choice.message)
    assert name == "get_weather"  # id and name sent once, or the helper would have doubled them (OAI-48)
    assert Weather.model_validate_json(arguments).city


def test_oai_48_streamed_required_call_chunks(oai):
    chunks = list(
        oai.chat.completions.create(**SETTINGS, messages=ASK, tools=[WEATHER], tool_choice="required", stream=True)
    )
    calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
    assert calls[0][0].id.startswith("call_") and calls[0][0].function.name == "get_weather"
    assert all(call.id is None and call.function.name is None for delta in calls[1:] for call in delta)
    arguments = "".join(call.function.arguments or "" for delta in calls for call in delta)
    assert Weather.model_validate_json(arguments).city
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    assert all(not (c.choices[0].delta.content or "") for c in chunks if c.choices)


def test_oai_19_tool_result_fed_back_gives_a_text_answer(oai):
    completion = oai.chat.completions.create(**SETTINGS, messages=_history(), tools=[WEATHER])
    choice = completion.choices[0]
    assert choice.message.tool_calls is None
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")


def test_oai_19_a_call_the_model_made_is_fed_back_as_it_came(oai):
    first = oai.chat.completions.create(**SETTINGS, messages=ASK, tools=[WEATHER], tool_choice="required")
    call = first.choices[0].message.tool_calls[0]
    messages = [
        *ASK,
        first.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "18 C and sunny"},
    ]
    second = oai.chat.completions.create(**SETTINGS, messages=messages, tools=[WEATHER], tool_choice="none")
    assert second.choices[0].message.tool_calls is None
    assert second.choices[0].message.content.strip()


def test_oai_21_auto_turns_an_answer_that_is_exactly_a_call_into_a_call(oai):
    messages = [
        *_history(),
        {"role": "assistant", "content": "It is 18 C and sunny in Paris."},
        {"role": "user", "content": "What is the weather in London?"},
    ]
    completion = oai.chat.completions.create(**SETTINGS, messages=messages, tools=[WEATHER])
    name, arguments = _only_call(completion.choices[0].message)
    assert name == "get_weather" and Weather.model_validate_json(arguments).city == "London"
    assert completion.choices[0].finish_reason == "tool_calls"


def test_oai_21_tool_choice_none_gives_text_and_keeps_the_tools_out_of_the_prompt(oai):
    plain = oai.chat.completions.create(**SETTINGS, messages=ASK)
    none = oai.chat.completions.create(**SETTINGS, messages=ASK, tools=[WEATHER], tool_choice="none")
    auto = oai.chat.completions.create(**SETTINGS, messages=ASK, tools=[WEATHER], max_completion_tokens=1)
    assert none.choices[0].message.tool_calls is None and none.choices[0].message.content.strip()
    assert none.choices[0].finish_reason in ("stop", "length")
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens
    assert auto.usage.prompt_tokens > plain.usage.prompt_tokens + 50  # the tools block reaches the model


# ------------------------------------------------------------------------------------------------- response_format


def test_oai_24_json_object_output_parses(oai):
    completion = oai.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=200,
        response_format={"type": "json_object"},
        messages=[{"role": "user", "content": "Give me a JSON object describing Paris."}],
    )
    assert completion.choices[0].finish_reason == "stop"
    assert isinstance(json.loads(completion.choices[0].message.content), dict)


def test_oai_24_json_schema_output_has_the_required_keys(oai):
    schema = {
        "type": "object",
        "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
        "required": ["city", "country"],
    }
    completion = oai.chat.completions.create(
        model=MODEL,
        temperature=0,
        max_tokens=100,
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": schema}},
        messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}],
    )
    value = json.loads(completion.choices[0].message.content)
    assert {"city", "country"} <= set(value) and all(isinstance(value[k], str) for k in ("city", "country"))


def test_oai_24_sdk_parse_helper_with_a_pydantic_model(oai):
    completion = oai.chat.completions.parse(
        model=MODEL,
        temperature=0,
        max_tokens=100,
        response_format=Place,
        messages=[{"role": "user", "content": "Where is the Eiffel Tower?"}],
    )
    place = completion.choices[0].message.parsed
    assert isinstance(place, Place) and place.city and place.country


# ------------------------------------------------------------------------------------------------- logprobs


def _check_logprobs(content, text: str, n_tokens: int) -> None:
    assert len(content) == n_tokens
    for entry in content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert all(t.logprob <= 0 for t in entry.top_logprobs)
        tops = [t.logprob for t in entry.top_logprobs]
        assert tops == sorted(tops, reverse=True)
        assert entry.logprob <= tops[0] + 1e-6
    assert b"".join(bytes(e.bytes) for e in content).decode("utf-8", errors="replace") == text


def test_oai_36_logprobs_with_top_logprobs_not_streamed(oai):
    completion = oai.chat.completions.create(
        model=MODEL, messages=ASK, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    choice = completion.choices[0]
    _check_logprobs(choice.logprobs.content, choice.message.content, completion.usage.completion_tokens)
    assert choice.logprobs.content[0].token == choice.logprobs.content[0].top_logprobs[0].token  # greedy


def test_oai_36_logprobs_with_top_logprobs_streamed(oai):
    chunks = list(
        oai.chat.completions.create(
            model=MODEL,
            messages=ASK,
            temperature=0,
            max_tokens=8,
            logprobs=True,
            top_logprobs=3,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    content = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    _check_logprobs(content, text, chunks[-1].usage.completion_tokens)


def test_oai_36_no_logprobs_unless_asked(oai):
    completion = oai.chat.completions.create(model=MODEL, messages=ASK, temperature=0, max_tokens=4)
    assert completion.choices[0].logprobs is None


def test_oai_23_top_logprobs_without_logprobs_is_400(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model=MODEL, messages=ASK, max_tokens=4, top_logprobs=3)
    assert exc.value.param == "top_logprobs"


def test_oai_59_tool_schema_no_grammar_can_hold_the_model_to_is_400(oai):
    odd = {
        "type": "function",
        "function": {"name": "odd", "parameters": {"type": "object", "properties": {"a": {"type": "wibble"}}}},
    }
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(**SETTINGS, messages=ASK, tools=[odd], tool_choice="required")
    assert "'wibble'" in exc.value.message and "/properties/a/type" in exc.value.message
    assert exc.value.param == "tools"
