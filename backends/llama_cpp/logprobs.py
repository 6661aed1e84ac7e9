"""Token log probabilities for the llama.cpp engine, and keeping them with the text they belong to.

``token_logprob`` takes the logits of the batch row the token was sampled from (the scheduler reads them with
``llama_get_logits_ith`` before the next decode replaces them) and takes their log-softmax. These
are the model's own probabilities: before temperature, penalties, top-k/top-p and any grammar, as llama.cpp's
server reports them by default.

``LogprobAligner`` pairs each entry with the text that goes out. An entry goes out with the delta that carries
the first character of its token's text (a token that decodes to no text yet, such as the first half of a UTF-8
character, goes with the next character). Text the stop matcher holds back keeps its entries back with it, and
tokens wholly inside a matched stop sequence, which is never sent, have no entry in the answer.

Runs only in the runner process; imports protocols, numpy and llama_cpp (through the ``Llama`` object given).
"""

from __future__ import annotations

from collections import deque
from typing import Any

import numpy as np

from meshgate.protocols.model import TokenLogprob, TopLogprob

__all__ = ["LogprobAligner", "token_logprob"]


def token_logprob(llm: Any, logits: np.ndarray, token: int, top_n: int) -> TokenLogprob:
    """The log probability of ``token`` under ``logits`` (the row it was sampled from) and the ``top_n`` most
    likely tokens; ``llm`` (a ``llama_cpp.Llama``) gives the tokens' bytes.

    Call it right after ``token`` was sampled, before the next decode replaces the logits.
    """
    piece = llm.detokenize([token])
    peak = float(logits.max())
    norm = peak + float(np.log(np.exp(logits - peak, dtype=np.float64).sum()))
    top: tuple[TopLogprob, ...] = ()
    if top_n > 0:
        best = np.argpartition(logits, -top_n)[-top_n:]
        best = best[np.argsort(-logits[best], kind="stable")]
        top = tuple(_top(llm, int(i), float(logits[i]) - norm) for i in best)
    return TokenLogprob(token=_text(piece), logprob=min(float(logits[token]) - norm, 0.0), bytes=tuple(piece), top=top)


def _top(llm: Any, token: int, logprob: float) -> TopLogprob:
    piece = llm.detokenize([token], special=True)
    return TopLogprob(token=_text(piece), logprob=min(logprob, 0.0), bytes=tuple(piece))


def _text(piece: bytes) -> str:
    return piece.decode("utf-8", errors="replace")


class LogprobAligner:
    """Queues entries at their token's character offset; hands them out as text covering them is sent."""

    def __init__(self) -> None:
        self.fed = 0
        self.sent = 0
        self.pending: deque[tuple[int, TokenLogprob]] = deque()

    def add(self, text: str, entry: TokenLogprob) -> None:
        """A token whose decoded text is ``text`` was fed to the stop matcher."""
        self.pending.append((self.fed, entry))
        self.fed += len(text)

    def take(self, text: str) -> tuple[TokenLogprob, ...]:
        """``text`` goes out now; the entries of the tokens it starts."""
        self.sent += len(text)
        out = []
        while self.pending and self.pending[0][0] < self.sent:
            out.append(self.pending.popleft()[1])
        return tuple(out)

    def rest(self) -> tuple[TokenLogprob, ...]:
        """Everything still queued (at the end of a generation that did not stop on a stop sequence)."""
        out = tuple(entry for _, entry in self.pending)
        self.pending.clear()
        return out
