"""llama.cpp over RPC: two loopback workers hold a layer split of Gemma 3 270M and give the same tokens as one
process; a dead worker is reported by ``probe`` before llama.cpp could abort the process.

The head (the process that creates ``Llama``) always runs in a subprocess: llama.cpp aborts a process whose
worker goes away. Every process is stopped and every wait is bounded.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from meshgate.backends.llama_cpp.rpc import RpcDevice, probe, split_kwargs
from meshgate.backends.runner.process import RunnerProcess
from meshgate.protocols.model import BackendUnavailable

ROOT = Path(__file__).resolve().parents[2]
ENV = {"PYTHONPATH": str(ROOT)}
N_TOKENS = 16
MiB = 1 << 20

# argv: model, json [[endpoint|null, start, end], ...] or "local". Prints the tokens, then holds the model (and
# the workers' buffers) until its stdin closes.
HEAD = r"""
import json, sys
from meshgate.backends.llama_cpp import rpc
from meshgate.backends.llama_cpp.gguf import read_metadata

model, placement, n_tokens = sys.argv[1], sys.argv[2], int(sys.argv[3])
kwargs = {}
if placement != "local":
    shards = [tuple(s) for s in json.loads(placement)]
    devices = rpc.add_rpc_servers([s[0] for s in shards if s[0] is not None], timeout=10)
    n_layers = read_metadata(model)["gemma3.block_count"]
    kwargs = rpc.split_kwargs(shards, n_layers, devices)
import llama_cpp
with rpc.weight_repacking(False):
    llm = llama_cpp.Llama(model_path=model, n_ctx=256, n_threads=1, n_threads_batch=1, verbose=False, **kwargs)
prompt = llm.tokenize(b"<start_of_turn>user\nName three colours.<end_of_turn>\n<start_of_turn>model\n",
                      add_bos=True, special=True)
tokens = []
for token in llm.generate(prompt, temp=0.0, top_k=1):
    tokens.append(token)
    if len(tokens) >= n_tokens:
        break
print(json.dumps({"tokens": tokens, "kwargs": kwargs}), flush=True)
sys.stdin.read()
"""


def rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for {pid}")


async def start_worker() -> RunnerProcess:
    argv = [
        sys.executable,
        "-m",
        "meshgate.backends.llama_cpp.rpc",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--threads",
        "1",
    ]
    return await RunnerProcess.start(argv, name="rpc-worker", env=ENV, ready_timeout=60)


class Head:
    """A head subprocess: ``run`` waits (bounded) for its tokens; ``stop`` ends it."""

    def __init__(self, model: Path, placement: str) -> None:
        self.proc = subprocess.Popen(
            [sys.executable, "-c", HEAD, str(model), placement, str(N_TOKENS)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=ROOT,
            env={**os.environ, **ENV},
        )

    async def result(self, timeout: float = 120) -> dict:
        line = await asyncio.wait_for(asyncio.to_thread(self.proc.stdout.readline), timeout)
        if not line:
            self.stop()
            raise AssertionError(f"head exited with {self.proc.returncode}: {self.proc.stderr.read().decode()}")
        return json.loads(line)

    def stop(self) -> None:
        with contextlib.suppress(OSError):
            self.proc.stdin.close()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


async def test_split_over_two_workers_matches_local(packaged_gguf: Path) -> None:
    workers = []
    heads = []
    try:
        workers = [await start_worker(), await start_worker()]
        endpoints = [f"127.0.0.1:{w.port}" for w in workers]
        idle = [rss(w.pid) for w in workers]
        heads.append(Head(packaged_gguf, "local"))
        local = await heads[-1].result()
        heads[-1].stop()
        heads.append(Head(packaged_gguf, json.dumps([[endpoints[0], 0, 9], [endpoints[1], 9, 18]])))
        split = await heads[-1].result()
        grew = [rss(w.pid) - before for w, before in zip(workers, idle, strict=True)]
        heads[-1].stop()

        assert len(local["tokens"]) == N_TOKENS
        assert split["tokens"] == local["tokens"]
        assert split["kwargs"]["tensor_split"] == [8.5, 10.5]
        # both workers hold weights (not a silent local load); the last one also holds the 170 MiB output layer
        assert grew[0] > 25 * MiB, grew
        assert grew[1] > grew[0] + 150 * MiB, grew
        assert all(w.alive for w in workers)
    finally:
        for head in heads:
            head.stop()
        for worker in workers:
            await worker.stop()


async def test_worker_exits_when_stdin_closes() -> None:
    worker = await start_worker()
    try:
        probe(f"127.0.0.1:{worker.port}", timeout=5)
        assert worker.proc.stdin is not None
        worker.proc.stdin.close()
        assert await asyncio.wait_for(worker.proc.wait(), 10) == 0
    finally:
        await worker.stop()


def test_worker_refuses_wildcard_address() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "meshgate.backends.llama_cpp.rpc", "--host", "0.0.0.0", "--port", "0"],
        stdin=subprocess.DEVNULL,
        capture_output=True,
        cwd=ROOT,
        env={**os.environ, **ENV},
        timeout=30,
    )
    assert result.returncode == 2
    assert b"MESHGATE_RUNNER_READY" not in result.stdout
    assert b"--allow-public" in result.stderr


def test_probe_closed_port_raises_promptly() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    started = time.monotonic()
    with pytest.raises(BackendUnavailable, match="unreachable"):
        probe(f"127.0.0.1:{port}", timeout=2)
    assert time.monotonic() - started < 2.5


def test_probe_silent_listener_times_out() -> None:
    """A port that accepts connections but never answers the handshake (e.g. a worker busy with another
    client) fails within the timeout instead of hanging."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(4)
        started = time.monotonic()
        with pytest.raises(BackendUnavailable, match="did not answer"):
            probe(f"127.0.0.1:{s.getsockname()[1]}", timeout=1)
        assert time.monotonic() - started < 2


def _devices(*endpoints: str) -> list[RpcDevice]:
    return [
        RpcDevice(index=i, name=f"RPC{i}", description=e, endpoint=e, memory_free=0, memory_total=0)
        for i, e in enumerate(endpoints)
    ]


def _assigned(kwargs: dict, n_layers: int) -> list[int]:
    """Device per position (blocks, then the output layer), -1 for the head's CPU, as llama.cpp's loader
    decides it: positions before ``n_layers + 1 - n_gpu_layers`` stay on the CPU, the rest go to the first
    device whose cumulative share of the offloaded positions lies above the position's own fraction."""
    import numpy as np

    total = n_layers + 1
    n_gpu = total if kwargs["n_gpu_layers"] < 0 else min(kwargs["n_gpu_layers"], total)
    start = max(total - n_gpu, 0)
    split = np.asarray(kwargs.get("tensor_split", [1.0]), dtype=np.float32)
    cumulative = np.cumsum(split, dtype=np.float32) / np.float32(split.sum(dtype=np.float32))
    out = []
    for il in range(total):
        if il < start:
            out.append(-1)
        else:
            out.append(int(np.searchsorted(cumulative, np.float32(il - start) / np.float32(n_gpu), side="right")))
    return out


@pytest.mark.parametrize(
    ("shards", "expected"),
    [
        ([("a", 0, 9), ("b", 9, 18)], [0] * 9 + [1] * 10),
        ([("a", 0, 5), ("b", 5, 11), ("c", 11, 18)], [0] * 5 + [1] * 6 + [2] * 8),
        ([("a", 0, 18), ("b", 18, 18)], [0] * 18 + [1]),
        ([(None, 0, 3), ("a", 3, 18)], [-1] * 3 + [0] * 16),
        ([(None, 0, 18), ("a", 18, 18)], [-1] * 18 + [0]),
    ],
)
def test_split_kwargs_places_each_shard(shards: list, expected: list[int]) -> None:
    kwargs = split_kwargs(shards, 18, _devices("a", "b", "c"))
    assert _assigned(kwargs, 18) == expected


def test_split_kwargs_rejects_bad_placements() -> None:
    devices = _devices("a", "b")
    with pytest.raises(ValueError, match="pipeline order"):
        split_kwargs([("b", 0, 9), ("a", 9, 18)], 18, devices)
    with pytest.raises(ValueError, match="not registered"):
        split_kwargs([("a", 0, 9), ("z", 9, 18)], 18, devices)
    with pytest.raises(ValueError, match="contiguously"):
        split_kwargs([("a", 0, 9), ("b", 10, 18)], 18, devices)
    with pytest.raises(ValueError, match="first shard"):
        split_kwargs([("a", 0, 9), (None, 9, 18)], 18, devices)
