"""Which backend serves a model several can serve: ``MESHGATE_BACKEND_PREFERENCE``, through the real control plane.

Three scripted backends, registered by a plugin on a fresh manager, all serve safetensors; two serve GGUF. The control
plane orders them by the setting and the built-in policy picks the first that supports the card.
"""

from __future__ import annotations

import asyncio

from meshgate.backends.base import ModelCard
from meshgate.gateway.http.runtime import control_plane
from meshgate.plugins.hookspecs import hookimpl
from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.policy import by_preference
from meshgate.plugins.settings import Settings

SAFETENSORS = ModelCard(name="m", path="", format="safetensors")
GGUF = ModelCard(name="g", path="", format="gguf")


class Scripted:
    def __init__(self, name: str, formats: set[str]) -> None:
        self.name = name
        self.formats = formats

    def supports(self, card: ModelCard) -> bool:
        return card.format in self.formats


class ThreeBackends:
    """Registers mlx, llama_cpp and vllm stand-ins, in that order (as if entry points loaded so)."""

    @hookimpl
    def meshgate_register_backends(self, register, settings, http) -> None:
        register(Scripted("mlx", {"safetensors"}))
        register(Scripted("llama_cpp", {"gguf"}))
        register(Scripted("vllm", {"safetensors", "gguf"}))


def _chosen(environ: dict[str, str]) -> tuple[list[str], str, str]:
    settings = Settings.from_env(environ, disabled_plugins=("llama_cpp", "mlx", "vllm"))
    pm = build_plugin_manager(settings, extra=[ThreeBackends()])

    async def run() -> tuple[list[str], str, str]:
        async with control_plane(settings, pm, gateway=False, agent=False) as plane:
            choose = pm.hook.meshgate_choose_backend
            return (
                [b.name for b in plane.backends],
                choose(card=SAFETENSORS, backends=plane.backends).name,
                choose(card=GGUF, backends=plane.backends).name,
            )

    return asyncio.run(run())


def test_default_prefers_vllm_then_mlx_then_registration_order() -> None:
    order, safetensors, gguf = _chosen({})
    assert order == ["vllm", "mlx", "llama_cpp"]
    assert safetensors == "vllm" and gguf == "vllm"


def test_the_setting_reorders_and_unnamed_backends_keep_registration_order() -> None:
    order, safetensors, gguf = _chosen({"MESHGATE_BACKEND_PREFERENCE": "llama_cpp, mlx"})
    assert order == ["llama_cpp", "mlx", "vllm"]
    assert safetensors == "mlx" and gguf == "llama_cpp"


def test_an_empty_preference_is_registration_order() -> None:
    order, safetensors, _ = _chosen({"MESHGATE_BACKEND_PREFERENCE": ""})
    assert order == ["mlx", "llama_cpp", "vllm"] and safetensors == "mlx"


def test_by_preference_is_stable_and_ignores_unknown_names() -> None:
    backends = [Scripted(n, set()) for n in ("a", "b", "c", "d")]
    assert [b.name for b in by_preference(backends, ("nope", "c", "a"))] == ["c", "a", "b", "d"]
