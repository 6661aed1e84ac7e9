"""Structured-output grammars on the llama.cpp runner: compile cost, coverage, and whether a big one stalls others.

Prints:

(a) per keyword group, and for a 20,000-value enum: compile time with llama-cpp-python's GBNF converter (converter
    plus llama.cpp's grammar parse) and with llguidance (schema to matcher), and whether each enforces the keyword
    (the converter: its grammar differs from the one without the keyword; llguidance: it refuses a violating value);
(b) a 2-token free-text request's latency alone, and while a 20,000-value enum request compiles and generates on
    the same runner (target: within 100 ms of alone);
(c) the same forced tools twice: the second request takes the compiled matcher from the cache.

Run: ``.venv/bin/python -m benchmarks.grammars [path/to/model.gguf]`` (default: the packaged Gemma 3 270M).
"""

from __future__ import annotations

import json
import statistics
import sys
import threading
import time
from typing import Any

ROWS: list[tuple[str, dict[str, Any], dict[str, Any], str]] = [
    # (group, schema, the schema without the keyword, a value the keyword forbids, as JSON)
    ("minimum/maximum", {"type": "integer", "minimum": 1, "maximum": 5}, {"type": "integer"}, "1000000000000000"),
    ("exclusiveMin/Max", {"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1}, {"type": "number"}, "1"),
    ("multipleOf", {"type": "integer", "multipleOf": 5}, {"type": "integer"}, "7"),
    ("minLength/maxLength", {"type": "string", "minLength": 2, "maxLength": 3}, {"type": "string"}, '"abcd"'),
    ("pattern", {"type": "string", "pattern": "^[a-c]+$"}, {"type": "string"}, '"xyz"'),
    ("format date", {"type": "string", "format": "date"}, {"type": "string"}, '"2024-13-45"'),
    ("format uuid", {"type": "string", "format": "uuid"}, {"type": "string"}, '"123"'),
    ("format email", {"type": "string", "format": "email"}, {"type": "string"}, '"not an email"'),
    ("enum", {"enum": ["a", "b"]}, {}, '"c"'),
    ("const", {"const": "a"}, {}, '"b"'),
    ("anyOf", {"anyOf": [{"type": "integer"}, {"type": "null"}]}, {}, '"s"'),
    ("allOf", {"allOf": [{"type": "integer"}, {"maximum": 3}]}, {"type": "integer"}, "9"),
    (
        "required/additionalProperties",
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
        {"type": "object", "properties": {"a": {"type": "integer"}}},
        "{}",
    ),
    (
        "minItems/maxItems",
        {"type": "array", "items": {"type": "integer"}, "maxItems": 1},
        {"type": "array", "items": {"type": "integer"}},
        "[1, 2]",
    ),  # fmt: skip  # noqa: E501
    (
        "prefixItems",
        {"type": "array", "prefixItems": [{"type": "integer"}], "items": False},
        {"type": "array"},
        '["x"]',
    ),
    (
        "recursive $ref",
        {"$ref": "#/$defs/n", "$defs": {"n": {"type": "object", "properties": {"c": {"$ref": "#/$defs/n"}}}}},
        {"type": "object"},
        '{"c": 1}',
    ),
]
ENUM = {"enum": [f"value-{i}-x" for i in range(20_000)]}


def gbnf(schema: dict[str, Any]) -> str:
    from llama_cpp.llama_grammar import SchemaConverter

    converter = SchemaConverter(prop_order={}, allow_fetch=False, dotall=False, raw_pattern=False)
    converter.visit(converter.resolve_refs(json.loads(json.dumps(schema)), "stdin"), "")  # it rewrites refs in place
    return str(converter.format_grammar())


def old_compile(vocab: Any, schema: dict[str, Any]) -> tuple[float, str | None]:
    """Seconds to convert and parse with the GBNF path, and the grammar (``None``: it failed)."""
    import llama_cpp as lib

    started = time.perf_counter()
    try:
        text = gbnf(schema)
    except Exception:  # the converter fails on what it lacks (recursion: KeyError)
        return time.perf_counter() - started, None
    grammar = lib.llama_sampler_init_grammar(vocab, text.encode(), b"root")
    elapsed = time.perf_counter() - started
    if grammar:
        lib.llama_sampler_free(grammar)
    return elapsed, text if grammar else None


def main() -> None:
    import llama_cpp as lib

    from meshgate.backends.llama_cpp.engine import LlamaEngine
    from meshgate.protocols.model import (
        Message,
        Request,
        ResponseFormat,
        Sampling,
        TextDelta,
        TextPart,
        Tool,
        ToolChoice,
    )

    path = sys.argv[1] if len(sys.argv) > 1 else _packaged()
    engine = LlamaEngine(path, n_ctx=4096, parallel=4)
    vocab = engine.llm._model.vocab
    grammars = engine.grammars
    started = time.perf_counter()
    tokenizer = grammars.tokenizer()
    print(f"llguidance tokenizer (once per runner): {time.perf_counter() - started:.2f} s\n")

    def new_compile(schema: dict[str, Any]) -> tuple[float, Any]:
        grammars._cache.clear()
        started = time.perf_counter()
        matcher = grammars.matcher(schema, "schema")
        return time.perf_counter() - started, matcher

    print("(a) compile time and coverage (enforced: a value the keyword forbids is refused)")
    print(f"{'keyword group':32} {'GBNF ms':>9} {'enforced':>9} {'llguidance ms':>14} {'enforced':>9}")
    for group, schema, without, forbidden in ROWS:
        old_s, text = old_compile(vocab, schema)
        old_enforced = "failed" if text is None else ("yes" if text != gbnf(without) else "no")
        new_s, matcher = new_compile(schema)
        tokens = tokenizer.tokenize_str(forbidden)
        refused = matcher.try_consume_tokens(tokens) < len(tokens) or not matcher.is_accepting()
        print(f"{group:32} {old_s * 1e3:9.1f} {old_enforced:>9} {new_s * 1e3:14.2f} {'yes' if refused else 'no':>9}")
    old_s, _ = old_compile(vocab, ENUM)
    new_s, _ = new_compile(ENUM)
    print(f"{'enum of 20,000 values':32} {old_s * 1e3:9.1f} {'':>9} {new_s * 1e3:14.2f}\n")

    def request(text: str, max_tokens: int, **kw: Any) -> Request:
        message = Message(role="user", parts=(TextPart(text=text),))
        return Request(model="m", messages=(message,), max_tokens=max_tokens, sampling=Sampling(temperature=0), **kw)

    def run(req: Request) -> float:
        started = time.perf_counter()
        for event in engine.generate(req, threading.Event()):
            if isinstance(event, TextDelta):
                pass
        return time.perf_counter() - started

    short = request("Say hi.", 2)
    run(short)
    alone = statistics.median(run(short) for _ in range(5))
    beside = []
    for i in range(3):
        schema = {"enum": [f"value-{i}-{j}-x" for j in range(20_000)]}  # a new schema each time: compiled again
        big = request("Pick a value.", 16, response_format=ResponseFormat(kind="json_schema", schema=schema))
        thread = threading.Thread(target=run, args=(big,))
        thread.start()
        time.sleep(0.01)  # the big one is compiling
        beside.append(run(short))
        thread.join()
    print("(b) a 2-token request on the same runner")
    print(
        f"alone: {alone * 1e3:.0f} ms; beside a 20,000-value enum request: "
        + ", ".join(f"{b * 1e3:.0f} ms" for b in beside)
    )
    print(f"worst added latency: {(max(beside) - alone) * 1e3:.0f} ms (target: 100 ms)\n")

    tools = tuple(
        Tool(
            name=f"tool_{i}",
            parameters={
                "type": "object",
                "properties": {
                    "q": {"type": "string", "maxLength": 8},
                    "n": {"type": "integer", "minimum": 0, "maximum": 9},
                },
            },
        )  # noqa: E501
        for i in range(20)
    )
    forced = request("Call a tool.", 8, tools=tools, tool_choice=ToolChoice(mode="required"))
    grammars._cache.clear()
    before = grammars.compiled
    first = run(forced)
    second = run(forced)
    print("(c) 20 forced tools, the same request twice")
    compiled, hits = grammars.compiled - before, grammars.hits
    print(f"first: {first * 1e3:.0f} ms, second: {second * 1e3:.0f} ms; compiled {compiled} time(s), hits {hits}")
    del lib


def _packaged() -> str:
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    found = sorted((root / ".cache" / "test-data" / "models").glob("*.gguf"))
    if not found:
        raise SystemExit("give the path of a GGUF (the packaged one is assembled by the test suite)")
    return str(found[0])


if __name__ == "__main__":
    main()
