"""Request bodies a careless or hostile client sends, refused with a 400 that names the field (issue 15, item 6):
JSON nested past the limit anywhere (it used to raise ``RecursionError``: a 500), Anthropic sampling values and
Ollama options outside their ranges; and each protocol's words for asking more output than the gateway allows."""

from __future__ import annotations

import json

import msgspec
import pytest

from meshgate.protocols import anthropic, ollama, openai
from meshgate.protocols.model import MAX_JSON_DEPTH, InvalidRequest, OutputTooLarge, decode_body, json_depth


def nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def body(free_form: str) -> bytes:
    """An Anthropic request whose tool schema holds ``free_form`` (a field taken as it comes)."""
    return (
        '{"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], '
        f'"tools": [{{"name": "t", "input_schema": {{"type": "object", "x": {free_form}}}}}]}}'
    ).encode()


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH, 1_000, 100_000])
def test_json_nested_past_the_limit_is_a_400(depth):
    with pytest.raises(InvalidRequest, match="nests JSON"):
        decode_body(body(nested(depth)), anthropic.MessagesRequest)


def test_json_within_the_limit_decodes_and_brackets_in_strings_do_not_count():
    wire = decode_body(body(nested(MAX_JSON_DEPTH - 10)), anthropic.MessagesRequest)
    assert wire.tools
    text = json.dumps("[" * 5000 + "{" * 5000)
    wire = decode_body(body(text), anthropic.MessagesRequest)
    assert wire.tools and json_depth(body(text)) == 4


def test_json_depth_counts_arrays_and_objects():
    assert json_depth(b'{"a": [1, {"b": "]]]"}], "c": "\\"[["}') == 3
    assert json_depth(b'"x"') == 0


def messages(**fields) -> bytes:
    return msgspec.json.encode(
        {"model": "m", "max_tokens": 5, "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [("temperature", 1.5), ("temperature", -0.1), ("top_p", 1.01), ("top_p", -1), ("top_k", -1), ("top_k", 2.5)],
)
def test_anthropic_sampling_out_of_range_names_the_field(field, value):
    with pytest.raises(InvalidRequest) as exc:
        decode_body(messages(**{field: value}), anthropic.MessagesRequest)
    assert exc.value.param == field and exc.value.status == 400


def test_anthropic_sampling_in_range():
    request = anthropic.messages_to_internal(
        decode_body(messages(temperature=0, top_p=1, top_k=0), anthropic.MessagesRequest)
    )
    assert (request.sampling.temperature, request.sampling.top_p, request.sampling.top_k) == (0, 1, 0)


def generate(options: dict) -> bytes:
    return msgspec.json.encode({"model": "m", "prompt": "hi", "options": options})


@pytest.mark.parametrize(
    ("option", "value"),
    [
        ("num_ctx", -1),
        ("num_ctx", 0),
        ("num_ctx", 2**40),
        ("temperature", -0.5),
        ("top_p", 1.5),
        ("min_p", -0.1),
        ("top_k", -3),
        ("repeat_penalty", 0),
        ("num_predict", 1.5),
        ("num_ctx", "4096"),
    ],
)
def test_ollama_options_out_of_range_name_the_option(option, value):
    with pytest.raises(InvalidRequest) as exc:
        decode_body(generate({option: value}), ollama.GenerateRequest)
    assert exc.value.param == f"options.{option}"


def test_ollama_options_in_range():
    wire = decode_body(
        generate({"num_ctx": 1, "temperature": 0, "top_p": 1, "top_k": 0, "repeat_penalty": 1.1, "num_predict": -2}),
        ollama.GenerateRequest,
    )
    request = ollama.generate_to_internal(wire)
    assert request.num_ctx == 1 and request.max_tokens is None


def test_output_too_large_in_each_protocols_words():
    err = OutputTooLarge(asked=2**70, limit=65536, model="gemma3:270m")
    status, raw = openai.error_body(err)
    error = json.loads(raw)["error"]
    assert status == 400 and error["param"] == "max_tokens" and error["type"] == "invalid_request_error"
    assert error["message"] == (
        f"max_tokens is too large: {2**70}. This model supports at most 65536 completion "
        f"tokens, whereas you provided {2**70}."
    )
    status, raw = anthropic.error_body(err)
    assert status == 400 and json.loads(raw)["error"] == {
        "type": "invalid_request_error",
        "message": f"max_tokens: {2**70} > 65536, which is the maximum allowed number of output tokens for gemma3:270m",
    }
