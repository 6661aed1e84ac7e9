"""How many messages one request may hold (issue step 15, part 4, item 7): OpenAI's chat completions keep
OpenAI's own 2,048, in OpenAI's words; Anthropic, Ollama and the Responses API ``MAX_MESSAGES``. More is a 400
naming the bound, answered before any prompt is built: a chat of 100,000 empty messages ran 37-60 s."""

from __future__ import annotations

import time

import anthropic
import httpx
import ollama
import openai
import pytest

from meshgate.protocols.model import MAX_MESSAGES
from meshgate.protocols.openai import MAX_CHAT_MESSAGES


def _chat(count: int, last: str = "hello") -> list[dict]:
    return [{"role": "user", "content": ""} for _ in range(count - 1)] + [{"role": "user", "content": last}]


@pytest.fixture(scope="module")
def oai(scripted_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="unused", max_retries=0, timeout=60)


def test_openai_keeps_openais_bound_in_its_words(oai):
    assert oai.chat.completions.create(model="scripted", messages=_chat(MAX_CHAT_MESSAGES)).choices[0].message.content
    with pytest.raises(openai.BadRequestError) as exc:
        oai.chat.completions.create(model="scripted", messages=_chat(MAX_CHAT_MESSAGES + 1))
    assert exc.value.body["param"] == "messages" and exc.value.body["message"] == (
        "Invalid 'messages': array too long. Expected an array with maximum length 2048, but got an array with "
        "length 2049 instead."
    )
    with pytest.raises(openai.BadRequestError) as exc:
        oai.responses.create(model="scripted", input=_chat(MAX_MESSAGES + 1))
    assert exc.value.body["param"] == "input" and f"at most {MAX_MESSAGES:,}" in exc.value.body["message"]


def test_anthropic_and_ollama_refuse_more_than_the_bound(scripted_server):
    ant = anthropic.Anthropic(base_url=scripted_server.url, api_key="unused", max_retries=0, timeout=60)
    answer = ant.messages.create(model="scripted", max_tokens=8, messages=_chat(MAX_MESSAGES))
    assert answer.content[0].text == "Hello, world"
    too_many = _chat(MAX_MESSAGES + 1)
    for call in (
        lambda: ant.messages.create(model="scripted", max_tokens=8, messages=too_many),
        lambda: ant.messages.count_tokens(model="scripted", messages=too_many),
    ):
        with pytest.raises(anthropic.BadRequestError) as exc:
            call()
        assert exc.value.body["error"]["message"] == (
            f"messages holds 10,001 messages; at most {MAX_MESSAGES:,} are allowed: drop or summarize the oldest"
        )

    oll = ollama.Client(host=scripted_server.url, timeout=60)
    with pytest.raises(ollama.ResponseError) as err:
        oll.chat(model="scripted", messages=_chat(MAX_MESSAGES + 1))
    assert err.value.status_code == 400 and f"at most {MAX_MESSAGES:,}" in err.value.error


def test_a_hundred_thousand_empty_messages_are_refused_at_once(scripted_server):
    body = {"model": "scripted", "messages": _chat(100_000)}
    for path in ("/v1/chat/completions", "/api/chat"):
        started = time.perf_counter()
        answer = httpx.post(f"{scripted_server.url}{path}", json=body, timeout=60)
        took = time.perf_counter() - started
        assert answer.status_code == 400 and "100000" in answer.text.replace(",", ""), answer.text[:300]
        assert took < 5, f"{path} took {took:.1f} s to refuse"
