"""The KV tier over an RPC pipeline: a head runner whose later layers live on two llama.cpp RPC workers keeps a
prompt's state (llama.cpp reads the workers' KV cells over RPC), and a head started again over new workers with the
same disk tier restores it and answers with the same tokens. Every process is stopped."""

from __future__ import annotations

import asyncio
import json
import sys
import time
from pathlib import Path

import httpx

from meshgate.backends.llama_cpp import LlamaCppRunner
from meshgate.backends.llama_cpp.kvstate import tail
from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.process import RunnerProcess
from meshgate.protocols.model import Request, Sampling, TextDelta, Usage
from tests.llama.test_rpc import ENV, start_worker

PROMPT = "Pipeline: " + " ".join(f"stage{i % 41} forwards activations {i}" for i in range(300))


async def _head(packaged_gguf: Path, endpoints: list[str], kv_dir: Path) -> RunnerProcess:
    shards = [[None, 0, 6], [endpoints[0], 6, 12], [endpoints[1], 12, 18]]
    argv = [sys.executable, "-m", "meshgate.backends.llama_cpp.runner", "--model", str(packaged_gguf)]
    argv += ["--n-ctx", "4096", "--parallel", "2", "--threads", "1", "--shards", json.dumps(shards)]
    argv += ["--kv-ram", str(1 << 30), "--kv-dir", str(kv_dir), "--kv-disk", str(1 << 30)]
    return await RunnerProcess.start(argv, name="kv-head", env=ENV, ready_timeout=180)


async def _ask(head: RunnerProcess, http: httpx.AsyncClient) -> tuple[list[int], Usage]:
    runner = LlamaCppRunner(RunnerClient(f"http://127.0.0.1:{head.port}", http))
    request = Request(model="m", raw_prompt=PROMPT, max_tokens=16, sampling=Sampling(temperature=0.0))
    tokens: list[int] = []
    usage = Usage()
    async for event in runner.generate(request):
        if isinstance(event, TextDelta):
            tokens += event.tokens
        elif isinstance(event, Usage):
            usage = event
    return tokens, usage


async def test_a_split_runner_restores_a_prompt_kept_over_rpc_after_a_restart(packaged_gguf, tmp_path):
    processes: list[RunnerProcess] = []
    try:
        async with httpx.AsyncClient(timeout=600) as http:
            results = []
            for _ in range(2):  # a head and its workers, then new ones over the same disk tier
                workers = [await start_worker(), await start_worker()]
                processes += workers
                processes.append(await _head(packaged_gguf, [f"127.0.0.1:{w.port}" for w in workers], tmp_path))
                results.append(await _ask(processes[-1], http))
                deadline = time.monotonic() + 30
                while not list(tmp_path.glob("*.kv")) and time.monotonic() < deadline:  # written off the decode loop
                    await asyncio.sleep(0.1)
                for process in reversed(processes):  # the head first: llama.cpp aborts a head whose worker goes
                    await process.stop()
                processes.clear()
    finally:
        for process in reversed(processes):
            await process.stop()
    (cold, first), (restored, second) = results
    assert first.cached_tokens == 0 and first.prompt_tokens > 1024
    assert second.cached_tokens == tail(first.prompt_tokens), "all but the last chunk came from the disk tier"
    assert restored == cold and len(cold) == 16
