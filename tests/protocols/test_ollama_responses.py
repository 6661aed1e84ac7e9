"""protocols.ollama, responses: NDJSON encoders, listings and errors (docs/protocols.md section 3). Every response
line is also validated with the official ``ollama`` client's pydantic types, and a few round trips drive
``ollama.AsyncClient`` over an ``httpx.MockTransport``."""

from __future__ import annotations

import json
from collections.abc import Sequence

import httpx
import msgspec
import ollama
import pytest

from meshgate.protocols import ollama as oll
from meshgate.protocols.model import (
    AuthenticationFailed,
    BackendUnavailable,
    ErrorInfo,
    Event,
    Failed,
    Finished,
    InvalidRequest,
    KeepAlive,
    ModelInfo,
    NoCapacity,
    ReasoningDelta,
    Request,
    TextDelta,
    ToolCallDelta,
    UnknownModel,
    UnsupportedFeature,
    Usage,
    collect,
    decode_body,
)
from tests.protocols.ollama_cases import (
    CREATED_AT,
    FINAL_USAGE,
    META,
    WEATHER_TOOL,
    lines,
    parse,
    stream,
)

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


async def test_oll_29_ndjson_lines_and_oll_30_keepalive_writes_a_space_never_a_line():
    """A keep-alive is bytes for idle proxies (issue 37, 13: a queue or resume wait sent none for up to 60 s),
    never a blank line: it is the next line's leading whitespace, which ``json.loads`` skips."""
    raw = await lines(oll.encode_chat_stream, KeepAlive(), KeepAlive(), TextDelta(text="a\nb"), Finished())
    assert len(raw) == 2 and raw[0].startswith(b"  {")
    assert all(line.endswith(b"\n") and b"\n" not in line[:-1] for line in raw)
    assert b"\n\n" not in b"".join(raw) and not b"".join(raw).startswith(b"\n")
    assert [json.loads(line)["done"] for line in raw] == [False, True]


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
