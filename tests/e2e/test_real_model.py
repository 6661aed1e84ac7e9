"""The official openai, anthropic and ollama clients against a real gateway serving the real Gemma 3 270M GGUF."""

from __future__ import annotations

import json

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import MODEL

PROMPT = "Write one sentence about the sea."


# ------------------------------------------------------------------------------------------------- openai


def test_openai_chat_not_streamed(oai):
    completion = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_tokens=8, temperature=0
    )
    choice = completion.choices[0]
    assert choice.message.role == "assistant"
    assert choice.message.content and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    assert completion.usage.prompt_tokens > 5
    assert 0 < completion.usage.completion_tokens <= 8
    assert completion.model == MODEL


def test_openai_chat_streamed_with_usage(oai):
    stream = oai.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text.strip()
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"


def test_openai_stream_and_plain_agree_at_temperature_zero(oai):
    kwargs = {"model": MODEL, "messages": [{"role": "user", "content": PROMPT}], "max_tokens": 12, "temperature": 0}
    plain = oai.chat.completions.create(**kwargs).choices[0].message.content
    streamed = "".join(
        c.choices[0].delta.content or "" for c in oai.chat.completions.create(**kwargs, stream=True) if c.choices
    )
    assert plain == streamed


def test_openai_max_tokens_gives_length(oai):
    completion = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], max_completion_tokens=3, temperature=0
    )
    assert completion.choices[0].finish_reason == "length"
    assert completion.usage.completion_tokens == 3


def test_openai_lists_the_model(oai):
    assert MODEL in [m.id for m in oai.models.list()]


def test_openai_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["message"] == "The model `no-such-model` does not exist or you do not have access to it."
    assert exc.value.body["type"] == "invalid_request_error"


def test_openai_missing_field_is_400_naming_it(real_server):
    r = httpx.post(f"{real_server.url}/v1/chat/completions", json={"model": MODEL})
    assert r.status_code == 400
    error = r.json()["error"]
    assert "`messages`" in error["message"] and error["param"] == "messages"
    assert error["type"] == "invalid_request_error"


def test_openai_malformed_json_is_400(real_server):
    r = httpx.post(
        f"{real_server.url}/v1/chat/completions", content=b'{"model": ', headers={"content-type": "application/json"}
    )
    assert r.status_code == 400
    assert "not valid JSON" in r.json()["error"]["message"]


# ------------------------------------------------------------------------------------------------- anthropic


def test_anthropic_message_not_streamed(ant):
    message = ant.messages.create(
        model=MODEL,
        max_tokens=8,
        extra_body={"temperature": 0},
        system="You are terse.",
        messages=[{"role": "user", "content": PROMPT}],
    )
    assert message.type == "message" and message.role == "assistant"
    assert message.content[0].type == "text" and message.content[0].text.strip()
    assert message.stop_reason in ("end_turn", "max_tokens")
    assert message.usage.input_tokens > 5 and 0 < message.usage.output_tokens <= 8


def test_anthropic_message_streamed(ant):
    with ant.messages.stream(
        model=MODEL, max_tokens=8, extra_body={"temperature": 0}, messages=[{"role": "user", "content": PROMPT}]
    ) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text.strip() and final.content[0].text == text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 8 and final.usage.input_tokens > 5


def test_anthropic_unknown_model_is_404(ant):
    with pytest.raises(anthropic.NotFoundError) as exc:
        ant.messages.create(model="no-such-model", max_tokens=5, messages=[{"role": "user", "content": "hi"}])
    assert exc.value.body["error"]["type"] == "not_found_error"
    assert exc.value.body["type"] == "error"


def test_anthropic_missing_max_tokens_is_400_naming_it(real_server):
    r = httpx.post(
        f"{real_server.url}/v1/messages", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]}
    )
    assert r.status_code == 400
    body = r.json()
    assert body["type"] == "error" and body["error"]["type"] == "invalid_request_error"
    assert "`max_tokens`" in body["error"]["message"]


def test_anthropic_malformed_json_is_400(real_server):
    r = httpx.post(f"{real_server.url}/v1/messages", content=b"{]", headers={"content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"


# ------------------------------------------------------------------------------------------------- ollama


def test_ollama_chat_not_streamed(oll):
    response = oll.chat(
        model=MODEL, messages=[{"role": "user", "content": PROMPT}], options={"num_predict": 8, "temperature": 0}
    )
    assert response.message.role == "assistant" and response.message.content.strip()
    assert response.done and response.done_reason in ("stop", "length")
    assert response.prompt_eval_count > 5 and 0 < response.eval_count <= 8
    assert response.eval_duration > 0 and response.total_duration >= response.eval_duration


def test_ollama_chat_streamed(oll):
    parts = list(
        oll.chat(
            model=MODEL,
            messages=[{"role": "user", "content": PROMPT}],
            stream=True,
            options={"num_predict": 10, "temperature": 0},
        )
    )
    assert "".join(p.message.content for p in parts).strip()
    assert [p.done for p in parts].count(True) == 1 and parts[-1].done
    assert parts[-1].done_reason == "length" and parts[-1].eval_count == 10


def test_ollama_generate_both_ways(oll):
    plain = oll.generate(model=MODEL, prompt="The capital of France is", options={"num_predict": 8, "temperature": 0})
    assert plain.response.strip() and plain.done_reason == "length"
    streamed = list(
        oll.generate(
            model=MODEL, prompt="The capital of France is", stream=True, options={"num_predict": 8, "temperature": 0}
        )
    )
    assert "".join(p.response for p in streamed) == plain.response


def test_ollama_streams_by_default_as_ndjson(real_server):
    with httpx.stream(
        "POST",
        f"{real_server.url}/api/generate",
        json={"model": MODEL, "prompt": "Hello", "options": {"num_predict": 3, "temperature": 0}},
    ) as r:
        assert r.headers["content-type"].startswith("application/x-ndjson")
        lines = [json.loads(line) for line in r.iter_lines()]
    # the 3 tokens come in 1 to 3 lines (a runner sends what it decoded within its stream interval together)
    assert 2 <= len(lines) <= 4 and not any(line["done"] for line in lines[:-1])
    assert "".join(line["response"] for line in lines)
    assert lines[-1]["done"] and lines[-1]["done_reason"] == "length" and lines[-1]["eval_count"] == 3


def test_ollama_tags_version_and_root(oll, real_server):
    assert MODEL in [m.model for m in oll.list().models]
    assert httpx.get(f"{real_server.url}/api/version").json()["version"]
    assert httpx.get(f"{real_server.url}/").text == "Ollama is running"
    assert httpx.head(f"{real_server.url}/").status_code == 200


def test_ollama_unknown_model_is_404(oll):
    with pytest.raises(ollama.ResponseError) as exc:
        oll.chat(model="no-such-model", messages=[{"role": "user", "content": "hi"}])
    assert exc.value.status_code == 404 and exc.value.error == "model 'no-such-model' not found"


def test_ollama_missing_field_is_400_naming_it(real_server):
    r = httpx.post(f"{real_server.url}/api/chat", json={"messages": []})
    assert r.status_code == 400 and "`model`" in r.json()["error"]


def test_ollama_malformed_json_is_400(real_server):
    r = httpx.post(f"{real_server.url}/api/chat", content=b"not json")
    assert r.status_code == 400 and "not valid JSON" in r.json()["error"]


def test_system_prompt_reaches_the_model(oai):
    """Gemma has no system role; the system text must still change the prompt the model reads."""
    base = [{"role": "user", "content": "Hi"}]
    without = oai.chat.completions.create(model=MODEL, messages=base, max_tokens=1).usage.prompt_tokens
    with_system = oai.chat.completions.create(
        model=MODEL, messages=[{"role": "system", "content": "Answer in French."}, *base], max_tokens=1
    )
    assert with_system.usage.prompt_tokens > without + 3
