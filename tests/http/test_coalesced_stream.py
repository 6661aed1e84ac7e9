"""``gateway.http.routes.common.stream_response``: what is ready goes out in one ASGI message, nothing waits
for company.

Driven as a plain ASGI callable with a recording ``send`` (an in-process HTTP transport would buffer the body and
hide the messages).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator

from meshgate.gateway.http.routes.common import stream_response


class Recorder:
    """``send`` and ``receive`` for one response; ``receive`` reports a disconnect once ``gone`` is set (the client
    left, or the body is complete, as uvicorn does)."""

    def __init__(self) -> None:
        self.bodies: list[tuple[float, bytes, bool]] = []
        self.gone = asyncio.Event()

    async def send(self, message: dict) -> None:
        if message["type"] == "http.response.body":
            self.bodies.append((time.perf_counter(), message["body"], message["more_body"]))
            if not message["more_body"]:
                self.gone.set()

    async def receive(self) -> dict:
        await self.gone.wait()
        return {"type": "http.disconnect"}


async def run(frames: AsyncIterator[bytes], recorder: Recorder) -> None:
    response = stream_response(frames, "text/event-stream").to_asgi_response(None, None)  # type: ignore[arg-type]
    await response({"type": "http"}, recorder.receive, recorder.send)


async def test_ready_frames_share_one_message_and_the_first_is_not_held_back():
    later = asyncio.Event()
    sent_first_at: list[float] = []

    async def frames() -> AsyncIterator[bytes]:
        yield b"a"
        yield b"b"  # ready at once with "a": the same message
        await asyncio.sleep(0.2)  # the runner has nothing more for a while
        sent_first_at.append(time.perf_counter())
        yield b"c"
        await later.wait()
        yield b"d"
        yield b"e"  # the last two and the end of the body: one message

    recorder = Recorder()

    async def sent(count: int) -> None:
        while len(recorder.bodies) < count:
            await asyncio.sleep(0.01)

    task = asyncio.create_task(run(frames(), recorder))
    await asyncio.wait_for(sent(2), 5)  # "c" went out before "d" is ready (a fixed wait may end before the pause)
    later.set()
    await asyncio.wait_for(task, 5)
    assert [(body, more) for _, body, more in recorder.bodies] == [(b"ab", True), (b"c", True), (b"de", False)]
    assert recorder.bodies[0][0] < sent_first_at[0]  # "ab" went out before the pause ended


async def test_an_empty_stream_ends_the_body():
    async def frames() -> AsyncIterator[bytes]:
        return
        yield b""

    recorder = Recorder()
    await run(frames(), recorder)
    assert [(body, more) for _, body, more in recorder.bodies] == [(b"", False)]


async def test_a_disconnect_closes_the_frames_at_once():
    closed = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        try:
            yield b"a"
            await asyncio.sleep(30)
            yield b"never"
        finally:
            closed.set()

    recorder = Recorder()
    task = asyncio.create_task(run(frames(), recorder))
    await asyncio.sleep(0.05)
    recorder.gone.set()
    await asyncio.wait_for(closed.wait(), 5)
    await asyncio.wait_for(task, 5)
    assert [body for _, body, _ in recorder.bodies] == [b"a"]


async def test_cancelling_the_response_closes_the_frames():
    """As on server shutdown: the task writing the response is cancelled."""
    closed = asyncio.Event()

    async def frames() -> AsyncIterator[bytes]:
        try:
            while True:
                yield b"x"
                await asyncio.sleep(0.01)
        finally:
            closed.set()

    task = asyncio.create_task(run(frames(), Recorder()))
    await asyncio.sleep(0.05)
    task.cancel()
    await asyncio.wait_for(closed.wait(), 5)
    await asyncio.wait({task}, timeout=5)
    assert task.done()
