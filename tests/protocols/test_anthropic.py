"""Anthropic Messages translation, tested as pure functions against the official ``anthropic`` SDK's own types.

Each test is named after the docs/protocols.md item it proves (``ant_NN``, or ``map_4_4_N`` for section 4.4).
Streams are checked three ways: exact frames, each event parsed by the SDK's ``RawMessageStreamEvent``, and the
whole stream driven through the SDK's ``Stream`` + ``MessageStream`` over an in-memory response.
"""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator, Iterable
from typing import Any

import anthropic
import httpx2  # the HTTP library anthropic 2.x builds its responses with
import msgspec
import pytest
from anthropic._streaming import SSEDecoder
from anthropic.lib.streaming import MessageStream
from anthropic.types import Message as SdkMessage
from anthropic.types import ModelInfo as SdkModelInfo
from anthropic.types import RawMessageStreamEvent
from pydantic import TypeAdapter

from meshgate.protocols.anthropic import (
    CountTokensRequest,
    MessagesRequest,
    count_tokens_to_internal,
    encode_count_tokens,
    encode_message_response,
    encode_message_stream,
    encode_model,
    encode_models,
    error_body,
    messages_to_internal,
    tool_use_id,
)
from meshgate.protocols.model import (
    UNSET,
    AuthenticationFailed,
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    Event,
    Finished,
    GatewayError,
    ImagePart,
    InvalidRequest,
    Message,
    Meta,
    ModelInfo,
    NoCapacity,
    NotFound,
    RateLimited,
    ReasoningDelta,
    ReasoningPart,
    RequestTooLarge,
    Response,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    Tool,
    ToolCall,
    ToolCallDelta,
    ToolCallPart,
    ToolChoice,
    ToolResultPart,
    UnknownModel,
    UnsupportedFeature,
    Usage,
    decode_body,
)

META = Meta(id="01abc", model="claude-sonnet-4-5", created=1_700_000_000.0)
WEATHER_TOOL = {
    "name": "get_weather",
    "description": "Get the current weather in a given location",
    "input_schema": {
        "type": "object",
        "properties": {"location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"}},
        "required": ["location"],
    },
}
EVENT_ADAPTER: TypeAdapter[Any] = TypeAdapter(RawMessageStreamEvent)


def usage(input_tokens: int, output_tokens: int) -> dict[str, int]:
    """The usage object as this gateway writes it (no prompt caching, so the cache fields are 0)."""
    return {
        "input_tokens": input_tokens,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 0,
        "output_tokens": output_tokens,
    }


def decode(body: dict[str, Any], into: type = MessagesRequest) -> Any:
    return decode_body(msgspec.json.encode(body), into)


def request(**fields: Any) -> dict[str, Any]:
    """A minimal valid body in the shape of the docs' first example, with ``fields`` on top."""
    body: dict[str, Any] = {
        "model": "claude-sonnet-4-5",
        "max_tokens": 1024,
        "messages": [{"role": "user", "content": "Hello, Claude"}],
    }
    return body | fields


def internal(**fields: Any):
    return messages_to_internal(decode(request(**fields)))


def invalid(body: dict[str, Any], into: type = MessagesRequest) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as caught:
        wire = decode(body, into)
        (messages_to_internal if into is MessagesRequest else count_tokens_to_internal)(wire)
    return caught.value


async def stream_of(events: Iterable[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def encode(events: Iterable[Event]) -> list[bytes]:
    return [frame async for frame in encode_message_stream(stream_of(events), META)]


def parsed(frames: list[bytes]) -> list[tuple[str | None, dict[str, Any]]]:
    """(event name, JSON data) for every SSE event, parsed by the SDK's own decoder."""
    return [(sse.event, sse.json()) for sse in SSEDecoder().iter_bytes(iter(frames))]


def sdk_stream(frames: list[bytes]) -> MessageStream:
    """The SDK's ``client.messages.stream()`` object, reading our frames as a 200 response body."""
    client = anthropic.Anthropic(api_key="dummy", base_url="http://gateway.invalid")
    response = httpx2.Response(
        200, content=b"".join(frames), request=httpx2.Request("POST", "http://gateway.invalid/v1/messages")
    )
    raw = anthropic.Stream(cast_to=RawMessageStreamEvent, response=response, client=client)
    return MessageStream(raw, anthropic.not_given)


TOOL_STREAM: list[Event] = [
    Usage(prompt_tokens=472),
    ReasoningDelta(text="The user wants weather; "),
    ReasoningDelta(text="call the tool.", provider_metadata={"signature": "EqQBCgIYAhIM"}),
    TextDelta(text="Okay, let's check the weather for San Francisco, CA:"),
    ToolCallDelta(index=0, id="toolu_01T1x1fJ34qAmk2tNTrN7Up6", name="get_weather"),
    ToolCallDelta(index=0, arguments='{"location":'),
    ToolCallDelta(index=0, arguments=' "San Francisco, CA"}'),
    ToolCallDelta(index=1, id="toolu_02", name="get_time", arguments='{"tz": "PST"}'),
    Usage(prompt_tokens=472, completion_tokens=89),
    Finished(reason="tool_calls"),
]


# ---------------------------------------------------------------------------------------------------- requests


def test_ant_11_max_tokens_required_and_named():
    body = request()
    del body["max_tokens"]
    err = invalid(body)
    assert err.param == "max_tokens"
    assert "max_tokens" in err.message


@pytest.mark.parametrize("field", ["model", "messages"])
def test_ant_11_model_and_messages_required(field):
    body = request()
    del body[field]
    assert invalid(body).param == field


def test_ant_11_max_tokens_must_be_positive():
    err = invalid(request(max_tokens=0))
    assert err.param == "max_tokens"
    assert ">= 1" in err.message


def test_ant_11_messages_must_not_be_empty():
    assert invalid(request(messages=[])).param == "messages"


def test_ant_12_unknown_role_is_named():
    assert invalid(request(messages=[{"role": "tool", "content": "x"}])).param == "messages[0].role"


def test_ant_12_system_role_messages_join_the_system_prompt():
    req = internal(
        system="You are terse.",
        messages=[
            {"role": "user", "content": "Hi"},
            {"role": "system", "content": [{"type": "text", "text": "Answer in French."}]},
            {"role": "user", "content": "How are you?"},
        ],
    )
    assert req.messages == (
        Message(role="system", parts=(TextPart(text="You are terse."), TextPart(text="Answer in French."))),
        Message(role="user", parts=(TextPart(text="Hi"), TextPart(text="How are you?"))),
    )


def test_ant_12_only_system_messages_is_invalid():
    assert invalid(request(messages=[{"role": "system", "content": "x"}])).param == "messages"


def test_ant_13_consecutive_same_role_messages_merge():
    req = internal(
        messages=[
            {"role": "user", "content": "Hello"},
            {"role": "user", "content": [{"type": "text", "text": "there"}]},
            {"role": "assistant", "content": "Hi"},
            {"role": "user", "content": "Bye"},
        ]
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "user"]
    assert req.messages[0].parts == (TextPart(text="Hello"), TextPart(text="there"))
    assert req.prefill is False


def test_ant_13_final_assistant_message_is_a_prefill():
    req = internal(
        messages=[
            {"role": "user", "content": "What's the Greek name for Sun? (A) Sol (B) Helios (C) Sun"},
            {"role": "assistant", "content": "The best answer is ("},
        ]
    )
    assert req.prefill is True
    assert req.messages[-1] == Message(role="assistant", parts=(TextPart(text="The best answer is ("),))


def test_ant_14_system_as_text_blocks_with_cache_control():
    req = internal(
        system=[
            {"type": "text", "text": "You are a helpful assistant."},
            {"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}},
        ]
    )
    assert req.messages[0] == Message(
        role="system", parts=(TextPart(text="You are a helpful assistant."), TextPart(text="Be brief."))
    )


def test_map_4_4_4_claude_code_billing_header_block_is_dropped():
    req = internal(
        system=[
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=1.0; cch=93a1f;"},
            {"type": "text", "text": "You are Claude Code."},
        ]
    )
    assert req.messages[0] == Message(role="system", parts=(TextPart(text="You are Claude Code."),))


def test_ant_15_base64_image_becomes_bytes():
    png = b"\x89PNG\r\n\x1a\n"
    source = {"type": "base64", "media_type": "image/png", "data": base64.b64encode(png).decode()}
    block = {"type": "image", "source": source}
    req = internal(messages=[{"role": "user", "content": [block, {"type": "text", "text": "What is this?"}]}])
    assert req.messages[0].parts == (ImagePart(data=png, media_type="image/png"), TextPart(text="What is this?"))


def test_ant_15_url_image_keeps_the_url():
    block = {"type": "image", "source": {"type": "url", "url": "https://upload.wikimedia.org/a.jpg"}}
    req = internal(messages=[{"role": "user", "content": [block]}])
    assert req.messages[0].parts == (ImagePart(url="https://upload.wikimedia.org/a.jpg"),)


def test_ant_15_bad_base64_is_named():
    block = {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "not base64!"}}
    err = invalid(request(messages=[{"role": "user", "content": [block]}]))
    assert err.param == "messages[0].content[0].source.data"


def test_ant_15_unsupported_image_source_is_named():
    block = {"type": "image", "source": {"type": "file", "file_id": "file_011"}}
    err = invalid(request(messages=[{"role": "user", "content": [{"type": "text", "text": "see"}, block]}]))
    assert err.param == "messages[0].content[1].source.type"


def test_ant_15_malformed_known_block_names_its_field():
    block = {"type": "tool_use", "name": "get_weather", "input": {}}
    err = invalid(request(messages=[{"role": "user", "content": "q"}, {"role": "assistant", "content": [block]}]))
    assert err.param == "messages[1].content[0].id"
    assert "`$.messages[1].content[0].id`" in err.message


def test_ant_15_tool_use_input_becomes_json_arguments():
    block = {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"location": "San Francisco, CA"}}
    req = internal(messages=[{"role": "user", "content": "Weather?"}, {"role": "assistant", "content": [block]}])
    call = req.messages[1].parts[0]
    assert call == ToolCallPart(id="toolu_01A", name="get_weather", arguments='{"location":"San Francisco, CA"}')


def test_map_4_4_6_tool_results_split_out_before_the_user_text():
    req = internal(
        messages=[
            {"role": "user", "content": "Weather in SF and the time?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"location": "SF"}},
                    {"type": "tool_use", "id": "toolu_01B", "name": "get_time", "input": {}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Also, be brief."},
                    {"type": "tool_result", "tool_use_id": "toolu_01A", "content": "15 degrees"},
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01B",
                        "content": [{"type": "text", "text": "clock broken"}, {"type": "search_result"}],
                        "is_error": True,
                    },
                ],
            },
        ]
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "tool", "tool", "user"]
    assert req.messages[2].parts == (
        ToolResultPart(call_id="toolu_01A", name="get_weather", content=(TextPart(text="15 degrees"),)),
    )
    assert req.messages[3].parts == (
        ToolResultPart(call_id="toolu_01B", name="get_time", content=(TextPart(text="clock broken"),), is_error=True),
    )
    assert req.messages[4] == Message(role="user", parts=(TextPart(text="Also, be brief."),))
    assert req.prefill is False


def test_map_4_4_6_user_message_of_only_tool_results_leaves_no_empty_user_message():
    req = internal(
        messages=[
            {"role": "user", "content": "Weather?"},
            {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "get_weather", "input": {}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1"}]},
        ]
    )
    assert [m.role for m in req.messages] == ["user", "assistant", "tool"]
    assert req.messages[2].parts == (ToolResultPart(call_id="t1", name="get_weather"),)


def test_map_4_4_13_thinking_keeps_its_signature_and_redacted_thinking_is_dropped():
    req = internal(
        messages=[
            {"role": "user", "content": "2+2?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "thinking", "thinking": "Simple sum.", "signature": "EqQBCgIYAhIM"},
                    {"type": "redacted_thinking", "data": "EmwKAhgBEgy3va3pzix"},
                    {"type": "text", "text": "4"},
                ],
            },
            {"role": "user", "content": "Thanks"},
        ]
    )
    assert req.messages[1].parts == (
        ReasoningPart(text="Simple sum.", provider_metadata={"signature": "EqQBCgIYAhIM"}),
        TextPart(text="4"),
    )


def test_ant_15_unknown_block_types_are_ignored():
    content = [
        {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc"}},
        {"type": "search_result", "source": "https://example.com", "title": "t", "content": []},
        {"type": "text", "text": "Summarize", "citations": None, "cache_control": {"type": "ephemeral"}},
        {"type": "brand_new_block", "content": {"weird": True}},
    ]
    assert internal(messages=[{"role": "user", "content": content}]).messages[0].parts == (TextPart(text="Summarize"),)


def test_ant_16_sampling_unset_null_and_values_differ():
    assert internal().sampling == Sampling()
    assert internal(temperature=None).sampling == Sampling(temperature=None)
    req = internal(temperature=0.2, top_p=0.9, top_k=40, stop_sequences=["\n\nHuman:", "END"])
    assert req.sampling == Sampling(temperature=0.2, top_p=0.9, top_k=40)
    assert req.sampling.min_p is UNSET
    assert req.stop == ("\n\nHuman:", "END")
    assert req.max_tokens == 1024


def test_ant_17_tools_become_internal_tools():
    req = internal(tools=[WEATHER_TOOL | {"cache_control": {"type": "ephemeral"}, "strict": True, "type": "custom"}])
    assert req.tools == (
        Tool(name="get_weather", description=WEATHER_TOOL["description"], parameters=WEATHER_TOOL["input_schema"]),
    )


def test_ant_17_server_tools_are_unsupported():
    with pytest.raises(UnsupportedFeature) as caught:
        internal(tools=[WEATHER_TOOL, {"type": "web_search_20250305", "name": "web_search", "max_uses": 5}])
    assert caught.value.param == "tools[1].type"


@pytest.mark.parametrize(
    ("wire", "expected"),
    [
        ({"type": "auto"}, ToolChoice(mode="auto")),
        ({"type": "any"}, ToolChoice(mode="required")),
        ({"type": "none"}, ToolChoice(mode="none")),
        ({"type": "tool", "name": "get_weather"}, ToolChoice(mode="tool", name="get_weather")),
        ({"type": "auto", "disable_parallel_tool_use": True}, ToolChoice(mode="auto", parallel=False)),
        ({"type": "any", "disable_parallel_tool_use": False}, ToolChoice(mode="required", parallel=True)),
    ],
)
def test_ant_18_tool_choice(wire, expected):
    assert internal(tools=[WEATHER_TOOL], tool_choice=wire).tool_choice == expected


def test_ant_18_tool_choice_tool_needs_a_name():
    assert invalid(request(tool_choice={"type": "tool"})).param == "tool_choice.name"


@pytest.mark.parametrize(
    ("thinking", "expected"),
    [
        (None, UNSET),
        ({"type": "enabled", "budget_tokens": 10000}, True),
        ({"type": "adaptive", "display": "summarized"}, True),
        ({"type": "disabled"}, False),
    ],
)
def test_ant_19_thinking_sets_reasoning(thinking, expected):
    fields = {} if thinking is None else {"thinking": thinking}
    assert internal(**fields).reasoning is expected


def test_ant_20_unknown_and_unused_fields_are_tolerated():
    req = internal(
        metadata={"user_id": "13803d75-b4b5-4c3e-b2a2-6f21399b021b"},
        service_tier="auto",
        cache_control={"type": "ephemeral"},
        container="container_011",
        inference_geo="us",
        some_future_field={"anything": [1, 2]},
    )
    assert req.model == "claude-sonnet-4-5"
    assert req.stream is False


def test_ant_20_output_config_json_schema_and_stream():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    req = internal(output_config={"effort": "high", "format": {"type": "json_schema", "schema": schema}}, stream=True)
    assert req.response_format == ResponseFormat(kind="json_schema", schema=schema)
    assert req.stream is True
    assert internal(output_config={"effort": "low"}).response_format == ResponseFormat()


def test_ant_50_count_tokens_has_no_max_tokens():
    body = request(system="Be brief.", tools=[WEATHER_TOOL])
    del body["max_tokens"]
    req = count_tokens_to_internal(decode(body, CountTokensRequest))
    assert req.max_tokens is None
    assert req.tools[0].name == "get_weather"
    assert [m.role for m in req.messages] == ["system", "user"]


def test_ant_51_count_tokens_reply():
    assert encode_count_tokens(2095) == b'{"input_tokens":2095}'


# ---------------------------------------------------------------------------------------------------- responses


def response_json(response: Response) -> dict[str, Any]:
    body = msgspec.json.decode(encode_message_response(response, META))
    SdkMessage.model_validate(body)
    return body


def test_ant_22_text_reply_matches_the_docs_example():
    body = response_json(
        Response(text="Hi! My name is Claude.", usage=Usage(prompt_tokens=2095, completion_tokens=503))
    )
    assert body == {
        "id": "msg_01abc",
        "type": "message",
        "role": "assistant",
        "model": "claude-sonnet-4-5",
        "content": [{"type": "text", "text": "Hi! My name is Claude."}],
        "stop_reason": "end_turn",
        "stop_sequence": None,
        "usage": {
            "input_tokens": 2095,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": 0,
            "output_tokens": 503,
        },
    }


@pytest.mark.parametrize(
    ("backend", "shown"),
    [
        ("call_6893e2a1b0c4", "toolu_6893e2a1b0c4"),
        ("toolu_01A", "toolu_01A"),
        ("chatcmpl-tool-9", "toolu_chatcmpl-tool-9"),
    ],
)
async def test_ant_26_tool_use_ids_read_toolu_in_both_answers(backend, shown):
    """A backend mints ``call_<x>`` (OpenAI's convention); an Anthropic client sees ``toolu_<x>``."""
    call = ToolCall(id=backend, name="get_weather", arguments="{}")
    body = msgspec.json.decode(encode_message_response(Response(tool_calls=(call,), finish=Finished()), META))
    assert body["content"][-1]["id"] == shown == tool_use_id(backend)
    events = [ToolCallDelta(index=0, id=backend, name="get_weather", arguments="{}"), Finished(reason="tool_calls")]
    frames = b"".join([frame async for frame in encode_message_stream(stream_of(events), META)])
    assert f'"id":"{shown}"'.encode() in frames


def test_ant_26_blocks_in_order_thinking_text_tool_use_with_object_input():
    response = Response(
        text="Let me check.",
        reasoning="Need the weather tool.",
        reasoning_metadata={"signature": "EqQBCgIYAhIM"},
        tool_calls=(ToolCall(id="toolu_01A", name="get_weather", arguments='{"location": "San Francisco, CA"}'),),
        finish=Finished(reason="tool_calls"),
    )
    body = response_json(response)
    assert body["content"] == [
        {"type": "thinking", "thinking": "Need the weather tool.", "signature": "EqQBCgIYAhIM"},
        {"type": "text", "text": "Let me check."},
        {"type": "tool_use", "id": "toolu_01A", "name": "get_weather", "input": {"location": "San Francisco, CA"}},
    ]
    assert body["stop_reason"] == "tool_use"


def test_ant_26_empty_text_is_omitted_beside_tool_calls_and_bad_arguments_become_empty_input():
    calls = (
        ToolCall(id="toolu_01A", name="get_weather", arguments='{"location" "SF"}'),
        ToolCall(id="toolu_01B", name="get_time", arguments="[1, 2]"),
        ToolCall(id="toolu_01C", name="ping", arguments=""),
    )
    body = response_json(Response(tool_calls=calls, finish=Finished(reason="tool_calls")))
    assert [block["input"] for block in body["content"]] == [{}, {}, {}]
    assert [block["type"] for block in body["content"]] == ["tool_use"] * 3


def test_ant_26_empty_reply_still_has_a_text_block():
    assert response_json(Response())["content"] == [{"type": "text", "text": ""}]


@pytest.mark.parametrize(
    ("finish", "stop_reason", "stop_sequence"),
    [
        (Finished(reason="stop"), "end_turn", None),
        (Finished(reason="stop_sequence", stop_sequence="\n\nHuman:"), "stop_sequence", "\n\nHuman:"),
        (Finished(reason="length"), "max_tokens", None),
        (Finished(reason="tool_calls"), "tool_use", None),
        (Finished(reason="content_filter"), "refusal", None),
        (Finished(reason="stop", stop_sequence="ignored"), "end_turn", None),
    ],
)
def test_ant_24_25_stop_reason_mapping(finish, stop_reason, stop_sequence):
    body = response_json(Response(text="x", finish=finish))
    assert (body["stop_reason"], body["stop_sequence"]) == (stop_reason, stop_sequence)


def test_ant_24_stop_after_tool_calls_reads_tool_use():
    body = response_json(Response(tool_calls=(ToolCall(id="t", name="f", arguments="{}"),), finish=Finished()))
    assert body["stop_reason"] == "tool_use"


def test_ant_27_input_tokens_exclude_cached_tokens():
    usage = response_json(Response(usage=Usage(prompt_tokens=100, cached_tokens=60, completion_tokens=5)))["usage"]
    assert usage == {
        "input_tokens": 40,
        "cache_creation_input_tokens": 0,
        "cache_read_input_tokens": 60,
        "output_tokens": 5,
    }


# ---------------------------------------------------------------------------------------------------- errors and models


@pytest.mark.parametrize(
    ("err", "status", "kind"),
    [
        (InvalidRequest("bad", param="messages"), 400, "invalid_request_error"),
        (UnsupportedFeature("no server tools"), 400, "invalid_request_error"),
        (AuthenticationFailed("bad key"), 401, "authentication_error"),
        (UnknownModel("claude-9"), 404, "not_found_error"),
        (NotFound("nope"), 404, "not_found_error"),
        (RequestTooLarge("too big"), 413, "request_too_large"),
        (RateLimited("slow down"), 429, "rate_limit_error"),
        (NoCapacity("busy"), 529, "overloaded_error"),
        (BackendUnavailable("runner down"), 529, "overloaded_error"),
        (BackendTimeout("slow runner"), 504, "timeout_error"),
        (BackendProtocolError("garbled"), 500, "api_error"),
        (GatewayError("boom"), 500, "api_error"),
    ],
)
def test_ant_44_45_error_envelope_and_status(err, status, kind):
    code, body = error_body(err)
    assert code == status
    assert msgspec.json.decode(body) == {"type": "error", "error": {"type": kind, "message": err.message}}


def test_ant_52_model_listing_is_accepted_by_the_sdk():
    models = [ModelInfo(name="qwen3:8b", created=1_700_000_000, context_length=40960), ModelInfo(name="org/llama-3")]
    body = msgspec.json.decode(encode_models(models))
    assert body["has_more"] is False
    assert (body["first_id"], body["last_id"]) == ("qwen3:8b", "org/llama-3")
    assert body["data"][0] == {
        "type": "model",
        "id": "qwen3:8b",
        "display_name": "qwen3:8b",
        "created_at": "2023-11-14T22:13:20Z",
        "lifecycle": "active",
        "max_input_tokens": 40960,
    }
    assert body["data"][1]["created_at"] == "1970-01-01T00:00:00Z"
    for info in body["data"]:
        SdkModelInfo.model_validate(info)


def test_ant_53_empty_listing_stops_pagination():
    assert msgspec.json.decode(encode_models([])) == {"data": [], "has_more": False, "first_id": None, "last_id": None}


def test_ant_52_single_model():
    info = SdkModelInfo.model_validate(msgspec.json.decode(encode_model(ModelInfo(name="qwen3:8b"))))
    assert (info.id, info.type) == ("qwen3:8b", "model")


async def test_ant_23_a_tool_call_without_a_backend_id_gets_a_stable_one():
    events = [ToolCallDelta(index=0, name="get_weather", arguments="{}"), Finished(reason="tool_calls")]
    final = sdk_stream(await encode(events)).get_final_message()
    assert final.content[0].id == "toolu_01abc_0"
