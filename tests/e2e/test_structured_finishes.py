"""Structured output from the real Gemma 3 270M finishes within a small ``max_tokens`` (issue 36).

The packaged model loves digits: under a schema whose integer or number had no bounds it wrote 26-digit integers
until ``max_tokens`` cut the JSON off before its next required key. ``protocols.schema_rules.enforceable`` now
holds an unbounded integer to 16 digits and a number to 16 integer digits and 10 decimals, so every answer here,
at ``max_tokens`` 48 and 20 prompts for each way a schema arrives (each protocol's official SDK: OpenAI
``response_format`` json_schema and a forced tool, Anthropic forced ``tool_use``, Ollama ``format`` and tools
with a format), parses, carries every required key and, for a forced tool call, ends with its protocol's
tool-call stop reason rather than the length one.

Greedy, so each answer is the one the model likes best, the same every run (the runner batches exactly), and
the digit-lover's worst case: it writes ``1000000000000000`` wherever a number may go on. Strings are the model's
to write: a schema bounds them where it says so, and these say it as typed clients do (``maxLength``). The Ollama
SDK passes a tool's parameters through its own model of a schema, which keeps only ``type``, ``description`` and
``enum``, so the tool schema it sends is unbounded but for the gateway's defaults. The prompts of one test run
side by side in the runner's slots.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from meshgate.protocols.schema_rules import MAX_SAFE_INTEGER, SIGNIFICANT_DIGITS
from tests.conftest import MODEL

MAX_TOKENS = 48
NAME = 20
"""Each string's ``maxLength``, as a typed client says it (pydantic's ``Field(max_length=20)``): a string is the
model's to write, and the schema bounds it only where it says so (``docs/endpoints.md``)."""
SUBJECTS = [
    "Paris", "Tokyo", "a small bakery", "the Moon", "a marathon runner", "Lagos", "a chess club", "the Amazon river",
    "a used bicycle", "Reykjavik", "a jazz album", "Mount Everest", "a coffee shop", "the year 1969", "a cat shelter",
    "Buenos Aires", "a vegetable garden", "the Pacific Ocean", "a football season", "Mumbai",
]  # fmt: skip
TRIP = {
    "type": "object",
    "properties": {
        "destination": {"type": "string", "maxLength": NAME},
        "days": {"type": "integer"},
        "budget": {"type": "number", "minimum": 0, "maximum": 100000},  # pydantic's Field(ge=0, le=100000)
    },
    "required": ["destination", "days", "budget"],
}
STAT = {
    "type": "object",
    "properties": {"days": {"type": "integer"}, "metric": {"type": "string", "maxLength": NAME}},
    "required": ["days", "metric"],
}
MOOD = {
    "type": "object",
    "properties": {
        "ok": {"type": "boolean"},
        "mood": {"type": "string", "maxLength": NAME},
        "score": {"type": "number"},
    },
    "required": ["ok", "mood", "score"],
}
COUNT = {
    "type": "object",
    "properties": {"count": {"type": "integer"}, "unit": {"type": "string", "maxLength": NAME}},
    "required": ["count", "unit"],
}


def _each(ask: Callable[[str], Any]) -> list[Any]:
    with ThreadPoolExecutor(4) as pool:
        return list(pool.map(ask, SUBJECTS))


def _whole(text: str | dict, schema: dict) -> dict:
    """``text`` parsed, with every required key of ``schema``, each number one a JSON consumer holds exactly."""
    value = json.loads(text) if isinstance(text, str) else text
    assert isinstance(value, dict) and set(schema["required"]) <= set(value), value
    for name, sub in schema["properties"].items():
        if sub["type"] == "integer":
            assert isinstance(value[name], int) and abs(value[name]) <= MAX_SAFE_INTEGER, value
        elif sub["type"] == "number":
            assert isinstance(value[name], int | float) and abs(value[name]) < 10**SIGNIFICANT_DIGITS, value
    return value


def _stop(reason: str | None, want: str = "stop") -> None:
    assert reason == want, f"finish reason {reason!r}, not {want!r}"


def _report(results: list[tuple[str, Any]]) -> None:
    """Fail naming every prompt whose answer broke, with what it was."""
    broken = [f"{subject}: {detail}" for subject, detail in results if detail is not None]
    assert not broken, f"{len(broken)} of {len(results)} answers broke:\n" + "\n".join(broken)


def _check(subject: str, run: Callable[[], None]) -> tuple[str, Any]:
    try:
        run()
    except (AssertionError, ValueError, KeyError) as exc:
        return subject, f"{type(exc).__name__}: {exc}"
    return subject, None


def test_openai_json_schema_answers_parse_with_every_key(oai):
    def ask(subject: str) -> tuple[str, Any]:
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"Plan a trip to see {subject}. Answer in JSON."}],
            response_format={"type": "json_schema", "json_schema": {"name": "trip", "schema": TRIP}},
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        choice = r.choices[0]
        return _check(subject, lambda: (_whole(choice.message.content or "", TRIP), _stop(choice.finish_reason)))

    _report(_each(ask))


def test_openai_forced_tool_calls_end_as_calls(oai):
    tool = {
        "type": "function",
        "function": {"name": "record_stat", "description": "Record a statistic.", "parameters": STAT},
    }

    def ask(subject: str) -> tuple[str, Any]:
        r = oai.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": f"How many days a year does {subject} get rain? Record it."}],
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "record_stat"}},
            max_tokens=MAX_TOKENS,
            temperature=0,
        )
        choice = r.choices[0]

        def run() -> None:
            _stop(choice.finish_reason, "tool_calls")
            [call] = choice.message.tool_calls or []
            _whole(call.function.arguments, STAT)

        return _check(subject, run)

    _report(_each(ask))


def test_anthropic_forced_tool_use_ends_as_tool_use(ant):
    tool = {"name": "record_count", "description": "Record how many there are.", "input_schema": COUNT}

    def ask(subject: str) -> tuple[str, Any]:
        r = ant.messages.create(
            model=MODEL,
            max_tokens=MAX_TOKENS,
            messages=[{"role": "user", "content": f"How many visitors did {subject} have last year? Record it."}],
            tools=[tool],
            tool_choice={"type": "tool", "name": "record_count"},
            extra_body={"temperature": 0},  # the SDK's own argument is gone in 2.x
        )

        def run() -> None:
            _stop(r.stop_reason, "tool_use")
            [block] = [b for b in r.content if b.type == "tool_use"]
            _whole(block.input, COUNT)

        return _check(subject, run)

    _report(_each(ask))


def test_ollama_format_answers_parse_with_every_key(oll):
    def ask(subject: str) -> tuple[str, Any]:
        r = oll.chat(
            model=MODEL,
            messages=[{"role": "user", "content": f"How do you feel about {subject}? Answer in JSON."}],
            format=MOOD,
            options={"num_predict": MAX_TOKENS, "temperature": 0},
        )
        return _check(subject, lambda: (_whole(r.message.content, MOOD), _stop(r.done_reason)))

    _report(_each(ask))


def test_ollama_tools_with_a_format_end_as_calls(oll):
    tool = {
        "type": "function",
        "function": {"name": "record_stat", "description": "Record a statistic.", "parameters": STAT},
    }

    def ask(subject: str) -> tuple[str, Any]:
        r = oll.chat(
            model=MODEL,
            messages=[{"role": "user", "content": f"How many days a year does {subject} get rain? Record it."}],
            tools=[tool],
            format="json",
            options={"num_predict": MAX_TOKENS, "temperature": 0},
        )

        def run() -> None:
            _stop(r.done_reason)
            [call] = r.message.tool_calls or []
            assert call.function.name == "record_stat"
            _whole(dict(call.function.arguments), STAT)

        return _check(subject, run)

    _report(_each(ask))


@pytest.mark.parametrize("schema", [TRIP, STAT, MOOD, COUNT])
def test_whole_rejects_what_broke_before(schema):
    """The checker above fails on the answers issue 36 quoted."""
    cut = '{"ok": true, "mood": "happy", "score": 10000000000000000000000000000000'
    with pytest.raises((AssertionError, ValueError)):
        _whole(cut, schema)
    huge = {
        name: (36639266431696144175400000 if sub["type"] != "string" else "x")
        for name, sub in schema["properties"].items()
    }
    if any(sub["type"] in ("integer", "number") for sub in schema["properties"].values()):
        with pytest.raises(AssertionError):
            _whole(json.dumps(huge), schema)
