"""An error that reaches a client mid-stream (after keep-alives) reads as it would have as an HTTP error."""

from __future__ import annotations

import msgspec

from meshgate.protocols import anthropic, openai
from meshgate.protocols.model import ContextLengthExceeded, ErrorInfo, error_from_info


def test_context_length_exceeded_keeps_its_numbers_through_an_error_info():
    info = ContextLengthExceeded(prompt_tokens=3640, context=2048).info()
    wire = msgspec.json.decode(msgspec.json.encode(info), type=ErrorInfo)  # runner -> gateway, or a Failed event
    rebuilt = error_from_info(wire)
    assert isinstance(rebuilt, ContextLengthExceeded) and (rebuilt.prompt_tokens, rebuilt.context) == (3640, 2048)
    _, body = anthropic.error_body(rebuilt)
    assert msgspec.json.decode(body)["error"]["message"] == "prompt is too long: 3640 tokens > 2047 maximum"
    status, body = openai.error_body(rebuilt)
    assert status == 400 and msgspec.json.decode(body)["error"]["code"] == "context_length_exceeded"


def test_an_error_info_without_detail_still_rebuilds():
    rebuilt = error_from_info(ErrorInfo(kind="ContextLengthExceeded", message="too long"))
    assert isinstance(rebuilt, ContextLengthExceeded) and rebuilt.message == "too long"
