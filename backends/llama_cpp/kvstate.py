"""One sequence's KV state in and out of a llama.cpp context, for the KV tiers (``runner.kvtier``).

llama.cpp's per-sequence state API (``llama_state_seq_get_data``/``set_data``) copies a sequence's cells out and
back. Two facts shape what the tiers keep (measured on Gemma 3 270M, llama-cpp-python 0.3.36):

- A model with sliding-window layers has two caches. Even with ``swa_full`` the state holds the sliding-window
  cache's cells only for the last window of positions (512 for Gemma 3): ~18 KiB a token up to 512 tokens, then
  ~3 KiB a token (the full-attention layers). Restored, it can be cut back (``llama_memory_seq_rm``) in the
  full-attention cache only: cut back to an earlier position, the sliding-window layers would miss cells. So a
  restore point inside a prompt keeps, beside the whole state, the sliding-window cells at that position
  (``LLAMA_STATE_SEQ_FLAGS_SWA_ONLY``, ~7.5 MiB): restore the state, cut it back, put those cells in.
- Restored, the cells are the very bytes computed. A prompt restored at a position where its cold evaluation cut a chunk
  and evaluated on in chunks that start and span multiples of 8 is evaluated as cold is (``ALIGN``); cut anywhere else,
  llama.cpp's CPU kernels give a row other numbers (seen: up to 2.7 in a logit). So restore points are the last
  ``POINTS`` multiples of ``CHUNK`` and where the prompt's last chunk starts (``tail``), and a prompt that is an entry's
  whole prompt starts from its saved logits, the cold ones bit for bit. One difference remains: llama.cpp puts restored
  sliding-window cells at the start of the sequence's cells, where a cold evaluation left them at their positions, and
  once the window moves past them attention sums over another layout (seen: logits up to ~1 apart after 20 tokens;
  greedy tokens the same in the tests).

Runs only in the runner process; imports llama_cpp and numpy.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np

from meshgate.backends.runner.kvtier import Entry, Hit, KVTier

__all__ = ["ALIGN", "POINTS", "ROWS", "SAVED", "Keeper", "SeqStates", "tail"]

SAVED = 512
"""Prompts shorter than this are not kept in the KV tier: they are evaluated again in well under a second."""

POINTS = 2
"""Restore points a tier entry keeps: the last ``POINTS`` chunk boundaries inside its prompt (where the next turn
of a conversation, or a prompt that shares all but its last message, starts over)."""


ROWS = 8
"""Token rows ggml's CPU matmuls take together: chunks that start and span multiples of this give every row the
numbers other such chunks give (see ``ALIGN``)."""

ALIGN = 256
"""Where restore points other than ``CHUNK``'s multiples sit: multiples of this. Two facts, probed on Gemma 3 270M
Q4_K_M: ggml's CPU matmuls take token rows 8 at a time, so chunks that start and span multiples of 8 give every
row the numbers other such chunks give (1,200 tokens cut 512+512+176, or with the last chunk split 128+48 or 168+8:
the next 64 tokens' logits equal bit for bit; split 130+46 or 172+4: up to 0.52 apart). And a restored
sliding-window snapshot lands in the sequence's first cells, shifted from where cold evaluation left it, while
attention reads a sequence's cells padded to 256: shifted by a multiple of 256 (restore points at 1,024, 1,280,
1,792) the next token's logits were cold's bit for bit, shifted otherwise (1,296, 1,320, 1,344, 1,408) up to 1.4
apart, though the greedy tokens held."""


def tail(n: int) -> int:
    """Where the last chunk of a prompt of ``n >= SAVED`` tokens starts: the last multiple of ``ALIGN`` before its
    end. Cold evaluation cuts the prompt there, and an entry keeps a restore point there: the next turn of a
    conversation, which goes on from the whole prompt, restores all but those 1 to ``ALIGN`` tokens and gets cold's
    numbers."""
    return n - (n % ALIGN or ALIGN)


class SeqStates:
    """Copies of one context's sequences: whole states, sliding-window cells, and restores."""

    def __init__(self, lib: Any, ctx: Any, model: Any) -> None:
        self._lib = lib
        self.ctx = ctx
        self.memory = lib.llama_get_memory(ctx)
        self.windowed = lib.llama_model_n_swa(model) > 0  # sliding-window layers: restore points need their cells

    def capture(self, seq: int) -> bytearray:
        """The whole state of sequence ``seq``."""
        lib = self._lib
        size = lib.llama_state_seq_get_size(self.ctx, seq)
        data = bytearray(size)
        written = lib.llama_state_seq_get_data(self.ctx, (ctypes.c_uint8 * size).from_buffer(data), size, seq)
        del data[written:]
        return data

    def capture_window(self, seq: int) -> bytearray:
        """The sliding-window cells of ``seq`` as they are now (empty for a model without such layers)."""
        if not self.windowed:
            return bytearray()
        lib = self._lib
        flags = lib.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY
        size = lib.llama_state_seq_get_size_ext(self.ctx, seq, flags)
        data = bytearray(size)
        buffer = (ctypes.c_uint8 * size).from_buffer(data)
        written = lib.llama_state_seq_get_data_ext(self.ctx, buffer, size, seq, flags)
        del data[written:]
        return data

    def restore(self, seq: int, state: Any, length: int, total: int, window: Any = None) -> bool:
        """Put ``state`` (``total`` tokens) into ``seq``, cut back to ``length`` tokens with the sliding-window
        cells ``window`` of that position; ``False`` (and ``seq`` emptied) when llama.cpp refuses any of it."""
        lib = self._lib
        lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        ok = _set(lib, self.ctx, seq, state, 0) == len(state)
        if ok and length < total:
            ok = bool(lib.llama_memory_seq_rm(self.memory, seq, length, -1))
            if ok and self.windowed:
                ok = window is not None and _set(lib, self.ctx, seq, window, lib.LLAMA_STATE_SEQ_FLAGS_SWA_ONLY) == len(
                    window
                )
        if not ok:
            lib.llama_memory_seq_rm(self.memory, seq, -1, -1)
        return ok


def _set(lib: Any, ctx: Any, seq: int, data: Any, flags: int) -> int:
    size = len(data)
    if size == 0:
        return 0
    buffer = (ctypes.c_uint8 * size).from_buffer(data)
    if flags:
        return int(lib.llama_state_seq_set_data_ext(ctx, buffer, size, seq, flags))
    return int(lib.llama_state_seq_set_data(ctx, buffer, size, seq))


class Keeper:
    """The KV tier as the scheduler uses it: a hit restored into a sequence, and a prompt's state kept as its
    prefill passes its restore points and ends (only a prompt evaluated as cold evaluates it: cold's chunks, from
    nothing or from the tier)."""

    def __init__(self, lib: Any, ctx: Any, model: Any, tier: KVTier, chunk: int) -> None:
        self._lib = lib
        self.ctx = ctx
        self.states = SeqStates(lib, ctx, model)
        self.tier = tier
        self.chunk = chunk
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))

    def restore(self, seq: int, hit: Hit, prompt_length: int) -> tuple[int, np.ndarray | None]:
        """Put ``hit``'s KV into ``seq``: the tokens it holds (0: llama.cpp refused it, ``seq`` is empty) and, when
        that is the whole prompt, the logits its first token is sampled from."""
        entry, n = hit.entry, hit.length
        if not self.states.restore(seq, entry.state, n, len(entry.tokens), entry.points.get(n)):
            return 0, None
        self.tier.restored(n)
        whole = n == prompt_length
        return n, np.frombuffer(entry.logits, dtype=np.float32) if whole else None

    def passed(
        self,
        seq: int,
        prompt: list[int],
        end: int,
        points: dict[int, bytearray],
        scope: str,
        tag: str,
        logits: Any,
    ) -> None:
        """``seq``'s prefill of ``prompt`` reached ``end``: at one of its last ``POINTS`` chunk boundaries or where
        its last chunk starts (``tail``), the window's cells there go to ``points``; at its end (``logits``: the last
        position's), it goes to the tier."""
        n = len(prompt)
        if n < SAVED:
            return
        first = max(self.chunk, ((n - 1) // self.chunk - POINTS + 1) * self.chunk)
        if end < n and (end == tail(n) or (end % self.chunk == 0 and end >= first)):
            points[end] = self.states.capture_window(seq)
        if end != n:
            return
        if n % self.chunk == 0:
            points[n] = bytearray()  # its end is a restore point too: the whole state is that position's
        row = np.ctypeslib.as_array(logits, shape=(self.n_vocab,))
        state = self.states.capture(seq)
        entry = Entry(scope, np.asarray(prompt, dtype=np.int32), state, bytearray(row.tobytes()), dict(points), tag=tag)
        points.clear()
        self.tier.put(entry)
