"""The Messages API as Claude-style clients use it, through the current anthropic SDK against real servers."""

from __future__ import annotations

import anthropic
import httpx
import pytest

from tests.conftest import MODEL

TOOLS = [
    {
        "name": name,
        "description": f"The {name} tool.",
        "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]},
        **({"cache_control": {"type": "ephemeral"}} if i == 11 else {}),
    }
    for i, name in enumerate(
        [
            "Read",
            "Write",
            "Edit",
            "Glob",
            "Grep",
            "Bash",
            "LS",
            "WebFetch",
            "TodoWrite",
            "NotebookEdit",
            "Task",
            "get_weather",
        ]
    )
]


def coding_tool_request(last: str) -> dict:
    """Shaped like a Claude coding tool's turn: billing header + system blocks with cache_control, a dozen
    tools, an earlier tool_use answered by a tool_result, metadata, a beta header."""
    return {
        "model": "scripted",
        "max_tokens": 1024,
        "stream": True,
        "system": [
            {"type": "text", "text": "x-anthropic-billing-header: cc_version=2.0; cch=abc;"},
            {"type": "text", "text": "You are a coding assistant.", "cache_control": {"type": "ephemeral"}},
        ],
        "tools": TOOLS,
        "tool_choice": {"type": "auto"},
        "metadata": {"user_id": "user_1"},
        "messages": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "Read main.py", "cache_control": {"type": "ephemeral"}}],
            },
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Reading it."},
                    {"type": "tool_use", "id": "toolu_01", "name": "Read", "input": {"path": "main.py"}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": "toolu_01",
                        "content": [{"type": "text", "text": "print('hi')"}],
                    },
                    {"type": "text", "text": last},
                ],
            },
        ],
    }


def test_a_claude_coding_tool_turn_streams_a_tool_use(scripted_server):
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0)
    body = coding_tool_request("tool")
    with client.messages.stream(
        **{k: v for k, v in body.items() if k != "stream"},
        extra_headers={"anthropic-beta": "prompt-caching-2024-07-31,unknown-beta"},
    ) as s:
        events = [e.type for e in s]
        final = s.get_final_message()
    assert events[0] == "message_start" and events[-1] == "message_stop"
    block = final.content[0]
    assert (block.type, block.name, block.input) == ("tool_use", "get_weather", {"city": "Paris"})
    assert final.stop_reason == "tool_use" and final.usage.input_tokens == 11


def test_ant_12_system_role_inside_messages_is_accepted(scripted_server):
    r = httpx.post(
        f"{scripted_server.url}/v1/messages",
        json={
            "model": "scripted",
            "max_tokens": 5,
            "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}],
        },
    )
    assert r.status_code == 200 and r.json()["content"][0]["text"] == "Hello, world"


def test_ant_19_thinking_is_ignored_by_a_model_without_reasoning(real_server):
    client = anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=2048,
        thinking={"type": "enabled", "budget_tokens": 1024},
        messages=[{"role": "user", "content": "Hi"}],
        extra_body={"max_tokens": 8},
    )
    assert [b.type for b in message.content] == ["text"]


def test_ant_16_top_k_top_p_and_stop_sequences_with_the_real_model(real_server):
    client = anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0)
    message = client.messages.create(
        model=MODEL,
        max_tokens=40,
        stop_sequences=[" 2"],  # greedy, it writes "Model: 1\nModel: 2": the stop comes at token 9, not 39 (" 8")
        messages=[{"role": "user", "content": "Count: 1, 2, 3, 4, 5, 6,"}],
        extra_body={"temperature": 0, "top_k": 1, "top_p": 0.9},
    )
    if message.stop_reason == "stop_sequence":
        assert message.stop_sequence == " 2" and " 2" not in message.content[0].text
    else:
        assert message.stop_reason in ("end_turn", "max_tokens") and message.stop_sequence is None


def test_ant_4_52_models_in_anthropics_shape(scripted_server):
    client = anthropic.Anthropic(base_url=scripted_server.url, api_key="x", max_retries=0)
    models = list(client.models.list())
    assert "scripted" in [m.id for m in models] and all(m.type == "model" for m in models)
    assert client.models.retrieve("acme/scripted:v1").id == "acme/scripted:v1"
    with pytest.raises(anthropic.NotFoundError):
        client.models.retrieve("nope")


def test_ant_6_both_auth_headers_when_keys_are_configured(data_dir):
    from tests.conftest import Server

    s = Server(
        data_dir, "--plugin", "tests.scripted_plugin", "--api-key", "k", env={"MESHGATE_DISABLED_PLUGINS": "llama_cpp"}
    )
    try:
        body = {"model": "scripted", "max_tokens": 5, "messages": [{"role": "user", "content": "hello"}]}
        for headers in ({"x-api-key": "k"}, {"authorization": "Bearer k"}):
            r = httpx.post(
                f"{s.url}/v1/messages?beta=true", json=body, headers={**headers, "anthropic-version": "2099-01-01"}
            )
            assert r.status_code == 200, headers
        r = httpx.post(f"{s.url}/v1/messages", json=body, headers={"x-api-key": "bad"})
        assert r.status_code == 401 and r.json()["error"]["type"] == "authentication_error"
    finally:
        s.stop()


def test_ant_3_50_51_count_tokens_with_the_models_tokenizer(real_server):
    client = anthropic.Anthropic(base_url=real_server.url, api_key="x", max_retries=0)
    plain = client.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "Hello there"}])
    with_system = client.messages.count_tokens(
        model=MODEL, system="You are a pirate. Answer like one.", messages=[{"role": "user", "content": "Hello there"}]
    )
    with_tools = client.messages.count_tokens(
        model=MODEL, messages=[{"role": "user", "content": "Hello there"}], tools=TOOLS[-1:]
    )
    assert 5 < plain.input_tokens < with_system.input_tokens and plain.input_tokens < with_tools.input_tokens
    created = client.messages.create(model=MODEL, max_tokens=1, messages=[{"role": "user", "content": "Hello there"}])
    assert created.usage.input_tokens == plain.input_tokens, "counted exactly as generation reads the prompt"
    r = httpx.post(
        f"{real_server.url}/v1/messages/count_tokens?beta=true",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hello there"}]},
        headers={"anthropic-beta": "token-counting-2024-11-01"},
    )
    assert r.json() == {"input_tokens": plain.input_tokens}
    with pytest.raises(anthropic.NotFoundError):
        client.messages.count_tokens(model="nope", messages=[{"role": "user", "content": "x"}])
