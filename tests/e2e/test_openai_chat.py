"""The chat completion request fields with the real model (docs/protocols.md 1.3): roles, sampling, stop, seed,
images on a model without vision, accepted-but-unused fields."""

from __future__ import annotations

import base64

import openai
import pytest

from tests.conftest import MODEL

PNG = base64.b64encode(
    bytes.fromhex(
        "89504e470d0a1a0a0000000d4948445200000001000000010806000000"
        "1f15c4890000000d49444154789c6360000002000154a24f5d0000000049454e44ae426082"
    )
)


@pytest.fixture(scope="module")
def client(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0)


def test_oai_15_every_role(client):
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        messages=[
            {"role": "developer", "content": "Be brief."},
            {"role": "system", "content": [{"type": "text", "text": "Answer in English."}]},
            {"role": "user", "content": [{"type": "text", "text": "What is 2+2?"}]},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}],
            },
            {"role": "tool", "tool_call_id": "call_1", "content": "4"},
            {"role": "user", "content": "So?"},
        ],
    )
    assert reply.choices[0].message.content is not None and reply.usage.prompt_tokens > 30


def test_oai_17_image_on_a_model_without_vision_is_a_400_that_says_so(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=MODEL,
            max_tokens=4,
            messages=[
                {
                    "role": "user",
                    "content": [
                        {"type": "text", "text": "What is this?"},
                        {"type": "image_url", "image_url": {"url": f"data:image/png;base64,{PNG.decode()}"}},
                    ],
                }
            ],
        )
    assert "does not support images" in exc.value.body["message"]


def test_oai_23_seed_makes_sampling_repeatable(client):
    def sample(seed: int) -> str:
        return (
            client.chat.completions.create(
                model=MODEL,
                max_tokens=12,
                temperature=1.2,
                top_p=0.95,
                seed=seed,
                messages=[{"role": "user", "content": "Tell me a story."}],
            )
            .choices[0]
            .message.content
        )

    first = sample(7)
    assert sample(7) == first
    assert any(sample(s) != first for s in (8, 9, 10))


def test_oai_23_stop_sequences_end_the_text(client):
    reply = client.completions.create(model=MODEL, prompt="1, 2, 3, 4, 5,", max_tokens=30, temperature=0, stop=[" 8"])
    assert reply.choices[0].finish_reason == "stop" and " 8" not in reply.choices[0].text
    assert reply.choices[0].text.rstrip().endswith("7,")


def test_oai_23_penalties_user_and_metadata_are_accepted(client):
    reply = client.chat.completions.create(
        model=MODEL,
        max_tokens=4,
        presence_penalty=0.5,
        frequency_penalty=0.5,
        user="u-123",
        metadata={"team": "a"},
        store=False,
        messages=[{"role": "user", "content": "Hi"}],
    )
    assert reply.usage.completion_tokens <= 4


def test_oai_37_n_above_one_is_a_clear_400(client):
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=MODEL, n=2, messages=[{"role": "user", "content": "Hi"}])
    assert exc.value.body["param"] == "n" and "n=1" in exc.value.body["message"]


def test_oai_22_max_tokens_and_max_completion_tokens(client):
    both = client.chat.completions.create(
        model=MODEL, max_tokens=9, max_completion_tokens=3, temperature=0, messages=[{"role": "user", "content": "Hi"}]
    )
    assert both.usage.completion_tokens == 3 and both.choices[0].finish_reason == "length"
