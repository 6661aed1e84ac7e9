"""The anthropic SDK at 0.x (0.125.0: x-api-key, anthropic-version 2023-06-01, ``?beta=true``) against a real
server: scripted shapes and the real model (ANT-2, ANT-6, ANT-7, ANT-30)."""

from __future__ import annotations

from tests.compat.venvs import ANTHROPIC_0, run_probe
from tests.conftest import MODEL


def test_anthropic_0x_scripted_shapes(scripted_server):
    seen = run_probe(ANTHROPIC_0, "anthropic_v0_probe.py", scripted_server.url, "scripted")
    assert seen["version"] == "0.125.0"
    assert seen["text"] == "Hello, world" and seen["stop_reason"] == "end_turn"
    assert seen["stream_text"] == "Hello, world" and seen["stream_output_tokens"] == 2
    assert seen["beta_text"] == "Hello, world", "ANT-2: ?beta=true accepted"
    assert "scripted" in seen["models"] and seen["not_found"] == "not_found_error"
    assert seen["tool_use"] == ["get_weather", {"city": "Paris"}]
    assert seen["mid_stream_error"] == [200, "overloaded_error"]


def test_anthropic_0x_real_model(real_server):
    seen = run_probe(ANTHROPIC_0, "anthropic_v0_probe.py", real_server.url, MODEL)
    assert seen["text"] and seen["stream_text"] and 0 < seen["stream_output_tokens"] <= 4
    assert MODEL in seen["models"]
