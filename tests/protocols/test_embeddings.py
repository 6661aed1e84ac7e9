"""The OpenAI and Ollama embedding codecs as plain functions (``protocols.openai_embeddings``, ``.ollama_embeddings``).

Vectors, float and base64, must decode back to the same float32 numbers; batched inputs keep their indexes.
"""

from __future__ import annotations

import base64
import json
import struct

import msgspec
import pytest

from meshgate.protocols import ollama_embeddings, openai_embeddings
from meshgate.protocols.model import Embeddings, EmbedRequest, InvalidRequest, decode_body

VECTORS = ((0.6, 0.8), (1.0, 0.0), (-0.28, 0.96))
RESULT = Embeddings(vectors=VECTORS, prompt_tokens=9, load_ns=1234)


def f32(values) -> list[float]:
    return list(struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}f", *values)))


def oai(body: dict) -> EmbedRequest:
    return openai_embeddings.embeddings_to_internal(
        decode_body(json.dumps(body).encode(), openai_embeddings.EmbeddingRequest)
    )


def oll(body: dict) -> EmbedRequest:
    return ollama_embeddings.embed_to_internal(decode_body(json.dumps(body).encode(), ollama_embeddings.EmbedBody))


# ------------------------------------------------------------------------------------------------- openai


@pytest.mark.parametrize(
    ("value", "inputs"),
    [
        ("a cat", ("a cat",)),
        (["a cat", "a kitten"], ("a cat", "a kitten")),
        ([1, 2, 3], ((1, 2, 3),)),
        ([[1, 2], [3]], ((1, 2), (3,))),
    ],
)
def test_oai_28_input_shapes(value, inputs):
    request = oai({"model": "m", "input": value, "user": "someone"})
    assert request == EmbedRequest(model="m", inputs=inputs, truncate=False)


@pytest.mark.parametrize("value", ["", [], ["a", ""], [[1], []], ["a", 1], [[1], 2], ["a", [1]]])
def test_oai_28_refused_inputs(value):
    with pytest.raises(InvalidRequest) as exc:
        oai({"model": "m", "input": value})
    assert exc.value.param == "input"


def test_oai_28_too_many_inputs():
    with pytest.raises(InvalidRequest, match="at most 2048"):
        oai({"model": "m", "input": ["x"] * 2049})


def test_oai_28_dimensions_and_format_are_validated_by_the_decoder():
    assert oai({"model": "m", "input": "x", "dimensions": 64}).dimensions == 64
    with pytest.raises(InvalidRequest) as exc:
        oai({"model": "m", "input": "x", "dimensions": 0})
    assert exc.value.param == "dimensions"
    with pytest.raises(InvalidRequest) as exc:
        oai({"model": "m", "input": "x", "encoding_format": "int8"})
    assert exc.value.param == "encoding_format"
    with pytest.raises(InvalidRequest) as exc:
        oai({"model": "m"})
    assert exc.value.param == "input"


def test_oai_30_float_reply_shape_indexes_and_usage():
    body = json.loads(openai_embeddings.encode_embeddings(RESULT, "gemma3:270m"))
    assert body == {
        "object": "list",
        "data": [{"object": "embedding", "index": i, "embedding": list(v)} for i, v in enumerate(VECTORS)],
        "model": "gemma3:270m",
        "usage": {"prompt_tokens": 9, "total_tokens": 9},
    }


def test_oai_29_base64_is_little_endian_float32_and_decodes_to_the_float_reply():
    floats = json.loads(openai_embeddings.encode_embeddings(RESULT, "m", "float"))
    packed = json.loads(openai_embeddings.encode_embeddings(RESULT, "m", "base64"))
    assert [d["index"] for d in packed["data"]] == [0, 1, 2]
    assert packed["usage"] == floats["usage"]
    for as_float, as_b64 in zip(floats["data"], packed["data"], strict=True):
        raw = base64.b64decode(as_b64["embedding"])
        assert len(raw) == 4 * len(as_float["embedding"])
        decoded = list(struct.unpack(f"<{len(raw) // 4}f", raw))
        assert decoded == f32(as_float["embedding"])


def test_oai_29_base64_matches_the_sdk_decoder():
    np = pytest.importorskip("numpy")
    packed = json.loads(openai_embeddings.encode_embeddings(RESULT, "m", "base64"))
    # what openai-python does with a base64 reply (resources/embeddings.py)
    decoded = [np.frombuffer(base64.b64decode(d["embedding"]), dtype="float32").tolist() for d in packed["data"]]
    assert decoded == [f32(v) for v in VECTORS]


def test_oai_30_empty_result_has_empty_data():
    body = json.loads(openai_embeddings.encode_embeddings(Embeddings(), "m", "base64"))
    assert body["data"] == [] and body["usage"] == {"prompt_tokens": 0, "total_tokens": 0}


# ------------------------------------------------------------------------------------------------- ollama


def test_oll_18_input_string_or_list_truncate_and_dimensions():
    assert oll({"model": "m", "input": "a cat"}) == EmbedRequest(model="m", inputs=("a cat",))
    assert oll(
        {
            "model": "m",
            "input": ["a", ""],
            "truncate": False,
            "dimensions": 8,
            "options": {"num_ctx": 512},
            "keep_alive": "5m",
        }
    ) == EmbedRequest(model="m", inputs=("a", ""), dimensions=8, truncate=False)


@pytest.mark.parametrize("body", [{"model": "m"}, {"model": "m", "input": ""}, {"model": "m", "input": []}])
def test_oll_18_no_input_only_loads(body):
    assert oll(body).inputs == ()


@pytest.mark.parametrize("dimensions", [0, -1, None])
def test_oll_18_dimensions_zero_or_less_means_full_size(dimensions):
    assert oll({"model": "m", "input": "x", "dimensions": dimensions}).dimensions is None


def test_oll_18_input_of_another_type_is_refused():
    with pytest.raises(InvalidRequest) as exc:
        oll({"model": "m", "input": [1, 2]})
    assert exc.value.param and exc.value.param.startswith("input")


def test_oll_43_embed_reply():
    body = msgspec.json.decode(ollama_embeddings.encode_embed(RESULT, "gemma3:270m", 5678))
    assert body == {
        "model": "gemma3:270m",
        "embeddings": [list(v) for v in VECTORS],
        "total_duration": 5678,
        "load_duration": 1234,
        "prompt_eval_count": 9,
    }


def test_oll_19_legacy_request():
    wire = decode_body(
        b'{"model": "m", "prompt": "a cat", "options": {"temperature": 0}}', ollama_embeddings.EmbeddingsBody
    )
    assert ollama_embeddings.embeddings_to_internal(wire) == EmbedRequest(model="m", inputs=("a cat",))
    empty = decode_body(b'{"model": "m"}', ollama_embeddings.EmbeddingsBody)
    assert ollama_embeddings.embeddings_to_internal(empty).inputs == ()


def test_oll_44_legacy_reply():
    assert json.loads(ollama_embeddings.encode_embeddings(RESULT)) == {"embedding": [0.6, 0.8]}
    assert json.loads(ollama_embeddings.encode_embeddings(Embeddings())) == {"embedding": []}
