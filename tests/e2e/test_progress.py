"""Progress for long operations, as a person or an Ollama client sees it: ``meshgate place`` following the
instance's events until it is ready, and ``/api/pull``'s streamed progress objects read by the ``ollama`` client
(growing ``completed`` while the model is read through, then the digest checked; a corrupt file fails as Ollama's
"digest mismatch"). ``meshgate convert``'s progress is checked where it runs (tests/convert/test_convert.py).

One gateway for the module with its own data directory (the packaged GGUF linked in), so the instance it places
and the model it corrupts never reach other tests' servers.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import ollama
import pytest

from tests.conftest import MODEL, ROOT, Server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, packaged_gguf: Path) -> Iterator[Server]:
    data = tmp_path_factory.mktemp("progress")
    (data / "models").mkdir()
    os.symlink(packaged_gguf, data / "models" / packaged_gguf.name)
    server = Server(data, "--n-ctx", "1024")
    yield server
    server.stop()


@pytest.fixture(scope="module")
def client(server: Server) -> ollama.Client:
    return ollama.Client(host=server.url)


def test_place_prints_progress_until_ready(server: Server) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "place", MODEL, "--url", server.url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0, done.stderr
    instance = json.loads(done.stdout)
    try:
        assert instance["state"]["state"] == "ready" and instance["model"] == MODEL
        lines = done.stderr.splitlines()
        assert lines[0].startswith(f"placing {MODEL} as instance {instance['id']}: llama_cpp single on ")
        assert "MiB" in lines[0]
        said = [line.split("] ", 1)[1] for line in lines[1:]]  # "[   1.2s] starting"
        assert said.index("starting") < said.index("ready"), done.stderr
        node = next(iter(instance["runners"]))
        assert said.index(f"runner on {node} starting") < said.index(f"runner on {node} ready"), done.stderr
    finally:
        httpx.delete(f"{server.url}/instances/{instance['id']}", params={"grace": 0}, timeout=30)


def test_place_no_wait_returns_once_created(server: Server) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "place", MODEL, "--no-wait", "--url", server.url],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert done.returncode == 0 and done.stderr == "", done.stderr
    instance = json.loads(done.stdout)
    httpx.delete(f"{server.url}/instances/{instance['id']}", params={"grace": 0}, timeout=30)
    assert instance["state"]["state"] == "starting"


def test_pull_streams_progress_as_the_model_is_read(client: ollama.Client, packaged_gguf: Path) -> None:
    progress = list(client.pull(MODEL, stream=True))
    statuses = [p.status for p in progress]
    assert statuses[0] == "pulling manifest"
    assert statuses[-3:] == ["verifying sha256 digest", "writing manifest", "success"]
    sized = [p for p in progress if p.total]
    size = packaged_gguf.stat().st_size
    assert all(p.total == size and p.digest == sized[0].digest for p in sized)
    completed = [p.completed for p in sized]
    assert completed[0] == 0 and completed[-1] == size
    assert completed == sorted(completed) and len(set(completed)) >= 10  # at least each 1% or 8 MiB
    assert statuses.index("verifying sha256 digest") > max(i for i, p in enumerate(progress) if p.total)


def _tiny_gguf(path: Path) -> None:
    """A valid GGUF header and one small tensor: enough for a user model's card."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), "llama")
    writer.add_block_count(1)
    writer.add_context_length(64)
    writer.add_tensor("token_embd.weight", np.zeros((8, 4), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_pull_of_a_file_that_changed_fails_with_digest_mismatch(client: ollama.Client, server: Server) -> None:
    path = Path(server.log).parent / "models" / "tiny-progress.gguf"
    _tiny_gguf(path)
    try:
        assert client.create("tiny-progress", from_=path.name).status == "success"
        assert client.pull("tiny-progress").status == "success"  # unchanged: its digest matches
        with open(path, "r+b") as f:  # flip the last byte of the tensor data
            f.seek(-1, os.SEEK_END)
            last = f.read(1)
            f.seek(-1, os.SEEK_END)
            f.write(bytes([last[0] ^ 0xFF]))
        with pytest.raises(ollama.ResponseError) as streamed:
            for _ in client.pull("tiny-progress", stream=True):
                pass
        assert "digest mismatch, file must be downloaded again: want sha256:" in streamed.value.error
        with pytest.raises(ollama.ResponseError) as whole:
            client.pull("tiny-progress")
        assert whole.value.status_code == 500 and "digest mismatch" in whole.value.error
    finally:
        client.delete("tiny-progress")
        path.unlink()
