"""Shared fixtures of the Ollama codec tests (``test_ollama_requests.py``, ``test_ollama_responses.py``):
the examples of Ollama's docs/api.md and small helpers to translate and encode them."""

from __future__ import annotations

import base64
import json
from collections.abc import AsyncIterator, Callable, Sequence

from meshgate.protocols import ollama as oll
from meshgate.protocols.model import (
    Event,
    Meta,
    Request,
    Usage,
    decode_body,
)

META = Meta(id="abc123", model="llama3.2", created=1_700_000_000.25)
CREATED_AT = "2023-11-14T22:13:20.250000+00:00"
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR"
JPEG = b"\xff\xd8\xff\xe0\x00\x10JFIF"
FINAL_USAGE = Usage(prompt_tokens=26, completion_tokens=298, load_ns=1_000, prompt_ns=2_000, eval_ns=3_000)

WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_current_weather",
        "description": "Get the current weather for a location",
        "parameters": {
            "type": "object",
            "properties": {"location": {"type": "string", "description": "The location, e.g. San Francisco, CA"}},
            "required": ["location"],
        },
    },
}


def chat(body: dict) -> Request:
    return oll.chat_to_internal(decode_body(json.dumps(body).encode(), oll.ChatRequest))


def generate(body: dict) -> Request:
    return oll.generate_to_internal(decode_body(json.dumps(body).encode(), oll.GenerateRequest))


def b64(raw: bytes) -> str:
    return base64.b64encode(raw).decode()


async def stream(*events: Event) -> AsyncIterator[Event]:
    for event in events:
        yield event


async def lines(encoder: Callable, *events: Event) -> list[bytes]:
    """The stream's lines as a client reads them (its chunks joined, split at newlines)."""
    return b"".join([chunk async for chunk in encoder(stream(*events), META)]).splitlines(keepends=True)


def parse(raw: Sequence[bytes]) -> list[dict]:
    assert all(line.endswith(b"\n") and line.count(b"\n") == 1 and line.strip() for line in raw)
    return [json.loads(line) for line in raw]
