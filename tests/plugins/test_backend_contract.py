"""What the gateway needs of a model comes through the backend contract and the plugins, never a backend's name.

``Backend.describe`` / ``Backend.context`` (with defaults for backends that don't care), the neutral ``models``
plugin (user models and Hugging Face checkpoints stay listed with ``llama_cpp`` disabled), each runtime's own
``PluginSettings``, and ``meshgate convert`` arriving through ``meshgate_register_commands``. In-process, on a
fresh plugin manager; the checkpoint is a tiny one written here (config and headers are all that is read).
"""

from __future__ import annotations

import argparse
import json
import struct
import sys
from pathlib import Path

import msgspec
import pytest

from meshgate.backends.base import Backend, ModelCard, ModelDescription
from meshgate.backends.checkpoints import describe_checkpoint, read_checkpoint
from meshgate.backends.registry import MAX_USER_MODELS, HidingSource, ModelRegistry, RegistrySource, UserModel
from meshgate.gateway.cli import commands as cli
from meshgate.gateway.http.runtime import control_plane
from meshgate.gateway.models import admin as model_admin
from meshgate.plugins.builtin import LlamaCppSettings
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.mlx import MlxSettings
from meshgate.plugins.settings import Settings
from meshgate.plugins.vllm import VllmSettings
from meshgate.protocols.model import InvalidRequest, UnknownModel

TINY_CONFIG = {
    "model_type": "tinyllama",
    "hidden_size": 8,
    "intermediate_size": 16,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "vocab_size": 32,
    "torch_dtype": "bfloat16",
}


def tiny_checkpoint(path: Path, name: str = "tiny:bf16") -> Path:
    """A checkpoint directory with a config, one 2x4 bfloat16 tensor per layer, a chat template and a name."""
    path.mkdir(parents=True)
    (path / "config.json").write_text(json.dumps(TINY_CONFIG))
    header, offset = {}, 0
    for layer in range(2):
        header[f"model.layers.{layer}.w"] = {"dtype": "BF16", "shape": [2, 4], "data_offsets": [offset, offset + 16]}
        offset += 16
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    (path / "model.safetensors").write_bytes(struct.pack("<Q", len(raw)) + raw + bytes(offset))
    (path / "tokenizer_config.json").write_text(json.dumps({"chat_template": "{{ messages[0]['content'] }}"}))
    (path / "meshgate.json").write_text(json.dumps({"name": name, "parameter_size": "16"}))
    return path


# ------------------------------------------------------------------------------------------- the contract


class Plain(Backend):
    """A backend that cares about neither ``context`` nor ``describe``."""

    name = "plain"


def test_describe_and_context_have_defaults_for_backends_that_do_not_care():
    card = ModelCard(name="m", path="", format="x", family="fam", context_length=2048)
    assert Plain().context(card) == 2048
    assert Plain().describe(card) == ModelDescription(
        model_info={"general.architecture": "fam", "fam.context_length": 2048}
    )
    assert Plain().describe(ModelCard(name="m", path="", format="x")) == ModelDescription()


def test_every_built_in_backend_declares_them():
    from meshgate.backends.llama_cpp import LlamaCppBackend
    from meshgate.backends.mlx import MlxBackend
    from meshgate.backends.vllm import VllmBackend
    from tests.scripted_plugin import ScriptedBackend

    for cls in (LlamaCppBackend, MlxBackend, VllmBackend, ScriptedBackend):
        assert Backend in cls.__mro__, cls  # subclasses: the defaults are inherited
    for cls in (LlamaCppBackend, MlxBackend, VllmBackend):
        assert cls.describe is not Backend.describe and cls.context is not Backend.context, cls


def test_a_checkpoint_is_described_from_its_config(tmp_path):
    card = read_checkpoint(str(tiny_checkpoint(tmp_path / "tiny")))
    assert card is not None and (card.name, card.family, card.context_length) == ("tiny:bf16", "tinyllama", 256)
    described = describe_checkpoint(card, 128)
    info = described.model_info
    assert info["general.architecture"] == "tinyllama" and info["general.parameter_count"] == 16
    assert info["tinyllama.context_length"] == 128  # the context a runner gets, not the trained 256
    assert (info["tinyllama.block_count"], info["tinyllama.embedding_length"]) == (2, 8)
    assert (info["tinyllama.attention.head_count"], info["tinyllama.attention.head_count_kv"]) == (2, 1)
    assert info["tinyllama.feed_forward_length"] == 16 and info["tinyllama.rope.freq_base"] == 10000.0
    assert described.template == "{{ messages[0]['content'] }}"
    gone = msgspec.structs.replace(card, path=str(tmp_path / "gone"))
    assert describe_checkpoint(gone, 128).model_info == {
        "general.architecture": "tinyllama",
        "tinyllama.context_length": 128,
    }


# ------------------------------------------------------------------------------------------- the registry


def test_the_registry_is_neutral_and_keeps_its_bounds(tmp_path):
    import meshgate.backends.llama_cpp.registry as old

    assert MAX_USER_MODELS == 1000 and old.ModelRegistry is ModelRegistry  # the old name still imports
    registry = ModelRegistry.in_data_dir(tmp_path)
    assert registry.path == tmp_path / "registry.json"
    checkpoint = tiny_checkpoint(tmp_path / "tiny")
    registry.put("mine:latest", UserModel(path=str(checkpoint), digest="d" * 64, created=1.0, system="hi"))
    registry.put("gone:latest", UserModel(path=str(tmp_path / "gone"), digest="0" * 64, created=1.0))
    registry.put("text:latest", UserModel(path=str(tmp_path / "registry.json"), digest="1" * 64, created=1.0))
    [card] = RegistrySource(registry, read_checkpoint).models()  # only what the reader reads, and still there
    assert (card.name, card.format, card.digest, card.created, card.source) == (
        "mine:latest",
        "safetensors",
        "d" * 64,
        1.0,
        "registry",
    )

    class Other:
        name = "other"

        def models(self):
            return [ModelCard(name=n, path="", format="x") for n in ("mine:latest", "gone:latest", "kept:latest")]

    registry.hide("kept:latest")
    assert HidingSource(Other(), registry).models() == [ModelCard(name="gone:latest", path="", format="x")]


# ------------------------------------------------------------------------------------------- settings


def test_each_runtime_reads_its_own_settings_with_the_same_names():
    core = {f.name for f in msgspec.structs.fields(Settings)}
    assert not core & {
        "llama_repack",
        "exact_batches",
        "mlx_python",
        "vllm_python",
        "vllm_tensor_parallel",
        "vllm_pipeline_parallel",
        "vllm_kv_cache_gib",
        "vllm_eager",
    }
    settings = Settings.from_env(
        {
            "MESHGATE_LLAMA_REPACK": "1",
            "MESHGATE_EXACT_BATCHES": "0",
            "MESHGATE_PORT": "80",
            "MESHGATE_MLX_PYTHON": "/mlx/bin/python",
            "MESHGATE_VLLM_PYTHON": "/v/bin/python",
            "MESHGATE_VLLM_TENSOR_PARALLEL": "2",
            "MESHGATE_VLLM_PIPELINE_PARALLEL": "3",
            "MESHGATE_VLLM_KV_CACHE_GIB": "4",
            "MESHGATE_VLLM_EAGER": "true",
            "HOME": "/root",
        }
    )
    assert settings.port == 80 and "MESHGATE_PORT" not in settings.environ and "HOME" not in settings.environ
    assert LlamaCppSettings.from_settings(settings) == LlamaCppSettings(llama_repack=True, exact_batches=False)
    assert MlxSettings.from_settings(settings).mlx_python == "/mlx/bin/python"
    assert VllmSettings.from_settings(settings) == VllmSettings(
        vllm_python="/v/bin/python",
        vllm_tensor_parallel=2,
        vllm_pipeline_parallel=3,
        vllm_kv_cache_gib=4,
        vllm_eager=True,
    )
    # unset: the defaults of before; the CLI's overrides keep what the environment gave the plugins
    assert LlamaCppSettings.from_settings(Settings()) == LlamaCppSettings(llama_repack=False, exact_batches=True)
    assert VllmSettings.from_settings(Settings()) == VllmSettings(
        vllm_python=None, vllm_tensor_parallel=1, vllm_pipeline_parallel=1, vllm_kv_cache_gib=1, vllm_eager=False
    )
    assert MlxSettings.from_settings(settings.replace(port=1)).mlx_python == "/mlx/bin/python"


async def test_the_vllm_plugin_passes_its_settings_to_its_backend(tmp_path):
    settings = Settings.from_env(
        {
            "MESHGATE_VLLM_PYTHON": sys.executable,
            "MESHGATE_VLLM_TENSOR_PARALLEL": "2",
            "MESHGATE_VLLM_KV_CACHE_GIB": "3",
            "MESHGATE_LLAMA_REPACK": "1",
        },
        data_dir=str(tmp_path),
    )
    backends: list = []
    pm = build_plugin_manager(settings)
    pm.hook.meshgate_register_backends(register=backends.append, settings=settings, http=None)
    by_name = {b.name: b for b in backends}
    assert (by_name["vllm"].tensor_per_node, by_name["vllm"].kv_cache_gib) == (2, 3)
    assert by_name["llama_cpp"].repack is True


def test_the_llama_cpp_plugin_sizes_its_kv_tiers_and_the_planner_counts_the_host_one(tmp_path):
    def backend(environ: dict[str, str]):
        settings = Settings.from_env(environ, data_dir=str(tmp_path))
        backends: list = []
        build_plugin_manager(settings).hook.meshgate_register_backends(
            register=backends.append, settings=settings, http=None
        )
        return next(b for b in backends if b.name == "llama_cpp")

    card = ModelCard(name="m", path="/m.gguf", format="gguf")
    default, set_, off = (
        backend({}),
        backend({"MESHGATE_KV_RAM_MIB": "512", "MESHGATE_KV_DISK_MIB": "1024", "MESHGATE_KV_DIR": "/srv/kv"}),
        backend({"MESHGATE_KV_RAM_MIB": "0", "MESHGATE_KV_DISK_MIB": "0"}),
    )
    assert default.kv_ram is None and default.kv_dir == str(tmp_path / "kv-cache") and 0 < default.kv_disk <= 32 << 30
    auto = default.costs(card)
    assert auto.cache(24 << 30) == 1536 << 20 and auto.cache(1 << 40) == 8 << 30, "a 16th of its node, at most 8 GiB"
    assert (set_.kv_ram, set_.kv_disk, set_.kv_dir) == (512 << 20, 1 << 30, "/srv/kv")
    assert set_.costs(card).head_bytes - off.costs(card).head_bytes == 512 << 20, "a set size is the runner's"
    assert set_.costs(card).cache(24 << 30) == off.costs(card).cache(24 << 30) == 0
    assert (off.kv_ram, off.kv_disk) == (0, 0)


# ------------------------------------------------------------------------------------------- the models plugin


@pytest.fixture
async def plane(tmp_path):
    """A gateway's control plane with the llama.cpp plugin disabled and MLX registered (never launched here)."""
    data = tmp_path / "data"
    tiny_checkpoint(data / "models" / "hf" / "tiny-bf16")
    settings = Settings.from_env(
        {"MESHGATE_MLX_PYTHON": sys.executable}, data_dir=str(data), disabled_plugins=("llama_cpp", "vllm")
    )
    async with control_plane(settings, build_plugin_manager(settings), gateway=True, agent=False) as plane:
        plane.extra["data"] = data
        yield plane


def _registry(plane) -> ModelRegistry:
    return model_admin.registry_of(str(plane.extra["data"]))


async def test_disabling_llama_cpp_keeps_checkpoints_and_their_user_models(plane):
    assert plane.plugins.get_plugin("models") is not None and plane.plugins.get_plugin("llama_cpp") is None
    assert [c.name for c in plane.catalog.models()] == ["tiny:bf16"]
    registry = _registry(plane)
    await model_admin.copy(plane.dispatcher, registry, "tiny:bf16", "mine")
    assert sorted(c.name for c in plane.catalog.models()) == ["mine:latest", "tiny:bf16"]
    shown = msgspec.json.decode(await model_admin.show(plane.dispatcher, registry, "mine"))
    assert shown["details"]["family"] == "tinyllama" and shown["model_info"]["tinyllama.block_count"] == 2
    await model_admin.delete(plane.dispatcher, registry, "mine")
    assert [c.name for c in plane.catalog.models()] == ["tiny:bf16"]
    with pytest.raises(UnknownModel):
        plane.dispatcher.resolve("mine")


async def test_show_answers_for_a_checkpoint_from_its_backend(plane):
    registry = _registry(plane)
    shown = msgspec.json.decode(await model_admin.show(plane.dispatcher, registry, "tiny:bf16"))
    assert shown["model_info"]["general.architecture"] == "tinyllama"
    assert shown["model_info"]["tinyllama.context_length"] == 256  # min(n_ctx 4096, the model's 256)
    assert shown["model_info"]["tinyllama.embedding_length"] == 8
    assert shown["details"]["format"] == "safetensors" and shown["capabilities"] == ["completion"]
    assert shown["template"] == "{{ messages[0]['content'] }}"


async def test_create_from_a_file_no_enabled_plugin_reads_is_refused(plane):
    registry = _registry(plane)
    models = plane.extra["data"] / "models"
    (models / "x.gguf").write_bytes(b"GGUF" + bytes(64))  # no llama.cpp plugin to read it
    wire = msgspec.convert({"model": "x", "from": "x.gguf"}, model_admin.ollama_models.CreateRequest)
    with pytest.raises(InvalidRequest, match="not a model file meshgate can read"):
        await model_admin.create(plane.dispatcher, registry, wire, (models.resolve(),))
    assert registry.models() == {}


# ------------------------------------------------------------------------------------------- commands


@hookimpl
def meshgate_register_commands(register):
    """This module as a plugin (``MESHGATE_PLUGINS=tests.plugins.test_backend_contract``): ``meshgate hello WHO``."""

    def hello(settings: Settings, args: argparse.Namespace) -> int:
        print(f"hello {args.who} on {settings.port}")
        return 3

    register("hello", hello, help="say hello").add_argument("who")


def test_convert_comes_through_the_hook(monkeypatch, capsys):
    monkeypatch.delenv("MESHGATE_DISABLED_PLUGINS", raising=False)
    with pytest.raises(SystemExit) as done:
        cli.main(["convert", "--help"])
    assert done.value.code == 0 and "--dtype {bfloat16,float16,float32}" in capsys.readouterr().out
    monkeypatch.setenv("MESHGATE_DISABLED_PLUGINS", "llama_cpp")
    with pytest.raises(SystemExit) as done:
        cli.main(["convert", "--help"])
    assert done.value.code == 2 and "invalid choice: 'convert'" in capsys.readouterr().err


def test_a_plugin_adds_a_command_and_cannot_take_a_built_in_one(monkeypatch, capsys):
    monkeypatch.setenv("MESHGATE_PLUGINS", __name__)
    monkeypatch.setenv("MESHGATE_PORT", "4321")
    assert cli.main(["hello", "world"]) == 3
    assert capsys.readouterr().out == "hello world on 4321\n"

    class Greedy:
        @hookimpl
        def meshgate_register_commands(self, register):
            register("serve", lambda settings, args: 0, help="mine now")

    monkeypatch.setattr(cli, "build_plugin_manager", lambda settings: build_plugin_manager(settings, extra=[Greedy()]))
    with pytest.raises(ValueError, match="'serve', which is taken"):
        cli.main(["ps"])
