"""The MLX backend's pieces: the tiny test model, the engine, the runner, two ranks over the ring backend.

Everything MLX runs in subprocesses of the MLX venv's python (``.cache/venvs/mlx``, made by the first test run
with ``mlx[cpu]``, ``mlx-lm[cpu]`` and the runner's own needs; ``MESHGATE_MLX_PYTHON`` points at another), with
``PYTHONPATH`` at the repo root. Every process is bounded by a timeout and killed on the way out.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

ROOT = Path(__file__).resolve().parents[2]
MLX_REQUIREMENTS = ("mlx[cpu]==0.32.4", "mlx-lm[cpu]==0.32.2", "tokenizers", "msgspec", "uvicorn", "httpx")
HERE = Path(__file__).parent
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}

sys.path.insert(0, str(ROOT))


@functools.cache
def mlx_python() -> Path:
    if os.environ.get("MESHGATE_MLX_PYTHON"):
        return Path(os.environ["MESHGATE_MLX_PYTHON"])
    from tests.compat.venvs import venv_python

    return venv_python("mlx", *MLX_REQUIREMENTS)


def _mlx(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    done = subprocess.run([str(mlx_python()), *args], env=ENV, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert done.returncode == 0, done.stderr[-2000:]
    return done


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-mlx") / "model"
    _mlx(str(HERE / "tiny_model.py"), str(path))
    return path


@pytest.fixture(scope="module")
def one_rank(tiny: Path) -> dict:
    return json.loads(_mlx(str(HERE / "rank_check.py"), str(tiny)).stdout.splitlines()[-1])


def test_tiny_model_builds_byte_identical(tiny: Path, tmp_path: Path) -> None:
    again = tmp_path / "again"
    _mlx(str(HERE / "tiny_model.py"), str(again))
    names = sorted(p.name for p in tiny.iterdir())
    assert "model.safetensors.index.json" in names and "tokenizer.json" in names
    assert all((tiny / n).read_bytes() == (again / n).read_bytes() for n in names)


def test_engine_matches_mlx_lm_generate(tiny: Path, one_rank: dict) -> None:
    script = ("import sys, json; from mlx_lm import load; from mlx_lm.generate import stream_generate\n"
              "m, t = load(sys.argv[1])\n"
              "out = []\n"
              "for p in json.loads(sys.argv[2]):\n"
              "    ids = t.apply_chat_template([{'role': 'user', 'content': p}], add_generation_prompt=True)\n"
              "    out.append([r.token for r in stream_generate(m, t, ids, max_tokens=32)])\n"
              "print(json.dumps(out))")
    prompts = [r["prompt"] for r in one_rank["results"]]
    reference = json.loads(_mlx("-c", script, str(tiny), json.dumps(prompts)).stdout.splitlines()[-1])
    for ours, theirs in zip(one_rank["results"], reference):
        eos = 1  # mlx-lm yields the end token; the engine stops before it
        assert ours["tokens"] == [t for t in theirs if t != eos][:len(ours["tokens"])]
        assert len(ours["tokens"]) == 32 or ours["finish"] == "stop"


def test_two_rank_tensor_sharding_is_token_identical(tiny: Path, one_rank: dict) -> None:
    from backends.mlx.launch import launch

    ranks = launch(2, [str(mlx_python()), str(HERE / "rank_check.py"), str(tiny)], env=ENV, cwd=ROOT,
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        outs = [p.communicate(timeout=120) for p in ranks.procs]
        codes = [p.returncode for p in ranks.procs]
    finally:
        ranks.close()
    assert codes == [0, 0], [err[-1500:] for _, err in outs]
    two = json.loads(outs[0][0].splitlines()[-1])
    assert two["ranks"] == 2 and two["sharded"] == "AllToShardedLinear"
    assert one_rank["sharded"] == "Linear"
    assert [r["tokens"] for r in two["results"]] == [r["tokens"] for r in one_rank["results"]]
    assert [r["text"] for r in two["results"]] == [r["text"] for r in one_rank["results"]]


def _ready_port(proc: subprocess.Popen, deadline: float) -> int:
    assert proc.stdout is not None
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if line.startswith("MESHGATE_RUNNER_READY"):
            return int(line.split("port=")[1])
        if not line and proc.poll() is not None:
            break
    raise AssertionError(f"runner not ready (rc={proc.poll()})")


def _generate(port: int, text: str) -> list[dict]:
    body = {"model": "tiny", "messages": [{"role": "user", "parts": [{"type": "text", "text": text}]}],
            "sampling": {"temperature": 0.0}, "max_tokens": 32}
    with httpx.Client(timeout=60) as client:
        assert client.get(f"http://127.0.0.1:{port}/health").json()["status"] == "ok"
        reply = client.post(f"http://127.0.0.1:{port}/generate", json=body)
    return [json.loads(line) for line in reply.text.splitlines() if line]


@pytest.mark.parametrize("n", [1, 2])
def test_runner_streams_the_same_events_on_one_and_two_ranks(tiny: Path, one_rank: dict, n: int) -> None:
    from backends.mlx.launch import launch

    argv = [str(mlx_python()), "-m", "backends.mlx.runner", "--model", str(tiny)]
    ranks = launch(n, argv, env=ENV, cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                   stderr=subprocess.DEVNULL, text=True)
    try:
        port = _ready_port(ranks.procs[0], time.monotonic() + 90)
        for expected in one_rank["results"][:2]:
            events = _generate(port, expected["prompt"])
            kinds = [e["type"] for e in events]
            assert kinds[0] == "usage" and kinds[-2:] == ["usage", "finished"] and set(kinds[1:-2]) == {"text"}
            assert "".join(e["text"] for e in events if e["type"] == "text") == expected["text"]
            assert events[-2]["completion_tokens"] == len(expected["tokens"])
    finally:
        ranks.close()
