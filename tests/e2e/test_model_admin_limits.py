"""``/api/create``, ``/api/copy`` and ``/api/delete`` under hostile clients: GGUF paths only under the data
directory or ``MESHGATE_MODEL_DIRS`` (one answer outside them, whether or not the path exists), Ollama's model
name rules, and a bounded registry of user models.

One gateway for the module with its own data directory (the packaged GGUF linked into ``models/``, so it is not
assembled again), the scripted backend, and ``MESHGATE_MODEL_DIRS`` naming one extra directory. Outside files
are hard links of the packaged GGUF (a copy where links are not possible): real GGUF files the old code read.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from meshgate.backends.llama_cpp.registry import MAX_USER_MODELS
from meshgate.protocols.model import InvalidRequest
from meshgate.protocols.ollama_models import parse_model_name
from tests.conftest import Server

OUTSIDE = "'from' must be a GGUF file under the data directory ({models}) or MESHGATE_MODEL_DIRS"


def _link(source: Path, target: Path) -> Path:
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)
    return target


@pytest.fixture(scope="module")
def tree(tmp_path_factory: pytest.TempPathFactory, packaged_gguf: Path) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("model-admin")
    data = root / "data"
    (data / "models").mkdir(parents=True)
    os.symlink(packaged_gguf, data / "models" / packaged_gguf.name)
    return {
        "root": root,
        "data": data,
        "allowed": _link(packaged_gguf, root / "allowed" / "allowed.gguf").parent,
        "outside": _link(packaged_gguf, root / "outside" / "outside.gguf"),
    }


@pytest.fixture(scope="module")
def server(tree: dict[str, Path]) -> Iterator[Server]:
    server = Server(
        tree["data"], "--plugin", "tests.scripted_plugin", env={"MESHGATE_MODEL_DIRS": str(tree["allowed"])}
    )
    yield server
    server.stop()


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def _create(http: httpx.Client, name: str, from_: str) -> httpx.Response:
    return http.post("/api/create", json={"model": name, "from": from_, "stream": False})


def _error(reply: httpx.Response) -> str:
    assert reply.status_code == 400, reply.text
    assert list(reply.json()) == ["error"]
    return reply.json()["error"]


def _tags(http: httpx.Client) -> list[str]:
    return [m["model"] for m in http.get("/api/tags").json()["models"]]


def test_a_gguf_outside_the_allowed_dirs_is_refused_as_if_it_did_not_exist(http, tree, packaged_gguf):
    refused = {
        path: _error(_create(http, "outsider", path))
        for path in [
            str(tree["outside"]),  # a real GGUF in a directory nobody allowed
            str(tree["root"] / "outside" / "none.gguf"),  # a file that does not exist, in the same place
            str(packaged_gguf),  # the file the data directory's link points at
            str(tree["data"] / "models" / packaged_gguf.name),  # that link: symlinks are followed
            "/etc/passwd",
            "/no/such/dir/x.gguf",
            "~/x.gguf",
        ]
    }
    models = (tree["data"] / "models").resolve()
    assert set(refused.values()) == {OUTSIDE.format(models=models)}, refused
    assert "outsider:latest" not in _tags(http)
    registry = tree["data"] / "registry.json"
    assert not registry.exists() or "outsider" not in registry.read_text()


def test_dot_dot_traversal_is_refused(http, tree):
    models = tree["data"] / "models"
    refused = {
        path: _error(_create(http, "climber", path))
        for path in [
            f"{models}/../../outside/outside.gguf",
            f"{models}/no-such-dir/../../../outside/outside.gguf",
            "../../outside/outside.gguf",  # relative paths start at <data_dir>/models
            "./../registry.json",
            f"{tree['allowed']}/../outside/outside.gguf",
        ]
    }
    assert set(refused.values()) == {OUTSIDE.format(models=models.resolve())}, refused


def test_a_gguf_under_model_dirs_is_accepted(http, tree):
    reply = _create(http, "allowed-model", str(tree["allowed"] / "allowed.gguf"))
    assert reply.status_code == 200, reply.text
    assert reply.json() == {"status": "success"}
    assert "allowed-model:latest" in _tags(http)
    shown = http.post("/api/show", json={"model": "allowed-model"}).json()
    assert f"FROM {(tree['allowed'] / 'allowed.gguf').resolve()}" in shown["modelfile"]
    assert http.request("DELETE", "/api/delete", json={"model": "allowed-model"}).status_code == 200


def test_inside_the_allowed_dirs_a_missing_file_says_so(http, tree):
    assert (
        _error(_create(http, "ghost", str(tree["allowed"] / "ghost.gguf")))
        == f"'from' names no file: {tree['allowed'] / 'ghost.gguf'}"
    )
    assert _error(_create(http, "ghost", "ghost.gguf")) == "'from' names no file: ghost.gguf"


@pytest.mark.parametrize(
    "name",
    [
        "",
        "bad name",
        "../../etc/passwd",
        "a/b/c/d",
        "-leading-dash",
        ".hidden",
        "ns.with.dot/model",
        "x:",
        "model:tag:extra",
        "a" * 81,
        "model:" + "t" * 81,
        "m\u00e9",
        "x\n",
        "a//b",
    ],
)
def test_invalid_names_are_refused_for_create_copy_and_delete(http, tree, name):
    created = _error(_create(http, name, str(tree["allowed"] / "allowed.gguf")))
    copied = _error(http.post("/api/copy", json={"source": "scripted", "destination": name}))
    deleted = _error(http.request("DELETE", "/api/delete", json={"model": name}))
    if name:  # an empty one is "required", as before
        assert "is invalid: a model name is [host/][namespace/]model[:tag]" in created
        assert "is invalid: a model name is [host/][namespace/]model[:tag]" in deleted
        assert copied.startswith("destination ") and "at most 80 characters" in copied


def test_valid_ollama_names_pass():
    for name in [
        "gemma3",
        "gemma3:270m",
        "my-model_2.1:q4_K_M",
        "acme/scripted:v1",
        "registry.ollama.ai/library/llama3.2:1b",
        "localhost:5000/team/model:v2",
        "a" * 80,
    ]:
        assert parse_model_name(name) == name
    assert parse_model_name("https://example.com/team/model:v2") == "example.com/team/model:v2"
    with pytest.raises(InvalidRequest) as err:
        parse_model_name("x" * 100_000, "destination")
    assert len(err.value.message) < 600  # a huge name is not echoed back whole


def test_the_registry_is_bounded(http, tree):
    registry = tree["data"] / "registry.json"
    saved = registry.read_bytes() if registry.exists() else None
    entry = {"path": str(tree["root"] / "gone.gguf"), "digest": "0" * 64, "created": 0.0}
    registry.write_text(
        json.dumps({"models": {f"stale-{i}:latest": entry for i in range(MAX_USER_MODELS)}, "hidden": []})
    )
    try:
        full = _error(_create(http, "one-too-many", str(tree["allowed"] / "allowed.gguf")))
        assert full.startswith(f"too many models: meshgate keeps at most {MAX_USER_MODELS}")
        assert _error(http.post("/api/copy", json={"source": "scripted", "destination": "another"})) == full
        # replacing an existing name is not an addition
        assert _create(http, "stale-0", str(tree["allowed"] / "allowed.gguf")).status_code == 200
        # an entry whose file has gone is listed nowhere, but delete frees its place
        assert http.request("DELETE", "/api/delete", json={"model": "stale-1"}).status_code == 200
        assert _create(http, "one-too-many", str(tree["allowed"] / "allowed.gguf")).status_code == 200
        assert len(json.loads(registry.read_text())["models"]) == MAX_USER_MODELS
    finally:
        if saved is None:
            registry.unlink(missing_ok=True)
        else:
            registry.write_bytes(saved)


def test_one_huge_system_prompt_cannot_blow_up_the_registry(http, tree):
    body = {
        "model": "windbag",
        "from": str(tree["allowed"] / "allowed.gguf"),
        "system": "x" * (17 << 20),
        "stream": False,
    }
    assert _error(http.post("/api/create", json=body)).startswith("the model registry would exceed 16 MiB")
    assert "windbag:latest" not in _tags(http)
