"""The Responses API through openai 1.x (1.97.1), which cannot type SSE events whose name does not start with
``response.``: the stream must end in ``response.failed``, not an ``error`` event (OAI-66)."""

from __future__ import annotations

from tests.compat.venvs import OPENAI_1, run_probe


def test_oai_66_openai_1x_responses_scripted(scripted_server):
    seen = run_probe(OPENAI_1, "openai_v1_responses_probe.py", scripted_server.url)
    assert seen["version"] == "1.97.1"
    assert seen["text"] == "Hello, world" and seen["total_tokens"] == 9
    assert seen["deltas"] == ["Hello", ", world"] and seen["final"] == "Hello, world"
    assert seen["fail"] == ["response.failed", "runner lost"]
    assert seen["length"] == ["response.incomplete", "max_output_tokens"]
