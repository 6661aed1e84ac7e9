"""The plugin contract: entry points (built-ins and a pip-installed example), configured modules, the policy hook."""

from __future__ import annotations

import subprocess
import sys

import openai
import pytest

from meshgate.backends.base import ModelCard
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings
from tests.conftest import ROOT, Server


def test_builtins_load_through_the_entry_point_group():
    pm = build_plugin_manager(Settings())
    plugin = pm.get_plugin("llama_cpp")
    assert plugin is not None and plugin.__name__ == "meshgate.plugins.builtin"
    assert [dist.project_name for p, dist in pm.list_plugin_distinfo() if p is plugin] == ["meshgate"]


def test_disabled_plugins_are_blocked():
    pm = build_plugin_manager(Settings(disabled_plugins=("llama_cpp",)))
    assert pm.get_plugin("llama_cpp") is None


def test_choose_backend_policy_is_a_hook_with_a_default():
    card = ModelCard(name="m", path="", format="gguf")

    class Gguf:
        name = "a"

        def supports(self, card):
            return True

    class Other:
        name = "b"

        def supports(self, card):
            return True

    pm = build_plugin_manager(Settings())
    assert pm.hook.meshgate_choose_backend(card=card, backends=[Gguf(), Other()]).name == "a"

    class PreferB:
        @hookimpl
        def meshgate_choose_backend(self, card, backends):
            return next((b for b in backends if b.name == "b"), None)

    pm.register(PreferB())
    assert pm.hook.meshgate_choose_backend(card=card, backends=[Gguf(), Other()]).name == "b"


@pytest.fixture(scope="module")
def echo_site(tmp_path_factory):
    """The example plugin, pip-installed into its own target directory (its entry point included)."""
    target = tmp_path_factory.mktemp("echo-site")
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(target),
            str(ROOT / "examples" / "meshgate-echo"),
        ],
        check=True,
    )
    return target


def test_pip_installed_example_plugin_is_found_and_serves(echo_site, data_dir):
    assert list(echo_site.glob("meshgate_echo-*.dist-info/entry_points.txt"))
    server = Server(data_dir, env={"PYTHONPATH": f"{ROOT}:{echo_site}"})
    try:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="x", max_retries=0)
        assert "echo:latest" in [m.id for m in client.models.list()]
        reply = client.chat.completions.create(model="echo", messages=[{"role": "user", "content": "one two three"}])
        assert reply.choices[0].message.content == "one two three"
        short = client.chat.completions.create(
            model="echo:latest", max_tokens=2, messages=[{"role": "user", "content": "one two three"}]
        )
        assert (short.choices[0].message.content, short.choices[0].finish_reason) == ("one two", "length")
        with pytest.raises(openai.BadRequestError, match="does not support embeddings"):  # no embeddings capability
            client.embeddings.create(model="echo", input="one two three")
    finally:
        server.stop()
