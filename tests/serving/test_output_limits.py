"""Bounded generation as plain functions (issue 15, item 2): ``cap_output`` holds ``max_tokens`` to the gateway's
setting (refused or cut, per protocol; no limit becomes the setting when the context allows more), and
``collect_or_cancel`` stops collecting a non-streaming answer, closing its event stream, when the client goes.
The same through real processes is in ``tests/e2e/test_hostile_requests.py`` and ``test_runner_faults.py``."""

from __future__ import annotations

import asyncio

import pytest

from meshgate.gateway.http.routes.common import ClientGone, collect_or_cancel
from meshgate.gateway.serving.context_fit import cap_output
from meshgate.protocols.model import Finished, OutputTooLarge, Request, TextDelta, Usage


def ask(max_tokens: int | None) -> Request:
    return Request(model="gemma3:270m", max_tokens=max_tokens)


def test_an_ask_within_the_limit_is_kept():
    assert cap_output(ask(64), 64, clamp=False).max_tokens == 64
    assert cap_output(ask(1), 64, clamp=True, context=2048).max_tokens == 1


def test_an_ask_above_the_limit_is_refused_or_cut():
    with pytest.raises(OutputTooLarge) as exc:
        cap_output(ask(2**70), 65536, clamp=False)
    assert (exc.value.asked, exc.value.limit, exc.value.model, exc.value.status) == (2**70, 65536, "gemma3:270m", 400)
    assert cap_output(ask(2**70), 65536, clamp=True).max_tokens == 65536


def test_no_limit_becomes_the_setting_only_where_the_context_holds_more():
    assert cap_output(ask(None), 64, clamp=False).max_tokens is None  # context unknown: the runner's room bounds it
    assert cap_output(ask(None), 64, clamp=True, context=2048).max_tokens == 64
    assert cap_output(ask(None), 65536, clamp=True, context=2048).max_tokens is None


class FakeRequest:
    """What ``collect_or_cancel`` reads of a Litestar request: its ASGI receive channel."""

    def __init__(self, disconnect_after: float | None) -> None:
        self.disconnect_after = disconnect_after

    async def receive(self) -> dict:
        if self.disconnect_after is None:
            await asyncio.Event().wait()
        await asyncio.sleep(self.disconnect_after)
        return {"type": "http.disconnect"}


async def opened(events):
    """What ``Dispatcher.open_stream`` gives ``collect_or_cancel``: an awaitable of the event stream."""
    return events


async def test_collect_or_cancel_closes_the_stream_when_the_client_goes():
    closed = asyncio.Event()

    async def endless():
        try:
            yield Usage(prompt_tokens=1)
            while True:
                await asyncio.sleep(0.01)
                yield TextDelta(text="x")
        finally:
            closed.set()

    with pytest.raises(ClientGone):
        await asyncio.wait_for(collect_or_cancel(FakeRequest(0.1), opened(endless())), 5)  # type: ignore[arg-type]
    assert closed.is_set()


async def test_collect_or_cancel_returns_the_answer_while_the_client_stays():
    async def short():
        yield TextDelta(text="hi")
        yield Finished(reason="stop")

    response = await collect_or_cancel(FakeRequest(None), opened(short()))  # type: ignore[arg-type]
    assert response.text == "hi" and response.finish.reason == "stop"
