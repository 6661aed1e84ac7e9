"""The out-of-process example plugin (``examples/meshgate-subprocess``), pip-installed and served by a real gateway.

Its model ``shout:latest`` runs in a runner process the plugin starts with ``RunnerProcess`` and reads with
``RunnerClient``: the answer streams through the OpenAI SDK, the runner is the gateway's child, and a client that
leaves mid-answer cancels the generation in the runner (which says so on its stderr, relayed to the gateway's log).
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest

from tests.conftest import ROOT, Server

EXAMPLE = ROOT / "examples" / "meshgate-subprocess"


def test_the_example_imports_only_meshgate_and_the_standard_library():
    for module in sorted((EXAMPLE / "meshgate_subprocess").glob("*.py")):
        tree = ast.parse(module.read_text())
        imported = {
            alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names
        }
        imported |= {
            node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module
        }
        assert imported - set(sys.stdlib_module_names) <= {"meshgate"}, module.name
    assert "meshgate>=0.1,<1" in (EXAMPLE / "pyproject.toml").read_text()


@pytest.fixture(scope="module")
def shout_server(tmp_path_factory, data_dir: Path) -> Iterator[Server]:
    """A gateway with the example pip-installed (``--no-deps``, its entry point included) on its ``PYTHONPATH``."""
    site = tmp_path_factory.mktemp("subprocess-site")
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site), str(EXAMPLE)],
        check=True,
    )
    assert list(site.glob("meshgate_subprocess-*.dist-info/entry_points.txt"))
    server = Server(data_dir, env={"PYTHONPATH": f"{ROOT}:{site}"})
    yield server
    server.stop()


@pytest.fixture
def client(shout_server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{shout_server.url}/v1", api_key="x", max_retries=0)


def test_streams_from_a_runner_process(shout_server: Server, client: openai.OpenAI):
    assert "shout:latest" in [m.id for m in client.models.list()]
    stream = client.chat.completions.create(
        model="shout",
        stream=True,
        stream_options={"include_usage": True},
        messages=[{"role": "user", "content": "hello from the gateway"}],
    )
    chunks = list(stream)
    deltas = [c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content]
    assert deltas == ["HELLO", " FROM", " THE", " GATEWAY"]  # word by word, as the runner sent them
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == ["stop"]
    usage = chunks[-1].usage
    assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (4, 4)

    runners = shout_server.children()
    assert len(runners) == 1
    cmdline = Path(f"/proc/{runners[0]}/cmdline").read_bytes().split(b"\0")
    assert b"meshgate_subprocess.runner" in cmdline

    short = client.chat.completions.create(
        model="shout:latest", max_tokens=2, messages=[{"role": "user", "content": "one two three"}]
    )
    assert (short.choices[0].message.content, short.choices[0].finish_reason) == ("ONE TWO", "length")
    assert shout_server.children() == runners  # the same runner served both


def test_a_client_that_leaves_cancels_the_runners_generation(shout_server: Server, client: openai.OpenAI):
    words = 1000  # ten seconds of output at the runner's pace
    with client.chat.completions.create(
        model="shout", stream=True, messages=[{"role": "user", "content": "word " * words}]
    ) as stream:
        received = list(itertools.islice(stream, 5))
    assert received  # then the with block closed the connection mid-answer
    deadline = time.monotonic() + 5
    while "meshgate-subprocess runner: cancelled after" not in shout_server.log.read_text(errors="replace"):
        assert time.monotonic() < deadline, "the runner did not cancel the generation"
        time.sleep(0.05)
    line = next(
        line
        for line in shout_server.log.read_text(errors="replace").splitlines()
        if "meshgate-subprocess runner: cancelled after" in line
    )
    assert int(line.split("cancelled after ")[1].split()[0]) < words // 2  # stopped within seconds, not at the end

    after = client.chat.completions.create(model="shout", messages=[{"role": "user", "content": "still here"}])
    assert after.choices[0].message.content == "STILL HERE"  # the runner serves on
