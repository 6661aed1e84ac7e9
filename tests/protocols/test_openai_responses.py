"""Tests for protocols.openai_responses: the Responses API as pure functions (docs/protocols.md OAI-6, OAI-65, OAI-66).

Every encoded event and Response is validated with the openai SDK's own pydantic types, and streams are parsed
back with the SDK's ``Stream`` and accumulated with its ``ResponseStream`` helper.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import msgspec
import openai
import pytest
from openai._streaming import Stream
from openai.lib.streaming.responses import ResponseStream
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter

from meshgate.protocols import openai_responses as resp
from meshgate.protocols.model import (
    UNSET,
    ErrorInfo,
    Event,
    Failed,
    Finished,
    InvalidRequest,
    KeepAlive,
    Message,
    Meta,
    ReasoningDelta,
    Response,
    ResponseFormat,
    Sampling,
    TextDelta,
    TextPart,
    UnsupportedFeature,
    Usage,
    collect,
    decode_body,
)

try:  # openai 3.x talks through httpx2, 1.x through httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]

META = Meta(id="abc123", model="gemma-3-270m", created=1741569952.7)
EVENT = TypeAdapter(ResponseStreamEvent)
HELLO = [
    Usage(prompt_tokens=7),
    TextDelta(text="Hello"),
    TextDelta(text=", world"),
    Usage(prompt_tokens=7, completion_tokens=2),
    Finished(reason="stop"),
]


def body(**fields: Any) -> resp.ResponsesRequest:
    fields.setdefault("model", "gpt-4.1")
    return decode_body(msgspec.json.encode(fields), resp.ResponsesRequest)


def internal(**fields: Any):
    fields.setdefault("input", "Tell me a three sentence bedtime story about a unicorn.")
    return resp.responses_to_internal(body(**fields))


async def feed(events: Iterable[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def stream(events: Iterable[Event]) -> bytes:
    return b"".join([frame async for frame in resp.encode_response_stream(feed(events), META)])


def frames(raw: bytes) -> list[tuple[str | None, Any]]:
    """(event name, decoded data) per SSE frame; a comment frame is ("comment", text)."""
    out: list[tuple[str | None, Any]] = []
    for frame in raw.decode().split("\r\n\r\n")[:-1]:
        name, data = None, None
        for line in frame.split("\r\n"):
            if line.startswith(":"):
                out.append(("comment", line[1:].strip()))
            elif line.startswith("event: "):
                name = line.removeprefix("event: ")
            elif line.startswith("data: "):
                data = json.loads(line.removeprefix("data: "))
        if data is not None:
            out.append((name, data))
    return out


def events_of(raw: bytes) -> list[dict[str, Any]]:
    """The JSON events, each checked against its ``event:`` line and the SDK's ``ResponseStreamEvent`` type."""
    out = []
    for name, data in frames(raw):
        if name == "comment":
            continue
        assert name == data["type"], "OAI-66: the event: line repeats the type"
        EVENT.validate_python(data)
        out.append(data)
    return out


def sdk_final(raw: bytes):
    """Parse a body as the SDK does and accumulate it with ``client.responses.stream()``'s helper."""
    client = openai.OpenAI(api_key="dummy", base_url="http://gateway.test/v1")
    request = httpx.Request("POST", "http://gateway.test/v1/responses")
    raw_stream = Stream(
        cast_to=ResponseStreamEvent, response=httpx.Response(200, content=raw, request=request), client=client
    )
    helper = ResponseStream(
        raw_stream=raw_stream, text_format=openai.omit, input_tools=openai.omit, starting_after=None
    )
    seen = list(helper)
    return seen, helper


# ---------------------------------------------------------------------------------------------------- requests


def test_oai_6_string_input_is_one_user_message():
    request = internal(input="Hello!")
    assert request.model == "gpt-4.1"
    assert request.messages == (Message(role="user", parts=(TextPart(text="Hello!"),)),)
    assert request.stream is False
    assert request.sampling == Sampling()
    assert request.max_tokens is None
    assert request.response_format == ResponseFormat()
    assert request.reasoning is UNSET


def test_oai_6_instructions_become_the_first_system_message():
    request = internal(instructions="Talk like a pirate.", input="Are semicolons optional in JavaScript?")
    assert [m.role for m in request.messages] == ["system", "user"]
    assert request.messages[0].text == "Talk like a pirate."


def test_oai_6_message_items_with_string_and_part_content():
    request = internal(
        input=[
            {"role": "developer", "content": "Be terse."},
            {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "Answer in French."}]},
            {"role": "user", "content": "knock knock."},
            # an earlier response's output item, passed back as history
            {
                "id": "msg_1",
                "type": "message",
                "role": "assistant",
                "status": "completed",
                "content": [{"type": "output_text", "text": "Who's there?", "annotations": []}],
            },
            {"role": "assistant", "content": [{"type": "refusal", "refusal": "No."}]},
            {
                "role": "user",
                "content": [{"type": "input_text", "text": "Orange"}, {"type": "input_text", "text": "."}],
            },
        ]
    )
    assert [m.role for m in request.messages] == ["system", "system", "user", "assistant", "assistant", "user"]
    assert [m.text for m in request.messages] == [
        "Be terse.",
        "Answer in French.",
        "knock knock.",
        "Who's there?",
        "No.",
        "Orange.",
    ]


def test_oai_6_reasoning_items_in_input_are_skipped():
    request = internal(
        input=[
            {"role": "user", "content": "hi"},
            {"type": "reasoning", "id": "rs_1", "summary": []},
            {"role": "assistant", "content": "hello"},
        ]
    )
    assert [m.role for m in request.messages] == ["user", "assistant"]


def test_oai_6_sampling_limits_and_stream():
    request = internal(max_output_tokens=16, temperature=0.2, top_p=0.9, stream=True, top_k=40)
    assert request.max_tokens == 16
    assert request.sampling == Sampling(temperature=0.2, top_p=0.9, top_k=40)
    assert request.stream is True


def test_oai_6_explicit_null_sampling_differs_from_absent():
    assert internal(temperature=None).sampling.temperature is None
    assert internal().sampling.temperature is UNSET


@pytest.mark.parametrize(("field", "value"), [("temperature", 2.5), ("top_p", 1.5), ("max_output_tokens", 0)])
def test_oai_6_documented_ranges_name_the_field(field, value):
    with pytest.raises(InvalidRequest) as exc:
        body(input="hi", **{field: value})
    assert exc.value.param == field


def test_oai_6_text_format_maps_to_response_format():
    schema = {"type": "object", "properties": {"name": {"type": "string"}}, "required": ["name"]}
    fmt = {"type": "json_schema", "name": "person", "schema": schema, "strict": True}
    assert internal(text={"format": fmt}).response_format == ResponseFormat(
        kind="json_schema", schema=schema, name="person"
    )
    assert internal(text={"format": {"type": "json_object"}}).response_format == ResponseFormat(kind="json_object")
    assert internal(text={"format": {"type": "text"}, "verbosity": "low"}).response_format == ResponseFormat()


def test_oai_6_reasoning_effort_switches_reasoning():
    assert internal(reasoning={"effort": "high"}).reasoning is True
    assert internal(reasoning={"effort": "none"}).reasoning is False
    assert internal(reasoning={"summary": "auto"}).reasoning is UNSET


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("previous_response_id", "resp_123"),
        ("conversation", "conv_123"),
        ("prompt", {"id": "pmpt_123"}),
        ("background", True),
    ],
)
def test_oai_6_stateful_features_are_unsupported(field, value):
    with pytest.raises(UnsupportedFeature) as exc:
        internal(**{field: value})
    assert exc.value.param == field
    assert exc.value.status == 400


def test_oai_6_accepted_and_ignored_fields():
    request = internal(
        store=True,
        metadata={"k": "v"},
        user="u1",
        include=["reasoning.encrypted_content"],
        truncation="auto",
        service_tier="auto",
        stream_options={"include_obfuscation": False},
        tool_choice="auto",
        parallel_tool_calls=True,
        tools=[],
        background=False,
    )
    assert request.messages[0].role == "user"


def test_oai_6_non_message_items_are_unsupported_naming_the_item():
    with pytest.raises(UnsupportedFeature) as exc:
        internal(
            input=[
                {"role": "user", "content": "hi"},
                {"type": "item_reference", "id": "msg_1"},
            ]
        )
    assert exc.value.param == "input[1].type"
    assert "item_reference" in exc.value.message


def test_oai_6_non_text_parts_are_unsupported_naming_the_part():
    image = {"type": "input_image", "image_url": "https://example.com/a.png"}
    with pytest.raises(UnsupportedFeature) as exc:
        internal(input=[{"role": "user", "content": [{"type": "input_text", "text": "what is this?"}, image]}])
    assert exc.value.param == "input[0].content[1].type"
    assert "input_image" in exc.value.message


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"input": None}, "input"),
        ({"input": []}, "input"),
        ({"input": [{"type": "message", "content": "hi"}]}, "input[0].role"),
        ({"input": [{"role": "user", "content": [{"type": "input_text"}]}]}, "input[0].content[0].text"),
    ],
)
def test_oai_6_missing_input_is_invalid(fields, param):
    with pytest.raises(InvalidRequest) as exc:
        resp.responses_to_internal(body(**fields))
    assert exc.value.param == param


def test_oai_6_unknown_role_is_rejected_naming_the_field():
    with pytest.raises(InvalidRequest) as exc:
        body(input=[{"role": "wizard", "content": "hi"}])
    assert exc.value.param == "input[0].role"


# ---------------------------------------------------------------------------------------------------- responses


def test_oai_65_response_shape_validates_as_the_sdks_response():
    response = Response(text="Hello, world", usage=Usage(prompt_tokens=7, completion_tokens=2, cached_tokens=3))
    raw = json.loads(resp.encode_response(response, META))
    assert raw == {
        "id": "resp_abc123",
        "object": "response",
        "created_at": 1741569952,
        "status": "completed",
        "error": None,
        "incomplete_details": None,
        "model": "gemma-3-270m",
        "output": [
            {
                "id": "msg_abc123_0",
                "type": "message",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "output_text", "text": "Hello, world", "annotations": []}],
            }
        ],
        "parallel_tool_calls": True,
        "tool_choice": "auto",
        "tools": [],
        "usage": {
            "input_tokens": 7,
            "input_tokens_details": {"cached_tokens": 3, "cache_write_tokens": 0},
            "output_tokens": 2,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": 9,
        },
    }
    sdk = SDKResponse.model_validate(raw)
    assert sdk.output_text == "Hello, world"
    assert sdk.usage.total_tokens == 9


@pytest.mark.parametrize(("reason", "detail"), [("length", "max_output_tokens"), ("content_filter", "content_filter")])
def test_oai_65_length_and_content_filter_are_incomplete(reason, detail):
    raw = json.loads(resp.encode_response(Response(text="cut", finish=Finished(reason=reason)), META))
    assert raw["status"] == "incomplete"
    assert raw["incomplete_details"] == {"reason": detail}
    assert raw["output"][0]["status"] == "incomplete"
    SDKResponse.model_validate(raw)


@pytest.mark.parametrize("reason", ["stop", "stop_sequence"])
def test_oai_65_natural_stops_are_completed(reason):
    raw = json.loads(resp.encode_response(Response(text="ok", finish=Finished(reason=reason)), META))
    assert (raw["status"], raw["incomplete_details"]) == ("completed", None)


def test_oai_65_reasoning_is_an_item_before_the_message():
    raw = json.loads(resp.encode_response(Response(text="Yes.", reasoning="Let me see."), META))
    assert raw["output"][0] == {
        "id": "rs_abc123_0",
        "type": "reasoning",
        "status": "completed",
        "summary": [],
        "content": [{"type": "reasoning_text", "text": "Let me see."}],
    }
    assert raw["output"][1]["id"] == "msg_abc123_1"
    assert SDKResponse.model_validate(raw).output_text == "Yes."


def test_oai_65_empty_answer_is_still_one_message_item():
    raw = json.loads(resp.encode_response(Response(), META))
    assert [item["type"] for item in raw["output"]] == ["message"]
    assert SDKResponse.model_validate(raw).output_text == ""


# ---------------------------------------------------------------------------------------------------- streams


async def test_oai_66_stream_exact_events_and_sequence_numbers():
    events = events_of(await stream(HELLO))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    at = {"item_id": "msg_abc123_0", "output_index": 0, "content_index": 0}
    part = {"type": "output_text", "text": "Hello, world", "annotations": []}
    assert events[2] == {
        "type": "response.output_item.added",
        "sequence_number": 2,
        "output_index": 0,
        "item": {"id": "msg_abc123_0", "type": "message", "status": "in_progress", "role": "assistant", "content": []},
    }
    assert events[3] == {
        "type": "response.content_part.added",
        "sequence_number": 3,
        **at,
        "part": {**part, "text": ""},
    }
    assert events[4] == {
        "type": "response.output_text.delta",
        "sequence_number": 4,
        **at,
        "delta": "Hello",
        "logprobs": [],
    }
    assert events[5]["delta"] == ", world"
    assert events[6] == {
        "type": "response.output_text.done",
        "sequence_number": 6,
        **at,
        "text": "Hello, world",
        "logprobs": [],
    }
    assert events[7] == {"type": "response.content_part.done", "sequence_number": 7, **at, "part": part}
    assert events[8] == {
        "type": "response.output_item.done",
        "sequence_number": 8,
        "output_index": 0,
        "item": {
            "id": "msg_abc123_0",
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [part],
        },
    }


async def test_oai_66_lifecycle_responses_carry_status_output_and_usage():
    events = events_of(await stream(HELLO))
    created, in_progress, completed = events[0]["response"], events[1]["response"], events[-1]["response"]
    assert created["id"] == in_progress["id"] == completed["id"] == "resp_abc123"
    assert (created["status"], created["output"], created["usage"]) == ("in_progress", [], None)
    assert in_progress["status"] == "in_progress"
    assert completed["status"] == "completed"
    assert completed["output"] == [events[8]["item"]]
    assert completed["usage"]["input_tokens"] == 7 and completed["usage"]["output_tokens"] == 2


async def test_oai_66_stream_and_plain_agree():
    completed = events_of(await stream(HELLO))[-1]["response"]
    assert completed == json.loads(resp.encode_response(await collect(feed(HELLO)), META))


async def test_oai_66_sdk_stream_helper_accumulates_the_final_response():
    seen, helper = sdk_final(await stream(HELLO))
    deltas = [e.delta for e in seen if e.type == "response.output_text.delta"]
    assert deltas == ["Hello", ", world"]
    assert [e.snapshot for e in seen if e.type == "response.output_text.delta"] == ["Hello", "Hello, world"]
    final = helper.get_final_response()
    assert final.output_text == "Hello, world"
    assert final.usage.output_tokens == 2


async def test_oai_66_length_ends_in_response_incomplete():
    events = events_of(
        await stream([TextDelta(text="cut"), Usage(prompt_tokens=3, completion_tokens=1), Finished(reason="length")])
    )
    assert events[-2]["item"]["status"] == "incomplete"
    assert events[-1]["type"] == "response.incomplete"
    assert events[-1]["response"]["status"] == "incomplete"
    assert events[-1]["response"]["incomplete_details"] == {"reason": "max_output_tokens"}
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == "cut"


async def test_oai_66_failure_mid_stream_is_response_failed():
    raw = await stream(
        [
            Usage(prompt_tokens=5),
            TextDelta(text="partial"),
            Failed(error=ErrorInfo(kind="BackendUnavailable", message="runner lost")),
        ]
    )
    events = events_of(raw)
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.failed",
    ]
    failed = events[-1]["response"]
    assert failed["status"] == "failed"
    assert failed["error"] == {"code": "server_error", "message": "runner lost"}
    assert failed["output"][0]["status"] == "incomplete"
    assert failed["output"][0]["content"][0]["text"] == "partial"
    assert all(name.startswith("response.") for name, _ in frames(raw)), "no 'error' event: 1.x cannot type it"
    seen, helper = sdk_final(raw)
    assert seen[-1].type == "response.failed" and seen[-1].response.error.message == "runner lost"
    with pytest.raises(RuntimeError):
        helper.get_final_response()


@pytest.mark.parametrize(
    ("kind", "code"),
    [("RateLimited", "rate_limit_exceeded"), ("InvalidRequest", "invalid_prompt"), ("NoCapacity", "server_error")],
)
async def test_oai_66_failure_codes_are_the_sdks_literals(kind, code):
    events = events_of(await stream([Failed(error=ErrorInfo(kind=kind, message="x"))]))
    assert events[-1]["response"]["error"]["code"] == code
    assert events[-1]["response"]["output"] == []


async def test_oai_66_stream_without_a_terminal_event_fails():
    events = events_of(await stream([TextDelta(text="a")]))
    assert events[-1]["type"] == "response.failed"
    assert "without finishing" in events[-1]["response"]["error"]["message"]


async def test_oai_66_keepalive_is_an_sse_comment():
    raw = await stream([KeepAlive(), *HELLO])
    assert frames(raw)[2] == ("comment", "keep-alive")
    assert b": keep-alive\r\n\r\n" in raw


async def test_oai_66_empty_answer_still_streams_one_message_item():
    events = events_of(await stream([Usage(prompt_tokens=1), Finished()]))
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert events[-1]["response"]["output"][0]["content"][0]["text"] == ""


async def test_oai_66_reasoning_streams_as_its_own_item():
    script = [ReasoningDelta(text="Let me see."), TextDelta(text="Yes."), Finished()]
    raw = await stream(script)
    events = events_of(raw)
    assert [e["type"] for e in events][2:] == [
        "response.output_item.added",
        "response.content_part.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert {e["output_index"] for e in events[2:8]} == {0} and {e["output_index"] for e in events[8:14]} == {1}
    assert events[-1]["response"] == json.loads(resp.encode_response(await collect(feed(script)), META))
    assert sdk_final(raw)[1].get_final_response().output_text == "Yes."
