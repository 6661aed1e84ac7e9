"""Context checks before the queue, through the official SDKs against the real Gemma 3 270M.

A prompt (plus, for OpenAI, the output asked for) that cannot fit the instance's context is refused with each
protocol's own error; the token counts in the messages are the runner's own (Anthropic's count_tokens agrees).
"""

from __future__ import annotations

import anthropic
import httpx
import ollama
import openai
import pytest

from tests.conftest import MODEL

LONG = "The quick brown fox jumps over the lazy dog. " * 300  # ~3,000 tokens
HALF = "The quick brown fox jumps over the lazy dog. " * 120  # ~1,200 tokens


@pytest.fixture(scope="module")
def context(real_server, ant) -> int:
    """The context the model's instance holds (placed by a first request)."""
    ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": "hi"}])
    instances = httpx.get(f"{real_server.url}/instances").json()
    return next(i["placement"]["context"] for i in instances if i["model"] == MODEL)


def _tokens(ant: anthropic.Anthropic, text: str) -> int:
    return ant.messages.count_tokens(model=MODEL, messages=[{"role": "user", "content": text}]).input_tokens


def test_openai_prompt_plus_max_tokens(oai, ant, context):
    prompt = _tokens(ant, HALF)
    asked = context - prompt + 1
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HALF}], max_tokens=asked)
    assert refused.value.status_code == 400 and refused.value.code == "context_length_exceeded"
    assert refused.value.body["type"] == "invalid_request_error"
    assert refused.value.body["message"] == (
        f"This model's maximum context length is {context} tokens. However, you requested {prompt + asked} tokens "
        f"({prompt} in the messages, {asked} in the completion). Please reduce the length of the messages or "
        "completion."
    )
    ok = oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HALF}], max_tokens=2)
    assert ok.usage.prompt_tokens == prompt, "the gateway's count is the one the runner uses"


def test_openai_prompt_alone(oai, ant, context):
    with pytest.raises(openai.BadRequestError) as refused:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": LONG}])
    assert refused.value.code == "context_length_exceeded"
    assert refused.value.body["message"] == (
        f"This model's maximum context length is {context} tokens. However, your "
        f"messages resulted in {_tokens(ant, LONG)} tokens. Please reduce the length "
        "of the messages."
    )


def test_anthropic_prompt_too_long(ant, context):
    with pytest.raises(anthropic.BadRequestError) as refused:
        ant.messages.create(model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": LONG}], timeout=60)
    assert refused.value.status_code == 400 and refused.value.type == "invalid_request_error"
    expected = f"prompt is too long: {_tokens(ant, LONG)} tokens > {context - 1} maximum"
    assert refused.value.body["error"]["message"] == expected


def test_anthropic_large_max_tokens_is_capped_not_refused(ant):
    """Claude Code sends max_tokens 32000 whatever the context: only the prompt must fit."""
    with ant.messages.stream(
        model=MODEL, max_tokens=32000, messages=[{"role": "user", "content": "Say hi."}], extra_body={"temperature": 0}
    ) as s:
        first = next(e for e in s if e.type == "content_block_delta")
    assert first.delta.text


def test_ollama_generate_too_long(real_server):
    with pytest.raises(ollama.ResponseError) as refused:
        ollama.Client(host=real_server.url).generate(MODEL, prompt=LONG, options={"num_predict": 2})
    assert refused.value.status_code == 400
    assert refused.value.error == "the input length exceeds the context length"


def test_ollama_chat_drops_oldest_turns(real_server, ant):
    question = {"role": "user", "content": "Say hi."}
    history = [{"role": "user", "content": HALF}, {"role": "assistant", "content": HALF}, question]
    reply = ollama.Client(host=real_server.url).chat(MODEL, messages=history, options={"num_predict": 2})
    full = ant.messages.count_tokens(model=MODEL, messages=history).input_tokens
    assert reply.done and 0 < reply.prompt_eval_count < full, "older turns were dropped to fit"
    r = httpx.post(
        f"{real_server.url}/api/chat",
        json={"model": MODEL, "messages": history, "truncate": False, "stream": False, "options": {"num_predict": 2}},
        timeout=60,
    )
    assert (r.status_code, r.json()) == (400, {"error": "the input length exceeds the context length"})


HUGE = "Tell me everything about foxes. " * 65_536  # 2 MiB of text


def test_a_prompt_too_big_by_its_bytes_alone_is_refused_without_counting(oai, ant, context, real_server):
    """2 MiB of text cannot fit 4,096 tokens whatever its tokens: the gateway refuses it from its bytes over the
    longest token of the model's vocabulary (48 bytes for Gemma 3), so the runner never spends seconds counting
    it; the error names that lower bound (the runner's own count would be about 460,000)."""
    least = len(HUGE.encode()) // 48
    with pytest.raises(anthropic.BadRequestError) as refused:
        ant.messages.create(model=MODEL, max_tokens=16, messages=[{"role": "user", "content": HUGE}], timeout=60)
    assert refused.value.body["error"]["message"] == f"prompt is too long: {least} tokens > {context - 1} maximum"
    with pytest.raises(openai.BadRequestError) as too_long:
        oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": HUGE}], max_tokens=16)
    assert too_long.value.code == "context_length_exceeded" and f"requested {least + 16} tokens" in str(too_long.value)
    with pytest.raises(ollama.ResponseError) as ollama_refused:
        ollama.Client(host=real_server.url).generate(MODEL, prompt=HUGE, options={"num_predict": 2})
    assert ollama_refused.value.status_code == 400
