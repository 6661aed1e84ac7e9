"""``gateway.serving.resume.resumable`` in process: a stream that fails as unavailable goes on from a resumed
replica's events, which replay what the client has either event by event (llama.cpp, MLX) or as one delta that
carries every sent token (vLLM); the client gets each piece of text once."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable

import pytest

from meshgate.gateway.serving.resume import resumable
from meshgate.protocols.model import (
    BackendUnavailable,
    Event,
    Failed,
    Finished,
    GatewayError,
    InvalidRequest,
    KeepAlive,
    TextDelta,
    ToolCallDelta,
    Usage,
)

CUT = Failed(error=BackendUnavailable("the runner closed mid-response").info())


async def _events(events: Iterable[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


def _run(first: list[Event], replays: list[list[Event]]) -> tuple[list[Event], list[tuple[int, ...]]]:
    """What the client gets from ``first`` resumed by ``replays`` in turn, and the tokens each resume was given."""
    asked: list[tuple[int, ...]] = []

    async def resume(tokens: tuple[int, ...], error: GatewayError) -> AsyncIterator[Event]:
        asked.append(tokens)
        return _events(replays[len(asked) - 1])

    async def main() -> list[Event]:
        return [e async for e in resumable(_events(first), resume, wait=5, keepalive=1)]

    return asyncio.run(main()), asked


def _text(events: list[Event]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


A, B, C, D = (TextDelta(text=t, tokens=(i,)) for i, t in enumerate(("A", "B", "C", "D"), start=1))
OPEN = ToolCallDelta(index=0, id="call_1", name="f")  # a delta that carries no tokens of its own


@pytest.mark.parametrize(
    ("first", "replay", "text"),
    [
        # llama.cpp / MLX: the same events again, then new ones
        ([A, B, CUT], [A, B, C, D, Finished()], "ABCD"),
        # a sent delta without tokens is replayed too, wherever it was
        ([A, OPEN, B, CUT], [A, OPEN, B, C, Finished()], "ABC"),
        ([A, B, OPEN, CUT], [A, B, OPEN, C, Finished()], "ABC"),
        # vLLM: one empty delta carrying every token sent, then new ones
        ([A, B, CUT], [TextDelta(text="", tokens=(1, 2)), C, D, Finished()], "ABCD"),
        # nothing sent yet: a plain retry, nothing skipped
        ([CUT], [A, B, Finished()], "AB"),
    ],
)
def test_the_client_gets_each_piece_once(first: list[Event], replay: list[Event], text: str) -> None:
    got, asked = _run(first, [replay])
    assert _text(got) == text
    assert asked == [tuple(t for e in first if isinstance(e, TextDelta) for t in e.tokens)]
    assert sum(e is OPEN for e in got) == sum(e is OPEN for e in first)  # sent once, not again
    assert isinstance(got[-1], Finished)


def test_the_resumed_usage_replaces_the_prompt_count_only_once_content_follows() -> None:
    got, _ = _run(
        [A, CUT],
        [[Usage(prompt_tokens=9, completion_tokens=0), A, B, Usage(prompt_tokens=9, completion_tokens=2), Finished()]],
    )
    assert _text(got) == "AB" and got[-2] == Usage(prompt_tokens=9, completion_tokens=2)


def test_a_stream_whose_tokens_are_unknown_fails_as_before() -> None:
    """A backend that puts no ids on its deltas (vLLM with a response format) cannot be resumed after content."""
    got, asked = _run([TextDelta(text="{"), CUT], [[A, Finished()]])
    assert asked == [] and got[-1] == CUT


def test_a_runner_error_is_not_resumed() -> None:
    refused = Failed(error=InvalidRequest("bad grammar").info())
    got, asked = _run([A, refused], [[A, Finished()]])
    assert asked == [] and got == [A, refused]


def test_a_client_gone_just_as_the_resume_arrives_closes_the_resumed_stream() -> None:
    """The client hangs up while it waits (on a keep-alive) and the new replica's stream arrives at that moment:
    that stream, which holds its replica's slot, is closed too, never left open (issue 37, 13)."""
    closed: list[str] = []
    arrived = asyncio.Event()

    class Resumed:  # as the dispatcher's ``EventStream``: closing it frees its slot even when never read
        def __aiter__(self) -> Resumed:
            return self

        async def __anext__(self) -> Event:
            raise StopAsyncIteration

        async def aclose(self) -> None:
            closed.append("resumed")

    async def resume(tokens: tuple[int, ...], error: GatewayError) -> AsyncIterator[Event]:
        await asyncio.sleep(0.05)  # after the first keep-alive went out
        stream = Resumed()
        arrived.set()
        return stream

    async def main() -> None:
        stream = resumable(_events([A, CUT]), resume, wait=5, keepalive=0.01)
        assert await anext(stream) == A
        assert isinstance(await anext(stream), KeepAlive)
        await arrived.wait()  # the resume has its stream; the client's still sits at its keep-alive
        await stream.aclose()

    asyncio.run(main())
    assert closed == ["resumed"]
