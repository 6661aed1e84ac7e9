"""Hook specifications: the only contract third-party plugins code against.

A plugin is a module (or object) with functions marked ``@hookimpl`` and named after the specs below,
published in the ``meshgate`` entry-point group::

    # pyproject.toml of a plugin package
    [project.entry-points.meshgate]
    my_backend = "my_package.plugin"

    # my_package/plugin.py
    from meshgate.plugins.hookspecs import hookimpl

    @hookimpl
    def meshgate_register_backends(register, settings, http):
        register(MyBackend(http))

Hooks are synchronous (pluggy cannot await): they return objects whose methods are async. They are called
when the gateway starts (``meshgate_register_commands``: when the ``meshgate`` command starts), never at import.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Protocol

import pluggy

if TYPE_CHECKING:
    import argparse

    import httpx

    from meshgate.backends.base import Backend, ModelCard, ModelSource
    from meshgate.backends.placement import Candidate, Topology
    from meshgate.plugins.settings import Settings

__all__ = ["PROJECT", "RegisterCommand", "hookimpl", "hookspec"]

PROJECT = "meshgate"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def meshgate_register_backends(
    register: Callable[[Backend], None], settings: Settings, http: httpx.AsyncClient
) -> None:
    """Register backends: runtimes that can start runners for models.

    :param register: Call with each ``backends.base.Backend`` this plugin provides.
    :param settings: The gateway's settings.
    :param http: The gateway's shared HTTP client, for talking to runner processes.

    .. versionadded:: 0.1
    """


@hookspec
def meshgate_register_model_sources(register: Callable[[ModelSource], None], settings: Settings) -> None:
    """Register model sources: places models are found (packaged files, paths, hubs).

    :param register: Call with each ``backends.base.ModelSource`` this plugin provides.
    :param settings: The gateway's settings.

    .. versionadded:: 0.1
    """


class RegisterCommand(Protocol):
    """The ``register`` callback of ``meshgate_register_commands``."""

    def __call__(
        self, name: str, run: Callable[[Settings, argparse.Namespace], int], *, help: str
    ) -> argparse.ArgumentParser:
        """Add ``meshgate NAME`` and return its parser, for the plugin to add arguments to.

        :param name: The subcommand; one that is taken already (a built-in or another plugin's) raises
            ``ValueError``.
        :param run: Runs the command: ``run(settings, args)`` with the settings from the environment
            (``MESHGATE_*``) and the parsed arguments; returns the exit status.
        :param help: One line for ``meshgate --help``.
        """
        ...


@hookspec
def meshgate_register_commands(register: RegisterCommand) -> None:
    """Add subcommands to the ``meshgate`` command line (the llama.cpp plugin adds ``meshgate convert``).

    Called once each time ``meshgate`` starts, before its arguments are parsed, on a manager built from the
    environment: commands come from the entry points and ``MESHGATE_PLUGINS`` (not from ``--plugin``, which is
    itself one of the arguments), less ``MESHGATE_DISABLED_PLUGINS``.

    Example::

        @hookimpl
        def meshgate_register_commands(register):
            parser = register("hello", lambda settings, args: print(f"hello {args.who}") or 0, help="say hello")
            parser.add_argument("who")

    :param register: Call once per command (``RegisterCommand``): ``register(name, run, help=...)`` returns the
        command's ``argparse.ArgumentParser``.

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def meshgate_choose_backend(card: ModelCard, backends: Sequence[Backend]) -> Backend | None:
    """Choose the backend that serves ``card``.

    Stops at first non-None result.

    :param card: The model to serve.
    :param backends: Every registered backend (not only those that support ``card``), in preference order:
        those named in ``Settings.backend_preference`` first, the others in registration order.
    :return: The chosen backend, or ``None`` to leave the choice to other plugins (the built-in policy picks
        the first backend whose ``supports(card)`` is true).

    .. versionadded:: 0.1
    """


@hookspec(firstresult=True)
def meshgate_rank_candidates(candidates: list[Candidate], topology: Topology) -> list[Candidate] | None:
    """Order placement candidates, best first (the placement policy).

    Stops at first non-None result.

    :param candidates: The fitting candidates the planner found for one model (rejected ones are not passed).
    :param topology: The frozen topology snapshot they were planned on.
    :return: The candidates in preference order (a plugin may drop some), or ``None`` to leave the order to
        other plugins (the built-in policy: fewest nodes, then fastest, then least link cost, then most headroom).

    .. versionadded:: 0.1
    """
