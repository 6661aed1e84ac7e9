"""Structured output for the MLX runner: llguidance holds each constrained sequence to its grammar, token by token.

``Grammars`` (one per engine) turns a request's response format (OpenAI ``response_format``, Ollama ``format``)
into a llguidance grammar, after ``protocols.schema_rules.check_schema`` has refused (400, naming the keyword)
what would not be enforced, so a schema means the same here as on the llama.cpp and vLLM runners. The tokenizer
llguidance needs is built from the model's Hugging Face tokenizer on the first structured request, in that
request's thread (compiling too: the scheduler thread never waits on a grammar).
``Constraint`` (one per sequence) is used by the scheduler thread only: ``mask`` gives the tokens the grammar
allows next as a boolean row (the batch's picker sets the others' logits to ``-inf`` before greedy or sampled
picking, so it works inside the batched decode), ``advance`` feeds it the token picked. Once the grammar is
complete only an end token is allowed. JSON is written as the other runners write it (``OPTIONS``).

llguidance's own MLX helper is a Metal kernel; this uses its numpy bitmask, which runs on any MLX device.
Tools stay refused by the engine (the gateway checks ``Capabilities.tools``).

Runs only in MLX processes; imports llguidance and numpy (lazily) and protocols, nothing else of ours.
"""

from __future__ import annotations

import threading
from typing import Any

from meshgate.protocols.model import InvalidRequest, Request
from meshgate.protocols.schema_rules import JSON_OPTIONS, check_schema, enforceable

__all__ = ["OPTIONS", "Constraint", "Grammars"]

OPTIONS = JSON_OPTIONS
"""llguidance's JSON options, every runner's (``protocols.schema_rules.JSON_OPTIONS``)."""


class Constraint:
    """One sequence's matcher: which tokens may come next, fed each token picked."""

    def __init__(self, matcher: Any, n_vocab: int) -> None:
        import llguidance.numpy as lln

        self._lln = lln
        self.matcher, self.n_vocab = matcher, n_vocab
        self._bitmask = lln.allocate_token_bitmask(1, n_vocab)

    def mask(self, width: int) -> Any:
        """The allowed next tokens as a numpy boolean row of ``width`` (the model's logits may be wider or
        narrower than the tokenizer's vocabulary: tokens it does not know are never allowed)."""
        import numpy as np

        self._lln.fill_next_token_bitmask(self.matcher, self._bitmask, 0)
        allowed = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)
        row = np.zeros(width, dtype=bool)
        row[: min(width, self.n_vocab)] = allowed[:width]
        return row

    def advance(self, token: int) -> None:
        """Feed the token picked (always one ``mask`` allowed)."""
        if not self.matcher.consume_token(token):
            raise RuntimeError(f"the grammar refused token {token}: {self.matcher.get_error()}")


class Grammars:
    """Compiles the structured-output requests of one model (``tokenizer``: mlx-lm's ``TokenizerWrapper``)."""

    def __init__(self, tokenizer: Any) -> None:
        self._hf = getattr(tokenizer, "_tokenizer", tokenizer)
        self._eos = sorted(tokenizer.eos_token_ids)
        self._tokenizer: Any = None
        self._building = threading.Lock()

    def constraint(self, request: Request) -> Constraint | None:
        """A fresh matcher for ``request``'s response format; ``None`` for free text.

        Raises:
            InvalidRequest: (400) a schema keyword that would not be enforced, or a schema llguidance cannot
                compile, naming it.
        """
        fmt = request.response_format
        if fmt.kind == "text":
            return None
        if fmt.kind == "json_schema":
            check_schema(fmt.schema, "the response format's JSON schema", param="response_format")
            schema: Any = fmt.schema
        else:
            schema = {"type": "object"}
        import llguidance

        tokenizer = self._llg_tokenizer()
        try:
            grammar = llguidance.LLMatcher.grammar_from_json_schema(enforceable(schema), overrides=OPTIONS)  # type: ignore[arg-type]  # a TypedDict in llguidance's stubs
        except ValueError as exc:
            raise InvalidRequest(
                f"the response format's JSON schema cannot be compiled: {exc}", param="response_format"
            ) from exc
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=llguidance.LLParserLimits())
        if matcher.is_error():
            error = matcher.get_error().split("\n")[0]
            raise InvalidRequest(
                f"the response format's JSON schema cannot be enforced: {error}", param="response_format"
            )
        return Constraint(matcher, tokenizer.vocab_size)

    def _llg_tokenizer(self) -> Any:
        with self._building:
            if self._tokenizer is None:
                import llguidance.hf

                self._tokenizer = llguidance.hf.from_tokenizer(self._hf, eos_token=self._eos)
            return self._tokenizer
