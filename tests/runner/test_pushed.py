"""``runner.pushed``: streams an engine pushes to the event loop, woken once a step for all of them.

A scripted engine stands in for llama.cpp's: a "decode thread" puts tokens in each stream's queue without waking
anyone and calls ``wake`` once per step, as ``batch.Scheduler`` does. The runner app serves it over a real socket.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time

import httpx
import msgspec

from meshgate.backends.runner.pushed import Waker, _joined, run_pushed
from meshgate.backends.runner.server import RunnerApp
from meshgate.protocols.model import (
    Event,
    Failed,
    Finished,
    Message,
    Request,
    TextDelta,
    TextPart,
    TokenLogprob,
    Usage,
)


async def test_many_wakes_before_the_loop_runs_are_one_callback_that_resolves_every_armed_wait():
    loop = asyncio.get_running_loop()
    waker = Waker(loop)
    scheduled = []
    real = loop.call_soon_threadsafe

    def counting(callback, *args):
        scheduled.append(callback)
        return real(callback, *args)

    loop.call_soon_threadsafe = counting  # type: ignore[method-assign]
    try:
        armed = [waker.armed() for _ in range(8)]
        thread = threading.Thread(target=lambda: [waker.wake() for _ in range(50)])
        thread.start()
        thread.join()
        await asyncio.sleep(0)
        assert len(scheduled) == 1, "50 wakes before the loop ran: one callback"
        assert all(f.done() for f in armed)
        waker.wake()
        await asyncio.sleep(0)
        assert len(scheduled) == 2, "a wake after the callback ran schedules the next one"
    finally:
        loop.call_soon_threadsafe = real  # type: ignore[method-assign]
    started = time.monotonic()
    await waker.wait(waker.armed(), 0.05)
    assert 0.04 <= time.monotonic() - started < 1.0, "no wake: the wait ends at its timeout"


async def test_wakes_within_the_interval_are_held_and_sent_as_one_but_a_first_token_or_end_never_waits():
    """With an interval, the first wake runs at once; wakes in the next ``interval`` seconds are held and run as one
    when it has passed (then the next interval holds); ``now`` (a first token, an end) runs at once; a wake after a
    quiet interval runs at once again."""
    loop = asyncio.get_running_loop()
    interval = 1.0  # long beside the windows below, so a loaded machine cannot blur them
    waker = Waker(loop, interval)

    async def woken(*, now: bool = False, within: float) -> bool:
        """Whether a wake (from another thread, as the decode loop's) resolves an armed wait within ``within`` s."""
        armed = waker.armed()
        threading.Thread(target=waker.wake, args=(now,)).start()
        try:
            await asyncio.wait_for(asyncio.shield(armed), within)
        except TimeoutError:
            return False
        return True

    assert await woken(within=0.4), "the first wake runs at once"
    started = time.monotonic()
    assert not await woken(within=0.4), "a wake right after one is held"
    armed = waker.armed()
    threading.Thread(target=lambda: [waker.wake() for _ in range(20)]).start()
    await armed  # the held wakes run as one when the interval has passed
    assert interval - 0.1 <= time.monotonic() - started < interval + 1.0
    assert await woken(now=True, within=0.4), "a first token or an end is never held"
    await asyncio.sleep(interval * 2.2)  # a quiet interval: holding stops
    assert await woken(within=0.4), "after a quiet interval a wake runs at once"


def test_the_text_deltas_one_poll_found_go_out_as_one_in_order():
    lp = [TokenLogprob(token=t, logprob=-0.5) for t in "abc"]
    events: list[Event] = [
        TextDelta(text="He", tokens=(1,)),
        TextDelta(text="", tokens=(2,)),  # a token whose text is held back (a stop string's start)
        TextDelta(text="llo", tokens=(3,)),
        Usage(prompt_tokens=3),
        TextDelta(text="a", logprobs=(lp[0],), tokens=(4,)),
        TextDelta(text="b", logprobs=(lp[1],), tokens=(5,)),
        TextDelta(text="c", tokens=(6,)),  # no log probabilities: not joined to those with them
    ]
    assert _joined(events) == [
        TextDelta(text="Hello", tokens=(1, 2, 3)),
        Usage(prompt_tokens=3),
        TextDelta(text="ab", logprobs=(lp[0], lp[1]), tokens=(4, 5)),
        TextDelta(text="c", tokens=(6,)),
    ]


class _Stream:
    """What ``open_stream`` returns: ``poll`` drains the queue the decode thread fills."""

    def __init__(self, tokens: queue.SimpleQueue) -> None:
        self.tokens = tokens
        self.opening = Usage(prompt_tokens=3)
        self.closed = False

    def poll(self):
        events = []
        while True:
            try:
                item = self.tokens.get_nowait()
            except queue.Empty:
                return events, False
            if item is None:
                return [*events, Usage(prompt_tokens=3, completion_tokens=6), Finished(reason="length")], True
            events.append(TextDelta(text=item))

    def close(self) -> None:
        self.closed = True


class _PushingEngine:
    """Streams of six tokens each, decoded together by one thread in steps of one token a stream."""

    parallel = 8

    def __init__(self, fail: bool = False) -> None:
        self.wakes = 0
        self.steps = 0
        self.fail = fail
        self.streams: list[_Stream] = []

    def health(self) -> dict:
        return {"status": "ok"}

    def open_stream(self, request: Request, cancel: threading.Event, wake) -> _Stream:
        if self.fail:
            raise ValueError("bad prompt")
        stream = _Stream(queue.SimpleQueue())
        self.streams.append(stream)
        if len(self.streams) == 4:  # all four are in: decode them together
            threading.Thread(target=self._decode, args=(wake,), daemon=True).start()
        return stream

    def _decode(self, wake) -> None:
        for step in range(7):
            time.sleep(0.02)
            for stream in self.streams:
                stream.tokens.put(f"t{step} " if step < 6 else None)
            self.steps += 1
            self.wakes += 1
            wake()


def _request_struct() -> Request:
    return Request(model="m", messages=(Message(role="user", parts=(TextPart(text="hi"),)),))


def _request() -> bytes:
    return msgspec.json.encode(_request_struct())


async def _serve(engine) -> tuple[httpx.AsyncClient, RunnerApp]:
    app = RunnerApp(engine, None)
    transport = httpx.ASGITransport(app=app)
    return httpx.AsyncClient(transport=transport, base_url="http://runner"), app


async def test_streams_pushed_by_one_decode_thread_arrive_whole_with_one_wake_a_step():
    engine = _PushingEngine()
    client, _ = await _serve(engine)
    async with client:

        async def one() -> list[Event]:
            response = await client.post("/generate", content=_request(), timeout=10)
            return [msgspec.json.decode(line, type=Event) for line in response.content.splitlines()]

        results = await asyncio.gather(*(one() for _ in range(4)))
    for events in results:
        text = "".join(e.text for e in events if isinstance(e, TextDelta))
        assert text == "t0 t1 t2 t3 t4 t5 ", events
        assert isinstance(events[0], Usage) and isinstance(events[-1], Finished)
    assert engine.wakes == engine.steps == 7, "one wake a step, for the four streams together"
    assert all(stream.closed for stream in engine.streams)


async def test_an_engine_that_fails_to_open_a_stream_answers_its_error_as_the_threaded_path_does():
    loop = asyncio.get_running_loop()
    engine, cancel = _PushingEngine(fail=True), threading.Event()
    events = [e async for e in run_pushed(engine, _request_struct(), cancel, Waker(loop))]
    assert len(events) == 1 and isinstance(events[0][0], Failed)
    assert events[0][0].error.kind == "InvalidRequest" and "bad prompt" in events[0][0].error.message
