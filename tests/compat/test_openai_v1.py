"""The openai SDK at 1.x (1.97.1, the last release before it tolerated ``event:`` lines, OAI-41) against a real
server: scripted shapes, and the real model."""

from __future__ import annotations

from tests.compat.venvs import OPENAI_1, run_probe
from tests.conftest import MODEL


def test_openai_1x_scripted_shapes(scripted_server):
    seen = run_probe(OPENAI_1, "openai_v1_probe.py", scripted_server.url, "scripted")
    assert seen["version"] == "1.97.1"
    assert seen["chat"] == "Hello, world" and seen["finish"] == "stop"
    assert seen["stream_text"] == "Hello, world" and seen["stream_usage"] == 9, "OAI-41: no event: lines"
    assert "acme/scripted:v1" in seen["models"] and seen["retrieved"] == "acme/scripted:v1", "OAI-8 raw /"
    assert seen["not_found"] == "model_not_found"
    assert seen["mid_stream_error"] == "runner lost"
    assert seen["tool_call"] == ["call_abc", "get_weather", {"city": "Paris"}]


def test_openai_1x_real_model(real_server):
    seen = run_probe(OPENAI_1, "openai_v1_probe.py", real_server.url, MODEL)
    assert seen["chat"] and seen["stream_text"] and seen["stream_usage"] > 0
    assert MODEL in seen["models"]
