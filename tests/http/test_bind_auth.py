"""``meshgate serve`` refuses a non-loopback address without keys unless told ``--insecure-no-auth``."""

from __future__ import annotations

import pytest

from meshgate.gateway.cli import commands as cli


@pytest.fixture
def served(monkeypatch, tmp_path):
    """The configs uvicorn servers were run with (nothing is bound here) and a clean environment."""
    import uvicorn

    calls = []
    monkeypatch.setattr(uvicorn.Server, "run", lambda self, sockets=None: calls.append(self.config))
    for name in ("MESHGATE_API_KEYS", "MESHGATE_REDIS", "MESHGATE_HOST"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("MESHGATE_DATA_DIR", str(tmp_path))
    monkeypatch.setenv("MESHGATE_DISABLED_PLUGINS", "llama_cpp,mlx,vllm")
    return calls


@pytest.mark.parametrize("host", ["0.0.0.0", "::", "192.0.2.10", "example.internal"])
def test_a_public_bind_without_keys_is_refused(served, host, capsys):
    assert cli.main(["serve", "--host", host]) == 2
    assert served == []
    assert "without API keys" in capsys.readouterr().err


@pytest.mark.parametrize(
    "args",
    [
        ["--host", "0.0.0.0", "--api-key", "k"],
        ["--host", "0.0.0.0", "--insecure-no-auth"],
        ["--host", "127.0.0.1"],
        ["--host", "::1"],
        ["--host", "localhost"],
        [],
    ],
)
def test_keys_loopback_or_an_explicit_opt_out_serve(served, args):
    assert cli.main(["serve", *args]) == 0
    assert len(served) == 1


def test_stored_keys_count_as_keys(served, tmp_path):
    (tmp_path / "keys.json").write_text('[{"id": "abc", "name": "n", "digest": "00"}]')
    assert cli.main(["serve", "--host", "0.0.0.0"]) == 0
