"""The helpers the protocol codecs share: ``protocols.formats`` (base64, data URIs, RFC 3339) and
``protocols.openai_wire`` (the OpenAI endpoints' common pieces), as plain functions, plus the import rule that
keeps the chat and legacy completions codecs apart."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
from datetime import datetime

import msgspec
import pytest
from msgspec import UNSET

from meshgate.protocols import openai_wire, sse
from meshgate.protocols.formats import DataURI, decode_base64, encode_data_uri, parse_data_uri, rfc3339
from meshgate.protocols.model import InvalidRequest, Overloaded, Sampling, Usage

PNG = b"\x89PNG\r\n\x1a\n\x00\x00"

# ---------------------------------------------------------------------------------------------------- base64


def test_decode_base64_is_strict() -> None:
    assert decode_base64(base64.b64encode(PNG).decode()) == PNG
    for bad in ["not base64!", "aGk", "aGk=\n", "aGk=é"]:  # bad alphabet, padding, a line break, non-ASCII
        with pytest.raises(ValueError):
            decode_base64(bad)


def test_decode_base64_wrapped_ignores_line_breaks() -> None:
    text = base64.b64encode(PNG * 10).decode()
    assert decode_base64("\r\n".join(text[i : i + 8] for i in range(0, len(text), 8)), wrapped=True) == PNG * 10


# ---------------------------------------------------------------------------------------------------- data URIs


@pytest.mark.parametrize(
    ("uri", "parsed"),
    [
        ("data:image/png;base64,iVBO", DataURI(media_type="image/png", base64=True, payload="iVBO")),
        ("data:image/png;charset=x;base64,a,b", DataURI(media_type="image/png", base64=True, payload="a,b")),
        ("data:;base64,iVBO", DataURI(media_type=None, base64=True, payload="iVBO")),
        ("data:image/png,iVBO", DataURI(media_type="image/png", base64=False, payload="iVBO")),
        ("data:,", DataURI(media_type=None, base64=False, payload="")),
    ],
)
def test_parse_data_uri(uri: str, parsed: DataURI) -> None:
    assert parse_data_uri(uri) == parsed


@pytest.mark.parametrize("text", ["iVBORw0KGgo=", "https://x/y.png", "data:image/png;base64", "DATA:,x", ""])
def test_what_is_not_a_data_uri(text: str) -> None:
    assert parse_data_uri(text) is None


def test_data_uri_round_trip() -> None:
    uri = parse_data_uri(encode_data_uri(PNG, "image/png"))
    assert uri is not None and uri.media_type == "image/png" and uri.base64
    assert decode_base64(uri.payload) == PNG


# ---------------------------------------------------------------------------------------------------- RFC 3339


def test_rfc3339_with_fraction_is_what_fromisoformat_reads() -> None:
    stamp = rfc3339(1741569952.7)
    assert stamp == "2025-03-10T01:25:52.700000+00:00"
    assert datetime.fromisoformat(stamp).timestamp() == 1741569952.7


def test_rfc3339_in_whole_seconds_ends_in_z() -> None:
    assert rfc3339(1741569952.7, fraction=False) == "2025-03-10T01:25:52Z"
    assert rfc3339(0, fraction=False) == "1970-01-01T00:00:00Z"


# ---------------------------------------------------------------------------------------------------- openai_wire


class _Body(openai_wire.Wire):
    temperature: openai_wire.Temperature | None | msgspec.UnsetType = UNSET
    top_p: float | None | msgspec.UnsetType = UNSET
    top_k: int | None | msgspec.UnsetType = UNSET
    min_p: float | None | msgspec.UnsetType = UNSET
    seed: int | None | msgspec.UnsetType = UNSET
    presence_penalty: float | None | msgspec.UnsetType = UNSET
    frequency_penalty: float | None | msgspec.UnsetType = UNSET
    repeat_penalty: float | None | msgspec.UnsetType = UNSET
    stream_options: openai_wire.StreamOptions | None = None


def test_sampling_keeps_unset_apart_from_null() -> None:
    body = msgspec.json.decode(b'{"temperature": 0.5, "seed": null, "unknown": 1}', type=_Body)
    assert openai_wire.sampling(body) == Sampling(temperature=0.5, seed=None)
    assert openai_wire.sampling(body).top_p is UNSET


def test_value_ranges_are_checked_by_the_decoder() -> None:
    with pytest.raises(msgspec.ValidationError, match="temperature"):
        msgspec.json.decode(b'{"temperature": 3}', type=_Body)


def test_wants_usage_only_when_asked() -> None:
    assert openai_wire.wants_usage(_Body(stream_options=openai_wire.StreamOptions(include_usage=True)))
    assert not openai_wire.wants_usage(_Body(stream_options=openai_wire.StreamOptions(include_usage=False)))
    assert not openai_wire.wants_usage(_Body())


def test_stop_sequences_and_only_one() -> None:
    assert openai_wire.stop_sequences(None) == ()
    assert openai_wire.stop_sequences("\n") == ("\n",)
    assert openai_wire.stop_sequences(["a", "b"]) == ("a", "b")
    openai_wire.only_one(None, "n")
    openai_wire.only_one(1, "n")
    with pytest.raises(InvalidRequest) as exc:
        openai_wire.only_one(2, "best_of")
    assert exc.value.param == "best_of"


def test_usage_body_names_cached_tokens_only_when_there_are_some() -> None:
    assert openai_wire.usage_body(Usage(prompt_tokens=3, completion_tokens=2)) == {
        "prompt_tokens": 3,
        "completion_tokens": 2,
        "total_tokens": 5,
    }
    assert openai_wire.usage_body(Usage(prompt_tokens=3, cached_tokens=2))["prompt_tokens_details"] == {
        "cached_tokens": 2
    }


def test_frames_are_sse_data_lines() -> None:
    assert openai_wire.frame({"a": 1}) == b'data: {"a":1}\r\n\r\n'
    assert openai_wire.DONE == b"data: [DONE]\r\n\r\n"
    assert sse.KEEPALIVE == b": keep-alive\r\n\r\n"


def test_error_envelope_before_and_after_the_stream_started() -> None:
    status, body = openai_wire.error_body(Overloaded("the queue is full", retry_after=2))
    assert status == 429
    assert json.loads(body) == {
        "error": {"message": "the queue is full", "type": "rate_limit_error", "param": None, "code": "overloaded"}
    }
    assert openai_wire.stream_error_frame(Overloaded("the queue is full")) == b"data: " + body + b"\r\n\r\n"


# ---------------------------------------------------------------------------------------------------- imports


def test_chat_and_legacy_completions_do_not_import_each_other() -> None:
    """Each codec imports ``openai_wire``, not the other (no cycle): importing one alone loads only it."""
    for module, other in [
        ("openai", "openai_completions"),
        ("openai_completions", "openai"),
        ("openai_responses", "openai"),
    ]:
        code = f"import sys, meshgate.protocols.{module}; print('meshgate.protocols.{other}' in sys.modules)"
        loaded = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
        assert loaded.stdout.strip() == "False", (module, other)
