"""ggml's reference matmuls for wide decodes (``cpu_kernels``), on the real Gemma 3 270M in this process.

Eight sequences decoded in one call on the reference matmuls give every row the logits it gets decoded alone, bit
for bit; on ggml's default kernels some rows differ (the tiled K-quant matmul takes 8 rows or more), which is why
the scheduler switches. Finding a context's CPU backend reads memory through ``/proc/self/mem`` only, so a
pointer to anything else gives ``None``, never a crash.
"""

from __future__ import annotations

import contextlib
import ctypes
import random

import llama_cpp
import numpy as np
import pytest

from meshgate.backends.llama_cpp.batch import Scheduler
from meshgate.backends.llama_cpp.cpu_kernels import ReferenceKernels, cpu_backend
from meshgate.backends.llama_cpp.rpc import weight_repacking

WIDTH = 8
PROMPTS = [
    f"Write about {topic}."
    for topic in ("the sea", "bread", "the moon", "a violin", "winter", "rain", "trains", "a garden")
]


@pytest.fixture(scope="module")
def scheduler(packaged_gguf):
    with weight_repacking(False):  # as the engine loads it (repacked weights take kernels of their own)
        llm = llama_cpp.Llama(model_path=str(packaged_gguf), n_ctx=64, n_batch=64, n_threads=2, verbose=False)
    s = Scheduler(llm._model.model, n_ctx=256, parallel=WIDTH, n_threads=2, is_eog=lambda _: False, reference=True)
    s.llm = llm  # keep the model alive with the context
    yield s
    s.free()


def _decode(s: Scheduler, tokens: list[tuple[int, int, int]], *, last_only: bool = False) -> np.ndarray:
    """Decode ``(sequence, position, token)`` in one call; the logits of every row (or of the last)."""
    batch = s.batch
    for i, (seq, pos, token) in enumerate(tokens):
        batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.seq_id[i][0] = token, pos, 1, seq
        batch.logits[i] = not last_only or i == len(tokens) - 1
    batch.n_tokens = len(tokens)
    assert llama_cpp.llama_decode(s.ctx, batch) == 0
    rows = [len(tokens) - 1] if last_only else range(len(tokens))
    return np.array([np.ctypeslib.as_array(llama_cpp.llama_get_logits_ith(s.ctx, r), shape=(s.n_vocab,)) for r in rows])


def test_eight_rows_on_the_reference_matmuls_are_their_single_decodes(scheduler):
    assert scheduler.group == WIDTH  # the backend was found: one call for all
    backend = cpu_backend(scheduler.ctx)
    assert backend is not None and backend == cpu_backend(scheduler.ctx)
    steps = []  # (sequence, position, next token) after each prompt, prefilled alone
    for seq, text in enumerate(PROMPTS):
        chat = f"<start_of_turn>user\n{text}<end_of_turn>\n<start_of_turn>model\n".encode()
        tokens = scheduler.llm.tokenize(chat, add_bos=True, special=True)
        logits = _decode(scheduler, [(seq, i, t) for i, t in enumerate(tokens)], last_only=True)
        steps.append((seq, len(tokens), int(logits[0].argmax())))

    def step(rows: list[tuple[int, int, int]], kernels: contextlib.AbstractContextManager) -> np.ndarray:
        with kernels:
            logits = _decode(scheduler, rows)
        for seq, pos, _ in rows:
            llama_cpp.llama_memory_seq_rm(scheduler.memory, seq, pos, -1)  # forget it: the next try is the same
        return logits

    alone = np.array([step([row], contextlib.nullcontext())[0] for row in steps])
    reference = step(steps, ReferenceKernels(backend))
    assert [r for r in range(WIDTH) if not np.array_equal(reference[r], alone[r])] == []
    default = step(steps, contextlib.nullcontext())
    assert any(not np.array_equal(default[r], alone[r]) for r in range(WIDTH)), "ggml's default kernels changed"


def test_a_pointer_to_anything_else_finds_no_backend():
    rng = random.Random(7)
    others = [ctypes.create_string_buffer(64) for _ in range(8)]  # readable memory that is no backend
    words = [ctypes.addressof(rng.choice(others)) for _ in range(256)]
    words += [rng.getrandbits(64) for _ in range(200)]  # mostly unmapped addresses
    words += [0, 8, 4096, (1 << 47) - 8, (1 << 64) - 8]
    rng.shuffle(words)
    fake = (ctypes.c_uint64 * len(words))(*words)
    assert cpu_backend(ctypes.cast(fake, ctypes.c_void_p)) is None
    assert cpu_backend(None) is None
