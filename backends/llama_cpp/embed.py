"""Sentence embeddings from a loaded llama.cpp model: mean-pooled, L2-normalized, one vector per input.

Runs only in the runner process (imports llama_cpp and numpy); the engine creates one ``Embedder`` on its first
embedding request, so a runner that only generates never pays for it.

Decisions, measured on Gemma 3 270M with llama-cpp-python 0.3.36:

- A second llama.cpp *context* over the engine's already loaded *model*, in embedding mode: generation's
  context and KV cache are untouched and the weights are not loaded twice (which, for a model split over RPC
  workers, would also double the workers' memory). ``Llama(..., embedding=True)`` would load a second model.
- Pooling is pinned to MEAN. Gemma's GGUF declares no pooling type, so llama.cpp's default is NONE, and
  ``Llama.embed`` then returns one vector per *token* (3 x 640 floats for "a cat"). Mean pooling separates
  meaning well on this base model (cos(a cat, a kitten) 0.96 vs cos(a cat, stock market) 0.45); last-token
  pooling does worse (0.83 vs 0.31) and CLS (the BOS token) gives the same vector for every input.
- A generative model in embedding mode still computes the output layer for *every* token: llama.cpp marks all
  tokens as outputs and reserves ``n_vocab`` floats of logits per token (Gemma's vocabulary is 262,144, so 1 GiB
  per 1,000 tokens; one 2,047-token input took 4 GiB in one batch). So an input is fed in chunks of
  ``chunk`` tokens, each a ``decode`` that continues the same sequence in the KV cache (attention is causal, so
  the per-token states are those of one pass), and the chunk means are averaged, weighted by chunk length.
  ``chunk`` keeps the logits under ``LOGITS_BUDGET``: 64 tokens for Gemma, for which the runner grows by
  ~160 MiB on its first embedding (27 MiB of context at 4,096 tokens, the rest logits and compute buffers;
  128 tokens cost ~290 MiB; the output layer's work per token, which dominates, is the same at any size).
- The KV cache does not keep the full sliding window (``swa_full`` off): nothing is ever rewound.
- Text is tokenized with the model's BOS/EOS rules and special tokens read as plain text; token-id inputs
  are used exactly as given. An input longer than the context is cut to fit with ``truncate``, else it is
  ``InvalidRequest``.
- Vectors are rounded to float32 and written with the shortest decimal that reads back as that float32, so
  JSON stays short and the base64 (float32) encoding carries exactly the same numbers.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from meshgate.protocols.model import Embeddings, EmbedRequest, GatewayError, InvalidRequest

__all__ = ["LOGITS_BUDGET", "Embedder", "finish_vector"]

LOGITS_BUDGET = 64 << 20
"""Bytes of per-token logits one embedding chunk may reserve (``chunk * n_vocab * 4``)."""


def finish_vector(pooled: np.ndarray, dimensions: int | None) -> tuple[float, ...]:
    """L2-normalize ``pooled``, keep the first ``dimensions`` components and renormalize; float32 precision."""
    if not np.all(np.isfinite(pooled)):
        raise GatewayError("the model produced an embedding with NaN or infinite values")
    vector = pooled.astype(np.float64)
    vector /= max(float(np.linalg.norm(vector)), 1e-12)
    if dimensions is not None and dimensions < vector.size:
        vector = vector[:dimensions]
        vector /= max(float(np.linalg.norm(vector)), 1e-12)
    return tuple(float(str(x)) for x in vector.astype(np.float32))


class Embedder:
    """An embedding-mode context over ``llm``'s model (a ``llama_cpp.Llama``), for one caller at a time.

    ``chunk`` (tokens per decode) defaults to what ``LOGITS_BUDGET`` allows, between 16 and 512.
    """

    def __init__(
        self,
        llm: Any,
        *,
        chunk: int | None = None,
        n_ctx: int | None = None,
        run: Callable[..., Any] | None = None,
    ) -> None:
        """``run(fn, *args)`` calls each decode (``batch.Scheduler.call``: on the thread that runs every other
        decode of the process, so llama.cpp's OpenMP build keeps one thread team); ``None``: on the caller's."""
        import llama_cpp
        from llama_cpp._internals import LlamaBatch, LlamaContext

        started = time.perf_counter_ns()
        self._llama_cpp = llama_cpp
        self.llm = llm
        self.n_embd = llm.n_embd()
        self.n_vocab = llm.n_vocab()
        self.n_ctx = n_ctx or llm.n_ctx()
        self.chunk = min(self.n_ctx, chunk or max(16, min(512, LOGITS_BUDGET // (4 * self.n_vocab))))
        params = llama_cpp.llama_context_default_params()
        params.n_ctx = self.n_ctx
        params.n_batch = params.n_ubatch = self.chunk
        params.n_seq_max = 1
        params.n_threads = llm.context_params.n_threads
        params.n_threads_batch = llm.context_params.n_threads_batch
        params.embeddings = True
        params.pooling_type = llama_cpp.LLAMA_POOLING_TYPE_MEAN
        params.swa_full = False
        self.ctx = LlamaContext(model=llm._model, params=params, verbose=False)
        self.batch = LlamaBatch(n_tokens=self.chunk, embd=0, n_seq_max=1, verbose=False)
        self._run = run or (lambda fn, *args: fn(*args))
        self.load_ns = time.perf_counter_ns() - started

    def embed(self, request: EmbedRequest, cancel: threading.Event | None = None) -> Embeddings:
        """The request's vectors; stops between two decodes once ``cancel`` is set (raising ``GatewayError``)."""
        if request.dimensions is not None and not 0 < request.dimensions <= self.n_embd:
            raise InvalidRequest(
                f"dimensions must be between 1 and the model's embedding size {self.n_embd}, got {request.dimensions}",
                param="dimensions",
            )
        token_lists = [self._tokens(item, i, request.truncate) for i, item in enumerate(request.inputs)]
        vectors = tuple(finish_vector(self._pooled(tokens, cancel), request.dimensions) for tokens in token_lists)
        return Embeddings(vectors=vectors, prompt_tokens=sum(map(len, token_lists)))

    def _tokens(self, item: str | Sequence[int], index: int, truncate: bool) -> list[int]:
        if isinstance(item, str):
            tokens = self.llm.tokenize(item.encode(), add_bos=True, special=False)
        else:
            tokens = list(item)
            bad = next((t for t in tokens if not 0 <= t < self.n_vocab), None)
            if bad is not None:
                raise InvalidRequest(
                    f"input {index} has token id {bad}, outside the vocabulary (0..{self.n_vocab - 1})", param="input"
                )
        if not tokens:
            raise InvalidRequest(f"input {index} is empty", param="input")
        if len(tokens) > self.n_ctx:
            if not truncate:
                raise InvalidRequest(
                    f"input {index} has {len(tokens)} tokens but the context holds {self.n_ctx}", param="input"
                )
            tokens = tokens[: self.n_ctx]
        return tokens

    def _pooled(self, tokens: list[int], cancel: threading.Event | None) -> np.ndarray:
        """The mean of the final hidden states of ``tokens``, fed ``chunk`` tokens per decode."""
        llama_cpp, batch = self._llama_cpp, self.batch.batch
        self.ctx.kv_cache_clear()
        total = np.zeros(self.n_embd, dtype=np.float64)
        for start in range(0, len(tokens), self.chunk):
            if cancel is not None and cancel.is_set():
                raise GatewayError("the embedding was cancelled: its client went away")
            part = tokens[start : start + self.chunk]
            for i, token in enumerate(part):
                batch.token[i] = token
                batch.pos[i] = start + i
                batch.seq_id[i][0] = 0
                batch.n_seq_id[i] = 1
                batch.logits[i] = True
            batch.n_tokens = len(part)
            self._run(self.ctx.decode, self.batch)
            pooled = llama_cpp.llama_get_embeddings_seq(self.ctx.ctx, 0)
            if not pooled:
                raise GatewayError("llama.cpp returned no pooled embedding")
            total += np.ctypeslib.as_array(pooled, shape=(self.n_embd,)) * len(part)
        self.ctx.kv_cache_clear()
        return total / len(tokens)
