"""JSON schemas as llama.cpp grammars (GBNF) that llama.cpp can parse and sample without crashing.

A request's schema (a response format, or the call schema of forced tool calls) reaches llama.cpp's C++ grammar
code, which aborts the whole runner on some inputs instead of failing the request. So the schema is checked and
the grammar made safe here, and what cannot be made safe is refused as ``Unprocessable`` (422) naming the
schema keyword:

- Literals (``const``, ``enum`` values, property names) are written with every backslash and control character
  escaped for GBNF. llama-cpp-python's converter escapes only quotes and line breaks, so the JSON escape
  ``\\u0000`` (a NUL in an enum or a tool name) reached GBNF as an escape of its own, asked the model for a raw
  NUL that no token produces, and the next sampled token aborted the runner ("Unexpected empty grammar stack").
  Non-ASCII text stays raw UTF-8, as before.
- A raw NUL anywhere else in the grammar (from a ``pattern``) is written as ``\\x00``: the grammar travels as a C
  string, which a NUL would cut short.
- Repetition bounds (``minLength``, ``maxLength``, ``minItems``, ``maxItems``, and ``{n,m}`` in patterns) are at
  most ``MAX_REPEAT``: the converter spells a repetition out (a 10^8 ``minLength`` is a 500 MB grammar) and
  llama.cpp's parser recurses once per nested optional, so ``maxLength: 100000`` overflowed its stack.
- The grammar is at most ``MAX_GBNF_BYTES`` long and nests parentheses at most ``MAX_NESTING`` deep.

A grammar can still allow no token at some point (a ``pattern`` that wants a NUL): ``sampling.Sampler`` then
fails that request, never the runner.

Runs only in the runner process; imports llama_cpp (its converter) and protocols.
"""

from __future__ import annotations

import json
import re
from typing import Any

from meshgate.protocols.model import Unprocessable

__all__ = ["MAX_GBNF_BYTES", "MAX_NESTING", "MAX_REPEAT", "escape_literal", "nesting", "schema_grammar"]

MAX_REPEAT = 1000
"""The largest repetition bound a schema may ask for (llama.cpp itself refuses a little above this)."""

MAX_NESTING = 2048
"""The deepest parenthesis nesting a grammar may have (llama.cpp's parser recurses once per level)."""

MAX_GBNF_BYTES = 4 << 20
"""The longest grammar text sent to llama.cpp."""

_REPEAT_KEYS = ("minLength", "maxLength", "minItems", "maxItems")
_QUANTIFIER = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")
_NEEDS_ESCAPE = re.compile(r'[\\"\x00-\x1f\x7f\ud800-\udfff]')
_GBNF_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|\[(?:[^\]\\]|\\.)*\]|[()]', re.DOTALL)


def escape_literal(text: str) -> str:
    """``text`` as a GBNF string literal: quotes and backslashes escaped, control characters (and lone
    surrogates, which UTF-8 cannot carry) as ``\\xHH`` / ``\\uHHHH``; other characters as they are."""

    def one(match: re.Match[str]) -> str:
        c = match.group(0)
        if c in '\\"':
            return "\\" + c
        return f"\\x{ord(c):02x}" if ord(c) < 0x80 else f"\\\\u{ord(c):04x}"  # a surrogate: its JSON escape

    return '"' + _NEEDS_ESCAPE.sub(one, text) + '"'


def nesting(gbnf: str) -> int:
    """The deepest parenthesis nesting of a grammar, outside its literals and character classes."""
    depth = deepest = 0
    for match in _GBNF_TOKEN.finditer(gbnf):
        token = match.group(0)
        if token == "(":
            depth += 1
            deepest = max(deepest, depth)
        elif token == ")":
            depth -= 1
    return deepest


def schema_grammar(schema: dict[str, Any], what: str) -> str:
    """The GBNF (root rule ``root``) that holds generation to ``schema``.

    Args:
        schema: A JSON schema.
        what: The schema's name for error messages ("the response format's JSON schema").

    Raises:
        Unprocessable: the schema asks for more than the grammar can hold, or cannot be converted.
    """
    _check(schema, what)
    from llama_cpp.llama_grammar import SchemaConverter

    class Converter(SchemaConverter):
        def _format_literal(self, literal: str) -> str:
            # Called with JSON text only (``json.dumps`` of a constant or a property name): write it back with
            # its non-ASCII characters raw, then escape it for GBNF.
            return escape_literal(json.dumps(json.loads(literal), ensure_ascii=False))

    try:
        converter = Converter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
        copy = json.loads(json.dumps(schema))
        converter.visit(converter.resolve_refs(copy, "stdin"), "")
        gbnf = converter.format_grammar()
    except Exception as exc:  # the converter asserts on schema features it lacks; RecursionError when too deep
        raise Unprocessable(f"{what} cannot be turned into a grammar: {exc!r}") from exc
    gbnf = gbnf.replace("\x00", "\\x00")
    if len(gbnf) > MAX_GBNF_BYTES:
        raise Unprocessable(
            f"{what} makes a grammar of {len(gbnf):,} characters; at most {MAX_GBNF_BYTES:,} "
            "are allowed: simplify the schema"
        )
    if (deep := nesting(gbnf)) > MAX_NESTING:
        raise Unprocessable(
            f"{what} makes a grammar nested {deep} levels deep; at most {MAX_NESTING} are allowed: "
            "lower its repetition bounds"
        )
    try:
        gbnf.encode()
    except UnicodeEncodeError as exc:
        raise Unprocessable(f"{what} holds text that is not valid Unicode: {exc.reason}") from exc
    return gbnf


def _check(schema: Any, what: str) -> None:
    """Refuse repetition bounds above ``MAX_REPEAT`` anywhere in ``schema`` (walked without recursion)."""
    stack: list[tuple[Any, str]] = [(schema, "")]
    while stack:
        node, at = stack.pop()
        if isinstance(node, list):
            stack.extend((item, f"{at}[{i}]") for i, item in enumerate(node))
            continue
        if not isinstance(node, dict):
            continue
        for key in _REPEAT_KEYS:
            value = node.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool) and value > MAX_REPEAT:
                raise Unprocessable(
                    f"{what}: {key} {value} at {at or 'the top'} is more than a grammar can hold (at most {MAX_REPEAT})"
                )
        pattern = node.get("pattern")
        if isinstance(pattern, str):
            for low, high in _QUANTIFIER.findall(pattern):
                if max(int(low or 0), int(high or 0)) > MAX_REPEAT:
                    raise Unprocessable(
                        f"{what}: the pattern at {at or 'the top'} repeats more than a grammar can "
                        f"hold (at most {MAX_REPEAT} times)"
                    )
        stack.extend((value, f"{at}.{key}" if at else str(key)) for key, value in node.items())
