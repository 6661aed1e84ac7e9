"""Settings: one object from MESHGATE_* variables and CLI flags."""

import argparse

from meshgate.gateway.cli.commands import _settings
from meshgate.plugins.settings import Settings, default_data_dir


def test_defaults_are_loopback_on_ollamas_port(monkeypatch):
    monkeypatch.setenv("XDG_DATA_HOME", "/xdg")
    s = Settings.from_env({})
    assert (s.host, s.port, s.cluster_address) == ("127.0.0.1", 11434, "127.0.0.1")
    assert s.redis is None and s.placement == "auto"
    assert s.data_dir == "/xdg/meshgate" == default_data_dir()


def test_environment_and_overrides():
    env = {
        "MESHGATE_PORT": "8080",
        "MESHGATE_MODELS": "mine=/m/a.gguf, /m/b.gguf",
        "MESHGATE_API_KEYS": "k1,k2",
        "MESHGATE_THREADS": "3",
    }
    s = Settings.from_env(env, port=9000, host=None)
    assert s.port == 9000 and s.host == "127.0.0.1" and s.threads == 3
    assert s.api_keys == ("k1", "k2")
    assert s.model_paths() == [("mine", "/m/a.gguf"), ("b", "/m/b.gguf")]


def test_cli_flags_extend_environment_lists(monkeypatch):
    monkeypatch.setenv("MESHGATE_MODELS", "a=/x.gguf")
    args = argparse.Namespace(
        host=None,
        port=1234,
        data_dir="/d",
        log_level=None,
        n_ctx=None,
        threads=None,
        redis=None,
        name=None,
        address=None,
        placement=None,
        memory=None,
        model=["b=/y.gguf"],
        plugin=[],
        api_key=[],
    )
    s = _settings(args)
    assert s.port == 1234 and s.data_dir == "/d" and s.models == ("a=/x.gguf", "b=/y.gguf")
