"""JSON schemas as llguidance matchers for the llama.cpp runner: checked, compiled off the decode loop, cached.

A request's schema (a response format, Ollama's ``format``, or the call schema of forced tool calls) is first
checked by the shared ``protocols.schema_rules.check_schema``: what no grammar would enforce, or what is beyond its
bounds, is refused as ``InvalidRequest`` (400) naming the keyword. Then llguidance turns it into a grammar
(``LLMatcher.grammar_from_json_schema``) and a matcher over the model's vocabulary, which ``sampling.Sampler``
asks about each sampled token. llguidance enforces every keyword ``schema_rules`` lets through (integer and number
ranges, recursive ``$ref``, formats, ``multipleOf``, lengths), where llama-cpp-python's GBNF converter, used
before, skipped number bounds, failed on recursion and spelled a 20,000-value enum out into a grammar that took
31 s to build.

- The llguidance tokenizer (every token's bytes, ~3-5 s for Gemma 3's 262k tokens) is built once per runner, on
  the first structured request, under a lock: requests without a schema never wait for it.
- Compiling runs in the request's own thread before its job reaches the scheduler (``LlamaEngine.generate``),
  with the GIL released by llguidance, so the decode loop never waits on a grammar. It is bounded by
  ``schema_rules``' size bounds and by llguidance's ``LLParserLimits`` (lexer fuel, grammar size, states):
  beyond them the request gets a 400 that names the limit.
- Compiled matchers are kept in an LRU keyed by the schema's canonical JSON (``CACHE_SIZE``); a request gets a
  copy (``deep_copy``, ~0.06 ms), so an agent that sends the same tools every turn compiles them once.
- JSON under a schema is written with ``", "`` and ``": "`` between items, as ``json.dumps`` writes it and as
  models learnt it (held to no space at all, Gemma 3 270M answered ``{"city":""}`` to "What is the weather in
  Paris?"), and no other whitespace (``OPTIONS``). ``json_object`` (Ollama's ``format: "json"``), an object with
  no schema, may also break a line and indent up to 20 characters between two tokens (``FORMAT_OPTIONS``), as
  llama.cpp's and Ollama's JSON grammars allow: held to the compact form, Gemma 3 270M never closed an open
  object ("describe Paris" went on adding keys until ``max_tokens``), where it ends a pretty-printed one; under
  a schema, which says when an object ends, the compact form ends sooner. Either way at most one break sits
  between two tokens, so no run of newlines can fill the output. Schema-embedded ``x-guidance`` options
  cannot override these (they go in as ``overrides``).

Runs only in the runner process; imports llguidance, llama_cpp (through llguidance's vocabulary reader) and
protocols.
"""

from __future__ import annotations

import json
import threading
import warnings
from collections import OrderedDict
from typing import Any

from meshgate.protocols.model import InvalidRequest
from meshgate.protocols.schema_rules import JSON_OPTIONS, check_schema, enforceable

__all__ = ["CACHE_SIZE", "FORMAT_OPTIONS", "JSON_OBJECT", "OPTIONS", "Grammars"]

CACHE_SIZE = 64
"""Compiled schemas kept per runner."""

JSON_OBJECT: dict[str, Any] = {"type": "object"}
"""What ``json_object`` mode (and Ollama's ``format: "json"``) holds an answer to."""

OPTIONS = JSON_OPTIONS
"""llguidance's JSON options under a schema, every runner's (see the module docstring)."""

FORMAT_OPTIONS = {"whitespace_flexible": False, "whitespace_pattern": r"[ ]?|\n[ \t]{0,20}", "lenient": False}
"""llguidance's JSON options for ``json_object``: llama.cpp's JSON whitespace (see the module docstring)."""


class Grammars:
    """One runner's llguidance tokenizer and its cache of compiled schemas; thread-safe."""

    def __init__(self, vocab: Any) -> None:
        """``vocab``: the model's ``llama_vocab`` pointer."""
        self._vocab = vocab
        self._tokenizer: Any = None
        self._lock = threading.Lock()  # held while the tokenizer is built and while the cache is touched
        self._cache: OrderedDict[str, Any] = OrderedDict()
        self.compiled = 0  # schemas compiled (misses); ``hits`` were served from the cache
        self.hits = 0

    def tokenizer(self) -> Any:
        """The llguidance tokenizer, built on first use."""
        with self._lock:
            if self._tokenizer is None:
                import llama_cpp as lib
                from llguidance.llamacpp import lltokenizer_from_vocab

                vocab = self._vocab
                # every end-of-generation token (Gemma's <end_of_turn> as well as <eos>) may end a whole answer
                eog = [t for t in range(lib.llama_vocab_n_tokens(vocab)) if lib.llama_vocab_is_eog(vocab, t)]
                with warnings.catch_warnings():  # llguidance asks for each token's attributes by a deprecated name
                    warnings.simplefilter("ignore", DeprecationWarning)
                    self._tokenizer = lltokenizer_from_vocab(vocab, eos_token=eog)
            return self._tokenizer

    def matcher(self, schema: Any, what: str, *, param: str | None = None, options: dict[str, Any] = OPTIONS) -> Any:
        """A fresh ``LLMatcher`` holding generation to ``schema``.

        Args:
            schema: A JSON schema (decoded).
            what: The schema's name for error messages ("the response format's JSON schema").
            param: The request field an error names.
            options: llguidance's JSON options (``OPTIONS`` or ``FORMAT_OPTIONS``).

        Raises:
            InvalidRequest: the schema asks for what no grammar here enforces, is beyond the bounds, or llguidance
                cannot compile it (its message says why).
        """
        check_schema(schema, what, param=param)
        key = json.dumps([schema, options], sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        with self._lock:
            cached = self._cache.get(key)
            if cached is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return cached.deep_copy()
        tokenizer = self.tokenizer()
        import llguidance

        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(enforceable(schema), overrides=options)  # type: ignore[arg-type]  # a TypedDict in llguidance's stubs
        except ValueError as exc:
            raise InvalidRequest(f"{what} cannot be compiled: {exc}", param=param) from exc
        compiled = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits())
        if compiled.is_error():
            error = compiled.get_error().split("\n")[0]
            fix = ": simplify the schema" if "limit" in error or "too big" in error else ""
            raise InvalidRequest(f"{what} cannot be enforced: {error}{fix}", param=param)
        with self._lock:
            self.compiled += 1
            self._cache[key] = compiled
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return compiled.deep_copy()
