"""A real gateway's node agent measures llama.cpp on this machine and the previews estimate speed from it.

Sane bounds only: whether the estimates match measured speed is ``benchmarks/previews.py``'s question.
"""

from __future__ import annotations

from pathlib import Path

import httpx
import msgspec
import pytest

from meshgate.backends.llama_cpp import spec_from_gguf
from meshgate.backends.llama_cpp.calibrate import cache_key, calibrate, default_cache_dir
from meshgate.backends.placement import Calibration, Candidate, Node
from meshgate.gateway.cluster import costs
from tests.cluster.test_cluster_e2e import wait_for
from tests.conftest import Server


def calibrated(server: Server) -> dict | None:
    node = httpx.get(f"{server.url}/cluster").json()["nodes"][0]
    return node if "llama_cpp" in node.get("calibration", {}) else None


@pytest.fixture(scope="module")
def server(data_dir: Path):
    gateway = Server(data_dir, "--n-ctx", "4096")
    yield gateway
    gateway.stop()


def test_node_record_carries_a_calibration_and_previews_use_it(server: Server, packaged_gguf: Path) -> None:
    # The first start on a machine measures (seconds when idle; more on a busy box); later starts read the cache.
    node = wait_for(lambda: calibrated(server), 600, "the node's llama.cpp calibration")
    assert isinstance(node, dict)
    cal = msgspec.convert(node["calibration"]["llama_cpp"], Calibration)
    assert 1e8 < cal.decode_bytes_per_s < 1e13  # 100 MB/s .. 10 TB/s
    assert 1e8 < cal.prefill_flops < 1e15
    assert 0 <= cal.step_seconds < 10 and 0.5 < cal.params_per_byte < 4  # a busy machine makes steps slow
    assert "llama-cpp-python" in cal.key and cal.threads >= 1 and cal.measured_at > 0
    cache = msgspec.json.decode((default_cache_dir() / "calibration.json").read_bytes())
    assert cal.key in cache  # the next agent start on this machine reads it instead of measuring

    preview = httpx.get(f"{server.url}/instances/previews", params={"model": "gemma3:270m"}).json()
    single = msgspec.convert(next(c for c in preview["candidates"] if c["strategy"] == "single"), Candidate)
    assert single.fits and single.context == 4096
    assert 0.05 < single.tok_s < 10_000 and single.tok_s < single.prompt_tok_s < 1_000_000
    # The estimate is the cost model on this node's calibration, not on its numpy flops.
    spec = spec_from_gguf("gemma3:270m", str(packaged_gguf))
    stage = costs.Stage(costs.speed(msgspec.convert(node, Node), "llama_cpp"), spec.weight_bytes, spec.n_layers)
    assert single.tok_s == pytest.approx(1 / costs.decode_seconds(spec, [stage], 4096, 0.0), rel=1e-6)
    assert single.prompt_tok_s == pytest.approx(
        costs.prompt_tokens(4096) / costs.prefill_seconds(spec, [stage], 4096, 0.0), rel=1e-6
    )


def test_a_cached_calibration_is_read_not_measured_again(tmp_path: Path, packaged_gguf) -> None:
    threads, parallel = 2, 4
    key = cache_key(str(packaged_gguf), threads, parallel)
    cached = Calibration(decode_bytes_per_s=9e9, prefill_flops=4e10, step_seconds=0.003, key=key, load=0.2)
    (tmp_path / "calibration.json").write_bytes(msgspec.json.encode({key: cached}))
    # /bin/false as the interpreter: measuring would fail, so an answer can only come from the cache
    found = calibrate(
        str(packaged_gguf), python="/bin/false", threads=threads, parallel=parallel, cache_dir=str(tmp_path)
    )
    assert found == cached
    other = calibrate(str(packaged_gguf), python="/bin/false", threads=3, parallel=parallel, cache_dir=str(tmp_path))
    assert other is None  # another key (threads) is measured, and that failed: no calibration, no crash
