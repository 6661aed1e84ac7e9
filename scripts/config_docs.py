"""Write docs/configuration.md from the code that reads the settings, so the reference cannot drift.

    python scripts/config_docs.py           # (re)write docs/configuration.md
    python scripts/config_docs.py --check   # exit 1 if docs/configuration.md is not what this would write

Sources, all read from the code rather than restated here:

- ``meshgate.plugins.settings.Settings``: one row per field, its variable ``MESHGATE_<NAME>``, type and default
  from the msgspec struct, its description from the class docstring's ``Attributes:`` section;
- every ``PluginSettings`` subclass defined in ``plugins/*.py`` or ``backends/**/*.py``, the same way;
- the ``meshgate serve``/``meshgate node`` flags, from ``gateway.cli.commands.build_parser``: which setting each
  flag sets is found by passing one flag at a time through ``gateway.cli.commands._settings``.

tests/test_docs.py checks that the file equals ``render()``.
"""

from __future__ import annotations

import argparse
import importlib
import inspect
import os
import re
import sys
import types
import typing
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import msgspec

ROOT = Path(__file__).resolve().parent.parent
OUTPUT = ROOT / "docs" / "configuration.md"
if str(ROOT) not in sys.path:  # run as a script from a checkout: meshgate/ links the four packages
    sys.path.insert(0, str(ROOT))

from meshgate.gateway.cli import commands as cli  # noqa: E402
from meshgate.plugins.settings import PluginSettings, Settings  # noqa: E402

SKIP_FIELDS = {"environ"}  # filled by Settings.from_env, never read from a variable of its own
SENTINEL = "\x00config-docs\x00"


# --- descriptions --------------------------------------------------------------------------------------------


def attribute_docs(cls: type) -> dict[str, str]:
    """Field descriptions from the ``Attributes:`` section of ``cls``'s docstring (Google style), one line each."""
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    found: dict[str, list[str]] = {}
    current: list[str] | None = None
    indent: int | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            current = None
            continue
        depth = len(line) - len(line.lstrip())
        if depth == 0:  # the section ended
            break
        match = re.match(r"(\w+)\s*(?:\([^)]*\))?:\s*(.*)", line.strip())
        if match and (indent is None or depth == indent):
            indent = depth
            current = found.setdefault(match.group(1), [])
            current.append(match.group(2))
        elif current is not None:
            current.append(line.strip())
    return {name: markdown(" ".join(parts)) for name, parts in found.items()}


def markdown(text: str) -> str:
    """reStructuredText inline literals as Markdown code, safe inside a table cell."""
    return text.replace("``", "`").replace("|", "\\|").strip()


# --- types and defaults --------------------------------------------------------------------------------------


def type_name(tp: object) -> str:
    """A field's type as a reader writes the variable: ``int >= 1``, ``list of str``, ``one of a, b``."""
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if origin is typing.Annotated:
        base, *metas = args
        bounds = []
        for meta in metas:
            if isinstance(meta, msgspec.Meta):
                for attr, sign in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<")):
                    value = getattr(meta, attr)
                    if value is not None:
                        bounds.append(f"{sign} {value}")
        return " ".join([type_name(base), *bounds])
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        name = " or ".join(type_name(a) for a in rest)
        return f"{name}, optional" if len(rest) < len(args) else name
    if origin is typing.Literal:
        return "one of " + ", ".join(f"`{a}`" for a in args)
    if origin is tuple:
        return f"list of {type_name(args[0])} (comma-separated)"
    if tp is bool:
        return "bool (`1`/`true`, `0`/`false`)"
    return getattr(tp, "__name__", str(tp))


def default_text(field: msgspec.structs.FieldInfo) -> str:
    if field.default_factory is not msgspec.NODEFAULT:
        doc = inspect.getdoc(field.default_factory)
        return markdown(doc.rstrip(".")) if doc else "computed"
    value = field.default
    if value is None:
        return "unset"
    if isinstance(value, tuple):
        return f"`{','.join(map(str, value))}`" if value else "empty"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    return f"`{value}`"


# --- CLI flags -----------------------------------------------------------------------------------------------


def cli_parser() -> argparse.ArgumentParser:
    """The parser ``meshgate`` builds (``gateway.cli.commands.build_parser``), with plugins loaded from a clean
    environment."""
    with clean_environment():
        parser, _ = cli.build_parser(Settings.from_env(os.environ))
    return parser


def subparser(parser: argparse.ArgumentParser, name: str) -> argparse.ArgumentParser:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices[name]
    raise KeyError(name)


def flags_by_field(commands: tuple[str, ...] = ("serve", "node")) -> tuple[dict[str, str], list[argparse.Action]]:
    """Setting name -> flag(s) for the options of ``commands``, and the options that set no setting."""
    parser = cli_parser()
    actions: dict[str, argparse.Action] = {}
    for command in commands:
        for action in subparser(parser, command)._actions:
            if action.option_strings and action.dest != "help":
                actions.setdefault(action.dest, action)
    blank = {dest: ([] if isinstance(action, argparse._AppendAction) else None) for dest, action in actions.items()}
    with clean_environment():
        base = cli._settings(argparse.Namespace(**blank))
        flags: dict[str, str] = {}
        unmapped: list[argparse.Action] = []
        for dest, action in actions.items():
            value = [SENTINEL] if isinstance(action, argparse._AppendAction) else SENTINEL
            changed = cli._settings(argparse.Namespace(**{**blank, dest: value}))
            fields = [f for f in msgspec.structs.fields(Settings) if getattr(changed, f.name) != getattr(base, f.name)]
            if not fields:
                unmapped.append(action)
            for field in fields:
                flags[field.name] = flag_text(action)
    return flags, unmapped


def flag_text(action: argparse.Action) -> str:
    """``--placement auto|never``, ``--host``; ``(repeatable)`` for a flag that adds to a list."""
    flag = max(action.option_strings, key=len)
    text = f"`{flag} {'|'.join(map(str, action.choices))}`" if action.choices else f"`{flag}`"
    repeat = " (repeatable)" if isinstance(action, argparse._AppendAction) else ""
    return markdown(text) + repeat


@contextmanager
def clean_environment() -> Iterator[None]:
    """No ``MESHGATE_*`` variables, so what this machine sets never shows up as a default."""
    kept = {k: v for k, v in os.environ.items() if not k.startswith("MESHGATE_")}
    with mock.patch.dict(os.environ, kept, clear=True):
        yield


# --- plugin settings -----------------------------------------------------------------------------------------


def plugin_settings_classes() -> list[type[PluginSettings]]:
    """``PluginSettings`` subclasses defined in ``plugins/*.py`` and ``backends/**/*.py``, in path order."""
    found: list[type[PluginSettings]] = []
    sources = [*sorted((ROOT / "plugins").glob("*.py")), *sorted((ROOT / "backends").rglob("*.py"))]
    for path in sources:
        if not re.search(r"\(\s*PluginSettings\b", path.read_text()):
            continue
        relative = path.relative_to(ROOT).with_suffix("")
        module = importlib.import_module("meshgate." + ".".join(relative.parts).removesuffix(".__init__"))
        for _, value in sorted(vars(module).items()):
            if (
                isinstance(value, type)
                and issubclass(value, PluginSettings)
                and value is not PluginSettings
                and value.__module__ == module.__name__
            ):
                found.append(value)
    return found


def plugin_name(cls: type) -> str:
    """The entry-point name of the plugin module that defines ``cls`` (from meshgate's installed metadata)."""
    from importlib.metadata import entry_points

    for entry in entry_points(group="meshgate"):
        if entry.value == cls.__module__:
            return entry.name
    return cls.__module__


# --- the document --------------------------------------------------------------------------------------------


def table(cls: type[msgspec.Struct], flags: dict[str, str] | None) -> list[str]:
    docs = attribute_docs(cls)
    head = ["variable", "type", "default", "description"]
    if flags is not None:
        head.insert(1, "flag")
    rows = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for field in msgspec.structs.fields(cls):
        if field.name in SKIP_FIELDS:
            continue
        cells = [
            f"`MESHGATE_{field.name.upper()}`",
            type_name(field.type),
            default_text(field),
            docs.get(field.name, ""),
        ]
        if flags is not None:
            cells.insert(1, flags.get(field.name, ""))
        rows.append("| " + " | ".join(cells) + " |")
    return rows


def render() -> str:
    flags, unmapped = flags_by_field()
    out = [
        "# Configuration",
        "",
        "<!-- Generated by scripts/config_docs.py from the settings classes and gateway/cli/commands.py; do not edit.",
        "     Regenerate with `python scripts/config_docs.py`; tests/test_docs.py fails when this file is stale. -->",
        "",
        "Every setting is an environment variable `MESHGATE_<NAME>`, read once at start into one settings object "
        "that is passed down (`meshgate.plugins.settings.Settings`). A flag of `meshgate serve` or `meshgate node`, "
        "where there is one, wins over the variable; list flags add to the variable's list. Lists are "
        "comma-separated; booleans take `1`/`true` or `0`/`false`. Setting by setting, what each one does in a "
        "running gateway is explained in [operations.md](operations.md).",
        "",
        "## Core settings",
        "",
        "Read by the gateway, node agents and `meshgate models` (`Settings` in `plugins/settings.py`).",
        "",
        *table(Settings, flags),
    ]
    if unmapped:
        out += ["", "Flags of `meshgate serve` and `meshgate node` that set no variable:", ""]
        out += ["| flag | description |", "|---|---|"]
        out += [f"| {flag_text(a)} | {markdown(a.help or '')} |" for a in unmapped]
    for cls in plugin_settings_classes():
        name = plugin_name(cls)
        path = cls.__module__.removeprefix("meshgate.").replace(".", "/") + ".py"
        out += [
            "",
            f"## `{name}` plugin",
            "",
            f"`{cls.__name__}` in `{path}`: read from the environment only while the `{name}` plugin is enabled "
            f"(`MESHGATE_DISABLED_PLUGINS` does not name it).",
            "",
            *table(cls, None),
        ]
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Write docs/configuration.md from the settings classes.")
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/configuration.md is out of date")
    args = parser.parse_args(argv)
    text = render()
    if args.check:
        current = OUTPUT.read_text() if OUTPUT.exists() else ""
        if current != text:
            print(f"{OUTPUT.relative_to(ROOT)} is out of date: run `python scripts/config_docs.py`", file=sys.stderr)
            return 1
        return 0
    OUTPUT.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
