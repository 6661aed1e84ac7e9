"""Fixtures: real gateway processes (``meshgate serve``) on free loopback ports, sharing one data directory.

The data directory lives under ``.cache/test-data`` in the repository (or ``MESHGATE_TEST_DATA``) so the packaged
GGUF is assembled once, not per run.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parent.parent
MODEL = "gemma3:270m"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """A ``meshgate serve`` subprocess."""

    def __init__(self, data_dir: Path, *args: str, env: dict[str, str] | None = None) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = data_dir / f"server-{self.port}.log"
        # SIGTERM (``stop``) lets open streams finish for 5 s, not the default 30, unless a test says otherwise
        # each gateway's llama.cpp runners start with an empty disk tier of their own unless a test gives one
        self.kv_dir = None if "MESHGATE_KV_DIR" in (env or {}) else tempfile.mkdtemp(prefix="meshgate-kv-")
        kv = {"MESHGATE_KV_DIR": self.kv_dir} if self.kv_dir else {}
        full_env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHGATE_DRAIN_GRACE": "5", **kv, **(env or {})}
        full_env.pop("MESHGATE_API_KEYS", None)
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "meshgate.gateway.cli",
                    "serve",
                    "--port",
                    str(self.port),
                    "--data-dir",
                    str(data_dir),
                    "--log-level",
                    "warning",
                    *args,
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=full_env,
                cwd=ROOT,
            )
        self._wait_ready()

    def _wait_ready(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited early:\n{self.log.read_text()}")
            try:
                if httpx.get(f"{self.url}/api/version", timeout=1).status_code == 200:
                    return
            except httpx.HTTPError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"server not ready in {timeout}s:\n{self.log.read_text()}")

    def children(self) -> list[int]:
        """Pids of the server's child processes (runners)."""
        path = Path(f"/proc/{self.proc.pid}/task/{self.proc.pid}/children")
        return [int(p) for p in path.read_text().split()] if path.exists() else []

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.kv_dir:
            shutil.rmtree(self.kv_dir, ignore_errors=True)


@pytest.fixture(scope="session")
def data_dir() -> Path:
    path = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="session")
def packaged_gguf(data_dir: Path) -> Path:
    """The packaged Gemma 3 270M GGUF, assembled into the test data directory (as the gateway does)."""
    from meshgate.backends.llama_cpp.sources import PackagedGGUFSource

    return Path(PackagedGGUFSource(data_dir / "models").models()[0].path)


@pytest.fixture(scope="session")
def converted_gemma(packaged_gguf: Path) -> Path:
    """The packaged GGUF as a bfloat16 Hugging Face checkpoint (``meshgate convert``'s output) for MLX and vLLM.

    Written once under ``<data_dir>/converted`` (outside ``models/hf``, so the shared gateways do not list it) and
    reused while its ``meshgate.json`` names the same GGUF and converter version.
    """
    import json

    from meshgate.backends.checkpoints import is_checkpoint
    from meshgate.backends.llama_cpp.convert import CONVERTER_VERSION, convert

    target = packaged_gguf.parent.parent / "converted" / "gemma3-270m-bf16"
    marker = target / "meshgate.json"
    if is_checkpoint(target) and marker.is_file():
        meta = json.loads(marker.read_text())
        if meta.get("source") == str(packaged_gguf.resolve()) and meta.get("converter") == CONVERTER_VERSION:
            return target
    return convert(packaged_gguf, target, dtype="bfloat16", name="gemma3:270m-bf16")


@pytest.fixture(scope="session")
def real_server(data_dir: Path) -> Iterator[Server]:
    """A gateway with the built-in plugins and the real Gemma 3 270M model."""
    server = Server(data_dir, "--n-ctx", "2048")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def scripted_server(data_dir: Path) -> Iterator[Server]:
    """A gateway that also loads the scripted test backend (model ``scripted``)."""
    server = Server(data_dir, "--plugin", "tests.scripted_plugin")
    yield server
    server.stop()


# ------------------------------------------------------------------ the "runtime" marker

_RUNTIME_FIXTURES = {
    "data_dir",
    "packaged_gguf",
    "converted_gemma",
    "real_server",
    "scripted_server",
    "redis_server",
    "store_kind",
}
"""Fixtures that start processes (gateways, runners, redis-server) or build models: a test using one is slow."""

_RUNTIME_DIRS = {"e2e", "llama", "mlx", "vllm", "convert", "compat"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "runtime: starts real processes (gateways, runtimes, Redis); "
        "`pytest -m 'not runtime'` runs the fast in-process tests",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``runtime`` what starts processes: tests under the runtime folders, or using such a fixture, or in a
    module that runs subprocesses itself. The simulator's (``tests/sim``) start only Python processes that need
    nothing built: they run with the in-process tests, while ``scripts/test`` still makes the runtimes' venvs."""
    for item in items:
        path = Path(str(item.fspath)).relative_to(ROOT / "tests")
        module = getattr(item, "module", None)
        spawns = module is not None and "subprocess" in vars(module) and path.parts[0] != "sim"
        if path.parts[0] in _RUNTIME_DIRS or _RUNTIME_FIXTURES & set(getattr(item, "fixturenames", ())) or spawns:
            item.add_marker(pytest.mark.runtime)
