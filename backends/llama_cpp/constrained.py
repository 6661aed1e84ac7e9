"""Grammar-constrained generation that samples the way llama.cpp's own server does.

llama-cpp-python puts a grammar into the sampler chain, so every token runs the grammar over the whole
vocabulary first (262k tokens for Gemma 3): about ten times slower per token than free text. llama.cpp's server
(``common_sampler_sample``) instead lets the usual chain pick a token from the full distribution, asks the grammar
about that one token, and only when the grammar rejects it runs the grammar over the vocabulary and samples
again. ``constrained_tokens`` does the same, with the same chain ``Llama.generate`` would build, so temperature 0
gives the answer the in-chain grammar would give whenever the model's first choice is allowed.

The token loop mirrors ``Llama.generate``: the prompt's longest prefix already in the KV cache is kept, and each
sampled token is evaluated only when the next one is asked for.

Runs only in the runner process; imports numpy and llama_cpp, nothing of ours.
"""

from __future__ import annotations

import ctypes
import math
from collections.abc import Iterator, Sequence
from typing import Any

import numpy as np

__all__ = ["constrained_tokens"]


class _CheckedSampler:
    """A sampler chain without a grammar, and the grammar as a separate sampler that checks its pick."""

    def __init__(self, llm: Any, grammar: Any, chain: dict[str, Any]) -> None:
        import llama_cpp

        self._lib = llama_cpp
        self.llm = llm
        self.n_vocab = llm.n_vocab()
        self.chain = llm._init_sampler(grammar=None, **chain)
        self.grammar = llama_cpp.llama_sampler_init_grammar(
            llm._model.vocab, grammar._grammar.encode(), grammar._root.encode())
        if not self.grammar:
            raise ValueError("the grammar for this request could not be parsed")
        self.data = (llama_cpp.llama_token_data * self.n_vocab)()
        self.view = np.ctypeslib.as_array(self.data)
        self.ids = np.arange(self.n_vocab, dtype=np.int32)
        self.one = (llama_cpp.llama_token_data * 1)()

    def sample(self) -> int:
        lib = self._lib
        logits = np.ctypeslib.as_array(lib.llama_get_logits_ith(self.llm.ctx, -1), shape=(self.n_vocab,))
        token = self._pick(logits, grammar_first=False)
        self.one[0].id, self.one[0].logit, self.one[0].p = token, float(logits[token]), 0.0
        single = lib.llama_token_data_array(self.one, 1, -1, False)
        lib.llama_sampler_apply(self.grammar, ctypes.byref(single))
        if math.isinf(self.one[0].logit):  # the grammar rejects the chain's pick: sample again within it
            token = self._pick(logits, grammar_first=True)
        lib.llama_sampler_accept(self.grammar, token)
        lib.llama_sampler_accept(self.chain.sampler, token)
        return token

    def _pick(self, logits: np.ndarray, *, grammar_first: bool) -> int:
        lib = self._lib
        self.view["id"] = self.ids
        self.view["logit"] = logits
        self.view["p"] = 0.0
        candidates = lib.llama_token_data_array(self.data, self.n_vocab, -1, False)
        if grammar_first:
            lib.llama_sampler_apply(self.grammar, ctypes.byref(candidates))
        lib.llama_sampler_apply(self.chain.sampler, ctypes.byref(candidates))
        return int(candidates.data[candidates.selected].id)

    def close(self) -> None:
        self.chain.close()
        if self.grammar:
            self._lib.llama_sampler_free(self.grammar)
            self.grammar = None


def constrained_tokens(llm: Any, prompt: Sequence[int], grammar: Any, **chain: Any) -> Iterator[int]:
    """Tokens for ``prompt`` held to ``grammar`` (a ``LlamaGrammar``); ``chain`` takes ``Llama.generate``'s
    sampling keywords (``temp``, ``top_k``, ...). Stops only when the caller stops asking."""
    prompt = list(prompt)
    sampler = _CheckedSampler(llm, grammar, chain)
    try:
        cached = llm._input_ids.tolist()
        keep = 0
        while keep < min(len(cached), len(prompt) - 1) and cached[keep] == prompt[keep]:
            keep += 1
        if keep == 0 or not llm._ctx.kv_cache_seq_rm(-1, keep, -1):
            llm.reset()
            keep = 0
        llm.n_tokens = keep
        llm.eval(prompt[keep:])
        while True:
            token = sampler.sample()
            yield token
            llm.eval([token])
    finally:
        sampler.close()
