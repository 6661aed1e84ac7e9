"""The floor for gateway overhead: a Litestar app that only decodes a chat request with msgspec and answers.

Run as ``python benchmarks/minimal_app.py PORT``; the benchmark measures its server CPU time per request.
"""

from __future__ import annotations

import sys
import time

import msgspec
import uvicorn
from litestar import Litestar, Request, Response, post


class Message(msgspec.Struct):
    role: str
    content: str


class Chat(msgspec.Struct):
    model: str
    messages: list[Message]
    stream: bool = False


ANSWER = {
    "object": "chat.completion",
    "choices": [
        {
            "index": 0,
            "message": {"role": "assistant", "content": "Hello, world"},
            "finish_reason": "stop",
            "logprobs": None,
        }
    ],
    "usage": {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9},
}


@post("/v1/chat/completions", status_code=200)
async def chat(request: Request) -> Response[bytes]:
    body = msgspec.json.decode(await request.body(), type=Chat)
    answer = {"id": "chatcmpl-1", "created": int(time.time()), "model": body.model, **ANSWER}
    return Response(msgspec.json.encode(answer), media_type="application/json")


if __name__ == "__main__":
    uvicorn.run(Litestar([chat]), host="127.0.0.1", port=int(sys.argv[1]), log_level="warning", access_log=False)
