"""Exact wire bytes through a real gateway, from the scripted backend (event order, indexes, ids, usage).

The scripted backend is loaded as a plugin (``--plugin tests.scripted_plugin``); the last user message picks
the script (see ``tests/scripted_plugin.py``).
"""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest


def sse_events(raw: str) -> list[tuple[str | None, str]]:
    """(event name, data) for each SSE frame; comments are kept as ("comment", text)."""
    frames = []
    for block in raw.replace("\r\n", "\n").split("\n\n"):
        if not block.strip():
            continue
        name, data = None, []
        for line in block.split("\n"):
            if line.startswith(":"):
                frames.append(("comment", line[1:].strip()))
            elif line.startswith("event: "):
                name = line[7:]
            elif line.startswith("data: "):
                data.append(line[6:])
        if data:
            frames.append((name, "\n".join(data)))
    return frames


def post_stream(server, path: str, body: dict) -> tuple[httpx.Response, str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=10) as r:
        return r, r.read().decode()


def chat(script: str, **extra) -> dict:
    return {"model": "scripted", "messages": [{"role": "user", "content": script}], **extra}


# ------------------------------------------------------------------------------------------------- openai


def test_openai_stream_exact_chunks(scripted_server):
    r, raw = post_stream(
        scripted_server, "/v1/chat/completions", chat("hello", stream=True, stream_options={"include_usage": True})
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    frames = sse_events(raw)
    assert all(name is None for name, _ in frames), "OAI-41: no event: lines"
    assert frames[-1] == (None, "[DONE]")
    chunks = [json.loads(data) for _, data in frames[:-1]]
    assert len({c["id"] for c in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert [c["choices"][0]["delta"] for c in chunks[:-1]] == [
        {"role": "assistant", "content": "Hello"},
        {"content": ", world"},
        {},
    ]
    assert chunks[-2]["choices"][0]["finish_reason"] == "stop"
    assert chunks[-1]["choices"] == []
    assert chunks[-1]["usage"] == {"prompt_tokens": 7, "completion_tokens": 2, "total_tokens": 9}


def test_openai_tool_call_stream_through_the_sdk_helper(scripted_server):
    client = openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="x", max_retries=0)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    with client.chat.completions.stream(
        model="scripted", messages=[{"role": "user", "content": "tool"}], tools=tools
    ) as stream:
        final = stream.get_final_completion()
    call = final.choices[0].message.tool_calls[0]
    assert (call.id, call.function.name) == ("call_abc", "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert final.choices[0].finish_reason == "tool_calls"


def test_openai_midstream_failure_is_an_error_frame(scripted_server):
    client = openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="x", max_retries=0)
    stream = client.chat.completions.create(
        model="scripted", messages=[{"role": "user", "content": "fail"}], stream=True
    )
    with pytest.raises(openai.APIError) as exc:
        list(stream)
    assert "runner lost" in exc.value.message


def test_openai_failure_before_first_event_is_a_status(scripted_server):
    r = httpx.post(f"{scripted_server.url}/v1/chat/completions", json=chat("failfirst", stream=True))
    assert r.status_code == 503 and r.json()["error"]["message"] == "no node has room for this model"


def test_openai_keepalive_is_a_comment(scripted_server):
    _, raw = post_stream(scripted_server, "/v1/chat/completions", chat("keepalive", stream=True))
    assert sse_events(raw)[0][0] == "comment"


# ------------------------------------------------------------------------------------------------- anthropic


def test_anthropic_stream_exact_events(scripted_server):
    r, raw = post_stream(scripted_server, "/v1/messages", chat("think", max_tokens=50, stream=True))
    frames = sse_events(raw)
    names = [name for name, _ in frames]
    assert names == [
        "message_start",
        "content_block_start",
        "content_block_delta",
        "content_block_delta",
        "content_block_stop",
        "content_block_start",
        "content_block_delta",
        "content_block_stop",
        "message_delta",
        "message_stop",
    ]
    payloads = [json.loads(data) for _, data in frames]
    assert all(p["type"] == name for (name, _), p in zip(frames, payloads, strict=True))
    start = payloads[0]["message"]
    assert start["usage"]["input_tokens"] == 4 and start["content"] == [] and start["stop_reason"] is None
    assert payloads[1] == {
        "type": "content_block_start",
        "index": 0,
        "content_block": {"type": "thinking", "thinking": "", "signature": ""},
    }
    assert payloads[3]["delta"]["type"] == "signature_delta"
    assert [p["index"] for p in payloads[1:8]] == [0, 0, 0, 0, 1, 1, 1]
    assert payloads[8]["delta"] == {"stop_reason": "end_turn", "stop_sequence": None}
    assert payloads[8]["usage"]["output_tokens"] == 5


def test_anthropic_tool_use_stream_through_the_sdk(scripted_server):
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0)
    with client.messages.stream(
        model="scripted",
        max_tokens=50,
        messages=[{"role": "user", "content": "tool"}],
        tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
    ) as stream:
        final = stream.get_final_message()
    block = final.content[0]
    assert block.type == "tool_use" and block.name == "get_weather" and block.input == {"city": "Paris"}
    assert final.stop_reason == "tool_use"


def test_anthropic_stop_sequence_is_reported(scripted_server):
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0)
    message = client.messages.create(
        model="scripted", max_tokens=50, stop_sequences=["three"], messages=[{"role": "user", "content": "stopseq"}]
    )
    assert (message.stop_reason, message.stop_sequence) == ("stop_sequence", "three")


def test_anthropic_midstream_failure_is_an_error_event(scripted_server):
    r, raw = post_stream(scripted_server, "/v1/messages", chat("fail", max_tokens=50, stream=True))
    name, data = sse_events(raw)[-1]
    assert name == "error"
    assert json.loads(data) == {"type": "error", "error": {"type": "overloaded_error", "message": "runner lost"}}


def test_anthropic_keepalive_is_a_ping_after_message_start(scripted_server):
    _, raw = post_stream(scripted_server, "/v1/messages", chat("keepalive", max_tokens=5, stream=True))
    names = [n for n, _ in sse_events(raw)]
    assert names[:2] == ["message_start", "ping"]


def test_anthropic_max_tokens_gives_max_tokens(scripted_server):
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0)
    message = client.messages.create(model="scripted", max_tokens=1, messages=[{"role": "user", "content": "length"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 1


# ------------------------------------------------------------------------------------------------- ollama


def test_ollama_stream_exact_lines(scripted_server):
    r, raw = post_stream(scripted_server, "/api/chat", chat("hello"))
    assert r.headers["content-type"].startswith("application/x-ndjson")
    assert raw.endswith("\n") and "\n\n" not in raw
    lines = [json.loads(line) for line in raw.splitlines()]
    assert [line["message"]["content"] for line in lines] == ["Hello", ", world", ""]
    assert [line["done"] for line in lines] == [False, False, True]
    final = lines[-1]
    assert final["done_reason"] == "stop" and final["prompt_eval_count"] == 7 and final["eval_count"] == 2
    for key in ("total_duration", "load_duration", "prompt_eval_duration", "eval_duration"):
        assert isinstance(final[key], int)


def test_ollama_tool_call_arrives_whole(scripted_server):
    client = ollama.Client(host=scripted_server.url)
    parts = list(client.chat(model="scripted", messages=[{"role": "user", "content": "tool"}], stream=True))
    calls = [c for p in parts for c in (p.message.tool_calls or [])]
    assert len(calls) == 1 and calls[0].function.name == "get_weather"
    assert calls[0].function.arguments == {"city": "Paris"}
    assert parts[-1].done_reason == "stop"


def test_ollama_midstream_failure_is_an_error_line(scripted_server):
    client = ollama.Client(host=scripted_server.url)
    with pytest.raises(ollama.ResponseError) as exc:
        list(client.chat(model="scripted", messages=[{"role": "user", "content": "fail"}], stream=True))
    assert exc.value.status_code == -1 and exc.value.error == "runner lost"


def test_ollama_length_gives_done_reason_length(scripted_server):
    response = ollama.Client(host=scripted_server.url).generate(model="scripted", prompt="length")
    assert response.done_reason == "length" and response.response == "cut"


def test_unknown_route_gets_the_path_protocols_error(scripted_server):
    r = httpx.get(f"{scripted_server.url}/api/nothing")
    assert r.status_code == 404 and isinstance(r.json()["error"], str)
    r = httpx.get(f"{scripted_server.url}/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error"


def test_oai_8_model_ids_with_slash_and_colon(scripted_server):
    client = openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="x", max_retries=0)
    assert client.models.retrieve("acme/scripted:v1").id == "acme/scripted:v1"  # the 3.x SDK sends %2F
    raw = httpx.get(f"{scripted_server.url}/v1/models/acme/scripted:v1").json()
    assert raw == {"id": "acme/scripted:v1", "object": "model", "created": 1700000000, "owned_by": "meshgate"}
    assert (
        client.chat.completions.create(model="acme/scripted:v1", messages=[{"role": "user", "content": "hello"}])
        .choices[0]
        .message.content
        == "Hello, world"
    )


def test_oai_7_paths_without_the_v1_prefix(scripted_server):
    client = openai.OpenAI(base_url=scripted_server.url, api_key="x", max_retries=0)
    assert (
        client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hello"}])
        .choices[0]
        .message.content
        == "Hello, world"
    )
    assert "scripted" in [m.id for m in client.models.list()]


def test_oll_8_think_true_is_served_where_the_model_can_think(scripted_server):
    """The scripted backend declares reasoning: ``think: true`` reaches it (the real model's 400 is in
    test_ollama_api)."""
    answer = ollama.Client(host=scripted_server.url).chat(
        model="scripted", messages=[{"role": "user", "content": "think"}], think=True
    )
    assert answer.message.thinking and answer.done
