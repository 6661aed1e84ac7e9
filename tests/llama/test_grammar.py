"""JSON schemas as llguidance matchers over the packaged model's vocabulary (``backends/llama_cpp/grammar.py``):
what the old GBNF converter lost (number bounds, recursion, a 20,000-value enum in reasonable time) is enforced,
literals with NULs and backslashes are written as JSON escapes, compiled schemas are cached, and what cannot be
enforced is a 400 that says why.

The matcher (fixture ``grammars`` in ``conftest.py``) is driven with the text's own tokens (``tokenize_str``)
instead of a model, so each assertion is about the grammar alone.
"""

from __future__ import annotations

import pytest

from meshgate.backends.llama_cpp.grammar import Grammars
from meshgate.backends.llama_cpp.tools import call_schema
from meshgate.protocols.model import InvalidRequest, Request, Tool, ToolChoice


def takes(grammars: Grammars, schema: dict, text: str) -> bool:
    """Whether the grammar for ``schema`` takes all of ``text`` and may end there."""
    matcher = grammars.matcher(schema, "format")
    tokens = grammars.tokenizer().tokenize_str(text)
    return matcher.try_consume_tokens(tokens) == len(tokens) and matcher.is_accepting()


@pytest.mark.parametrize(
    ("schema", "good", "bad"),
    [
        ({"type": "integer", "minimum": 1, "maximum": 5}, ["1", "5"], ["0", "6", "1000000000000000"]),
        ({"type": "integer", "exclusiveMinimum": 1, "exclusiveMaximum": 5}, ["2", "4"], ["1", "5"]),
        ({"type": "number", "minimum": -1.5, "maximum": 2.5}, ["-1.5", "2.25", "0"], ["-2", "2.75"]),
        ({"type": "integer", "multipleOf": 5}, ["0", "15"], ["7"]),
        (
            {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}},
            ['{"c": {"c": {}}}'],
            ['{"d": {}}'],
        ),
        ({"type": "string", "format": "date"}, ['"2024-02-29"'], ['"2024-13-01"']),
        ({"type": "string", "format": "uuid"}, ['"123e4567-e89b-12d3-a456-426614174000"'], ['"123"']),
        ({"type": ["string", "null"], "maxLength": 2}, ['"ab"', "null"], ['"abc"']),
        ({"type": "string", "nullable": True}, ['"x"', "null"], ["1"]),
        ({"type": "object", "properties": {"a": {"type": "integer"}}}, ['{"a": 1}', "{}"], ['{"b": 1}']),
    ],
)
def test_keywords_the_gbnf_converter_dropped_are_held_to(grammars, schema, good, bad):
    assert [takes(grammars, schema, text) for text in good] == [True] * len(good)
    assert [takes(grammars, schema, text) for text in bad] == [False] * len(bad)


def test_nul_and_backslash_literals_are_json_escapes(grammars):
    schema = {"enum": ["\u0000", "a\\b"]}
    assert takes(grammars, schema, '"\\u0000"') and takes(grammars, schema, '"a\\\\b"')
    request = Request(model="m", tools=(Tool(name="x\u0000"),), tool_choice=ToolChoice(mode="required"))
    assert takes(grammars, call_schema(request), '{"name": "x\\u0000", "arguments": {}}')


def test_a_twenty_thousand_value_enum_compiles_and_the_same_schema_is_compiled_once(grammars):
    schema = {"enum": [f"value-{i}-x" for i in range(20_000)]}
    before = grammars.compiled, grammars.hits
    assert takes(grammars, schema, '"value-12345-x"') and not takes(grammars, schema, '"value-20000-x"')
    assert (grammars.compiled, grammars.hits) == (before[0] + 1, before[1] + 1)


def test_each_matcher_is_its_own(grammars):
    schema = {"type": "integer", "maximum": 99}
    first = grammars.matcher(schema, "format")
    tokens = grammars.tokenizer().tokenize_str("12")
    assert first.try_consume_tokens(tokens) == len(tokens)
    second = grammars.matcher(schema, "format")  # from the cache: starts at the beginning, not after "12"
    assert second.try_consume_tokens(grammars.tokenizer().tokenize_str("9")) == 1


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "not": {"const": "a"}}, "the keyword 'not' is not supported"),
        ({"type": "string", "pattern": "^(a$"}, "cannot be enforced: regex parse error"),
        ({"type": "string", "pattern": "^(a)\\1$"}, "cannot be enforced"),
    ],
)
def test_what_cannot_be_enforced_is_a_400_that_says_why(grammars, schema, words):
    with pytest.raises(InvalidRequest) as caught:
        grammars.matcher(schema, "the response format's JSON schema", param="response_format")
    assert caught.value.status == 400 and caught.value.param == "response_format"
    assert words in caught.value.message and caught.value.message.startswith("the response format's JSON schema")
