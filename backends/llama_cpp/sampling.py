"""One request's sampler: llama.cpp's native sampler chain, and a grammar checked against its pick.

The chain is the one llama-cpp-python's ``Llama.generate`` builds, in the same order, so a request samples as it
would through ``Llama.generate`` alone: penalties, then greedy at temperature 0, else top-k, typical (1.0: off),
top-p, min-p, temperature and the seeded distribution. It samples from the logits of one position of a batch
(``llama_sampler_sample(chain, ctx, i)``), so every sequence of a batched decode keeps its own chain and seed.

A grammar (tools, JSON output) is an llguidance matcher (``grammar.Grammars``). It is not applied to the whole
vocabulary (262k tokens for Gemma 3) for every token: as llama.cpp's server does (``common_sampler_sample``), the
chain picks a token from the full distribution, the matcher is asked about that one token
(``validate_tokens``), and only when it rejects it is the matcher's token mask (``fill_next_token_bitmask``,
well under a millisecond) applied to the logits and the chain run again. At temperature 0 this gives the answer
an in-chain grammar would give whenever the model's first choice is allowed.

No disallowed token is ever taken: when the chain picks one anyway (all allowed ones cut by its filters) the most
likely allowed one is taken; when the mask allows no token at all, or the matcher fails on a token, ``sample``
raises ``GrammarStuck`` and only that request fails. Once the matcher is stopped (the JSON is whole and nothing
may follow) the end-of-generation token is returned without sampling; while the JSON is whole but could go on (a
number), the mask allows the end-of-generation tokens beside the digits.

Runs only in the runner process; imports numpy, llama_cpp and llguidance, nothing of ours.
"""

from __future__ import annotations

import ctypes
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
        grammar: Any = None,
        end_token: int = -1,
    ) -> None:
        """``grammar``: an llguidance ``LLMatcher`` (this sampler's own), or ``None`` for free text;
        ``end_token``: what to return once the matcher is stopped (the model's end of turn)."""
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
        self.greedy = temp == 0 and repeat_penalty == 1.0 and not presence_penalty and not frequency_penalty
        self.grammar = grammar
        self.end_token = end_token
        self._candidates: tuple[Any, np.ndarray, np.ndarray] | None = None  # for ``_pick``, made at its first use
        if grammar is not None:
            self.mask = np.full((1, (n_vocab + 31) // 32), -1, dtype=np.int32)

    def sample(self, ctx: Any, index: int, saved: np.ndarray | None = None) -> int:
        """The next token from the logits of batch position ``index`` (or ``saved``: a restored prompt's); the chain
        (and grammar) accept it."""
        lib = self._lib
        if self.grammar is None and saved is None and not self.greedy:
            return int(lib.llama_sampler_sample(self.chain, ctx, index))  # accepts the token itself
        if saved is not None:
            logits = saved
        else:
            logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(ctx, index), shape=(self.n_vocab,))
        if self.grammar is None:
            if self.greedy:
                return int(logits.argmax())
            token = self._pick(logits, None)  # what ``llama_sampler_sample`` does, from these logits
            lib.llama_sampler_accept(self.chain, token)
            return token
        matcher = self.grammar
        if matcher.is_stopped():  # the JSON is whole and nothing may follow it
            return self.end_token
        token = int(logits.argmax()) if self.greedy else self._pick(logits, None)
        if token < 0 or matcher.validate_tokens([token]) != 1:  # rejected: sample again within the grammar
            allowed = self._allowed()
            if self.greedy:
                token = int(np.argmax(np.where(allowed, logits, -np.inf)))
            else:
                token = self._pick(logits, allowed)
            if not (0 <= token < self.n_vocab and allowed[token]):
                token = int(np.argmax(np.where(allowed, logits, -np.inf)))  # never hand the matcher a token it rejects
        if not matcher.consume_token(token):
            raise GrammarStuck(f"the grammar failed on a token it allowed: {matcher.get_error()}")
        if not self.greedy:
            lib.llama_sampler_accept(self.chain, token)
        return token

    def replay(self, tokens: list[int]) -> None:
        """Take ``tokens`` as sampled (a resumed request's output so far): the grammar consumes them and the
        penalties remember them. A token the grammar rejects is ``GrammarStuck``."""
        for token in tokens:
            if self.grammar is not None and not self.grammar.consume_token(token):
                raise GrammarStuck(f"the grammar rejects a resumed token: {self.grammar.get_error()}")
            if not self.greedy:
                self._lib.llama_sampler_accept(self.chain, token)

    def _allowed(self) -> np.ndarray:
        """The matcher's mask as one boolean per token id."""
        from llguidance.numpy import fill_next_token_bitmask

        fill_next_token_bitmask(self.grammar, self.mask, 0)
        if self.grammar.is_error():
            raise GrammarStuck(f"the grammar cannot go on: {self.grammar.get_error()}")
        allowed = np.unpackbits(self.mask.view(np.uint8), bitorder="little")[: self.n_vocab].astype(bool)
        if not allowed.any():
            raise GrammarStuck(
                "the grammar (from the request's JSON schema or tools) allows no token here: "
                "it asks for text the model cannot produce"
            )
        return allowed

    def _pick(self, logits: np.ndarray, allowed: np.ndarray | None) -> int:
        """The chain's pick from ``logits`` (only among ``allowed`` token ids when given); -1 when it picks none."""
        lib = self._lib
        if self._candidates is None:
            data = (lib.llama_token_data * self.n_vocab)()
            self._candidates = (data, np.ctypeslib.as_array(data), np.arange(self.n_vocab, dtype=np.int32))
        data, view, ids = self._candidates
        view["id"] = ids
        view["logit"] = logits if allowed is None else np.where(allowed, logits, -np.inf)
        view["p"] = 0.0
        candidates = lib.llama_token_data_array(data, self.n_vocab, -1, False)
        lib.llama_sampler_apply(self.chain, ctypes.byref(candidates))
        selected = candidates.selected
        return int(candidates.data[selected].id) if 0 <= selected < candidates.size else -1

    def close(self) -> None:
        if self.chain:
            self._lib.llama_sampler_free(self.chain)
            self.chain = None
        self.grammar = None
