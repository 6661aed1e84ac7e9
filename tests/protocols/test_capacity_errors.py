"""A full queue and a prompt that does not fit, rendered by each protocol's ``error_body`` (pure functions)."""

from __future__ import annotations

import json

from meshgate.protocols import anthropic, ollama, openai
from meshgate.protocols.model import ContextLengthExceeded, Overloaded, error_from_info

BUSY = Overloaded("the model is busy", retry_after=3)


def test_overloaded_per_protocol():
    status, body = openai.error_body(BUSY)
    assert status == 429 and json.loads(body)["error"]["type"] == "rate_limit_error"
    status, body = anthropic.error_body(BUSY)
    assert (status, json.loads(body)["error"]["type"]) == (529, "overloaded_error")
    status, body = ollama.error_body(BUSY)
    assert (status, json.loads(body)) == (
        503,
        {"error": "server busy, please try again.  maximum pending requests exceeded"},
    )


def test_context_length_per_protocol():
    err = ContextLengthExceeded(prompt_tokens=3000, completion_tokens=2000, context=4096)
    status, body = openai.error_body(err)
    assert status == 400 and json.loads(body) == {
        "error": {
            "message": "This model's maximum context length is 4096 tokens. However, you requested 5000 tokens "
            "(3000 in the messages, 2000 in the completion). Please reduce the length of the messages or completion.",
            "type": "invalid_request_error",
            "param": "messages",
            "code": "context_length_exceeded",
        }
    }
    prompt_only = ContextLengthExceeded(prompt_tokens=5000, context=4096)
    assert json.loads(openai.error_body(prompt_only)[1])["error"]["message"] == (
        "This model's maximum context length is 4096 tokens. However, your messages resulted in 5000 tokens. Please "
        "reduce the length of the messages."
    )
    status, body = anthropic.error_body(prompt_only)
    assert (status, json.loads(body)) == (
        400,
        {
            "type": "error",
            "error": {"type": "invalid_request_error", "message": "prompt is too long: 5000 tokens > 4095 maximum"},
        },
    )
    status, body = ollama.error_body(prompt_only)
    assert (status, json.loads(body)) == (400, {"error": "the input length exceeds the context length"})


def test_mid_stream_context_error_keeps_its_code_and_message():
    """Rebuilt from a ``Failed`` event (a model that was still loading), the numbers are gone, not the meaning."""
    rebuilt = error_from_info(ContextLengthExceeded(prompt_tokens=5000, context=4096).info())
    frame = openai.stream_error_frame(rebuilt).decode()
    error = json.loads(frame.removeprefix("data: ").strip())["error"]
    assert error["code"] == "context_length_exceeded" and "5000" in error["message"] and "4096" in error["message"]
