"""The llama.cpp embedder on the real Gemma 3 270M: chunked decoding, truncation, token-id inputs, dimensions.

Runs in this process (no runner); a small context (llama.cpp's minimum, 256 tokens) keeps long inputs cheap.
"""

from __future__ import annotations

import math
import threading

import pytest

from meshgate.protocols.model import EmbedRequest, GatewayError, InvalidRequest

llama_cpp = pytest.importorskip("llama_cpp")

from meshgate.backends.llama_cpp.embed import Embedder  # noqa: E402

N_CTX = 256
TEXT = "The quick brown fox jumps over the lazy dog while the cat sleeps in the warm afternoon sun."


@pytest.fixture(scope="module")
def llm(packaged_gguf):
    return llama_cpp.Llama(model_path=str(packaged_gguf), n_ctx=N_CTX, n_gpu_layers=0, verbose=False)


@pytest.fixture(scope="module")
def embedder(llm) -> Embedder:
    return Embedder(llm)


def cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b, strict=True))


def one(embedder: Embedder, item, **kw) -> tuple[float, ...]:
    return embedder.embed(EmbedRequest(model="m", inputs=(item,), **kw)).vectors[0]


def test_one_pooled_unit_vector_per_input(embedder):
    result = embedder.embed(EmbedRequest(model="m", inputs=("a cat", "a kitten", "stock market")))
    assert [len(v) for v in result.vectors] == [640, 640, 640]
    assert all(abs(math.sqrt(sum(x * x for x in v)) - 1) < 1e-5 for v in result.vectors)
    cat, kitten, market = result.vectors
    assert cos(cat, kitten) > cos(cat, market)
    assert result.prompt_tokens == 9  # BOS + 2 tokens, three times


def test_chunked_decoding_matches_one_pass(llm, embedder):
    assert llm.n_ctx() == N_CTX
    assert embedder.chunk == 64  # 64 MiB of logits over Gemma's 262,144-token vocabulary
    text = TEXT * 6  # 115 tokens
    whole, chunked = one(Embedder(llm, chunk=N_CTX), text), one(Embedder(llm, chunk=16), text)
    assert cos(whole, chunked) > 0.999  # the same states up to f16 KV cache and kernel rounding (measured 0.9998)


def test_token_ids_are_used_as_given(llm, embedder):
    ids = tuple(llm.tokenize(b"a cat", add_bos=True, special=False))
    assert cos(one(embedder, ids), one(embedder, "a cat")) > 0.99999


def test_truncate_cuts_to_the_context_or_refuses(llm, embedder):
    long = TEXT * 15  # 286 tokens
    result = embedder.embed(EmbedRequest(model="m", inputs=(long,)))
    assert result.prompt_tokens == N_CTX
    head = tuple(llm.tokenize(long.encode(), add_bos=True, special=False)[:N_CTX])
    assert cos(result.vectors[0], one(embedder, head)) > 0.99999
    with pytest.raises(InvalidRequest, match="context holds 256"):
        embedder.embed(EmbedRequest(model="m", inputs=(long,), truncate=False))


def test_dimensions(embedder):
    full = one(embedder, "a cat")
    short = one(embedder, "a cat", dimensions=8)
    scale = math.sqrt(sum(x * x for x in full[:8]))
    assert short == pytest.approx([x / scale for x in full[:8]], abs=1e-6)
    with pytest.raises(InvalidRequest) as exc:
        one(embedder, "a cat", dimensions=641)
    assert exc.value.param == "dimensions"


def test_bad_token_ids_and_empty_inputs_are_refused(embedder):
    with pytest.raises(InvalidRequest, match="outside the vocabulary"):
        one(embedder, (1, 10**9))
    with pytest.raises(InvalidRequest, match="empty"):
        one(embedder, ())


def test_a_set_cancel_flag_stops_before_the_next_decode(embedder):
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(GatewayError, match="cancelled"):
        embedder.embed(EmbedRequest(model="m", inputs=("a cat",)), cancel)
