"""The stop matcher holds back exactly the text that may begin a stop sequence (checked against brute force)."""

from __future__ import annotations

import random

from meshgate.backends.runner.stops import StopMatcher


def _brute(pieces: list[str], stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Text before the first stop sequence once a piece completes one (earliest start wins), and that sequence."""
    text = ""
    for piece in pieces:
        text += piece
        hits = [(text.find(s), s) for s in stops if s and s in text]
        if hits:
            at, stop = min(hits)
            return text[:at], stop
    return text, None


def test_random_streams_match_brute_force():
    rng = random.Random(7)
    for _ in range(3000):
        stops = tuple("".join(rng.choice("ab ") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 3)))
        pieces = ["".join(rng.choice("ab ") for _ in range(rng.randint(0, 3))) for _ in range(rng.randint(1, 8))]
        matcher, out, matched = StopMatcher(stops), "", None
        for piece in pieces:
            text, matched = matcher.feed(piece)
            out += text
            if matched is not None:
                break
        if matched is None:
            out += matcher.flush()
        assert (out, matched) == _brute(pieces, stops), (pieces, stops)


def test_a_long_stop_sequence_holds_back_only_what_may_begin_it():
    matcher = StopMatcher(("x" * 400_000,))
    assert matcher.feed("hello ") == ("hello ", None)
    assert matcher.feed("world xx") == ("world ", None)
    assert matcher.pending == "xx"
