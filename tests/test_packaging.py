"""``pip install meshgate`` puts everything under ``meshgate``; ``import meshgate`` is the whole plugin API."""

from __future__ import annotations

import ast
import subprocess
import sys
import tomllib
import zipfile

import meshgate
from tests.conftest import ROOT

PARTS = ("protocols", "backends", "plugins", "gateway")


def test_every_package_folder_is_listed_for_the_build():
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    found = {"meshgate"} | {
        "meshgate." + ".".join(init.parent.relative_to(ROOT).parts)
        for part in PARTS
        for init in (ROOT / part).rglob("__init__.py")
    }
    assert set(config["packages"]) == found
    assert config["package-dir"] == {"meshgate": "meshgate", **{f"meshgate.{p}": p for p in PARTS}}


def test_the_wheel_holds_only_the_meshgate_package(tmp_path):
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path), str(ROOT)],
        check=True,
        capture_output=True,
    )
    wheel = next(tmp_path.glob("meshgate-*.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert tops == {"meshgate"}
    assert {
        "meshgate/__init__.py",
        "meshgate/gateway/http/app.py",
        "meshgate/gateway/cli/__main__.py",
        "meshgate/backends/runner/bindshim.c",
        "meshgate/protocols/model.py",
        "meshgate/plugins/hookspecs.py",
        "meshgate/gateway/http/ui/index.html",  # the dashboard (package data)
        "meshgate/gateway/http/ui/dashboard.js",
        "meshgate/gateway/http/ui/wire.js",
        "meshgate/gateway/http/ui/dashboard.css",
    } <= set(names)
    entry = zipfile.ZipFile(wheel).read(next(n for n in names if n.endswith("entry_points.txt"))).decode()
    assert "meshgate = meshgate.gateway.cli.commands:main" in entry and "meshgate.plugins.builtin" in entry


def test_the_public_api_is_one_import():
    for name in (
        "hookimpl",
        "Backend",
        "Runner",
        "Capabilities",
        "ModelCard",
        "ModelSource",
        "Request",
        "TextDelta",
        "Finished",
        "GatewayError",
        "InvalidRequest",
        "Candidate",
        "Shard",
        "ShardCosts",
        "ModelSpec",
        "InProcess",
        "Settings",
    ):
        assert getattr(meshgate, name) is not None, name
    assert meshgate.API_VERSION == 1


def test_the_example_plugin_imports_only_meshgate():
    tree = ast.parse((ROOT / "examples/meshgate-echo/meshgate_echo/plugin.py").read_text())
    imported = {
        alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
    }
    imported |= {
        node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
    }
    assert imported - set(sys.stdlib_module_names) == {"meshgate"}
    assert "meshgate>=0.1,<1" in (ROOT / "examples/meshgate-echo/pyproject.toml").read_text()
