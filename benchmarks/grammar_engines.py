"""Structured-generation engines side by side on one vocabulary: which JSON Schema keywords each enforces, and what
compiling a schema costs. The engines are the ones issue step 15 names: llguidance (what the runners use),
xgrammar (vLLM's and SGLang's default) and outlines-core (Outlines, vLLM's older choice); llama-cpp-python's GBNF
converter, the runners' engine before, is measured by ``benchmarks/grammars.py`` against the running runner.

Every engine gets the packaged Gemma 3 270M's 262,144-token vocabulary, read from its GGUF (token bytes: ``▁`` as
a space, ``<0xNN>`` as that byte). For each row of ``benchmarks.grammars.ROWS`` (a keyword group, and a value the
keyword forbids) and for a 20,000-value enum it prints the compile time (schema to whatever masks tokens: a
compiled grammar, a matcher, an index) and whether the forbidden value is refused, as each engine's own matcher
would see it: llguidance and xgrammar are fed the value's bytes (tokenized greedily), outlines-core's regex is
matched against the value. "error" is an engine that refused the schema, "> Ns" one still compiling after the
bound. Each engine runs in a child process of its own (killed at the bound and started again for the next row).

Needs llguidance, xgrammar (with torch) and outlines-core, and ``gguf`` to read the vocabulary: the vLLM venv the
test suite builds has all of them (vLLM uses the three):

    .cache/venvs/vllm/bin/python benchmarks/grammar_engines.py .cache/test-data/models/*.gguf [--bound 120]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import re
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.grammars import ENUM, ROWS  # noqa: E402  (schemas and forbidden values only: no runner here)

BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")
CONTROL = 3  # GGUF token types: 1 normal, 3 control, 6 byte, ...


def vocabulary(gguf_path: str) -> tuple[list[bytes], list[bool], int]:
    """Every token's bytes, which tokens are special (control), and the end-of-sequence id, from the GGUF."""
    from gguf import GGUFReader

    reader = GGUFReader(gguf_path)
    field = reader.fields["tokenizer.ggml.tokens"]
    texts = [bytes(field.parts[i]).decode("utf-8") for i in field.data]
    kinds_field = reader.fields["tokenizer.ggml.token_type"]
    kinds = [int(kinds_field.parts[i][0]) for i in kinds_field.data]
    eos_field = reader.fields["tokenizer.ggml.eos_token_id"]
    eos = int(eos_field.parts[eos_field.data[0]][0])
    tokens = []
    for text in texts:
        byte = BYTE.match(text)
        tokens.append(bytes([int(byte.group(1), 16)]) if byte else text.replace("\u2581", " ").encode("utf-8"))
    return tokens, [k == CONTROL for k in kinds], eos


def greedy(lookup: dict[bytes, int], data: bytes) -> list[int]:
    """``data`` as tokens, longest match first (every byte has a token of its own)."""
    out, at = [], 0
    while at < len(data):
        for end in range(min(len(data), at + 32), at, -1):
            if data[at:end] in lookup:
                out.append(lookup[data[at:end]])
                at = end
                break
        else:
            raise ValueError(f"no token for byte {data[at]:#x}")
    return out


class Llguidance:
    name = "llguidance"

    def __init__(self, tokens: list[bytes], special: list[bool], eos: int) -> None:
        import llguidance

        self.ll = llguidance
        lookup = {t: i for i, t in reversed(list(enumerate(tokens))) if t and not special[i]}
        self.lookup = lookup

        class Wrapper:
            eos_token_id, bos_token_id = eos, None
            special_token_ids = [i for i, s in enumerate(special) if s]

            def __init__(self) -> None:
                # llguidance marks special tokens with a leading 0xFF byte
                self.tokens = [b"\xff" + t if special[i] else t for i, t in enumerate(tokens)]

            def __call__(self, s: bytes | str) -> list[int]:
                return greedy(lookup, s.encode() if isinstance(s, str) else s)

        self.tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(Wrapper()))

    def compile(self, schema: dict[str, Any]) -> Any:
        grammar = self.ll.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
        matcher = self.ll.LLMatcher(self.tokenizer, grammar)
        if matcher.is_error():
            raise ValueError(matcher.get_error())
        return matcher

    def refuses(self, matcher: Any, value: str) -> bool:
        tokens = greedy(self.lookup, value.encode())
        return matcher.try_consume_tokens(tokens) < len(tokens) or not matcher.is_accepting()


class Xgrammar:
    name = "xgrammar"

    def __init__(self, tokens: list[bytes], special: list[bool], eos: int) -> None:
        import xgrammar

        self.xgr = xgrammar
        info = xgrammar.TokenizerInfo(
            [t.decode("utf-8", "surrogateescape") if s else t for t, s in zip(tokens, special, strict=True)],
            vocab_type=xgrammar.VocabType.RAW,
            stop_token_ids=[eos],
        )
        self.eos = eos
        self.compiler = xgrammar.GrammarCompiler(info, cache_enabled=False)

    def compile(self, schema: dict[str, Any]) -> Any:
        compiled = self.compiler.compile_json_schema(json.dumps(schema), any_whitespace=False)
        return self.xgr.GrammarMatcher(compiled)

    def refuses(self, matcher: Any, value: str) -> bool:
        return not matcher.accept_string(value) or not matcher.accept_token(self.eos)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, tokens: list[bytes], special: list[bool], eos: int) -> None:
        import outlines_core

        self.oc = outlines_core
        ids: dict[bytes, list[int]] = {}
        for i, token in enumerate(tokens):
            if token and not special[i] and i != eos:
                ids.setdefault(token, []).append(i)
        self.vocabulary = outlines_core.Vocabulary(eos, ids)
        self.regex = ""

    def compile(self, schema: dict[str, Any]) -> Any:
        from outlines_core.json_schema import build_regex_from_schema

        self.regex = build_regex_from_schema(json.dumps(schema))
        return self.oc.Index(self.regex, self.vocabulary)

    def refuses(self, index: Any, value: str) -> bool:
        return re.fullmatch(self.regex, value) is None


ENGINES = {e.name: e for e in (Llguidance, Xgrammar, OutlinesCore)}


def child(engine_name: str, gguf_path: str, jobs: Any, results: Any) -> None:
    """One engine: build its tokenizer once, then compile and check each schema it is sent."""
    vocab = vocabulary(gguf_path)
    started = time.perf_counter()
    engine = ENGINES[engine_name](*vocab)
    results.put(("ready", time.perf_counter() - started, None))
    while (job := jobs.get()) is not None:
        schema, forbidden = job
        try:
            started = time.perf_counter()
            compiled = engine.compile(schema)
            elapsed = time.perf_counter() - started
            verdict = "-" if forbidden is None else ("yes" if engine.refuses(compiled, forbidden) else "NO")
            results.put(("done", elapsed, verdict))
        except Exception as exc:  # an engine that refuses a schema (or fails on it) says so in the table
            results.put(("done", None, f"error: {type(exc).__name__}: {str(exc)[:60]}"))


def run(engine_name: str, gguf_path: str, rows: list[tuple[str, dict, str | None]], bound: float) -> dict[str, str]:
    """``group -> "ms / enforced"`` for one engine, a row beyond ``bound`` seconds killing its child."""
    ctx = mp.get_context("spawn")
    out: dict[str, str] = {}
    todo = list(rows)
    while todo:
        jobs, results = ctx.Queue(), ctx.Queue()
        proc = ctx.Process(target=child, args=(engine_name, gguf_path, jobs, results), daemon=True)
        proc.start()
        _, setup, _ = _first_result(results, proc, 600)
        out.setdefault("tokenizer (once)", f"{setup:.2f} s")
        while todo:
            group, schema, forbidden = todo[0]
            jobs.put((schema, forbidden))
            try:
                _, elapsed, verdict = results.get(timeout=bound)
            except Exception:  # queue.Empty: still compiling at the bound
                out[group] = f"> {bound:.0f} s"
                todo.pop(0)
                proc.kill()
                proc.join()
                break
            todo.pop(0)
            out[group] = verdict if elapsed is None else f"{elapsed * 1e3:.1f} ms / {verdict}"
        else:
            jobs.put(None)
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
    return out


def _first_result(results: Any, proc: Any, timeout: float) -> tuple:
    """The child's first message (its setup time); a child that died first (a missing package) ends the run."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1)
        except Exception:  # queue.Empty
            if not proc.is_alive():
                raise SystemExit(f"the engine's process exited ({proc.exitcode}) before it was ready") from None
    raise SystemExit(f"the engine's process was not ready in {timeout:.0f} s")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("gguf", help="the GGUF whose vocabulary the engines get (the packaged Gemma 3 270M)")
    parser.add_argument("--bound", type=float, default=120.0, help="seconds one compile may take")
    parser.add_argument("--engines", default=",".join(ENGINES))
    args = parser.parse_args()
    rows: list[tuple[str, dict, str | None]] = [(g, s, bad) for g, s, _, bad in ROWS]
    rows.append(("enum of 20,000 values", ENUM, None))
    names = args.engines.split(",")
    versions = {}
    for name in names:
        module = {"llguidance": "llguidance", "xgrammar": "xgrammar", "outlines-core": "outlines_core"}[name]
        from importlib.metadata import version

        versions[name] = version(module.replace("_", "-"))
    table = {name: run(name, args.gguf, rows, args.bound) for name in names}
    print("compile ms / the forbidden value refused; " + ", ".join(f"{n} {v}" for n, v in versions.items()))
    width = 24
    print(f"{'keyword group':32}" + "".join(f"{n:>{width}}" for n in names))
    for group in ["tokenizer (once)"] + [r[0] for r in rows]:
        print(f"{group:32}" + "".join(f"{table[n].get(group, '?'):>{width}}" for n in names))


if __name__ == "__main__":
    main()
