"""The official openai SDK's ``client.responses`` against real gateways (docs/protocols.md OAI-6, OAI-7,
OAI-65, OAI-66).

``real_server`` serves the real Gemma 3 270M GGUF; ``scripted_server`` plays the scripts of
``tests/scripted_plugin.py`` (chosen by the last user message) for exact shapes.
"""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.conftest import MODEL
from tests.e2e.test_wire_scripted import post_stream, sse_events

PROMPT = "Write one sentence about the sea."


def client_for(server, base: str = "/v1") -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}{base}", api_key="unused", max_retries=0)


# ------------------------------------------------------------------------------------------------- real model


def test_oai_65_real_model_not_streamed(real_server):
    response = client_for(real_server).responses.create(model=MODEL, input=PROMPT, max_output_tokens=16, temperature=0)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.output_text.strip()
    assert response.output[0].type == "message" and response.output[0].role == "assistant"
    assert response.status in ("completed", "incomplete")
    assert response.usage.input_tokens > 5
    assert 0 < response.usage.output_tokens <= 16
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    assert response.model == MODEL


def test_oai_66_real_model_streamed_deltas_join_to_the_final_text(real_server):
    with client_for(real_server).responses.stream(
        model=MODEL, input=PROMPT, instructions="Be brief.", max_output_tokens=16, temperature=0
    ) as stream:
        events = list(stream)
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert [e.sequence_number for e in events] == list(range(len(events)))
    # 16 tokens hit the limit: the stream ends in response.incomplete, so (as with OpenAI) the helper's
    # get_final_response(), which wants response.completed, does not apply; the terminal event has the response.
    final = events[-1]
    assert final.type == "response.incomplete"
    assert deltas.strip() and deltas == final.response.output_text
    assert final.response.usage.output_tokens == 16
    assert final.response.incomplete_details.reason == "max_output_tokens"


def test_oai_66_real_model_stream_and_plain_agree_at_temperature_zero(real_server):
    client = client_for(real_server)
    kwargs = {"model": MODEL, "input": PROMPT, "max_output_tokens": 12, "temperature": 0}
    plain = client.responses.create(**kwargs).output_text
    streamed = "".join(
        e.delta for e in client.responses.create(**kwargs, stream=True) if e.type == "response.output_text.delta"
    )
    assert plain == streamed


# ------------------------------------------------------------------------------------------------- scripted


def test_oai_65_scripted_hello_exact_response(scripted_server):
    response = client_for(scripted_server).responses.create(model="scripted", input="hello")
    raw = response.to_dict()
    assert raw["status"] == "completed" and raw["incomplete_details"] is None
    assert raw["output"] == [
        {
            "id": raw["output"][0]["id"],
            "type": "message",
            "status": "completed",
            "role": "assistant",
            "content": [{"type": "output_text", "text": "Hello, world", "annotations": []}],
        }
    ]
    assert raw["output"][0]["id"].startswith("msg_")
    assert response.usage.input_tokens == 7 and response.usage.output_tokens == 2
    assert response.usage.total_tokens == 9


def test_oai_7_responses_is_served_without_the_v1_prefix(scripted_server):
    assert client_for(scripted_server, base="").responses.create(model="scripted", input="hello").output_text == (
        "Hello, world"
    )


def test_oai_65_scripted_length_is_incomplete(scripted_server):
    response = client_for(scripted_server).responses.create(model="scripted", input="length", max_output_tokens=16)
    assert response.status == "incomplete"
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output_text == "cut"


def test_oai_66_scripted_hello_exact_stream(scripted_server):
    r, raw = post_stream(scripted_server, "/v1/responses", {"model": "scripted", "input": "hello", "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_events(raw)
    names = [name for name, _ in frames]
    assert names == [
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
    payloads = [json.loads(data) for _, data in frames]
    assert [p["type"] for p in payloads] == names
    assert [p["sequence_number"] for p in payloads] == list(range(len(payloads)))
    assert [p["delta"] for p in payloads[4:6]] == ["Hello", ", world"]
    assert payloads[-1]["response"]["usage"]["total_tokens"] == 9


def test_oai_66_scripted_stream_through_the_sdk_helper(scripted_server):
    with client_for(scripted_server).responses.stream(
        model="scripted", input=[{"role": "developer", "content": "Be brief."}, {"role": "user", "content": "hello"}]
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response()
    assert deltas == ["Hello", ", world"] and final.output_text == "Hello, world"


def test_oai_66_scripted_length_stream_ends_in_response_incomplete(scripted_server):
    events = list(client_for(scripted_server).responses.create(model="scripted", input="length", stream=True))
    assert events[-1].type == "response.incomplete"
    assert events[-1].response.incomplete_details.reason == "max_output_tokens"
    assert events[-1].response.output_text == "cut"


def test_oai_66_scripted_failure_mid_stream_is_response_failed(scripted_server):
    events = list(client_for(scripted_server).responses.create(model="scripted", input="fail", stream=True))
    assert [e.type for e in events][-2:] == ["response.output_text.delta", "response.failed"]
    failed = events[-1].response
    assert failed.status == "failed" and failed.error.code == "server_error"
    assert failed.error.message == "runner lost"
    assert failed.output[0].status == "incomplete"


def test_oai_63_scripted_failure_before_the_first_event_is_a_status(scripted_server):
    r = httpx.post(
        f"{scripted_server.url}/v1/responses", json={"model": "scripted", "input": "failfirst", "stream": True}
    )
    assert r.status_code == 503 and r.json()["error"]["message"] == "no node has room for this model"


def test_oai_59_unsupported_features_are_400s_naming_the_param(scripted_server):
    client = client_for(scripted_server)
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(model="scripted", input="hello", previous_response_id="resp_1")
    assert exc.value.body["param"] == "previous_response_id"
    with pytest.raises(openai.BadRequestError) as exc:
        client.responses.create(
            model="scripted",
            input="hello",
            tools=[{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": False}],
            tool_choice={"type": "function", "name": "g"},
        )
    assert exc.value.body["param"] == "tool_choice"


def test_oai_59_unknown_model_is_a_404(scripted_server):
    with pytest.raises(openai.NotFoundError):
        client_for(scripted_server).responses.create(model="no-such-model", input="hello")


def test_oai_44_scripted_keepalive_is_a_comment_after_the_lifecycle_events(scripted_server):
    _, raw = post_stream(scripted_server, "/v1/responses", {"model": "scripted", "input": "keepalive", "stream": True})
    names = [name for name, _ in sse_events(raw)]
    assert names[:3] == ["response.created", "response.in_progress", "comment"]
    assert names[-1] == "response.completed"
