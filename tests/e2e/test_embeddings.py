"""Embeddings end to end: the official openai and ollama clients against a real gateway.

The real Gemma 3 270M (``real_server``) proves the vectors mean something; the scripted backend
(``scripted_server``, ``tests.scripted_plugin.scripted_vector``) pins the exact wire bytes.
"""

from __future__ import annotations

import base64
import math
import struct

import httpx
import ollama
import openai
import pytest

from tests.conftest import MODEL
from tests.scripted_plugin import scripted_vector

ANIMALS = ["a cat", "a kitten", "stock market"]
GEMMA_SIZE = 640


def cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def norm(v) -> float:
    return math.sqrt(sum(x * x for x in v))


@pytest.fixture(scope="module")
def oai(real_server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{real_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def oll(real_server) -> ollama.Client:
    return ollama.Client(host=real_server.url, timeout=120)


@pytest.fixture(scope="module")
def default_reply(oai):
    """The SDK's default call: it asks for base64 itself and decodes it (OAI-29)."""
    return oai.embeddings.create(model=MODEL, input=ANIMALS)


# ------------------------------------------------------------------------------------------------- openai, real model


def test_oai_5_embeddings_mean_something(default_reply):
    vectors = [d.embedding for d in default_reply.data]
    assert [d.index for d in default_reply.data] == [0, 1, 2]
    assert all(len(v) == GEMMA_SIZE for v in vectors)
    assert all(abs(norm(v) - 1) < 1e-4 for v in vectors)
    cat, kitten, market = vectors
    assert cos(cat, kitten) > cos(cat, market)
    assert default_reply.model == MODEL and default_reply.object == "list"
    assert default_reply.usage.prompt_tokens == default_reply.usage.total_tokens > 3


def test_oai_29_float_format_gives_the_same_vectors_as_base64(oai, default_reply):
    reply = oai.embeddings.create(model=MODEL, input=ANIMALS, encoding_format="float")
    for plain, packed in zip(reply.data, default_reply.data, strict=True):
        as_f32 = struct.unpack(f"<{GEMMA_SIZE}f", struct.pack(f"<{GEMMA_SIZE}f", *plain.embedding))
        assert max(abs(a - b) for a, b in zip(as_f32, packed.embedding, strict=True)) < 1e-6
    assert reply.usage == default_reply.usage


def test_oai_28_single_string_and_token_ids(oai):
    one = oai.embeddings.create(model=MODEL, input="a cat", encoding_format="float")
    assert len(one.data) == 1 and len(one.data[0].embedding) == GEMMA_SIZE
    ids = oai.embeddings.create(model=MODEL, input=[[2, 496, 5866], [2, 5866]])
    assert [len(d.embedding) for d in ids.data] == [GEMMA_SIZE, GEMMA_SIZE]
    assert ids.usage.prompt_tokens == 5


def test_oai_28_dimensions_truncate_and_renormalize(oai, default_reply):
    reply = oai.embeddings.create(model=MODEL, input=ANIMALS, dimensions=64)
    for short, full in zip(reply.data, default_reply.data, strict=True):
        assert len(short.embedding) == 64 and abs(norm(short.embedding) - 1) < 1e-4
        head = full.embedding[:64]
        assert cos(short.embedding, [x / norm(head) for x in head]) > 0.9999


def test_oai_28_dimensions_larger_than_the_model_is_400(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.embeddings.create(model=MODEL, input="a cat", dimensions=GEMMA_SIZE + 1)
    assert exc.value.body["param"] == "dimensions"


def test_oai_28_input_longer_than_the_context_is_400(oai):
    with pytest.raises(openai.BadRequestError) as exc:
        oai.embeddings.create(model=MODEL, input="cat " * 3000)
    assert "context" in exc.value.body["message"]


def test_oai_5_unknown_model_is_404(oai):
    with pytest.raises(openai.NotFoundError) as exc:
        oai.embeddings.create(model="no-such-model", input="a cat")
    assert exc.value.body["code"] == "model_not_found"


# ------------------------------------------------------------------------------------------------- ollama, real model


def test_oll_43_embed_list(oll, default_reply):
    reply = oll.embed(model=MODEL, input=ANIMALS)
    assert len(reply.embeddings) == 3 and all(len(v) == GEMMA_SIZE for v in reply.embeddings)
    cat, kitten, market = reply.embeddings
    assert cos(cat, kitten) > cos(cat, market)
    assert cos(cat, default_reply.data[0].embedding) > 0.9999
    assert reply.model == MODEL
    assert reply.prompt_eval_count == default_reply.usage.prompt_tokens
    assert reply.total_duration > 0 and reply.load_duration is not None


def test_oll_18_embed_string_and_dimensions(oll):
    reply = oll.embed(model=MODEL, input="a cat", dimensions=32)
    assert len(reply.embeddings) == 1 and len(reply.embeddings[0]) == 32
    assert abs(norm(reply.embeddings[0]) - 1) < 1e-4


def test_oll_18_truncate_false_refuses_an_input_longer_than_the_context(oll):
    with pytest.raises(ollama.ResponseError) as exc:
        oll.embed(model=MODEL, input="cat " * 3000, truncate=False)
    assert exc.value.status_code == 400


def test_oll_18_empty_input_only_loads(real_server):
    reply = httpx.post(f"{real_server.url}/api/embed", json={"model": MODEL, "input": ""}, timeout=60)
    assert reply.status_code == 200 and reply.json()["embeddings"] == []


def test_oll_44_legacy_embeddings(oll, default_reply):
    reply = oll.embeddings(model=MODEL, prompt="a cat")
    assert len(reply.embedding) == GEMMA_SIZE
    assert cos(reply.embedding, default_reply.data[0].embedding) > 0.9999


def test_oll_18_unknown_model_is_404(oll):
    with pytest.raises(ollama.ResponseError) as exc:
        oll.embed(model="no-such-model", input="a cat")
    assert exc.value.status_code == 404
    with pytest.raises(ollama.ResponseError) as exc:
        oll.embeddings(model="no-such-model", prompt="a cat")
    assert exc.value.status_code == 404


# ------------------------------------------------------------------------------------------------- exact wire, scripted


def test_oai_30_exact_reply_float(scripted_server):
    r = httpx.post(
        f"{scripted_server.url}/v1/embeddings",
        timeout=10,
        json={"model": "scripted", "input": ["one two", "three"], "encoding_format": "float"},
    )
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/json")
    assert r.json() == {
        "object": "list",
        "data": [
            {"object": "embedding", "index": 0, "embedding": list(scripted_vector("one two"))},
            {"object": "embedding", "index": 1, "embedding": list(scripted_vector("three"))},
        ],
        "model": "scripted",
        "usage": {"prompt_tokens": 3, "total_tokens": 3},
    }


def test_oai_29_exact_reply_base64_and_sdk_decoding(scripted_server):
    r = httpx.post(
        f"{scripted_server.url}/v1/embeddings",
        timeout=10,
        json={"model": "scripted", "input": "one two", "encoding_format": "base64"},
    )
    raw = base64.b64decode(r.json()["data"][0]["embedding"])
    assert raw == struct.pack("<4f", *scripted_vector("one two"))
    client = openai.OpenAI(base_url=f"{scripted_server.url}/v1", api_key="unused", max_retries=0)
    reply = client.embeddings.create(model="scripted", input=["one two", "three"], dimensions=2)
    assert [d.embedding for d in reply.data] == [list(scripted_vector("one two", 2)), list(scripted_vector("three", 2))]


def test_oll_43_exact_reply(scripted_server):
    r = httpx.post(
        f"{scripted_server.url}/api/embed", json={"model": "scripted", "input": ["one two", "three"]}, timeout=10
    )
    body = r.json()
    assert set(body) == {"model", "embeddings", "total_duration", "load_duration", "prompt_eval_count"}
    assert body["model"] == "scripted"
    assert body["embeddings"] == [list(scripted_vector("one two")), list(scripted_vector("three"))]
    assert body["prompt_eval_count"] == 3 and body["load_duration"] == 0 and body["total_duration"] > 0


def test_oll_44_exact_legacy_reply(scripted_server):
    r = httpx.post(f"{scripted_server.url}/api/embeddings", json={"model": "scripted", "prompt": "one two"}, timeout=10)
    assert r.json() == {"embedding": list(scripted_vector("one two"))}
    empty = httpx.post(f"{scripted_server.url}/api/embeddings", json={"model": "scripted", "prompt": ""}, timeout=10)
    assert empty.json() == {"embedding": []}


def test_oai_28_bad_input_is_openai_400(scripted_server):
    r = httpx.post(f"{scripted_server.url}/v1/embeddings", json={"model": "scripted", "input": ["a", 1]}, timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "input" and r.json()["error"]["type"] == "invalid_request_error"
