"""JSON schemas as llama.cpp grammars that cannot crash a runner (``backends/llama_cpp/grammar.py``): literals
escaped for GBNF, repetition bounds and nesting held to what llama.cpp's parser survives.

The conversions are plain functions; whether llama.cpp parses a grammar is asked in a child process (with the
packaged model's vocabulary), since a grammar it cannot take used to kill the process that parses it.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from meshgate.backends.llama_cpp.grammar import MAX_REPEAT, escape_literal, nesting, schema_grammar
from meshgate.backends.llama_cpp.tools import call_schema
from meshgate.protocols.model import Request, Tool, ToolChoice, Unprocessable

ROOT = Path(__file__).resolve().parents[2]

PARSE = """
import sys, llama_cpp as lib
params = lib.llama_model_default_params(); params.vocab_only = True
model = lib.llama_model_load_from_file(sys.argv[1].encode(), params)
grammar = lib.llama_sampler_init_grammar(lib.llama_model_get_vocab(model), sys.stdin.read().encode(), b"root")
print("parsed" if grammar else "refused")
"""


def parses(gbnf: str, gguf: Path) -> str:
    """``parsed`` or ``refused`` from llama.cpp in a child process, or how that process died."""
    done = subprocess.run(
        [sys.executable, "-c", PARSE, str(gguf)], input=gbnf, capture_output=True, text=True, timeout=120, cwd=ROOT
    )
    return done.stdout.strip().splitlines()[-1] if done.returncode == 0 else f"died with {done.returncode}"


def test_escape_literal_escapes_quotes_backslashes_and_control_characters():
    assert escape_literal('a"b\\c') == '"a\\"b\\\\c"'
    assert escape_literal("x\x00y\x1f\x7f") == '"x\\x00y\\x1f\\x7f"'
    assert escape_literal("é✓") == '"é✓"'
    assert escape_literal("\ud800") == '"\\\\ud800"'  # a lone surrogate: its JSON escape, spelled out


def test_nul_in_an_enum_asks_for_the_json_escape_not_a_raw_nul():
    gbnf = schema_grammar({"enum": ["\u0000", "é", "a\\b"]}, "format")
    assert "\x00" not in gbnf
    # the model must write the six characters \u0000 (valid JSON for a NUL), é as it is, and a\b as "a\\b"
    assert '"\\"\\\\u0000\\""' in gbnf and '"\\"é\\""' in gbnf and '"\\"a\\\\\\\\b\\""' in gbnf


def test_nul_in_a_forced_tool_name():
    request = Request(model="m", tools=(Tool(name="x\u0000"),), tool_choice=ToolChoice(mode="required"))
    gbnf = schema_grammar(call_schema(request), "the tools' parameter schemas")
    assert 'name ::= "\\"x\\\\u0000\\""' in gbnf


def test_raw_nul_in_a_pattern_is_escaped_for_the_c_string():
    gbnf = schema_grammar({"type": "string", "pattern": "^a\u0000b$"}, "format")
    assert "\x00" not in gbnf and "a\\x00b" in gbnf


@pytest.mark.parametrize(
    "schema",
    [
        {"type": "string", "maxLength": 100_000},
        {"type": "string", "minLength": 10**8},
        {"type": "array", "items": {"type": "integer"}, "maxItems": 50_000},
        {"type": "object", "properties": {"a": {"type": "array", "minItems": MAX_REPEAT + 1}}},
        {"type": "string", "pattern": "^a{1,100000}$"},
        {"type": "string", "pattern": "^a{100000000}$"},
    ],
)
def test_repetition_beyond_the_bound_is_refused_before_conversion(schema):
    with pytest.raises(Unprocessable, match="more than a grammar can hold|repeats more"):
        schema_grammar(schema, "format")


def test_nesting_skips_literals_and_classes():
    assert nesting('root ::= ("(" [(] (a)?)?') == 2
    assert nesting('root ::= "\\"((((("') == 0


def test_a_schema_the_converter_cannot_take_is_unprocessable():
    with pytest.raises(Unprocessable, match="cannot be turned into a grammar"):
        schema_grammar({"type": "string", "pattern": "no anchors"}, "format")


def test_llama_cpp_parses_the_escaped_grammars(packaged_gguf):
    request = Request(model="m", tools=(Tool(name="x\u0000"),), tool_choice=ToolChoice(mode="required"))
    grammars = [
        schema_grammar({"enum": ["\u0000", "é", "a\\b", "\ud800"]}, "format"),
        schema_grammar(call_schema(request), "tools"),
        schema_grammar({"type": "string", "pattern": "^a\u0000b$"}, "format"),
        schema_grammar({"type": "string", "maxLength": MAX_REPEAT}, "format"),
    ]
    assert [parses(g, packaged_gguf) for g in grammars] == ["parsed"] * len(grammars)


def test_unchecked_deep_grammars_are_what_llama_cpp_cannot_take(packaged_gguf):
    """Why the bounds exist: the converter's own grammar for maxLength 100000 nests 100000 levels, which overflows
    the stack of the process that parses it (with an 8 MiB stack; a larger one gets a refusal)."""
    from llama_cpp.llama_grammar import json_schema_to_gbnf

    gbnf = json_schema_to_gbnf(json.dumps({"type": "string", "maxLength": 100_000}))
    assert nesting(gbnf) > 50_000
    assert parses(gbnf, packaged_gguf) != "parsed"
