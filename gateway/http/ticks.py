"""uvicorn's server loop at one tick a second instead of ten, so an idle gateway or node agent wakes less.

uvicorn's ``Server.main_loop`` wakes every 0.1 s: to refresh the ``date`` header (``on_tick`` does that once a
second, when ``counter % 10 == 0``) and to notice ``should_exit``. Those wake-ups are most of what an idle meshgate
process spends (a gateway with its embedded agent runs two uvicorn servers: ~20 wake-ups a second, ~3.8 ms of CPU
a second measured on the 2-core dev box; ~2 ms with both at one tick a second). ``tick_once_a_second(server)``
gives one ``uvicorn.Server`` a loop that calls ``on_tick`` with the same counters once a second, and wakes at once
when a signal asks the server to exit (``handle_exit``), so shutting down is no slower.

Imports nothing of meshgate; uvicorn is not imported here (the server is passed in).
"""

from __future__ import annotations

import asyncio
import contextlib
from types import FrameType
from typing import Any

__all__ = ["tick_once_a_second"]


def tick_once_a_second(server: Any) -> None:
    """Give ``server`` (a ``uvicorn.Server``, before it serves) a ``main_loop`` that ticks once a second."""
    wake: asyncio.Event | None = None
    loop: asyncio.AbstractEventLoop | None = None
    handle_exit = server.handle_exit

    def exit_now(sig: int, frame: FrameType | None) -> None:  # uvicorn installs it as the signal handler
        handle_exit(sig, frame)
        if loop is not None and wake is not None:
            loop.call_soon_threadsafe(wake.set)

    async def main_loop() -> None:
        nonlocal wake, loop
        wake, loop = asyncio.Event(), asyncio.get_running_loop()
        counter = 0
        while not await server.on_tick(counter):
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(1.0):
                    await wake.wait()
            counter = (counter + 10) % 864000  # uvicorn's own wrap (ten days of ticks)

    server.handle_exit = exit_now
    server.main_loop = main_loop
