"""Structured output obeys the whole schema: the real model (Gemma 3 270M) on a real gateway, every answer checked
with ``jsonschema`` (issue step 15).

Each keyword group is asked for greedily, at seed 1 and temperature 0.7 and at seed 2 and 1.0 (``RUNS``), through
OpenAI ``response_format`` (its SDK), Ollama ``format`` (its SDK), forced tool calls in all three protocols (OpenAI
``tool_choice``, Anthropic ``tool_choice`` ``{"type": "tool"}``, Ollama ``tools`` with ``format``) and pydantic
models' own schemas (``model_json_schema``). The schemas bound every answer (string lengths, item counts) so that
it fits ``MAX_TOKENS`` and ends on its own: an answer cut short would not be JSON. Requests go out together, so
the runner batches them. Refusals: a 400 in each protocol's own error shape naming the keyword.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Literal

import anthropic
import jsonschema
import ollama
import openai
import pytest
from pydantic import BaseModel, Field

from meshgate.protocols.schema_rules import enforceable
from tests.conftest import MODEL, Server

MAX_TOKENS = 80
FORMATS = jsonschema.Draft202012Validator.FORMAT_CHECKER
"""Checks ``format`` too (date, time, date-time, email, uuid: time and date-time with rfc3339-validator)."""
assert {"date", "time", "date-time", "email", "uuid"} <= set(FORMATS.checkers)
RUNS: list[dict[str, Any]] = [
    {"temperature": 0.0, "seed": 1},
    {"temperature": 0.7, "seed": 1},
    {"temperature": 1.0, "seed": 2},
]
PROMPT = "Answer with one JSON value about a small made-up order."


def closed(properties: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": properties,
        "required": list(properties) if required is None else required,
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 6}

CASES: dict[str, dict[str, Any]] = {
    "integer bounds": closed(
        {
            "a": {"type": "integer", "minimum": 1, "maximum": 5},
            "b": {"type": "integer", "exclusiveMinimum": 0, "exclusiveMaximum": 10},
            "c": {"type": "integer", "multipleOf": 5, "minimum": 0, "maximum": 100},
            "d": {"type": "integer", "minimum": -3, "maximum": -1},
        }
    ),
    "number bounds": closed(
        {
            "x": {"type": "number", "minimum": -1, "maximum": 1, "multipleOf": 0.25},
            "y": {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 2, "multipleOf": 0.5},
        }
    ),
    "strings": closed(
        {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"},
            "name": {"type": "string", "minLength": 2, "maxLength": 6},
            "kind": {"enum": ["box", "bag", 3, None]},
            "fixed": {"const": "ok"},
        }
    ),
    "formats": closed(
        {
            "d": {"type": "string", "format": "date"},
            "u": {"type": "string", "format": "uuid"},
        }
    ),
    # maxLength: the formats allow fractional seconds and local parts without end, which the model may write on
    "format time": closed({"t": {"type": "string", "format": "time", "maxLength": 9}}),
    "format date-time": closed({"at": {"type": "string", "format": "date-time", "maxLength": 20}}),
    "format email": closed({"mail": {"type": "string", "format": "email", "maxLength": 16}}),
    "arrays": closed(
        {
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "minItems": 1, "maxItems": 3},
            "pair": {
                "type": "array",
                "prefixItems": [{"type": "integer", "maximum": 9, "minimum": 0}, {"type": "boolean"}],
                "items": False,
            },  # fmt: skip
        }
    ),
    "composition": closed(
        {
            "any": {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 9}, SHORT]},
            "one": {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
            "all": {"allOf": [{"type": "integer"}, {"minimum": 2}, {"maximum": 4}]},
            "types": {"type": ["integer", "null"], "minimum": 0, "maximum": 9},
            "opt": {"type": "string", "maxLength": 4, "nullable": True},
            "obj": {
                "type": "object",
                "additionalProperties": {"type": "integer", "minimum": 0, "maximum": 9},
                "maxProperties": 1,
            },  # fmt: skip
        }
    ),
}


RECURSIVE = {
    "$ref": "#/$defs/node",
    "$defs": {
        "node": {
            "type": "object",
            "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        }
    },
}
"""Answered, where the GBNF converter failed with a KeyError (422); its answers nest too deep for ``MAX_TOKENS``,
so ``tests/llama/test_grammar.py`` checks that the grammar holds to it."""


class Line(BaseModel):
    sku: Literal["A1", "B2"]
    qty: int = Field(ge=1, le=5)


class Order(BaseModel):
    who: str = Field(min_length=1, max_length=6)
    rush: bool
    note: str | None = Field(default=None, max_length=4)
    lines: list[Line] = Field(min_length=1, max_length=2)


CASES["pydantic"] = Order.model_json_schema()

TOOL = closed(
    {
        "city": {"type": "string", "maxLength": 8},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "unit": {"enum": ["C", "F"]},
    }
)


@pytest.fixture(scope="module")
def server(data_dir) -> Iterator[Server]:
    s = Server(data_dir, "--n-ctx", "2048", env={"MESHGATE_PARALLEL": "4"})
    yield s
    s.stop()


def together(calls: list[Any]) -> list[Any]:
    with ThreadPoolExecutor(8) as pool:
        return list(pool.map(lambda call: call(), calls))


def check(schema: dict[str, Any], answers: list[str]) -> None:
    """Every answer validates. Against ``enforceable(schema)``: OpenAPI's ``nullable``, which ``jsonschema`` does
    not know, spelled in JSON Schema; otherwise the schema as sent, with objects closed and numbers bounded
    (stricter). Without the decimal steps it adds (``steps=False``): ``jsonschema`` checks a float ``multipleOf``
    by float division, and ``0.1234567891 / 1e-10`` is not whole."""
    assert len(answers) == len(RUNS)
    for answer in answers:
        jsonschema.validate(json.loads(answer), enforceable(schema, steps=False), format_checker=FORMATS)


def test_response_format_obeys_every_keyword_group(server):
    client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)

    def ask(schema: dict[str, Any], run: dict[str, Any]) -> Any:
        fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema}}
        return lambda: client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=MAX_TOKENS,
            response_format=fmt, **run,  # type: ignore[arg-type]
        )  # fmt: skip

    calls = [ask(schema, run) for schema in CASES.values() for run in RUNS]
    replies = together(calls)
    for i, (name, schema) in enumerate(CASES.items()):
        chunk = replies[i * len(RUNS) : (i + 1) * len(RUNS)]
        assert [r.choices[0].finish_reason for r in chunk] == ["stop"] * len(RUNS), name
        check(schema, [r.choices[0].message.content for r in chunk])


def test_ollama_format_and_forced_tools_in_every_protocol(server):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0, timeout=600)
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0, timeout=600)
    ol = ollama.Client(host=server.url, timeout=600)
    ask = "What is the weather in Paris for the next three days?"
    schema = CASES["pydantic"]

    def by_openai(run: dict[str, Any]) -> str:
        r = oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=MAX_TOKENS,
            tools=[{"type": "function", "function": {"name": "weather", "parameters": TOOL}}],
            tool_choice={"type": "function", "function": {"name": "weather"}}, **run,
        )  # fmt: skip
        call = r.choices[0].message.tool_calls[0]
        assert call.function.name == "weather" and r.choices[0].finish_reason == "tool_calls"
        return call.function.arguments

    def by_anthropic(run: dict[str, Any]) -> str:
        r = an.messages.create(
            model=MODEL, messages=[{"role": "user", "content": ask}], max_tokens=MAX_TOKENS,
            tools=[{"name": "weather", "input_schema": TOOL}], tool_choice={"type": "tool", "name": "weather"},
            extra_body=run,
        )  # fmt: skip
        [block] = [b for b in r.content if b.type == "tool_use"]
        assert block.name == "weather" and r.stop_reason == "tool_use"
        return json.dumps(block.input)

    def by_ollama_tools(run: dict[str, Any]) -> str:
        r = ol.chat(
            model=MODEL, messages=[{"role": "user", "content": ask}], format="json",
            tools=[{"type": "function", "function": {"name": "weather", "parameters": TOOL}}],
            options={**run, "num_predict": MAX_TOKENS},
        )  # fmt: skip
        [call] = r.message.tool_calls or []
        assert call.function.name == "weather"
        return json.dumps(call.function.arguments)

    def by_ollama_format(run: dict[str, Any]) -> str:
        r = ol.generate(model=MODEL, prompt=PROMPT, format=schema, options={**run, "num_predict": MAX_TOKENS})
        assert r.done_reason == "stop"
        return r.response

    calls = [(lambda f=f, run=run: f(run)) for f in (by_openai, by_anthropic, by_ollama_tools, by_ollama_format) for run in RUNS]  # fmt: skip  # noqa: E501
    answers = together(calls)
    n = len(RUNS)
    check(TOOL, answers[:n])
    check(TOOL, answers[n : 2 * n])
    check(TOOL, answers[2 * n : 3 * n])
    check(schema, answers[3 * n :])


def test_refusals_are_400s_in_each_protocol_naming_the_keyword(server):
    oa = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
    answered = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "A tree."}], max_tokens=4,
        response_format={"type": "json_schema", "json_schema": {"name": "tree", "schema": RECURSIVE}},
    )  # fmt: skip
    assert answered.choices[0].message.content.startswith("{")  # type: ignore[union-attr]
    an = anthropic.Anthropic(base_url=server.url, api_key="x", max_retries=0)
    ol = ollama.Client(host=server.url)
    bad = closed({"v": {"type": "array", "items": {"type": "integer"}, "uniqueItems": True}})
    with pytest.raises(openai.BadRequestError) as caught_oa:
        oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": bad}},
        )  # fmt: skip
    assert "the keyword 'uniqueItems' is not supported" in caught_oa.value.body["message"]  # type: ignore[index]
    assert caught_oa.value.body["param"] == "response_format"  # type: ignore[index]
    with pytest.raises(anthropic.BadRequestError) as caught_an:
        an.messages.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
            tools=[{"name": "t", "input_schema": {"type": "object", "properties": {"d": {"type": "string", "format": "idn-email"}}}}],  # fmt: skip  # noqa: E501
            tool_choice={"type": "tool", "name": "t"},
        )  # fmt: skip
    assert caught_an.value.status_code == 400
    assert "the format 'idn-email' is not supported" in caught_an.value.body["error"]["message"]  # type: ignore[index]
    with pytest.raises(ollama.ResponseError) as caught_ol:
        ol.generate(model=MODEL, prompt="Hi", format={"type": "string", "not": {"const": "a"}}, options={"num_predict": 4})  # fmt: skip  # noqa: E501
    assert caught_ol.value.status_code == 400 and "the keyword 'not' is not supported" in caught_ol.value.error
