"""meshgate: one inference gateway for OpenAI, Anthropic and Ollama clients, over models split across machines.

This module is the public plugin API (see ``docs/plugins.md``): a plugin imports ``meshgate`` and nothing else::

    import meshgate

    class EchoBackend(meshgate.Backend): ...

    @meshgate.hookimpl
    def meshgate_register_backends(register, settings, http):
        register(EchoBackend())

The code lives in ``meshgate.protocols`` (wire formats and the internal model), ``meshgate.backends`` (the
backend contract, placement types, the runtimes), ``meshgate.plugins`` (hooks, settings, the built-in plugins)
and ``meshgate.gateway`` (the server and control plane). In the repository these are the top-level folders
``protocols/``, ``backends/``, ``plugins/`` and ``gateway/``: ``pyproject.toml`` maps them under this package when
it is installed, and the links in this folder do the same in a checkout (``PYTHONPATH`` = the repository, as for
runner processes started with another interpreter).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
API_VERSION = 1
"""The plugin API's version: hooks and the names below change only with a new major meshgate version."""

_HOME = {  # public name -> the module that defines it; loaded on first use, so a runner process that imports
    # ``meshgate.backends.x`` (perhaps in another interpreter, without the gateway's dependencies) loads only that
    **dict.fromkeys(
        [
            "Backend",
            "Capabilities",
            "InProcess",
            "Launched",
            "ModelCard",
            "ModelDescription",
            "ModelSource",
            "Peers",
            "Runner",
            "basic_model_info",
            "check_capabilities",
            "check_embeddings",
        ],
        "meshgate.backends.base",
    ),
    **dict.fromkeys(
        [
            "Candidate",
            "InstanceId",
            "Link",
            "ModelSpec",
            "Node",
            "NodeId",
            "Shard",
            "ShardCosts",
            "Strategy",
            "Topology",
        ],
        "meshgate.backends.placement",
    ),
    **dict.fromkeys(["hookimpl", "hookspec"], "meshgate.plugins.hookspecs"),
    **dict.fromkeys(["Settings", "PluginSettings"], "meshgate.plugins.settings"),
    # the runner seam, for out-of-process backends (examples/meshgate-subprocess)
    "serve": "meshgate.backends.runner.server",
    "RunnerClient": "meshgate.backends.runner.client",
    "RunnerProcess": "meshgate.backends.runner.process",
}

if TYPE_CHECKING:
    from meshgate.backends.base import *  # noqa: F403
    from meshgate.backends.placement import *  # noqa: F403
    from meshgate.backends.runner.client import RunnerClient  # noqa: F401  # for type checkers
    from meshgate.backends.runner.process import RunnerProcess  # noqa: F401  # for type checkers
    from meshgate.backends.runner.server import serve  # noqa: F401  # for type checkers
    from meshgate.plugins.hookspecs import hookimpl, hookspec  # noqa: F401  # for type checkers
    from meshgate.plugins.settings import PluginSettings, Settings  # noqa: F401  # for type checkers
    from meshgate.protocols.model import *  # noqa: F403


def _model_names() -> list[str]:
    return list(importlib.import_module("meshgate.protocols.model").__all__)


def __getattr__(name: str) -> Any:
    """``meshgate.Backend`` and the rest of the public API, imported when first asked for."""
    module = _HOME.get(name)
    if module is None and not name.startswith("_") and name in _model_names():
        module = "meshgate.protocols.model"  # the internal request, events and errors
    if module is None:
        raise AttributeError(f"module 'meshgate' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_HOME, *_model_names()})


__all__ = ["API_VERSION", *_HOME]  # plus every name of meshgate.protocols.model, through __getattr__
