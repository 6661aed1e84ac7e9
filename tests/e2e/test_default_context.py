"""A gateway started with its defaults (no ``--n-ctx``) against the real Gemma 3 270M.

Open WebUI, connected as to an Ollama server, sends every chat from its page with its built-in tools (28 of them,
~21 KB of definitions): a prompt of ~5,200 tokens, more than the 4,096-token default context. A request that sets
no ``num_ctx`` gets a replica with the context it needs (here 8,192), beside the default one, whose many slots
keep serving short requests.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, Server

TOOL_KINDS = (
    ("search_web", "Search the public web for pages matching a query and return titles, links and snippets"),
    ("fetch_url", "Fetch a web page and return its readable text, without scripts, styles or navigation"),
    ("get_current_timestamp", "Get the current date and time in the user's timezone as an ISO 8601 string"),
    ("calculate_timestamp", "Add or subtract days, weeks or months to a date and return the resulting timestamp"),
    ("ask_user", "Ask the user a clarifying question and wait for the answer before going on"),
    ("execute_code", "Run a short Python program in a sandbox and return what it printed and its result"),
    ("search_memories", "Search the memories stored about the user for ones relevant to the conversation"),
    ("add_memory", "Store a new fact about the user that should be remembered in later conversations"),
)


def open_webui_like_tools(count: int = 28) -> list[dict]:
    """``count`` tool definitions shaped and sized like Open WebUI's built-in ones (~800 bytes each)."""
    tools = []
    for i in range(count):
        name, what = TOOL_KINDS[i % len(TOOL_KINDS)]
        tools.append(
            {
                "type": "function",
                "function": {
                    "name": f"{name}_{i}",
                    "description": f"{what}. Use it only when the user's request needs it; prefer answering "
                    f"directly otherwise. Results are returned as JSON and may be long. Call it at most once per turn, "
                    "with arguments that match its schema.",
                    "parameters": {
                        "type": "object",
                        "properties": {
                            "query": {"type": "string", "description": f"What to {name.replace('_', ' ')} for"},
                            "limit": {"type": "integer", "description": "The most results to return (1-50)"},
                            "page": {"type": "integer", "description": "Which page of results, from 1"},
                            "filter": {
                                "type": "string",
                                "description": "An optional filter: a tag, a folder name or a date range",
                            },
                        },
                        "required": ["query"],
                    },
                },
            }
        )
    return tools


@pytest.fixture(scope="module")
def default_server(data_dir: Path) -> Iterator[Server]:
    """A gateway as README starts it: no ``--n-ctx``, slots sized from memory."""
    server = Server(data_dir)
    yield server
    server.stop()


def _instances(server: Server) -> list[dict]:
    listed = httpx.get(f"{server.url}/instances").json()
    return [i for i in listed if i["model"] == MODEL and i["state"]["state"] == "ready"]


def _chat(server: Server, content: str, **extra) -> tuple[int, dict, float]:
    """Stream one Ollama /api/chat; (status, the last frame with the text joined into it, seconds to first text)."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], **extra}
    started, first, text, last = time.monotonic(), 0.0, "", {}
    with httpx.stream("POST", f"{server.url}/api/chat", json=body, timeout=600) as r:
        if r.status_code != 200:
            return r.status_code, json.loads(r.read()), 0.0
        for line in r.iter_lines():
            last = json.loads(line)
            piece = last.get("message", {}).get("content", "")
            if piece and not first:
                first = time.monotonic() - started
            text += piece
    return 200, {**last, "text": text}, first


def test_eight_short_requests_at_once_out_of_the_box(default_server):
    status, _, _ = _chat(default_server, "Hello", options={"num_predict": 1})  # places the model
    assert status == 200
    (instance,) = _instances(default_server)
    assert instance["placement"]["context"] == 4096
    assert instance["placement"]["sequences"] >= 8, instance["placement"]
    with ThreadPoolExecutor(8) as pool:
        results = list(
            pool.map(
                lambda i: _chat(default_server, f"Count to {i + 3}:", options={"num_predict": 16, "temperature": 0}),
                range(8),
            )
        )
    assert [status for status, _, _ in results] == [200] * 8
    assert all(frame["text"] and frame["eval_count"] >= 1 for _, frame, _ in results)
    firsts = sorted(first for _, _, first in results)
    print(f"8 concurrent short chats, {instance['placement']['sequences']} slots: first text after {firsts} s")
    placed = [(i["placement"]["context"], i.get("reason")) for i in _instances(default_server)]
    assert len(placed) == 1, placed  # short requests need no bigger replica


def test_open_webui_sized_prompt_gets_a_bigger_context(default_server):
    tools = open_webui_like_tools()
    assert 20_000 < len(json.dumps(tools)) < 24_000
    content = "What is the capital of France? Answer in one word."
    status, frame, first = _chat(default_server, content, tools=tools, options={"num_predict": 8, "temperature": 0})
    assert status == 200, frame
    assert frame["done"] and frame["prompt_eval_count"] > 4096, frame  # more than the default context holds
    assert frame["text"] or frame["message"].get("tool_calls"), frame
    contexts = sorted(i["placement"]["context"] for i in _instances(default_server))
    assert contexts == [4096, 8192], contexts  # the default replica stays for short requests
    print(f"{frame['prompt_eval_count']}-token prompt on an 8192 replica: first text after {first:.1f} s")
