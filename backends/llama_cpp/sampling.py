"""One request's sampler: llama.cpp's native sampler chain, and a grammar checked against its pick.

The chain is the one llama-cpp-python's ``Llama.generate`` builds, in the same order, so a request samples as it
did before batching: penalties, then greedy at temperature 0, else top-k, typical (1.0: off), top-p, min-p,
temperature and the seeded distribution. It samples from the logits of one position of a batch
(``llama_sampler_sample(chain, ctx, i)``), so every sequence of a batched decode keeps its own chain and seed.

A grammar (tools, JSON output) is not put in the chain, where it would run over the whole vocabulary (262k tokens
for Gemma 3) for every token: about ten times slower. As llama.cpp's server does (``common_sampler_sample``), the
chain picks a token from the full distribution, the grammar is asked about that one token, and only when it
rejects it is the grammar applied to the vocabulary and the chain run again. At temperature 0 this gives the
answer an in-chain grammar would give whenever the model's first choice is allowed.

llama.cpp aborts the whole process when its grammar is made to accept a token it does not allow ("Unexpected
empty grammar stack"), so no such token is ever accepted: when the grammar allows no token at all (a grammar that
asks for text no token can produce) ``sample`` raises ``GrammarStuck`` and only that request fails; when the chain
picks a disallowed token anyway (all allowed ones cut by its filters), the most likely allowed one is taken.

Runs only in the runner process; imports numpy and llama_cpp, nothing of ours.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import numpy as np

__all__ = ["GrammarStuck", "Sampler"]

PENALTY_LAST_N = 64
"""Tokens the repetition penalties look back over (``Llama.last_n_tokens_size``)."""


class GrammarStuck(RuntimeError):
    """The request's grammar allows no token at this point: the request cannot go on (the runner can)."""


class Sampler:
    """A request's sampler chain (and grammar), freed with ``close``."""

    def __init__(
        self,
        vocab: Any,
        n_vocab: int,
        *,
        temp: float,
        top_k: int,
        top_p: float,
        min_p: float,
        repeat_penalty: float,
        presence_penalty: float,
        frequency_penalty: float,
        seed: int,
        grammar: tuple[str, str] | None = None,
    ) -> None:
        """``grammar``: GBNF text and its root rule name, or ``None`` for free text."""
        import llama_cpp as lib

        self._lib = lib
        self.n_vocab = n_vocab
        self.chain = lib.llama_sampler_chain_init(lib.llama_sampler_chain_default_params())
        add = lambda s: lib.llama_sampler_chain_add(self.chain, s)  # noqa: E731
        # llama-cpp-python 0.3.36 declares a leading n_vocab that the C function no longer has: on x86-64 the first
        # int reaches C as penalty_last_n (the floats travel in their own registers), so both ints are the window.
        add(
            lib.llama_sampler_init_penalties(
                PENALTY_LAST_N, PENALTY_LAST_N, repeat_penalty, frequency_penalty, presence_penalty
            )
        )
        if temp < 0:
            add(lib.llama_sampler_init_dist(seed))
        elif temp == 0:
            add(lib.llama_sampler_init_greedy())
        else:
            add(lib.llama_sampler_init_top_k(top_k))
            add(lib.llama_sampler_init_typical(1.0, 1))
            add(lib.llama_sampler_init_top_p(top_p, 1))
            add(lib.llama_sampler_init_min_p(min_p, 1))
            add(lib.llama_sampler_init_temp(temp))
            add(lib.llama_sampler_init_dist(seed))
        # Greedy with neutral penalties is the logits' first maximum, as the chain would pick it: numpy finds it
        # in ~0.1 ms, where the chain first copies the whole vocabulary into a candidate array (~1 ms for 262k).
        self.greedy = (
            temp == 0 and grammar is None and repeat_penalty == 1.0 and not presence_penalty and not frequency_penalty
        )
        self.grammar = None
        if grammar is not None:
            self.grammar = lib.llama_sampler_init_grammar(vocab, grammar[0].encode(), grammar[1].encode())
            if not self.grammar:
                self.close()
                raise ValueError("the grammar for this request could not be parsed")
            self.data = (lib.llama_token_data * n_vocab)()
            self.view = np.ctypeslib.as_array(self.data)
            self.ids = np.arange(n_vocab, dtype=np.int32)
            self.one = (lib.llama_token_data * 1)()

    def sample(self, ctx: Any, index: int) -> int:
        """The next token from the logits of batch position ``index``; the chain (and grammar) accept it."""
        lib = self._lib
        if self.greedy:
            return int(np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,)).argmax())
        if self.grammar is None:
            return int(lib.llama_sampler_sample(self.chain, ctx, index))  # accepts the token itself
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
        token = self._pick(logits, grammar_first=False)
        rejected = token < 0
        if not rejected:
            self.one[0].id, self.one[0].logit, self.one[0].p = token, float(logits[token]), 0.0  # type: ignore[assignment]  # ctypes converts
            single = lib.llama_token_data_array(self.one, 1, -1, False)
            lib.llama_sampler_apply(self.grammar, ctypes.byref(single))
            rejected = math.isinf(self.one[0].logit)
        if rejected:  # the grammar rejects the chain's pick: sample again within it
            token = self._pick(logits, grammar_first=True)
        lib.llama_sampler_accept(self.grammar, token)
        lib.llama_sampler_accept(self.chain, token)
        return token

    def _pick(self, logits: np.ndarray, *, grammar_first: bool) -> int:
        lib = self._lib
        self.view["id"] = self.ids
        self.view["logit"] = logits
        self.view["p"] = 0.0
        candidates = lib.llama_token_data_array(self.data, self.n_vocab, -1, False)
        allowed = None
        if grammar_first:
            lib.llama_sampler_apply(self.grammar, ctypes.byref(candidates))
            allowed = np.isfinite(self.view["logit"])  # by token id: the chain reorders the array next
            if not allowed.any():
                raise GrammarStuck(
                    "the grammar (from the request's JSON schema or tools) allows no token here: "
                    "it asks for text the model cannot produce"
                )
        lib.llama_sampler_apply(self.chain, ctypes.byref(candidates))
        selected = candidates.selected
        token = int(candidates.data[selected].id) if 0 <= selected < candidates.size else -1
        if allowed is not None and not (0 <= token < self.n_vocab and allowed[token]):
            token = int(np.argmax(np.where(allowed, logits, -np.inf)))  # never hand the grammar a token it rejects
        return token

    def close(self) -> None:
        if self.chain:
            self._lib.llama_sampler_free(self.chain)
            self.chain = None
        if self.grammar:
            self._lib.llama_sampler_free(self.grammar)
            self.grammar = None
