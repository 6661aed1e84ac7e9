"""Tests for protocols.openai: pure translation, checked against docs/protocols.md section 1 and the openai SDK's types.

Fixtures follow the request and response examples of OpenAI's API reference (chat, vision, function calling).
Streams are parsed back with the SDK's own ``Stream`` and accumulated with ``ChatCompletionStreamState``.
"""

from __future__ import annotations

import base64
import json
from typing import Any

import msgspec
import pytest
from openai.types.chat import ChatCompletion

from meshgate.protocols import openai as oai
from meshgate.protocols import openai_completions as oac
from meshgate.protocols.model import (
    UNSET,
    Finished,
    ImagePart,
    InvalidRequest,
    Message,
    ReasoningPart,
    Response,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    TokenLogprob,
    Tool,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    TopLogprob,
    UnsupportedFeature,
    Usage,
    collect,
    decode_body,
)
from tests.protocols.openai_wire import (  # the SDK's HTTP library (httpx2 for openai 3.x) comes from there too
    META,
    WEATHER_TOOL,
    accumulate,
    chat_stream,
    feed,
    payloads,
    sdk_stream,
)

PNG = b"\x89PNG\r\n\x1a\n"


def chat(**body: Any) -> oai.ChatRequest:
    body.setdefault("model", "gpt-4o")
    body.setdefault("messages", [{"role": "user", "content": "Hello!"}])
    return decode_body(msgspec.json.encode(body), oai.ChatRequest)


def internal(**body: Any):
    return oai.chat_to_internal(chat(**body))


def completion(**body: Any):
    body.setdefault("model", "gpt-3.5-turbo-instruct")
    return oac.completion_to_internal(decode_body(msgspec.json.encode(body), oac.CompletionRequest))


# ---------------------------------------------------------------------------------------------------- requests


def test_oai_14_model_and_messages_are_required():
    with pytest.raises(InvalidRequest) as exc:
        decode_body(b'{"model": "gpt-4o"}', oai.ChatRequest)
    assert exc.value.param == "messages"
    with pytest.raises(InvalidRequest) as exc:
        decode_body(b'{"messages": []}', oai.ChatRequest)
    assert exc.value.param == "model"


def test_oai_14_empty_messages_is_invalid():
    with pytest.raises(InvalidRequest) as exc:
        internal(messages=[])
    assert exc.value.param == "messages"


def test_oai_14_docs_example_translates():
    request = internal(
        messages=[
            {"role": "developer", "content": "You are a helpful assistant."},
            {"role": "user", "content": "Hello!"},
        ]
    )
    assert request.model == "gpt-4o"
    assert request.messages == (
        Message(role="system", parts=(TextPart(text="You are a helpful assistant."),)),
        Message(role="user", parts=(TextPart(text="Hello!"),)),
    )
    assert request.stream is False
    assert request.raw_prompt is None
    assert request.sampling == Sampling()
    assert request.max_tokens is None


def test_oai_15_developer_and_system_both_map_to_system():
    request = internal(
        messages=[
            {"role": "system", "content": "Be terse."},
            {"role": "user", "content": "Hi"},
            {"role": "developer", "content": [{"type": "text", "text": "Answer in French."}], "name": "ops"},
        ]
    )
    assert [m.role for m in request.messages] == ["system", "user", "system"]
    assert request.messages[2].text == "Answer in French."


def test_oai_15_unknown_role_is_rejected_naming_the_field():
    with pytest.raises(InvalidRequest) as exc:
        chat(messages=[{"role": "wizard", "content": "hi"}])
    assert exc.value.param == "messages[0].role"


def test_oai_15_function_role_pairs_with_legacy_function_call():
    request = internal(
        messages=[
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "function_call": {"name": "get_weather", "arguments": '{"c":1}'}},
            {"role": "function", "name": "get_weather", "content": "18C"},
        ]
    )
    assert request.messages[1].parts == (ToolCallPart(id="call_1", name="get_weather", arguments='{"c":1}'),)
    assert request.messages[2] == Message(
        role="tool", parts=(ToolResultPart(call_id="call_1", name="get_weather", content=(TextPart(text="18C"),)),)
    )


def test_oai_16_text_and_image_parts_keep_their_order():
    url = "https://upload.wikimedia.org/wikipedia/commons/thumb/d/dd/Gfp-wisconsin-madison-the-nature-boardwalk.jpg"
    request = internal(
        messages=[
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "What's in this image?"},
                    {"type": "image_url", "image_url": {"url": url, "detail": "high"}},
                    {"type": "text", "text": "Be brief."},
                ],
            }
        ]
    )
    assert request.messages[0].parts == (
        TextPart(text="What's in this image?"),
        ImagePart(url=url),
        TextPart(text="Be brief."),
    )


@pytest.mark.parametrize(
    "part",
    [
        {"type": "input_audio", "input_audio": {"data": "UklGRg==", "format": "wav"}},
        {"type": "file", "file": {"file_id": "file-abc"}},
    ],
)
def test_oai_16_audio_and_file_parts_are_unsupported(part):
    with pytest.raises(UnsupportedFeature) as exc:
        internal(messages=[{"role": "user", "content": [{"type": "text", "text": "hi"}, part]}])
    assert exc.value.param == "messages[0].content[1]"
    assert part["type"] in exc.value.message


def test_oai_16_system_messages_take_text_parts_only():
    with pytest.raises(InvalidRequest) as exc:
        chat(messages=[{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "https://x/y.png"}}]}])
    assert exc.value.param == "messages[0].content[0].type"


def test_oai_17_data_uri_is_decoded():
    uri = "data:image/png;base64," + base64.b64encode(PNG).decode()
    request = internal(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": uri}}]}])
    assert request.messages[0].parts == (ImagePart(data=PNG, media_type="image/png"),)


@pytest.mark.parametrize(
    "url", ["ftp://host/cat.png", "data:image/png,not-base64", "data:image/png;base64,@@@", "cat.png"]
)
def test_oai_17_other_image_urls_are_rejected(url):
    with pytest.raises(InvalidRequest) as exc:
        internal(messages=[{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}]}])
    assert exc.value.param == "messages[0].content[0].image_url.url"


def test_oai_18_assistant_tool_calls_with_null_content():
    function = {"name": "get_current_weather", "arguments": '{"location": "Boston, MA"}'}
    call = {"id": "call_abc", "type": "function", "function": function}
    request = internal(
        messages=[
            {"role": "user", "content": "What's the weather like in Boston today?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
        ]
    )
    assert request.messages[1] == Message(
        role="assistant",
        parts=(ToolCallPart(id="call_abc", name="get_current_weather", arguments='{"location": "Boston, MA"}'),),
    )


def test_oai_18_assistant_reasoning_text_and_refusal_parts():
    request = internal(
        messages=[
            {"role": "user", "content": "hi"},
            {
                "role": "assistant",
                "reasoning_content": "They greet me.",
                "content": [{"type": "text", "text": "Hello"}, {"type": "refusal", "refusal": "No."}],
            },
        ]
    )
    assert request.messages[1].parts == (
        ReasoningPart(text="They greet me."),
        TextPart(text="Hello"),
        TextPart(text="No."),
    )


def test_oai_19_tool_message_becomes_tool_result():
    request = internal(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "tool", "tool_call_id": "call_abc", "content": [{"type": "text", "text": '{"temp": 22}'}]},
        ]
    )
    assert request.messages[1] == Message(
        role="tool", parts=(ToolResultPart(call_id="call_abc", content=(TextPart(text='{"temp": 22}'),)),)
    )


def test_oai_19_tool_call_id_is_required():
    with pytest.raises(InvalidRequest) as exc:
        chat(messages=[{"role": "tool", "content": "22"}])
    assert "`tool_call_id`" in exc.value.message
    assert exc.value.param == "messages[0].tool_call_id"


def test_oai_20_tools_keep_name_description_and_schema():
    bare = {"type": "function", "function": {"name": "now"}}
    request = internal(tools=[WEATHER_TOOL, bare])
    assert request.tools == (
        Tool(
            name="get_current_weather",
            description="Get the current weather in a given location",
            parameters=WEATHER_TOOL["function"]["parameters"],
        ),
        Tool(name="now", parameters={"type": "object", "properties": {}}),
    )


@pytest.mark.parametrize(
    ("tool_choice", "expected"),
    [
        (None, ToolChoice()),
        ("none", ToolChoice(mode="none")),
        ("auto", ToolChoice(mode="auto")),
        ("required", ToolChoice(mode="required")),
        (
            {"type": "function", "function": {"name": "get_current_weather"}},
            ToolChoice(mode="tool", name="get_current_weather"),
        ),
    ],
)
def test_oai_21_tool_choice_modes(tool_choice, expected):
    assert internal(tools=[WEATHER_TOOL], tool_choice=tool_choice).tool_choice == expected


def test_oai_21_parallel_tool_calls():
    assert internal(tools=[WEATHER_TOOL], parallel_tool_calls=False).tool_choice == ToolChoice(parallel=False)
    assert internal(tool_choice="auto", parallel_tool_calls=True).tool_choice == ToolChoice(parallel=True)
    assert internal().tool_choice.parallel is UNSET
    assert internal(parallel_tool_calls=None).tool_choice.parallel is UNSET


@pytest.mark.parametrize(
    "body",
    [
        {"tool_choice": "required"},
        {"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
    ],
)
def test_oai_21_tool_choice_without_a_matching_tool_is_invalid(body):
    with pytest.raises(InvalidRequest) as exc:
        internal(**body)
    assert exc.value.param == "tool_choice"


@pytest.mark.parametrize(
    ("body", "expected"),
    [
        ({"max_tokens": 50}, 50),
        ({"max_completion_tokens": 80}, 80),
        ({"max_tokens": 50, "max_completion_tokens": 80}, 80),
        ({"max_tokens": None}, None),
        ({}, None),
    ],
)
def test_oai_22_max_completion_tokens_wins_over_max_tokens(body, expected):
    assert internal(**body).max_tokens == expected


def test_oai_23_sampling_keeps_unset_apart_from_null():
    request = internal(temperature=0.2, top_p=None, seed=42, presence_penalty=-1.5)
    assert request.sampling == Sampling(temperature=0.2, top_p=None, seed=42, presence_penalty=-1.5)
    assert request.sampling.top_p is None
    assert request.sampling.frequency_penalty is UNSET
    assert request.sampling.top_k is UNSET


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 2.5), ("temperature", -0.1), ("top_p", 1.5), ("presence_penalty", 3), ("frequency_penalty", -2.1)],
)
def test_oai_23_out_of_range_values_are_rejected(field, value):
    with pytest.raises(InvalidRequest) as exc:
        chat(**{field: value})
    assert exc.value.param == field


@pytest.mark.parametrize(("stop", "expected"), [("\n", ("\n",)), (["END", "###"], ("END", "###")), (None, ())])
def test_oai_23_stop_string_or_list_becomes_tuple(stop, expected):
    assert internal(stop=stop).stop == expected


@pytest.mark.parametrize("n", [2, 0])
def test_oai_23_n_other_than_one_is_invalid(n):
    with pytest.raises(InvalidRequest) as exc:
        internal(n=n)
    assert exc.value.param == "n"
    assert "only n=1 is served" in exc.value.message


def test_oai_23_n_one_logprobs_user_metadata_are_accepted():
    request = internal(
        n=1, logprobs=True, top_logprobs=3, logit_bias={"50256": -100}, user="user-1234", metadata={"team": "a"}
    )
    assert request.messages[0].text == "Hello!"


@pytest.mark.parametrize(("effort", "expected"), [("none", False), ("low", True), ("high", True), (None, UNSET)])
def test_oai_23_reasoning_effort(effort, expected):
    assert internal(reasoning_effort=effort).reasoning == expected


@pytest.mark.parametrize(
    ("fmt", "expected"),
    [
        ({"type": "text"}, ResponseFormat()),
        ({"type": "json_object"}, ResponseFormat(kind="json_object")),
        (
            {"type": "json_schema", "json_schema": {"name": "answer", "strict": True, "schema": {"type": "object"}}},
            ResponseFormat(kind="json_schema", schema={"type": "object"}, name="answer"),
        ),
        (None, ResponseFormat()),
    ],
)
def test_oai_24_response_format(fmt, expected):
    assert internal(response_format=fmt).response_format == expected


def test_oai_24_json_schema_needs_a_name():
    with pytest.raises(InvalidRequest) as exc:
        chat(response_format={"type": "json_schema", "json_schema": {"schema": {}}})
    assert exc.value.param == "response_format.json_schema.name"


def test_oai_25_stream_and_include_usage():
    wire = chat(stream=True, stream_options={"include_usage": True})
    assert oai.chat_to_internal(wire).stream is True
    assert oai.wants_usage(wire) is True
    assert oai.wants_usage(chat(stream=True)) is False
    assert oai.wants_usage(chat(stream=True, stream_options={"include_usage": False})) is False


def test_oai_26_extra_body_keys_reach_sampling_and_unknown_keys_are_ignored():
    request = internal(top_k=40, min_p=0.05, repeat_penalty=1.1, mirostat=2, cache_prompt=True)
    assert request.sampling == Sampling(top_k=40, min_p=0.05, repeat_penalty=1.1)


# ---------------------------------------------------------------------------------------------------- legacy


@pytest.mark.parametrize("prompt", ["Say this is a test", ["Say this is a test"]])
def test_oai_27_completion_prompt_becomes_raw_prompt(prompt):
    request = completion(prompt=prompt, max_tokens=7, temperature=0, stop="\n", top_k=20)
    assert request.raw_prompt == "Say this is a test"
    assert request.messages == ()
    assert request.max_tokens == 7
    assert request.stop == ("\n",)
    assert request.sampling == Sampling(temperature=0, top_k=20)


@pytest.mark.parametrize(
    ("body", "error", "param"),
    [
        ({"prompt": ["a", "b"]}, InvalidRequest, "prompt"),
        ({"prompt": []}, InvalidRequest, "prompt"),
        ({"prompt": None}, InvalidRequest, "prompt"),
        ({"prompt": [1, 2, 3]}, UnsupportedFeature, "prompt"),
        ({"prompt": [[1, 2]]}, UnsupportedFeature, "prompt"),
        ({"prompt": "x", "n": 3}, InvalidRequest, "n"),
        ({"prompt": "x", "best_of": 2}, InvalidRequest, "best_of"),
        ({"prompt": "x", "echo": True}, UnsupportedFeature, "echo"),
        ({"prompt": "x", "suffix": "end"}, UnsupportedFeature, "suffix"),
    ],
)
def test_oai_27_completion_requests_we_do_not_serve(body, error, param):
    with pytest.raises(error) as exc:
        completion(**body)
    assert type(exc.value) is error
    assert exc.value.param == param


def test_oai_27_completion_prompt_is_required():
    with pytest.raises(InvalidRequest) as exc:
        decode_body(b'{"model": "m"}', oac.CompletionRequest)
    assert exc.value.param == "prompt"


# ---------------------------------------------------------------------------------------------------- logprobs


def _lp(token: str, logprob: float, *top: tuple[str, float]) -> TokenLogprob:
    return TokenLogprob(
        token=token,
        logprob=logprob,
        bytes=tuple(token.encode()),
        top=tuple(TopLogprob(token=t, logprob=p, bytes=tuple(t.encode())) for t, p in top),
    )


def test_oai_23_logprobs_and_top_logprobs_reach_the_request():
    request = internal(logprobs=True, top_logprobs=3)
    assert (request.logprobs, request.top_logprobs) == (True, 3)
    assert (internal().logprobs, internal().top_logprobs) == (False, 0)
    assert (internal(logprobs=True).logprobs, internal(logprobs=True).top_logprobs) == (True, 0)


@pytest.mark.parametrize("body", [{"top_logprobs": 2}, {"logprobs": False, "top_logprobs": 2}])
def test_oai_23_top_logprobs_requires_logprobs(body):
    with pytest.raises(InvalidRequest) as exc:
        internal(**body)
    assert exc.value.param == "top_logprobs"


def test_oai_36_logprobs_content_entries_in_the_chat_completion():
    entries = (_lp("Hel", -0.25, ("Hel", -0.25), ("Hi", -1.5)), _lp("lo", -0.0, ("lo", -0.0), ("p", -7.0)))
    response = Response(text="Hello", logprobs=entries, usage=Usage(prompt_tokens=3, completion_tokens=2))
    body = json.loads(oai.encode_chat_response(response, META))
    assert body["choices"][0]["logprobs"] == {
        "content": [
            {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108],
             "top_logprobs": [{"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]},
                              {"token": "Hi", "logprob": -1.5, "bytes": [72, 105]}]},
            {"token": "lo", "logprob": -0.0, "bytes": [108, 111],
             "top_logprobs": [{"token": "lo", "logprob": -0.0, "bytes": [108, 111]},
                              {"token": "p", "logprob": -7.0, "bytes": [112]}]},
        ],
        "refusal": None,
    }  # fmt: skip
    logprobs = ChatCompletion.model_validate(body).choices[0].logprobs
    assert [c.token for c in logprobs.content] == ["Hel", "lo"]
    assert [t.token for t in logprobs.content[0].top_logprobs] == ["Hel", "Hi"]


def test_oai_36_logprobs_null_unless_the_backend_sent_them():
    assert json.loads(oai.encode_chat_response(Response(text="x"), META))["choices"][0]["logprobs"] is None
    empty = json.loads(oai.encode_chat_response(Response(text="", logprobs=()), META))
    assert empty["choices"][0]["logprobs"] == {"content": [], "refusal": None}


async def test_oai_36_collect_joins_the_logprobs_of_every_text_delta():
    events = [
        TextDelta(text="Hel", logprobs=(_lp("Hel", -0.25),)),
        TextDelta(text="lo", logprobs=(_lp("lo", -1.0),)),
        TextDelta(text="", logprobs=()),
        Finished(),
    ]
    response = await collect(feed(events))
    assert response.text == "Hello"
    assert [e.token for e in response.logprobs] == ["Hel", "lo"]
    assert (await collect(feed([TextDelta(text="x"), Finished()]))).logprobs is None


async def test_oai_36_stream_chunks_carry_their_own_logprobs():
    events = [
        TextDelta(text="Hel", logprobs=(_lp("Hel", -0.25, ("Hel", -0.25)),)),
        TextDelta(text="lo", logprobs=(_lp("lo", -1.0, ("lo", -1.0)),)),
        TextDelta(text="", logprobs=(_lp("", -2.0, ("", -2.0)),)),  # a token with no text of its own yet
        TextDelta(text="", logprobs=()),
        Finished(),
    ]
    raw = await chat_stream(events)
    choices = [p["choices"][0] for p in payloads(raw)[:-1]]
    assert [c["delta"].get("content") for c in choices] == ["Hel", "lo", "", None]
    assert [[e["token"] for e in c["logprobs"]["content"]] if c["logprobs"] else None for c in choices] == [
        ["Hel"],
        ["lo"],
        [""],
        None,
    ]
    assert choices[0]["logprobs"]["content"][0]["top_logprobs"] == [
        {"token": "Hel", "logprob": -0.25, "bytes": [72, 101, 108]}
    ]
    final = accumulate(sdk_stream(raw))
    assert final.choices[0].message.content == "Hello"
    assert [c.token for c in final.choices[0].logprobs.content] == ["Hel", "lo", ""]


async def test_oai_36_no_logprobs_on_chunks_unless_sent():
    raw = await chat_stream([TextDelta(text="Hi"), Finished()])
    assert all(p["choices"][0]["logprobs"] is None for p in payloads(raw)[:-1])
