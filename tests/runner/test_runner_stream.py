"""``RunnerClient.generate`` over ``backends.runner.http_stream``: events, coalescing, and every transport failure.

A raw asyncio server on a loopback port writes HTTP responses byte by byte as a test scripts them, so chunk
boundaries (a line split across chunks, a chunk header split from its data, many lines in one chunk) are exact.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable

import httpx
import msgspec
import pytest

from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.http_stream import post_stream
from meshgate.protocols.model import (
    BackendProtocolError,
    BackendTimeout,
    BackendUnavailable,
    Event,
    Failed,
    Finished,
    Request,
    TextDelta,
    Usage,
)
from tests.conftest import free_port

REQUEST = Request(model="m", raw_prompt="hi", stream=True)
HEAD = b"HTTP/1.1 200 OK\r\ncontent-type: application/x-ndjson\r\ntransfer-encoding: chunked\r\n\r\n"
EVENTS: list[Event] = [
    Usage(prompt_tokens=2),
    TextDelta(text="Hel"),
    TextDelta(text="lo\n"),
    Usage(prompt_tokens=2, completion_tokens=2),
    Finished(reason="stop"),
]
LINES = [msgspec.json.encode(e) + b"\n" for e in EVENTS]

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


def chunk(data: bytes) -> bytes:
    return b"%x\r\n%s\r\n" % (len(data), data)


async def read_request(reader: asyncio.StreamReader) -> bytes:
    head = await reader.readuntil(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1]) for line in head.split(b"\r\n") if line.lower().startswith(b"content-length")
    )
    return head + await reader.readexactly(length)


class Runner:
    """A loopback server that answers each connection with ``script``; ``requests`` and ``disconnects`` seen."""

    def __init__(self, script: Script) -> None:
        self.script = script
        self.requests: list[bytes] = []
        self.disconnected = asyncio.Event()

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests.append(await read_request(reader))
        try:
            await self.script(reader, writer)
        finally:
            writer.close()

    async def __aenter__(self) -> str:
        self.server = await asyncio.start_server(self.handle, "127.0.0.1", 0)
        return f"http://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()


async def events_from(url: str, read_timeout: float = 5.0) -> list[Event]:
    async with httpx.AsyncClient() as http:
        return [e async for e in RunnerClient(url, http, read_timeout=read_timeout).generate(REQUEST)]


async def writes(writer: asyncio.StreamWriter, *parts: bytes) -> None:
    for part in parts:
        writer.write(part)
        await writer.drain()
        await asyncio.sleep(0.01)


async def test_events_arrive_whole_however_the_bytes_are_cut():
    body = b"".join(chunk(line) for line in LINES)

    async def byte_by_byte(reader, writer):
        await writes(writer, HEAD)
        for i in range(0, len(body), 7):  # lines, chunk headers and CRLFs all cut mid-way
            await writes(writer, body[i : i + 7])
        await writes(writer, b"0\r\n\r\n")

    runner = Runner(byte_by_byte)
    async with runner as url:
        assert await events_from(url) == EVENTS
    head, _, sent = runner.requests[0].partition(b"\r\n\r\n")
    assert head.startswith(b"POST /generate HTTP/1.1\r\n")
    assert msgspec.json.decode(sent, type=Request) == REQUEST


async def test_lines_split_across_chunks_and_many_in_one():
    data = b"".join(LINES)
    cut = len(LINES[0]) + 4  # the second line starts in one chunk and ends in the next

    async def uneven(reader, writer):
        await writes(writer, HEAD + chunk(data[:cut]), chunk(data[cut:]) + b"0\r\n\r\n")

    async with Runner(uneven) as url:
        assert await events_from(url) == EVENTS


async def test_what_arrived_together_is_read_in_one_step():
    """A batched runner's lines, written at once, come out of ``post_stream`` as one item."""

    async def together(reader, writer):
        await writes(writer, HEAD + chunk(LINES[0]))
        await writes(writer, chunk(LINES[1]) + chunk(LINES[2]) + chunk(LINES[3]))
        await writes(writer, chunk(LINES[4]) + b"0\r\n\r\n")

    async with Runner(together) as url:
        items = [item async for item in post_stream(f"{url}/generate", b"{}")]
    assert items == [LINES[0], LINES[1] + LINES[2] + LINES[3], LINES[4]]


async def test_a_status_other_than_200_is_a_protocol_error_with_the_body():
    async def refuse(reader, writer):
        await writes(writer, b'HTTP/1.1 400 Bad Request\r\ncontent-length: 21\r\n\r\n{"error":"bad input"}')

    async with Runner(refuse) as url:
        [failed] = await events_from(url)
    assert isinstance(failed, Failed) and failed.error.kind == BackendProtocolError.__name__
    assert failed.error.message == 'runner answered 400: {"error":"bad input"}'


async def test_no_runner_is_unavailable():
    [failed] = await events_from(f"http://127.0.0.1:{free_port()}")
    assert isinstance(failed, Failed) and failed.error.kind == BackendUnavailable.__name__


async def test_a_runner_that_dies_mid_stream_is_unavailable():
    async def die(reader, writer):
        await writes(writer, HEAD + chunk(LINES[0]) + chunk(LINES[1]))

    async with Runner(die) as url:
        events = await events_from(url)
    assert events[:2] == EVENTS[:2]
    assert isinstance(events[2], Failed) and events[2].error.kind == BackendUnavailable.__name__
    assert len(events) == 3


async def test_a_body_that_ends_before_the_terminal_event_is_unavailable():
    async def short(reader, writer):
        await writes(writer, HEAD + chunk(LINES[0]) + b"0\r\n\r\n")

    async with Runner(short) as url:
        events = await events_from(url)
    assert events[0] == EVENTS[0]
    assert isinstance(events[1], Failed) and "before finishing" in events[1].error.message


async def test_a_stalled_runner_times_out():
    async def stall(reader, writer):
        await writes(writer, HEAD + chunk(LINES[0]))
        await asyncio.sleep(2)

    async with Runner(stall) as url:
        events = await events_from(url, read_timeout=0.3)
    assert events[0] == EVENTS[0]
    assert isinstance(events[1], Failed) and events[1].error.kind == BackendTimeout.__name__


@pytest.mark.parametrize("garbage", [b"not json\n", b'{"type":"nope"}\n'])
async def test_garbage_is_a_protocol_error(garbage: bytes):
    async def send_garbage(reader, writer):
        await writes(writer, HEAD + chunk(LINES[0] + garbage) + b"0\r\n\r\n")

    async with Runner(send_garbage) as url:
        events = await events_from(url)
    assert isinstance(events[1], Failed) and events[1].error.kind == BackendProtocolError.__name__


async def test_a_malformed_response_is_a_protocol_error():
    async def nonsense(reader, writer):
        await writes(writer, b"SPDY/9 what\r\n\r\n")

    async with Runner(nonsense) as url:
        [failed] = await events_from(url)
    assert failed.error.kind == BackendProtocolError.__name__


async def test_closing_the_stream_closes_the_connection():
    """What the runner sees as a disconnect (and cancels the generation on)."""
    runner: Runner

    async def endless(reader, writer):
        await writes(writer, HEAD)
        for _ in range(500):
            try:
                await writes(writer, chunk(LINES[1]))
                if await asyncio.wait_for(reader.read(1), 0.01) == b"":
                    break  # EOF: the client closed
            except TimeoutError:
                continue
            except ConnectionError:
                break
        runner.disconnected.set()

    runner = Runner(endless)
    async with runner as url, httpx.AsyncClient() as http:
        stream: AsyncIterator[Event] = RunnerClient(url, http).generate(REQUEST)
        assert await anext(stream) == EVENTS[1]
        await stream.aclose()
        await asyncio.wait_for(runner.disconnected.wait(), 5)
