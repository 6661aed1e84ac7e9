"""Tool names each protocol allows (issue step 15, part 4, item 1), driven by the official clients against the
scripted backend: OpenAI ``^[a-zA-Z0-9_-]{1,64}$``, Anthropic ``^[a-zA-Z0-9_-]{1,128}$`` (Claude Code's MCP names
such as ``mcp__server__tool`` fit), Ollama anything printable. A name that breaks the rule is a 400 in the
protocol's own error shape, naming the tool and the rule."""

from __future__ import annotations

import anthropic
import ollama
import openai
import pytest

SCHEMA = {"type": "object", "properties": {"city": {"type": "string"}}}


def _openai_tool(name: str) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": SCHEMA}}


@pytest.fixture(scope="module")
def oai(scripted_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def ant(scripted_server) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=scripted_server.url, api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oll(scripted_server) -> ollama.Client:
    return ollama.Client(host=scripted_server.url)


def test_openai_refuses_a_name_outside_its_pattern(oai):
    ask = [{"role": "user", "content": "hello"}]
    for name, why in (("x\u0000", '"x\\u0000" does not match'), ("a" * 65, "has 65 characters")):
        with pytest.raises(openai.BadRequestError) as exc:
            oai.chat.completions.create(model="scripted", messages=ask, tools=[_openai_tool("ok"), _openai_tool(name)])
        error = exc.value.body
        assert error["type"] == "invalid_request_error" and error["param"] == "tools[1].function.name"
        assert why in error["message"] and "^[a-zA-Z0-9_-]{1,64}$" in error["message"], error
    answer = oai.chat.completions.create(model="scripted", messages=ask, tools=[_openai_tool("a-b_" + "c" * 60)])
    assert answer.choices[0].message.content == "Hello, world"

    with pytest.raises(openai.BadRequestError) as exc:  # the Responses API holds function names to the same rule
        oai.responses.create(
            model="scripted", input="hello", tools=[{"type": "function", "name": "x\u0000", "parameters": SCHEMA}]
        )
    assert exc.value.body["param"] == "tools[0].name" and "^[a-zA-Z0-9_-]{1,64}$" in exc.value.body["message"]


def test_anthropic_refuses_a_name_outside_its_pattern_and_takes_mcp_names(ant):
    ask = [{"role": "user", "content": "hello"}]
    with pytest.raises(anthropic.BadRequestError) as exc:
        ant.messages.create(
            model="scripted", max_tokens=16, messages=ask, tools=[{"name": "x\u0000", "input_schema": SCHEMA}]
        )
    body = exc.value.body
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert '"x\\u0000"' in body["error"]["message"] and "^[a-zA-Z0-9_-]{1,128}$" in body["error"]["message"]
    for name in ("mcp__claude-in-chrome__read_page", "t" * 128):  # too long for OpenAI, not for Anthropic
        answer = ant.messages.create(
            model="scripted", max_tokens=16, messages=ask, tools=[{"name": name, "input_schema": SCHEMA}]
        )
        assert answer.content[0].text == "Hello, world"
    with pytest.raises(anthropic.BadRequestError) as exc:
        ant.messages.create(
            model="scripted", max_tokens=16, messages=ask, tools=[{"name": "t" * 129, "input_schema": SCHEMA}]
        )
    assert "has 129 characters" in exc.value.body["error"]["message"]


def test_ollama_takes_printable_names_and_refuses_control_characters(oll):
    ask = [{"role": "user", "content": "hello"}]
    answer = oll.chat(model="scripted", messages=ask, tools=[_openai_tool("weather.get now")])  # Ollama checks nothing
    assert answer.message.content == "Hello, world"
    with pytest.raises(ollama.ResponseError) as exc:
        oll.chat(model="scripted", messages=ask, tools=[_openai_tool("x\u0000")])
    assert exc.value.status_code == 400
    assert exc.value.error.startswith('tools[0].function.name: the tool name "x\\u0000" holds a control character')
