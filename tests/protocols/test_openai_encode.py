"""Tests for protocols.openai's answers: chat and legacy completion bodies, the model list and error envelopes,
checked against docs/protocols.md section 1 and read back with the openai SDK's own types (requests, streams and
log probabilities: ``test_openai.py``, ``test_openai_stream.py``)."""

from __future__ import annotations

import json

import openai
import pytest
from openai.types import Completion, Model
from openai.types.chat import ChatCompletion

from meshgate.protocols import openai as oai
from meshgate.protocols import openai_completions as oac
from meshgate.protocols.model import (
    AuthenticationFailed,
    BackendTimeout,
    Finished,
    GatewayError,
    InvalidRequest,
    ModelInfo,
    NoCapacity,
    NotFound,
    RateLimited,
    RequestTooLarge,
    Response,
    ToolCall,
    UnknownModel,
    UnsupportedFeature,
    Usage,
)
from tests.protocols.openai_wire import (  # the SDK's HTTP library (httpx2 for openai 3.x) comes from there too
    META,
    httpx,
)

# ---------------------------------------------------------------------------------------------------- responses


def test_oai_31_chat_completion_shape():
    usage = Usage(prompt_tokens=9, completion_tokens=12)
    response = Response(text="Hello there, how may I assist you today?", usage=usage)
    body = json.loads(oai.encode_chat_response(response, META))
    assert body == {
        "id": "chatcmpl-abc123",
        "object": "chat.completion",
        "created": 1741569952,
        "model": "gemma-3-270m",
        "choices": [
            {
                "index": 0,
                "message": {"role": "assistant", "content": "Hello there, how may I assist you today?"},
                "logprobs": None,
                "finish_reason": "stop",
            }
        ],
        "usage": {"prompt_tokens": 9, "completion_tokens": 12, "total_tokens": 21},
    }
    assert ChatCompletion.model_validate(body).choices[0].message.content == body["choices"][0]["message"]["content"]


def test_oai_31_cached_tokens_and_reasoning():
    usage = Usage(prompt_tokens=30, completion_tokens=5, cached_tokens=16)
    response = Response(text="4", reasoning="2+2=4", usage=usage)
    body = json.loads(oai.encode_chat_response(response, META))
    assert body["usage"] == {
        "prompt_tokens": 30,
        "completion_tokens": 5,
        "total_tokens": 35,
        "prompt_tokens_details": {"cached_tokens": 16},
    }
    assert body["choices"][0]["message"]["reasoning_content"] == "2+2=4"
    assert ChatCompletion.model_validate(body).usage.prompt_tokens_details.cached_tokens == 16


def test_oai_35_tool_calls_with_json_string_arguments_and_null_content():
    call = ToolCall(id="call_abc123", name="get_current_weather", arguments='{"location": "Boston, MA"}')
    response = Response(tool_calls=(call,), usage=Usage(prompt_tokens=82, completion_tokens=17))
    body = json.loads(oai.encode_chat_response(response, META))
    message = body["choices"][0]["message"]
    assert message == {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_abc123",
                "type": "function",
                "function": {"name": "get_current_weather", "arguments": '{"location": "Boston, MA"}'},
            }
        ],
    }
    assert body["choices"][0]["finish_reason"] == "tool_calls"
    parsed = ChatCompletion.model_validate(body).choices[0].message.tool_calls[0]
    assert json.loads(parsed.function.arguments) == {"location": "Boston, MA"}


def test_oai_31_empty_answer_has_empty_string_content():
    body = json.loads(oai.encode_chat_response(Response(), META))
    assert body["choices"][0]["message"]["content"] == ""


@pytest.mark.parametrize(
    ("finish", "tool_calls", "expected"),
    [
        (Finished(reason="stop"), False, "stop"),
        (Finished(reason="stop"), True, "tool_calls"),
        (Finished(reason="tool_calls"), True, "tool_calls"),
        (Finished(reason="stop_sequence", stop_sequence="###"), False, "stop"),
        (Finished(reason="length"), False, "length"),
        (Finished(reason="length"), True, "length"),
        (Finished(reason="content_filter"), False, "content_filter"),
    ],
)
def test_oai_34_finish_reason_mapping(finish, tool_calls, expected):
    calls = (ToolCall(id="call_1", name="f", arguments="{}"),) if tool_calls else ()
    body = json.loads(oai.encode_chat_response(Response(tool_calls=calls, finish=finish), META))
    assert body["choices"][0]["finish_reason"] == expected


@pytest.mark.parametrize(
    ("reason", "expected"),
    [
        ("stop", "stop"),
        ("stop_sequence", "stop"),
        ("length", "length"),
        ("tool_calls", "stop"),
        ("content_filter", "content_filter"),
    ],
)
def test_oai_38_legacy_completion_shape(reason, expected):
    usage = Usage(prompt_tokens=5, completion_tokens=7)
    response = Response(text="This is a test.", usage=usage, finish=Finished(reason=reason))
    body = json.loads(oac.encode_completion_response(response, META))
    assert body == {
        "id": "cmpl-abc123",
        "object": "text_completion",
        "created": 1741569952,
        "model": "gemma-3-270m",
        "choices": [{"index": 0, "text": "This is a test.", "logprobs": None, "finish_reason": expected}],
        "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12},
    }
    assert Completion.model_validate(body).choices[0].text == "This is a test."


def test_oai_39_model_list_and_model():
    models = [ModelInfo(name="gemma-3-270m", created=1686935002.9), ModelInfo(name="org/qwen3:0.6b")]
    body = json.loads(oai.encode_models(models))
    assert body == {
        "object": "list",
        "data": [
            {"id": "gemma-3-270m", "object": "model", "created": 1686935002, "owned_by": "meshgate"},
            {"id": "org/qwen3:0.6b", "object": "model", "created": 0, "owned_by": "meshgate"},
        ],
    }
    assert [Model.model_validate(m).id for m in body["data"]] == ["gemma-3-270m", "org/qwen3:0.6b"]
    assert json.loads(oai.encode_model(models[1])) == body["data"][1]


# ---------------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("err", "status", "type_", "code", "param"),
    [
        (InvalidRequest("no messages", param="messages"), 400, "invalid_request_error", "invalid_request", "messages"),
        (UnsupportedFeature("no audio", param="tools"), 400, "invalid_request_error", "unsupported_feature", "tools"),
        (AuthenticationFailed("bad key"), 401, "authentication_error", "invalid_api_key", None),
        (NotFound("model 'gpt-9' not found", param="model"), 404, "invalid_request_error", "model_not_found", "model"),
        (RequestTooLarge("body too large"), 413, "invalid_request_error", "request_too_large", None),
        (RateLimited("slow down"), 429, "rate_limit_error", "rate_limit_exceeded", None),
        (NoCapacity("no node fits"), 503, "api_error", "no_capacity", None),
        (BackendTimeout("too slow"), 504, "api_error", "backend_timeout", None),
        (GatewayError("boom"), 500, "api_error", None, None),
    ],
)
def test_oai_57_error_envelope(err, status, type_, code, param):
    got_status, body = oai.error_body(err)
    assert got_status == status
    assert json.loads(body) == {"error": {"message": err.message, "type": type_, "param": param, "code": code}}


def test_oai_57_unknown_model_in_openais_words():
    status, body = oai.error_body(UnknownModel("gpt-9"))
    assert status == 404
    assert json.loads(body) == {
        "error": {
            "message": "The model `gpt-9` does not exist or you do not have access to it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "model_not_found",
        }
    }


def test_oai_58_sdk_reads_message_type_param_and_code():
    status, body = oai.error_body(UnknownModel("gpt-9"))
    client = openai.OpenAI(api_key="dummy", base_url="http://gateway.test/v1")
    request = httpx.Request("GET", "http://gateway.test/v1/models/gpt-9")
    error = client._make_status_error_from_response(httpx.Response(status, content=body, request=request))
    assert isinstance(error, openai.NotFoundError)
    assert (error.type, error.param, error.code) == ("invalid_request_error", None, "model_not_found")
    assert "The model `gpt-9` does not exist" in error.message


def test_oai_62_stream_error_frame():
    assert oai.stream_error_frame(RateLimited("slow down")) == (
        b'data: {"error":{"message":"slow down","type":"rate_limit_error",'
        b'"param":null,"code":"rate_limit_exceeded"}}\r\n\r\n'
    )
