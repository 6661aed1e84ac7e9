"""Build a plugin manager: the ``meshgate`` entry-point group (built-ins included) plus configured modules.

meshgate's own backends are published in its own ``pyproject.toml`` under the same entry-point group as
third-party ones, so they load through the same path. No module-level manager: each gateway builds its own.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterable
from types import ModuleType

import pluggy

from meshgate.plugins import hookspecs
from meshgate.plugins.settings import Settings

__all__ = ["build_plugin_manager"]


def build_plugin_manager(settings: Settings, extra: Iterable[object | ModuleType] = ()) -> pluggy.PluginManager:
    """A fresh manager with the hook specs, the ``meshgate`` entry points, ``settings.plugins`` and ``extra``.

    ``settings.disabled_plugins`` names entry points (or module names) that are blocked.
    """
    pm = pluggy.PluginManager(hookspecs.PROJECT)
    pm.add_hookspecs(hookspecs)
    for name in settings.disabled_plugins:
        pm.set_blocked(name)
    pm.load_setuptools_entrypoints(hookspecs.PROJECT)
    for module_name in settings.plugins:
        if not pm.is_blocked(module_name):
            pm.register(importlib.import_module(module_name), name=module_name)
    for plugin in extra:
        pm.register(plugin)
    return pm
