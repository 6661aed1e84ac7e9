"""OpenAI wire helpers shared by the protocol tests: example fixtures, our stream encoder fed a list of events,
and the openai SDK's own SSE parser and stream accumulator to read what we wrote."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterable
from typing import Any

import openai
from openai._streaming import Stream
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

from meshgate.protocols import openai as oai
from meshgate.protocols.model import Event, Meta

try:  # openai 3.x talks through httpx2, 1.x through httpx
    import httpx2 as httpx
except ImportError:  # pragma: no cover
    import httpx  # type: ignore[no-redef]

META = Meta(id="abc123", model="gemma-3-270m", created=1741569952.7)
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather in a given location",
        "parameters": {
            "type": "object",
            "properties": {
                "location": {"type": "string", "description": "The city and state, e.g. San Francisco, CA"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["location"],
        },
    },
}


async def feed(events: Iterable[Event]) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def chat_stream(events: Iterable[Event], include_usage: bool = False) -> bytes:
    return b"".join([frame async for frame in oai.encode_chat_stream(feed(events), META, include_usage=include_usage)])


def payloads(raw: bytes) -> list[Any]:
    """The ``data:`` payloads of an SSE body, JSON-decoded except ``[DONE]``; fails on any ``event:`` line."""
    out = []
    for frame in raw.decode().split("\r\n\r\n")[:-1]:
        for line in frame.split("\r\n"):
            assert not line.startswith("event:"), line
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                out.append(data if data == "[DONE]" else json.loads(data))
    return out


def sdk_stream(raw: bytes, cast_to: type = ChatCompletionChunk) -> list[Any]:
    """Parse a body exactly as the openai SDK does (its own SSE decoder and ``Stream``)."""
    client = openai.OpenAI(api_key="dummy", base_url="http://gateway.test/v1")
    request = httpx.Request("POST", "http://gateway.test/v1/chat/completions")
    response = httpx.Response(200, content=raw, request=request)
    return list(Stream(cast_to=cast_to, response=response, client=client))


def accumulate(chunks: list[ChatCompletionChunk]):
    state = ChatCompletionStreamState(input_tools=[WEATHER_TOOL])
    for chunk in chunks:
        state.handle_chunk(chunk)
    return state.get_final_completion()
