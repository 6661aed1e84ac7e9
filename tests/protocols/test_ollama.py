"""Tests for protocols.ollama: request translation, NDJSON encoders, listings and errors (PROTOCOLS.md section 3).

Fixtures follow the examples in Ollama's docs/api.md; every response line is also validated with the official
``ollama`` client's own pydantic types, and a few round trips drive ``ollama.AsyncClient`` over an
``httpx.MockTransport``.
"""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable, Sequence

import httpx
import msgspec
import ollama
import pytest

from meshgate.protocols import ollama as oll
from meshgate.protocols.model import (
    UNSET,
    AuthenticationFailed,
    BackendUnavailable,
    ErrorInfo,
    Event,
    Failed,
    Finished,
    ImagePart,
    InvalidRequest,
    KeepAlive,
    Message,
    Meta,
    ModelInfo,
    NoCapacity,
    ReasoningDelta,
    ReasoningPart,
    Request,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    Tool,
    ToolCallDelta,
    ToolCallPart,
    ToolResultPart,
    UnknownModel,
    UnsupportedFeature,
    Usage,
    collect,
    decode_body,
)

META = Meta(id="abc123", model="llama3.2", created=1_700_000_000.25)
CREATED_AT = "2023-11-14T22:13:20.250000+00:00"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF"
FINAL_USAGE = Usage(prompt_tokens=26, completion_tokens=298, load_ns=1_000, prompt_ns=2_000, eval_ns=3_000)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather for a location",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "The location, e.g. San Francisco, CA"}},
            "required": ["location"],
        },
    },
}


def chat(body: dict) -> Request:
    return oll.chat_to_internal(decode_body(json.dumps(body).encode(), oll.ChatRequest))


def generate(body: dict) -> Request:
    return oll.generate_to_internal(decode_body(json.dumps(body).encode(), oll.GenerateRequest))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


async def stream(*events: Event) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def lines(encoder: Callable, *events: Event) -> list[bytes]:
    return [line async for line in encoder(stream(*events), META)]


def parse(raw: Sequence[bytes]) -> list[dict]:
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 and line.strip() for line in raw)
    return [json.loads(line) for line in raw]


# ---------------------------------------------------------------------------------------------------- chat requests


def test_oll_8_chat_request_with_history_tools_and_options():
    request = chat(
        {
            "model": "llama3.2",
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": "why is the sky blue?"},
                {"role": "assistant", "content": "due to rayleigh scattering.", "thinking": "physics"},
                {"role": "user", "content": "how is that different than mie scattering?"},
            ],
            "tools": [WEATHER_TOOL],
            "options": {"temperature": 0.2, "seed": 101, "num_predict": 128},
            "stream": False,
        }
    )
    assert request == Request(
        model="llama3.2",
        messages=(
            Message(role="system", parts=(TextPart(text="You are terse."),)),
            Message(role="user", parts=(TextPart(text="why is the sky blue?"),)),
            Message(
                role="assistant", parts=(ReasoningPart(text="physics"), TextPart(text="due to rayleigh scattering."))
            ),
            Message(role="user", parts=(TextPart(text="how is that different than mie scattering?"),)),
        ),
        tools=(
            Tool(
                name="get_current_weather",
                description="Get the current weather for a location",
                parameters=WEATHER_TOOL["function"]["parameters"],
            ),
        ),
        sampling=Sampling(temperature=0.2, seed=101),
        max_tokens=128,
        stream=False,
    )


def test_oll_8_model_is_required():
    with pytest.raises(InvalidRequest) as missing:
        decode_body(b'{"messages": []}', oll.ChatRequest)
    assert missing.value.param == "model"
    with pytest.raises(InvalidRequest) as empty:
        chat({"model": "", "messages": [{"role": "user", "content": "hi"}]})
    assert empty.value.param == "model"


def test_oll_8_top_logprobs_out_of_range_is_400_and_logprobs_unsupported():
    with pytest.raises(InvalidRequest) as exc:
        chat({"model": "m", "messages": [], "top_logprobs": 21})
    assert exc.value.param == "top_logprobs" and exc.value.status == 400
    with pytest.raises(UnsupportedFeature):
        chat({"model": "m", "messages": [], "logprobs": True})


def test_oll_9_empty_tools_list_and_unknown_fields_are_accepted():
    request = chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "hi"}],
            "tools": [],
            "stream": False,
            "truncate": True,
            "shift": False,
            "keep_alive": "5m",
        }
    )
    assert request.tools == () and request.stream is False


def test_oll_10_server_streams_when_stream_is_missing():
    base = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
    assert chat(base).stream is True
    assert chat({**base, "stream": True}).stream is True
    assert chat({**base, "stream": None}).stream is True
    assert chat({**base, "stream": False}).stream is False
    assert generate({"model": "m", "prompt": "hi"}).stream is True


def test_oll_11_roles_are_lower_cased_and_unknown_roles_rejected():
    request = chat({"model": "m", "messages": [{"role": "SYSTEM", "content": "s"}, {"role": "User", "content": "u"}]})
    assert [m.role for m in request.messages] == ["system", "user"]
    with pytest.raises(InvalidRequest) as exc:
        chat({"model": "m", "messages": [{"role": "user", "content": "u"}, {"role": "developer", "content": "d"}]})
    assert exc.value.param == "messages[1].role"
    assert "system, user, assistant, tool" in exc.value.message


def test_oll_12_images_are_raw_base64_with_sniffed_media_type():
    request = chat(
        {
            "model": "llava",
            "messages": [
                {"role": "user", "content": "what is in these images?", "images": [b64(PNG), b64(JPEG), b64(b"??")]},
            ],
        }
    )
    assert request.messages[0].parts == (
        TextPart(text="what is in these images?"),
        ImagePart(data=PNG, media_type="image/png"),
        ImagePart(data=JPEG, media_type="image/jpeg"),
        ImagePart(data=b"??", media_type=None),
    )


def test_oll_12_data_uri_is_tolerated_and_bad_base64_rejected():
    request = chat(
        {
            "model": "llava",
            "messages": [
                {"role": "user", "content": "", "images": [f"data:image/webp;base64,{b64(b'xx')}"]},
            ],
        }
    )
    assert request.messages[0].parts == (ImagePart(data=b"xx", media_type="image/webp"),)
    with pytest.raises(InvalidRequest) as exc:
        chat({"model": "llava", "messages": [{"role": "user", "content": "x", "images": ["not base64!"]}]})
    assert exc.value.param == "messages[0].images[0]"


def test_oll_13_tools_in_openai_shape_become_tools():
    no_params = {"type": "function", "function": {"name": "now"}}
    request = chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "tools": [WEATHER_TOOL, no_params]})
    assert request.tools == (
        Tool(
            name="get_current_weather",
            description="Get the current weather for a location",
            parameters=WEATHER_TOOL["function"]["parameters"],
        ),
        Tool(name="now"),
    )


def test_oll_14_options_map_to_sampling_and_unknown_keys_are_ignored():
    request = chat(
        {
            "model": "m",
            "messages": [{"role": "user", "content": "x"}],
            "options": {
                "temperature": 0.8,
                "top_k": 20,
                "top_p": 0.9,
                "min_p": 0.05,
                "seed": 42,
                "repeat_penalty": 1.2,
                "presence_penalty": 1.5,
                "frequency_penalty": 1.0,
                "num_predict": 100,
                "stop": ["\n", "user:"],
                "num_ctx": 1024,
                "num_keep": 5,
                "typical_p": 0.7,
                "mirostat": 1,
                "num_gpu": 1,
                "use_mmap": True,
                "not_an_option": "ignored",
            },
        }
    )
    assert request.sampling == Sampling(
        temperature=0.8,
        top_p=0.9,
        top_k=20,
        min_p=0.05,
        seed=42,
        presence_penalty=1.5,
        frequency_penalty=1.0,
        repeat_penalty=1.2,
    )
    assert (request.max_tokens, request.stop, request.num_ctx) == (100, ("\n", "user:"), 1024)


def test_oll_14_absent_or_null_options_are_backend_defaults():
    request = chat(
        {"model": "m", "messages": [{"role": "user", "content": "x"}], "options": {"temperature": None, "top_k": None}}
    )
    assert request.sampling == Sampling()
    assert request.sampling.temperature is UNSET
    assert (request.max_tokens, request.stop, request.num_ctx) == (None, (), UNSET)


@pytest.mark.parametrize("num_predict", [-1, -2, 0])
def test_oll_14_num_predict_unlimited_values_mean_no_limit(num_predict):
    request = generate({"model": "m", "prompt": "x", "options": {"num_predict": num_predict}})
    assert request.max_tokens is None


def test_oll_8_format_json_and_schema():
    base = {"model": "m", "messages": [{"role": "user", "content": "x"}]}
    schema = {"type": "object", "properties": {"age": {"type": "integer"}}, "required": ["age"]}
    assert chat({**base, "format": "json"}).response_format == ResponseFormat(kind="json_object")
    assert chat({**base, "format": schema}).response_format == ResponseFormat(kind="json_schema", schema=schema)
    assert chat({**base, "format": ""}).response_format == ResponseFormat()
    with pytest.raises(InvalidRequest) as exc:
        chat({**base, "format": "yaml"})
    assert exc.value.param == "format"


@pytest.mark.parametrize(
    ("think", "reasoning"),
    [(True, True), (False, False), ("low", True), ("medium", True), ("high", True), ("max", True), (None, UNSET)],
)
def test_oll_8_think_bool_or_level_sets_reasoning(think, reasoning):
    request = chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "think": think})
    assert request.reasoning == reasoning


def test_oll_8_think_unknown_level_rejected():
    with pytest.raises(InvalidRequest) as exc:
        chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "think": "extreme"})
    assert exc.value.param == "think"


@pytest.mark.parametrize("keep_alive", ["5m", "1h", 300, 0, -1, 2.5])
def test_oll_15_keep_alive_is_accepted(keep_alive):
    assert chat({"model": "m", "messages": [{"role": "user", "content": "x"}], "keep_alive": keep_alive})


# ---------------------------------------------------------------------------------------------------- tool history


def test_oll_24_tool_call_history_arguments_objects_become_json_text():
    request = chat(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "weather in Paris and Tokyo?"},
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "get_current_weather", "arguments": {"location": "Paris"}}},
                        {
                            "id": "call_client1",
                            "function": {"index": 1, "name": "get_current_weather", "arguments": {"location": "Tokyo"}},
                        },
                    ],
                },
            ],
        }
    )
    assert request.messages[1].parts == (
        ToolCallPart(id="call_0", name="get_current_weather", arguments='{"location":"Paris"}'),
        ToolCallPart(id="call_client1", name="get_current_weather", arguments='{"location":"Tokyo"}'),
    )


def test_4_4_5_invented_ids_are_stable_and_results_paired_by_order_and_name():
    history = [
        {"role": "user", "content": "weather and time?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {"function": {"name": "get_time", "arguments": {}}},
                {"function": {"name": "get_current_weather", "arguments": {"location": "Paris"}}},
            ],
        },
        {"role": "tool", "tool_name": "get_current_weather", "content": "22 C"},
        {"role": "tool", "tool_name": "get_time", "content": "noon"},
        {"role": "assistant", "content": "", "tool_calls": [{"function": {"name": "get_time", "arguments": {}}}]},
        {"role": "tool", "content": "one pm"},
    ]
    first = chat({"model": "m", "messages": history})
    later = chat({"model": "m", "messages": [*history, {"role": "user", "content": "thanks"}]})
    assert first.messages == later.messages[:-1]
    assert [p.id for m in first.messages for p in m.parts if isinstance(p, ToolCallPart)] == [
        "call_0",
        "call_1",
        "call_2",
    ]
    results = [m.parts[0] for m in first.messages if m.role == "tool"]
    assert results == [
        ToolResultPart(call_id="call_1", name="get_current_weather", content=(TextPart(text="22 C"),)),
        ToolResultPart(call_id="call_0", name="get_time", content=(TextPart(text="noon"),)),
        ToolResultPart(call_id="call_2", name=None, content=(TextPart(text="one pm"),)),
    ]


def test_4_4_5_result_with_its_own_id_answers_that_call_first():
    request = chat(
        {
            "model": "m",
            "messages": [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [
                        {"function": {"name": "f", "arguments": {"n": 1}}},
                        {"function": {"name": "f", "arguments": {"n": 2}}},
                    ],
                },
                {"role": "tool", "tool_name": "f", "tool_call_id": "call_0", "content": "one"},
                {"role": "tool", "tool_name": "f", "content": "two"},
            ],
        }
    )
    assert [m.parts[0].call_id for m in request.messages[1:]] == ["call_0", "call_1"]


def test_4_4_5_client_tool_call_id_is_never_rewritten():
    request = chat(
        {
            "model": "m",
            "messages": [
                {
                    "role": "assistant",
                    "content": "",
                    "tool_calls": [{"id": "call_abc", "function": {"name": "f", "arguments": {}}}],
                },
                {"role": "tool", "tool_name": "f", "tool_call_id": "call_abc", "content": "ok"},
                {"role": "tool", "tool_name": "unknown", "content": "orphan"},
            ],
        }
    )
    assert request.messages[0].parts == (ToolCallPart(id="call_abc", name="f", arguments="{}"),)
    assert request.messages[1].parts == (ToolResultPart(call_id="call_abc", name="f", content=(TextPart(text="ok"),)),)
    assert request.messages[2].parts == (
        ToolResultPart(call_id=None, name="unknown", content=(TextPart(text="orphan"),)),
    )


# ---------------------------------------------------------------------------------------------------- generate


def test_oll_16_generate_system_and_prompt_become_messages():
    request = generate(
        {
            "model": "llava",
            "prompt": "What is in this picture?",
            "system": "Be brief.",
            "images": [b64(PNG)],
            "template": "{{ .Prompt }}",
            "context": [1, 2, 3],
            "options": {"temperature": 0},
            "format": "json",
            "stream": False,
        }
    )
    assert request == Request(
        model="llava",
        messages=(
            Message(role="system", parts=(TextPart(text="Be brief."),)),
            Message(
                role="user",
                parts=(TextPart(text="What is in this picture?"), ImagePart(data=PNG, media_type="image/png")),
            ),
        ),
        response_format=ResponseFormat(kind="json_object"),
        sampling=Sampling(temperature=0.0),
        stream=False,
    )


def test_oll_16_generate_raw_prompt_skips_the_template():
    request = generate(
        {
            "model": "mistral",
            "prompt": "[INST] why is the sky blue? [/INST]",
            "raw": True,
            "system": "ignored in raw mode",
            "stream": False,
        }
    )
    assert request.raw_prompt == "[INST] why is the sky blue? [/INST]"
    assert request.messages == ()
    with pytest.raises(UnsupportedFeature) as exc:
        generate({"model": "llava", "prompt": "x", "raw": True, "images": [b64(PNG)]})
    assert exc.value.param == "images"


def test_oll_16_generate_suffix_is_refused_not_dropped():
    assert generate({"model": "m", "prompt": "def f(", "suffix": ""}).messages
    with pytest.raises(UnsupportedFeature) as exc:
        generate({"model": "codellama:code", "prompt": "def compute_gcd(a, b):", "suffix": "    return result"})
    assert exc.value.param == "suffix"


# ---------------------------------------------------------------------------------------------------- load / unload


def test_oll_17_empty_messages_or_prompt_is_a_load_request():
    load_chat = decode_body(b'{"model": "llama3.2", "messages": []}', oll.ChatRequest)
    assert oll.is_load_request(load_chat) and not oll.is_unload_request(load_chat)
    assert oll.is_load_request(decode_body(b'{"model": "llama3.2"}', oll.ChatRequest))
    assert oll.is_load_request(decode_body(b'{"model": "llama3.2"}', oll.GenerateRequest))
    assert not oll.is_load_request(decode_body(b'{"model": "m", "prompt": "hi"}', oll.GenerateRequest))
    assert not oll.is_load_request(
        decode_body(b'{"model": "m", "messages": [{"role": "user", "content": "hi"}]}', oll.ChatRequest)
    )
    assert oll.chat_to_internal(load_chat).messages == ()  # translating does not raise


@pytest.mark.parametrize(
    ("keep_alive", "unload"),
    [(0, True), (0.0, True), ("0", True), ("0s", True), ("0m0s", True), ("5m", False), (-1, False), (None, False)],
)
def test_oll_17_keep_alive_zero_unloads(keep_alive, unload):
    body = msgspec.json.encode({"model": "llama3.2", "prompt": "", "keep_alive": keep_alive})
    assert oll.is_unload_request(decode_body(body, oll.GenerateRequest)) is unload


def test_oll_17_keep_alive_zero_with_a_prompt_is_not_an_unload():
    wire = decode_body(b'{"model": "m", "prompt": "hi", "keep_alive": 0}', oll.GenerateRequest)
    assert not oll.is_unload_request(wire)


def test_oll_17_load_and_unload_responses():
    chat_load = json.loads(oll.encode_load_response("llama3.2", META, unloaded=False, chat=True))
    assert chat_load == {
        "model": "llama3.2",
        "created_at": CREATED_AT,
        "message": {"role": "assistant", "content": ""},
        "done": True,
        "done_reason": "load",
    }
    ollama.ChatResponse.model_validate(chat_load)
    unload = json.loads(oll.encode_load_response("llama3.2:latest", META, unloaded=True, chat=False))
    assert unload == {
        "model": "llama3.2:latest",
        "created_at": CREATED_AT,
        "response": "",
        "done": True,
        "done_reason": "unload",
    }
    ollama.GenerateResponse.model_validate(unload)


# ---------------------------------------------------------------------------------------------------- chat output


async def test_oll_21_message_in_every_chat_chunk_and_oll_22_metrics_on_the_final_one():
    raw = await lines(
        oll.encode_chat_stream,
        KeepAlive(),
        Usage(prompt_tokens=26),
        TextDelta(text="The"),
        KeepAlive(),
        TextDelta(text=" sky"),
        FINAL_USAGE,
        Finished(reason="stop"),
    )
    objs = parse(raw)
    for obj in objs:
        ollama.ChatResponse.model_validate(obj)
    assert objs == [
        {
            "model": "llama3.2",
            "created_at": CREATED_AT,
            "message": {"role": "assistant", "content": "The"},
            "done": False,
        },
        {
            "model": "llama3.2",
            "created_at": CREATED_AT,
            "message": {"role": "assistant", "content": " sky"},
            "done": False,
        },
        {
            "model": "llama3.2",
            "created_at": CREATED_AT,
            "message": {"role": "assistant", "content": ""},
            "done": True,
            "done_reason": "stop",
            "total_duration": 6_000,
            "load_duration": 1_000,
            "prompt_eval_count": 26,
            "prompt_eval_duration": 2_000,
            "eval_count": 298,
            "eval_duration": 3_000,
        },
    ]


async def test_oll_29_ndjson_lines_and_oll_30_keepalive_writes_nothing():
    raw = await lines(oll.encode_chat_stream, KeepAlive(), KeepAlive(), TextDelta(text="a\nb"), Finished())
    assert len(raw) == 2
    assert all(line.endswith(b"\n") and b"\n" not in line[:-1] for line in raw)
    assert b"\n\n" not in b"".join(raw) and not b"".join(raw).startswith(b"\n")


async def test_oll_23_length_finish_and_other_reasons_map_to_stop():
    for reason, wire in [
        ("length", "length"),
        ("stop", "stop"),
        ("stop_sequence", "stop"),
        ("tool_calls", "stop"),
        ("content_filter", "stop"),
    ]:
        objs = parse(await lines(oll.encode_chat_stream, TextDelta(text="x"), Finished(reason=reason)))
        assert objs[-1]["done_reason"] == wire


async def test_oll_20_reasoning_deltas_go_to_message_thinking():
    objs = parse(
        await lines(oll.encode_chat_stream, ReasoningDelta(text="Let me think"), TextDelta(text="42"), Finished())
    )
    assert [o["message"] for o in objs] == [
        {"role": "assistant", "content": "", "thinking": "Let me think"},
        {"role": "assistant", "content": "42"},
        {"role": "assistant", "content": ""},
    ]
    for obj in objs:
        assert ollama.ChatResponse.model_validate(obj).message.role == "assistant"


async def test_oll_24_26_tool_call_fragments_leave_whole_as_an_object():
    raw = await lines(
        oll.encode_chat_stream,
        Usage(prompt_tokens=10),
        ToolCallDelta(index=0, id="call_a1", name="get_current_weather", arguments=""),
        ToolCallDelta(index=0, arguments='{"loca'),
        ToolCallDelta(index=0, arguments='tion": "Paris, FR"'),
        ToolCallDelta(index=0, arguments="}"),
        ToolCallDelta(index=1, name="get_time", arguments='{"tz":'),
        ToolCallDelta(index=1, arguments=' "CET"}'),
        Usage(prompt_tokens=10, completion_tokens=20),
        Finished(reason="tool_calls"),
    )
    objs = parse(raw)
    assert [o["done"] for o in objs] == [False, False, True]
    assert objs[0]["message"] == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "call_a1",
                "function": {"index": 0, "name": "get_current_weather", "arguments": {"location": "Paris, FR"}},
            }
        ],
    }
    assert objs[1]["message"]["tool_calls"] == [
        {"id": "call_1", "function": {"index": 1, "name": "get_time", "arguments": {"tz": "CET"}}}
    ]
    assert objs[2]["done_reason"] == "stop" and objs[2]["eval_count"] == 20
    parsed = [ollama.ChatResponse.model_validate(o) for o in objs]
    assert parsed[0].message.tool_calls[0].function.arguments == {"location": "Paris, FR"}
    assert parsed[1].message.tool_calls[0].function.name == "get_time"


async def test_oll_24_arguments_that_are_not_a_json_object_become_empty():
    objs = parse(
        await lines(
            oll.encode_chat_stream,
            ToolCallDelta(index=0, id="c", name="f", arguments="{oops"),
            ToolCallDelta(index=1, id="d", name="g", arguments="[1]"),
            Finished(),
        )
    )
    assert [o["message"]["tool_calls"][0]["function"]["arguments"] for o in objs[:2]] == [{}, {}]
    for obj in objs:
        ollama.ChatResponse.model_validate(obj)


async def test_oll_28_non_streaming_joins_content_thinking_and_tool_calls():
    response = await collect(
        stream(
            Usage(prompt_tokens=26),
            ReasoningDelta(text="The user "),
            ReasoningDelta(text="wants weather."),
            TextDelta(text="Checking"),
            TextDelta(text="."),
            ToolCallDelta(index=0, id="call_x", name="get_current_weather", arguments='{"location":'),
            ToolCallDelta(index=0, arguments='"Paris"}'),
            FINAL_USAGE,
            Finished(reason="tool_calls"),
        )
    )
    obj = json.loads(oll.encode_chat_response(response, META))
    assert obj == {
        "model": "llama3.2",
        "created_at": CREATED_AT,
        "message": {
            "role": "assistant",
            "content": "Checking.",
            "thinking": "The user wants weather.",
            "tool_calls": [
                {
                    "id": "call_x",
                    "function": {"index": 0, "name": "get_current_weather", "arguments": {"location": "Paris"}},
                }
            ],
        },
        "done": True,
        "done_reason": "stop",
        "total_duration": 6_000,
        "load_duration": 1_000,
        "prompt_eval_count": 26,
        "prompt_eval_duration": 2_000,
        "eval_count": 298,
        "eval_duration": 3_000,
    }
    assert ollama.ChatResponse.model_validate(obj).message.tool_calls[0].function.arguments == {"location": "Paris"}


async def test_oll_32_failure_mid_stream_is_one_error_line_then_the_end():
    failed = Failed(error=ErrorInfo(kind="BackendUnavailable", message="runner crashed"))
    objs = parse(
        await lines(
            oll.encode_chat_stream,
            TextDelta(text="Hel"),
            ToolCallDelta(index=0, id="c", name="f", arguments='{"a'),
            failed,
            TextDelta(text="x"),
        )
    )
    assert objs == [
        {
            "model": "llama3.2",
            "created_at": CREATED_AT,
            "message": {"role": "assistant", "content": "Hel"},
            "done": False,
        },
        {"error": "runner crashed"},
    ]
    gen = parse(await lines(oll.encode_generate_stream, failed))
    assert gen == [{"error": "runner crashed"}]


async def test_oll_31_stream_without_terminal_event_ends_with_an_error_line():
    objs = parse(await lines(oll.encode_chat_stream, TextDelta(text="x")))
    assert list(objs[-1]) == ["error"]


# ---------------------------------------------------------------------------------------------------- generate output


async def test_oll_27_generate_stream_response_fragments_and_final_chunk():
    objs = parse(
        await lines(
            oll.encode_generate_stream,
            Usage(prompt_tokens=26),
            ReasoningDelta(text="hmm"),
            TextDelta(text="The"),
            TextDelta(text=" sky"),
            FINAL_USAGE,
            Finished(reason="length"),
        )
    )
    for obj in objs:
        ollama.GenerateResponse.model_validate(obj)
    assert objs == [
        {"model": "llama3.2", "created_at": CREATED_AT, "response": "", "thinking": "hmm", "done": False},
        {"model": "llama3.2", "created_at": CREATED_AT, "response": "The", "done": False},
        {"model": "llama3.2", "created_at": CREATED_AT, "response": " sky", "done": False},
        {
            "model": "llama3.2",
            "created_at": CREATED_AT,
            "response": "",
            "done": True,
            "done_reason": "length",
            "total_duration": 6_000,
            "load_duration": 1_000,
            "prompt_eval_count": 26,
            "prompt_eval_duration": 2_000,
            "eval_count": 298,
            "eval_duration": 3_000,
        },
    ]


async def test_oll_27_generate_non_streaming_response():
    response = await collect(stream(TextDelta(text="The sky is blue."), FINAL_USAGE, Finished()))
    obj = json.loads(oll.encode_generate_response(response, META))
    assert obj["response"] == "The sky is blue." and obj["done"] is True and obj["done_reason"] == "stop"
    assert "thinking" not in obj and obj["eval_count"] == 298
    assert ollama.GenerateResponse.model_validate(obj).response == "The sky is blue."


# ---------------------------------------------------------------------------------------------------- client round trip


def mock_client(events: Sequence[Event], seen: list[Request]) -> ollama.AsyncClient:
    async def handler(http_request: httpx.Request) -> httpx.Response:
        is_chat = http_request.url.path == "/api/chat"
        wire = decode_body(http_request.content, oll.ChatRequest if is_chat else oll.GenerateRequest)
        request = oll.chat_to_internal(wire) if is_chat else oll.generate_to_internal(wire)
        seen.append(request)
        if not request.stream:
            encode = oll.encode_chat_response if is_chat else oll.encode_generate_response
            return httpx.Response(200, content=encode(await collect(stream(*events)), META))
        encoder = oll.encode_chat_stream if is_chat else oll.encode_generate_stream
        body = b"".join(await lines(encoder, *events))
        return httpx.Response(200, content=body, headers={"content-type": "application/x-ndjson"})

    return ollama.AsyncClient(host="http://gateway.test", transport=httpx.MockTransport(handler))


async def test_oll_24_ollama_client_streams_a_fragmented_tool_call_as_one_object():
    seen: list[Request] = []
    client = mock_client(
        [
            ToolCallDelta(index=0, id="call_1", name="get_current_weather", arguments='{"loc'),
            ToolCallDelta(index=0, arguments='ation": "Paris"}'),
            FINAL_USAGE,
            Finished(reason="tool_calls"),
        ],
        seen,
    )
    parts = [
        part
        async for part in await client.chat(
            model="llama3.2",
            messages=[{"role": "user", "content": "weather in Paris?"}],
            tools=[WEATHER_TOOL],
            stream=True,
        )
    ]
    assert parts[0].message.tool_calls[0].function.arguments == {"location": "Paris"}
    assert parts[-1].done and parts[-1].done_reason == "stop" and parts[-1].eval_count == 298
    assert seen[0].tools[0].name == "get_current_weather" and seen[0].stream is True


async def test_oll_9_ollama_client_non_streaming_chat_and_generate():
    seen: list[Request] = []
    client = mock_client([ReasoningDelta(text="hm"), TextDelta(text="Blue."), FINAL_USAGE, Finished()], seen)
    reply = await client.chat(
        model="llama3.2", messages=[{"role": "user", "content": "sky?"}], options={"temperature": 0.1}, think=True
    )
    assert (reply.message.content, reply.message.thinking, reply.done_reason) == ("Blue.", "hm", "stop")
    generated = await client.generate(model="llama3.2", prompt="sky?", system="terse")
    assert generated.response == "Blue."
    assert seen[0].stream is False and seen[0].sampling.temperature == 0.1 and seen[0].reasoning is True
    assert [m.role for m in seen[1].messages] == ["system", "user"]


async def test_oll_32_ollama_client_raises_response_error_on_the_error_line():
    failed = Failed(error=ErrorInfo(kind="BackendUnavailable", message="runner crashed"))
    client = mock_client([TextDelta(text="Hel"), failed], [])
    with pytest.raises(ollama.ResponseError) as exc:
        async for _ in await client.generate(model="llama3.2", prompt="hi", stream=True):
            pass
    assert exc.value.error == "runner crashed" and exc.value.status_code == -1


# ---------------------------------------------------------------------------------------------------- listings, errors


def test_oll_38_40_tags_listing():
    models = [
        ModelInfo(
            name="llama3.2:latest",
            created=1_700_000_000.25,
            size=2_019_393_189,
            digest="a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
            family="llama",
            parameter_size="3.2B",
            quantization="Q4_K_M",
        ),
        ModelInfo(name="no-family"),
    ]
    obj = json.loads(oll.encode_tags(models))
    assert obj["models"][0] == {
        "name": "llama3.2:latest",
        "model": "llama3.2:latest",
        "modified_at": CREATED_AT,
        "size": 2_019_393_189,
        "digest": "a80c4f17acd55265feec403c7aef86be0c25983ab279d83f3bcd3abbcb5b8b72",
        "details": {
            "parent_model": "",
            "format": "gguf",
            "family": "llama",
            "families": ["llama"],
            "parameter_size": "3.2B",
            "quantization_level": "Q4_K_M",
        },
    }
    assert obj["models"][1]["details"]["families"] == []
    listed = ollama.ListResponse.model_validate(obj)
    assert listed.models[0].modified_at.timestamp() == 1_700_000_000.25
    assert listed.models[1].modified_at.timestamp() == 0


def test_oll_38_empty_tags_listing():
    assert oll.encode_tags([]) == b'{"models":[]}'


def test_oll_2_version():
    assert json.loads(oll.encode_version("0.6.2")) == {"version": "0.6.2"}


@pytest.mark.parametrize(
    ("err", "status", "message"),
    [
        (
            InvalidRequest("messages[0].role must be one of system, user, assistant, tool"),
            400,
            "messages[0].role must be one of system, user, assistant, tool",
        ),
        (UnsupportedFeature('"llama3.2" does not support thinking'), 400, '"llama3.2" does not support thinking'),
        (AuthenticationFailed("unauthorized"), 401, "unauthorized"),
        (UnknownModel("llama9"), 404, "model 'llama9' not found"),
        (NoCapacity("no runner has room"), 503, "no runner has room"),
        (BackendUnavailable("runner crashed"), 503, "runner crashed"),
    ],
)
def test_oll_34_35_error_body_is_a_plain_string(err, status, message):
    assert oll.error_body(err) == (status, msgspec.json.encode({"error": message}))


async def test_oll_27_generate_stream_has_no_tool_calls():
    objs = parse(
        await lines(
            oll.encode_generate_stream,
            ToolCallDelta(index=0, id="c", name="f", arguments="{}"),
            TextDelta(text="ok"),
            Finished(),
        )
    )
    assert [o["response"] for o in objs] == ["ok", ""]
