"""Hostile and careless requests against a real gateway and the real model (issue 15, items 1, 2 and 6).

One request must never take the llama.cpp runner down (a NUL inside a grammar-constrained literal used to abort it:
"Unexpected empty grammar stack"), output is bounded by ``MESHGATE_MAX_TOKENS`` (16 here: small, so the tests
that generate up to it stay short) in each protocol's way, and malformed values are 400s in the protocol's
envelope, never 500s or a runner that fails to load.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator

import httpx
import pytest

from tests.conftest import MODEL, Server

LONG = "Count from one to one thousand, one number per line."
LIMIT = 16


@pytest.fixture(scope="module")
def server(data_dir) -> Iterator[Server]:
    s = Server(data_dir, "--n-ctx", "2048", env={"MESHGATE_MAX_TOKENS": str(LIMIT)})
    yield s
    s.stop()


def post(server: Server, path: str, body: dict, timeout: float = 120) -> httpx.Response:
    return httpx.post(f"{server.url}{path}", json=body, timeout=timeout)


def runner_pids(server: Server) -> list[int]:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if pids := server.children():
            return pids
        time.sleep(0.1)
    raise AssertionError("no runner process")


@pytest.fixture
def runner(server: Server) -> Iterator[list[int]]:
    """The runner's pid before the test, checked to be the same, alive, after it (nothing re-placed)."""
    post(server, "/api/generate", {"model": MODEL, "prompt": "", "stream": False})
    before = runner_pids(server)
    yield before
    assert server.children() == before, "the runner died or the model was re-placed"
    instances = httpx.get(f"{server.url}/instances", timeout=10).json()
    assert [i["state"]["state"] for i in instances] == ["ready"] and instances[0]["attempts"] == 0
    assert [r["pid"] for r in instances[0]["runners"].values()] == before


# ------------------------------------------------------------------------------------- item 1: grammar literals


def test_nul_in_a_forced_tool_name_is_refused_in_every_protocol(server, runner):
    """A tool name with a NUL breaks every protocol's naming rule: a 400 in its envelope, and the runner lives."""
    schema = {"type": "object", "properties": {}}
    ask = [{"role": "user", "content": "Call the tool."}]
    bodies = {
        "/v1/chat/completions": {
            "model": MODEL,
            "messages": ask,
            "tools": [{"type": "function", "function": {"name": "x\u0000", "parameters": schema}}],
            "tool_choice": "required",
        },
        "/v1/messages": {
            "model": MODEL,
            "max_tokens": LIMIT,
            "messages": ask,
            "tools": [{"name": "x\u0000", "input_schema": schema}],
            "tool_choice": {"type": "any"},
        },
        "/api/chat": {
            "model": MODEL,
            "messages": ask,
            "stream": False,
            "tools": [{"type": "function", "function": {"name": "x\u0000", "parameters": schema}}],
        },
    }
    for path, body in bodies.items():
        r = post(server, path, body)
        assert r.status_code == 400, (path, r.text)
        error = r.json()["error"]
        message = error if isinstance(error, str) else error["message"]
        assert "x\\u0000" in message, (path, message)


def test_nul_in_an_ollama_format_enum_is_answered(server, runner):
    r = post(
        server,
        "/api/generate",
        {
            "model": MODEL,
            "prompt": "Pick one.",
            "stream": False,
            "format": {"enum": ["\u0000", "a\\b"]},
            "options": {"temperature": 0},
        },
    )
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["response"]) in ("\u0000", "a\\b")


def test_a_grammar_beside_free_text_holds_its_request_and_leaves_the_other_alone(server, runner):
    """A pattern that wants a NUL (which the old GBNF grammar asked for raw, so no token matched and the request
    failed): the answer holds it as the JSON escape, and the free-text request beside it on the same runner goes on
    to its end (the constrained one is sent once the other has streamed its first token)."""
    beside: dict = {"lines": []}
    generating = threading.Event()

    def stream_beside() -> None:
        try:
            with httpx.stream(
                "POST",
                f"{server.url}/api/generate",
                timeout=120,
                json={"model": MODEL, "prompt": LONG, "options": {"num_predict": LIMIT, "temperature": 0}},
            ) as r:
                for line in r.iter_lines():
                    if line:
                        beside["lines"].append(json.loads(line))
                        generating.set()
        finally:
            generating.set()

    thread = threading.Thread(target=stream_beside)
    thread.start()
    assert generating.wait(120), "the stream beside never started"
    r = post(
        server,
        "/api/generate",
        {
            "model": MODEL,
            "prompt": "Say a then b.",
            "stream": False,
            "format": {"type": "string", "pattern": "^a\u0000b$"},
        },
    )
    thread.join(120)
    assert r.status_code == 200, r.text
    assert json.loads(r.json()["response"]) == "a\u0000b"
    last = beside["lines"][-1]
    assert last["done"] is True and last["eval_count"] == LIMIT and "error" not in last


@pytest.mark.parametrize(
    ("schema", "words"),
    [
        ({"type": "string", "not": {"const": "x"}}, "the keyword 'not' is not supported"),
        ({"type": "array", "uniqueItems": True}, "the keyword 'uniqueItems' is not supported"),
        ({"type": "string", "pattern": "^(?=a)a$"}, "'pattern' uses look-around"),
        ({"type": "string", "format": "idn-email"}, "the format 'idn-email' is not supported"),
    ],
)
def test_schemas_the_grammar_cannot_enforce_are_400s_naming_the_keyword(server, runner, schema, words):
    r = post(
        server,
        "/v1/messages",
        {
            "model": MODEL,
            "max_tokens": LIMIT,
            "messages": [{"role": "user", "content": "Go."}],
            "tools": [{"name": "t", "input_schema": {"type": "object", "properties": {"v": schema}}}],
            "tool_choice": {"type": "any"},
        },
    )
    assert r.status_code == 400, r.text
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert words in body["error"]["message"] and "(at /properties/v" in body["error"]["message"]


# ------------------------------------------------------------------------------------- item 2: bounded output


def test_openai_refuses_max_tokens_above_the_limit(server, runner):
    for field, value in (("max_tokens", 2**70), ("max_completion_tokens", LIMIT + 1)):
        r = post(
            server,
            "/v1/chat/completions",
            {"model": MODEL, field: value, "messages": [{"role": "user", "content": "Hi"}]},
        )
        assert r.status_code == 400, r.text
        error = r.json()["error"]
        assert error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
        assert error["message"] == (
            f"max_tokens is too large: {value}. This model supports at most {LIMIT} "
            f"completion tokens, whereas you provided {value}."
        )


def test_openai_without_a_limit_stops_at_the_setting(server, runner):
    r = post(
        server,
        "/v1/chat/completions",
        {"model": MODEL, "temperature": 0, "messages": [{"role": "user", "content": LONG}]},
    )
    assert r.status_code == 200
    assert r.json()["usage"]["completion_tokens"] <= LIMIT


def test_anthropic_refuses_absurd_max_tokens_in_its_words(server, runner):
    r = post(
        server, "/v1/messages", {"model": MODEL, "max_tokens": 2**70, "messages": [{"role": "user", "content": "Hi"}]}
    )
    assert r.status_code == 400, r.text
    assert r.json() == {
        "type": "error",
        "error": {
            "type": "invalid_request_error",
            "message": (
                f"max_tokens: {2**70} > {LIMIT}, which is the maximum allowed number of output tokens for {MODEL}"
            ),
        },
    }
    ok = post(
        server,
        "/v1/messages",
        {"model": MODEL, "max_tokens": LIMIT, "temperature": 0, "messages": [{"role": "user", "content": LONG}]},
    )
    assert ok.status_code == 200 and ok.json()["usage"]["output_tokens"] <= LIMIT


@pytest.mark.parametrize("num_predict", [2**70, -1, 0])
def test_ollama_num_predict_is_cut_to_the_setting(server, runner, num_predict):
    r = post(
        server,
        "/api/generate",
        {"model": MODEL, "prompt": LONG, "stream": False, "options": {"num_predict": num_predict, "temperature": 0}},
    )
    assert r.status_code == 200, r.text
    assert r.json()["eval_count"] == LIMIT and r.json()["done_reason"] == "length"


# ------------------------------------------------------------------------------------- item 6: no 500s


def test_num_ctx_out_of_range_is_a_400_and_the_model_stays(server, runner):
    for value in (-1, 0):
        r = post(
            server,
            "/api/chat",
            {
                "model": MODEL,
                "stream": False,
                "options": {"num_ctx": value},
                "messages": [{"role": "user", "content": "Hi"}],
            },
        )
        assert r.status_code == 400 and "options.num_ctx" in r.json()["error"]


@pytest.mark.parametrize(
    ("path", "options"),
    [("/api/generate", {"temperature": -1}), ("/api/generate", {"top_p": 2}), ("/api/chat", {"top_k": -1})],
)
def test_ollama_options_out_of_range_are_400s(server, path, options):
    body = {"model": MODEL, "stream": False, "options": options}
    body.update({"prompt": "Hi"} if path == "/api/generate" else {"messages": [{"role": "user", "content": "Hi"}]})
    r = post(server, path, body)
    assert r.status_code == 400 and f"options.{next(iter(options))}" in r.json()["error"]


@pytest.mark.parametrize(("field", "value"), [("temperature", 1.5), ("top_p", -0.5), ("top_k", -1)])
def test_anthropic_sampling_out_of_range_is_a_400(server, field, value):
    r = post(
        server,
        "/v1/messages",
        {"model": MODEL, "max_tokens": 5, field: value, "messages": [{"role": "user", "content": "Hi"}]},
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert f"$.{field}" in r.json()["error"]["message"]


def deep(depth: int) -> object:
    return json.loads("[" * depth + "]" * depth)


@pytest.mark.parametrize("depth", [200, 990])
def test_deeply_nested_json_is_a_400_in_each_protocol(server, depth):
    raw = "[" * depth + "]" * depth
    openai_body = (
        '{"model": "%s", "messages": [{"role": "user", "content": "Hi"}], "tools": [{"type": "function", '
        '"function": {"name": "t", "parameters": {"type": "object", "x": %s}}}]}' % (MODEL, raw)
    )
    r = httpx.post(
        f"{server.url}/v1/chat/completions",
        content=openai_body,
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "nests JSON" in r.json()["error"]["message"]
    anthropic_body = (
        '{"model": "%s", "max_tokens": 5, "messages": [{"role": "user", "content": "Hi"}], '
        '"metadata": {"x": %s}}' % (MODEL, raw)
    )
    r = httpx.post(
        f"{server.url}/v1/messages", content=anthropic_body, timeout=30, headers={"content-type": "application/json"}
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    ollama_body = '{"model": "%s", "prompt": "Hi", "stream": false, "format": {"x": %s}}' % (MODEL, raw)
    r = httpx.post(f"{server.url}/api/generate", content=ollama_body, timeout=30)
    assert r.status_code == 400 and "nests JSON" in r.json()["error"]


def test_deeply_nested_json_in_a_body_litestar_decodes_is_a_400(server):
    raw = "[" * 5000 + "]" * 5000
    r = httpx.post(
        f"{server.url}/instances",
        content='{"model": "%s", "x": %s}' % (MODEL, raw),
        timeout=30,
        headers={"content-type": "application/json"},
    )
    assert r.status_code == 400 and "nests JSON too deeply" in r.json()["error"]["message"]


def test_events_since_that_is_no_event_id_is_a_400(server):
    r = httpx.get(f"{server.url}/events", params={"since": "abc"}, timeout=10)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "since" and r.json()["error"]["type"] == "invalid_request_error"
    events = httpx.get(f"{server.url}/events", timeout=10).json()
    assert (
        events and httpx.get(f"{server.url}/events", params={"since": events[0]["id"]}, timeout=10).status_code == 200
    )
