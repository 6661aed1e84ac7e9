"""``meshgate bench`` as a person runs it: a subprocess against the shared real-model gateway, at tiny sizes
(16-token prompts, 8 tokens out, 1 and 2 streams, one repetition): the table, ``--json``'s document, ``--plot``'s
PNG, and a clear failure for a model the gateway does not have."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import MODEL, ROOT, Server

TINY = ["--model", MODEL, "--prompt-tokens", "16", "--gen-tokens", "8", "--concurrency", "1,2", "--repetitions", "1"]


def bench(server: Server, *args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "bench", "--url", server.url, *args],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )


@pytest.fixture(scope="module")
def document(real_server: Server) -> dict:
    done = bench(real_server, *TINY, "--json")
    assert done.returncode == 0, done.stderr
    assert "[1/2] c=1 prompt=16 gen=8 rep 1/1" in done.stderr and "[2/2] c=2 prompt=16 gen=8 rep 1/1" in done.stderr
    return json.loads(done.stdout)


def test_json_has_every_cell_with_sensible_numbers(document: dict) -> None:
    assert document["model"] == MODEL and document["endpoint"] == "/v1/completions"
    cells = document["results"]
    assert [(c["prompt_tokens"], c["gen_tokens"], c["concurrency"]) for c in cells] == [(16, 8, 1), (16, 8, 2)]
    for cell in cells:
        assert cell["repetitions"] == 1 and len(cell["runs"]) == 1
        assert cell["measured_prompt_tokens"] == 16  # the calibrated prompt is exactly the size asked for
        assert 1 <= cell["measured_gen_tokens"] <= 8
        for metric in ("prompt_tps", "gen_tps", "ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
            assert cell[metric]["mean"] > 0 and cell[metric]["stdev"] == 0, (metric, cell)
        assert cell["ttft_p99"]["mean"] >= cell["ttft_p50"]["mean"]
        assert cell["prompt_tps"]["mean"] == pytest.approx(16 / cell["ttft_p50"]["mean"], rel=0.5)


def test_json_names_the_placement_and_its_memory(document: dict) -> None:
    where = document["placement"]
    assert where["backend"] == "llama_cpp" and where["strategy"] == "single" and where["state"] == "ready"
    assert where["nodes"] and all(m > 100 << 20 for m in where["memory_per_node"].values())
    assert set(where["memory_per_node"]) == {n["node_id"] for n in where["nodes"]}


def test_table_and_plot(real_server: Server, tmp_path: Path) -> None:
    png = tmp_path / "bench.png"
    done = bench(real_server, *TINY, "--plot", str(png))
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert lines[0].startswith(f"model: {MODEL} at {real_server.url}")
    assert lines[1].startswith("placement: llama_cpp single on ") and "runner memory" in lines[1]
    head = next(i for i, line in enumerate(lines) if "prompt tok/s" in line)
    assert "gen tok/s" in lines[head] and "TTFT p99 ms" in lines[head] and "ITL p50 ms" in lines[head]
    rows = [line.split() for line in lines[head + 2 : head + 4]]
    assert [row[:3] for row in rows] == [["1", "16", "8"], ["2", "16", "8"]]
    assert all(float(row[3]) > 0 and row[4] == "±" for row in rows)  # prompt tok/s, mean ± stdev
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert f"wrote {png}" in done.stderr


def test_unknown_model_fails_with_the_gateways_message(real_server: Server) -> None:
    done = bench(real_server, "--model", "no-such:model", "-p", "16", "-n", "4", "-c", "1", "-r", "1", timeout=120)
    assert done.returncode == 1 and done.stdout == ""
    assert "meshgate bench: HTTP 404" in done.stderr and "no-such:model" in done.stderr


def test_bad_sizes_are_refused_before_any_request(real_server: Server) -> None:
    done = bench(real_server, "--concurrency", "1,x", timeout=60)
    assert done.returncode == 2 and "comma-separated whole numbers" in done.stderr
