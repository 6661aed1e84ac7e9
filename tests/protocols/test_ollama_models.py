"""``protocols.ollama_models`` as plain functions: keep_alive durations, show/ps/progress shapes."""

from __future__ import annotations

import math
from datetime import UTC, datetime

import msgspec
import pytest
from ollama import _types

from meshgate.protocols.model import InvalidRequest, ModelInfo, decode_body
from meshgate.protocols.ollama_models import (
    CreateRequest,
    ShowRequest,
    encode_ps,
    encode_show,
    parse_keep_alive,
    progress_line,
)

INFO = ModelInfo(
    name="gemma3:270m",
    created=1_700_000_000.0,
    size=253113024,
    digest="ab" * 32,
    family="gemma3",
    parameter_size="270M",
    quantization="Q4_K_M",
    context_length=2048,
)


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        (None, None),
        (0, 0.0),
        ("0", 0.0),
        ("0s", 0.0),
        ("0m0s", 0.0),
        (300, 300.0),
        (2.5, 2.5),
        ("5m", 300.0),
        ("1h", 3600.0),
        ("1h30m", 5400.0),
        ("1.5s", 1.5),
        ("250ms", 0.25),
        ("300", 300.0),
        (-1, math.inf),
        ("-1", math.inf),
        ("-1m", math.inf),
    ],
)
def test_oll_15_parse_keep_alive(value, seconds):
    assert parse_keep_alive(value) == seconds


@pytest.mark.parametrize("value", ["soon", "5 minutes", "m", ""])
def test_oll_15_bad_keep_alive_is_invalid(value):
    with pytest.raises(InvalidRequest):
        parse_keep_alive(value)


def test_oll_42_show_request_accepts_name():
    assert decode_body(b'{"name": "m"}', ShowRequest).target == "m"
    with pytest.raises(InvalidRequest):
        _ = decode_body(b"{}", ShowRequest).target


def test_oll_45_create_request_reads_from():
    wire = decode_body(b'{"model": "x", "from": "gemma3:270m", "stream": false}', CreateRequest)
    assert wire.from_ == "gemma3:270m" and wire.stream is False


def test_oll_42_show_parses_in_the_client():
    body = encode_show(
        INFO,
        path="/m.gguf",
        model_info={"general.architecture": "gemma3"},
        capabilities=["completion", "tools"],
        template="{{ .Prompt }}",
        system="Be brief.",
        parameters={"temperature": 0.5, "stop": ["a", "b"]},
    )
    shown = _types.ShowResponse.model_validate_json(body)
    assert shown.modelinfo == {"general.architecture": "gemma3"}
    assert shown.capabilities == ["completion", "tools"]
    assert shown.parameters.splitlines() == [f"{'temperature':<30} 0.5", f'{"stop":<30} "a"', f'{"stop":<30} "b"']
    assert 'SYSTEM """Be brief."""' in shown.modelfile and "FROM /m.gguf" in shown.modelfile


def test_oll_41_ps_expiry_and_forever():
    """Forever is Ollama's: ``math.MaxInt64`` ns after the model was kept (2026-12-02 -> 2319-03-14); the
    longest-lived model comes first."""
    kept = datetime(2026, 12, 2, 15, 33, 53, tzinfo=UTC).timestamp()
    body = msgspec.json.decode(encode_ps([(INFO, 1_800_000_000.123456789, kept), (INFO, None, kept)]))
    first, second = body["models"]
    assert first["expires_at"].startswith("2319-03-14T") and first["size_vram"] == 0
    assert datetime.fromisoformat(first["expires_at"]).timestamp() - kept == pytest.approx((2**63 - 1) / 1e9)
    assert second["expires_at"] == "2027-01-15T08:00:00.123457+00:00"
    assert first["context_length"] == 2048 and first["model"] == "gemma3:270m"
    assert len(second["expires_at"].split(".")[1].split("+")[0]) == 6  # at most 6 fractional digits
    datetime.fromisoformat(second["expires_at"])
    _types.ProcessResponse.model_validate(body)


def test_oll_45_progress_line_leaves_out_absent_fields():
    assert progress_line("success") == b'{"status":"success"}\n'
    assert msgspec.json.decode(progress_line("pulling", digest="sha256:x", total=2, completed=1)) == {
        "status": "pulling",
        "digest": "sha256:x",
        "total": 2,
        "completed": 1,
    }
