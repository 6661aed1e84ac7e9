"""The framework examples (``examples/frameworks``) against a default-started gateway serving the real Gemma 3 270M.

Each example (LangChain over the three protocols, pydantic-ai over OpenAI and Anthropic, LiteLLM, and the official
JavaScript SDKs) runs plain chat, streaming, a forced tool call, structured output with a bounded integer, and a
typed answer whose integer has no bounds within 48 tokens (issue 36: it ran on until the token limit), and prints
``ok``/``FAIL`` per check. They run at once (the runner batches them in its slots), so the suite waits for
the slowest, not the sum. Nothing is installed here: the ``frameworks`` extra and ``npm ci`` in
``examples/frameworks/js`` come with ``scripts/test``.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.conftest import MODEL, ROOT, Server

HERE = ROOT / "examples" / "frameworks"
CHECKS = ("chat", "stream", "forced tool", "structured", "typed")
EXAMPLES = {
    "langchain-openai": ([sys.executable, "langchain_openai_example.py"], 1),
    "langchain-anthropic": ([sys.executable, "langchain_anthropic_example.py"], 1),
    "langchain-ollama": ([sys.executable, "langchain_ollama_example.py"], 1),
    "pydantic-ai": ([sys.executable, "pydantic_ai_example.py"], 2),  # its OpenAI and Anthropic providers
    "litellm": ([sys.executable, "litellm_example.py"], 1),
    "js openai": (["node", "js/openai.mjs"], 1),
    "js anthropic": (["node", "js/anthropic.mjs"], 1),
    "js ollama": (["node", "js/ollama.mjs"], 1),
}


@pytest.fixture(scope="module")
def results(data_dir: Path) -> Iterator[dict[str, subprocess.CompletedProcess]]:
    server = Server(data_dir)
    try:
        r = httpx.post(f"{server.url}/api/generate", json={"model": MODEL}, timeout=300)  # load it first
        assert r.status_code == 200, r.text
        env = {
            **os.environ,
            "MESHGATE_URL": server.url,
            "MESHGATE_MODEL": MODEL,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",
        }
        procs = {
            name: subprocess.Popen(cmd, cwd=HERE, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
            for name, (cmd, _) in EXAMPLES.items()
        }
        done = {}
        for name, proc in procs.items():
            try:
                out, err = proc.communicate(timeout=600)
            except subprocess.TimeoutExpired:
                proc.kill()
                out, err = proc.communicate()
            done[name] = subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
        yield done
    finally:
        server.stop()


@pytest.mark.parametrize("name", EXAMPLES)
def test_example_passes_its_checks(results, name):
    result, providers = results[name], EXAMPLES[name][1]
    lines = [line for line in result.stdout.splitlines() if line.startswith(("ok ", "FAIL "))]
    print(f"\n{name}:\n" + "\n".join(lines))
    failed = [line for line in lines if line.startswith("FAIL ")]
    assert not failed, "\n".join(failed) + "\n" + result.stderr[-3000:]
    assert len(lines) == len(CHECKS) * providers, result.stdout + result.stderr[-3000:]
    assert all(any(f" {check}: " in line for line in lines) for check in CHECKS), lines
    assert result.returncode == 0, result.stderr[-3000:]
