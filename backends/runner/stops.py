"""Stop sequences for runtimes that run their own token loop (llama.cpp, MLX): hold back text that may start a
stop sequence, report the sequence that matched. Pure; imports nothing of ours."""

from __future__ import annotations

__all__ = ["StopMatcher"]


class StopMatcher:
    """Holds back text that might be the start of a stop sequence; reports the sequence that matched."""

    def __init__(self, stops: tuple[str, ...]) -> None:
        self.stops = tuple(s for s in stops if s)
        self.pending = ""

    def feed(self, text: str) -> tuple[str, str | None]:
        """Add ``text``; return (text safe to emit, matched stop sequence or None)."""
        self.pending += text
        if not self.stops:
            out, self.pending = self.pending, ""
            return out, None
        hits = [(self.pending.find(s), s) for s in self.stops if s in self.pending]
        if hits:
            at, stop = min(hits)
            out, self.pending = self.pending[:at], ""
            return out, stop
        keep = max((_overlap(self.pending, s) for s in self.stops), default=0)
        cut = len(self.pending) - keep
        out, self.pending = self.pending[:cut], self.pending[cut:]
        return out, None

    def flush(self) -> str:
        out, self.pending = self.pending, ""
        return out


def _overlap(text: str, stop: str) -> int:
    """The length of the longest end of ``text`` that begins ``stop`` (shorter than ``stop`` itself).

    Only places where ``stop``'s first character occurs are tried, each with one C-speed comparison, so a long
    stop sequence costs about the length of the held-back text, not the square of its own length.
    """
    start = max(0, len(text) - len(stop) + 1)
    at = text.find(stop[0], start)
    while at != -1:
        if stop.startswith(text[at:]):
            return len(text) - at
        at = text.find(stop[0], at + 1)
    return 0
