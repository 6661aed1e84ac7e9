"""``protocols.sse.frame`` writes exactly what sse-starlette's ``ServerSentEvent`` writes."""

from __future__ import annotations

import msgspec
import pytest
from sse_starlette.event import ServerSentEvent

from meshgate.protocols import sse

PAYLOADS = [b"[DONE]", msgspec.json.encode({"text": "line\nbreak \r and \u2028 \U0001f600", "n": 1}), b"{}"]


@pytest.mark.parametrize("payload", PAYLOADS)
@pytest.mark.parametrize("event", [None, "content_block_delta", "response.output_text.delta"])
def test_frames_match_server_sent_event(payload: bytes, event: str | None):
    assert sse.frame(payload, event) == ServerSentEvent(data=payload.decode(), event=event).encode()


def test_a_payload_with_line_breaks_becomes_several_data_lines():
    assert sse.frame(b"a\nb", "x") == b"event: x\r\ndata: a\r\ndata: b\r\n\r\n"
