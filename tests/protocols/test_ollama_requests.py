"""protocols.ollama, requests: chat and generate bodies to the internal request, tool history, load and unload
(docs/protocols.md section 3), after the examples of Ollama's docs/api.md."""

from __future__ import annotations

import json

import msgspec
import ollama
import pytest

from meshgate.protocols import ollama as oll
from meshgate.protocols.model import (
    UNSET,
    ImagePart,
    InvalidRequest,
    Message,
    ReasoningPart,
    Request,
    ResponseFormat,
    Sampling,
    TextPart,
    Tool,
    ToolCallPart,
    ToolResultPart,
    UnsupportedFeature,
    decode_body,
)
from tests.protocols.ollama_cases import (
    CREATED_AT,
    JPEG,
    META,
    PNG,
    WEATHER_TOOL,
    b64,
    chat,
    generate,
)

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


def test_oll_8_think_on_a_model_that_cannot_think_is_ollamas_400():
    """``server/routes.go``: ``"<model>" does not support thinking``, for true and for a level alike."""
    asked = {"model": "gemma3:270m", "messages": [{"role": "user", "content": "x"}]}
    for think in (True, "low"):
        wire = msgspec.json.decode(json.dumps({**asked, "think": think}), type=oll.ChatRequest)
        refused = oll.refuses_thinking(wire, can_think=False)
        assert isinstance(refused, InvalidRequest) and refused.param == "think"
        assert oll.error_body(refused) == (400, b'{"error":"\\"gemma3:270m\\" does not support thinking"}')
        assert oll.refuses_thinking(wire, can_think=True) is None
    for think in (False, None):
        wire = msgspec.json.decode(json.dumps({**asked, "think": think}), type=oll.ChatRequest)
        assert oll.refuses_thinking(wire, can_think=False) is None
    load = msgspec.json.decode(json.dumps({"model": "m", "think": True}), type=oll.GenerateRequest)
    assert oll.refuses_thinking(load, can_think=False) is None  # a load asks nothing of the model's thinking


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
