"""Two llama.cpp runner processes, each with its own KV tier: the second fetches a prompt's state from the first
over HTTP (the cluster secret, the entry format, checked) when the link's estimate beats prefilling, and answers
with the tokens the first computed; with a link too slow to pay, it prefills instead. A third one, told to warm
from the first, fetches what the first used last before it is asked for. A runner told its node copies each entry it
makes to a peer on another node, which then serves the prompt without its source. Every process is stopped."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import httpx

from meshgate.backends.llama_cpp import LlamaCppRunner
from meshgate.backends.llama_cpp.kvstate import tail
from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.process import RunnerProcess
from meshgate.protocols.model import Request, Sampling, TextDelta, Usage

ROOT = Path(__file__).resolve().parents[2]
WORDS = "the parser reads each token of the file and the linter reports a warning when a rule fails".split()


def _prompt(name: str, words: int) -> str:
    return f"{name}: " + " ".join(f"{WORDS[(i * 7) % len(WORDS)]}{i % 89}" for i in range(words))


async def _runner(packaged_gguf: Path, kv_dir: Path) -> RunnerProcess:
    argv = [sys.executable, "-m", "meshgate.backends.llama_cpp.runner", "--model", str(packaged_gguf)]
    argv += ["--n-ctx", "4096", "--parallel", "2", "--threads", "1", "--kv-ram", str(1 << 30)]
    argv += ["--kv-dir", str(kv_dir), "--kv-disk", str(1 << 30)]
    return await RunnerProcess.start(argv, name="kv-peer", env={"PYTHONPATH": str(ROOT)}, ready_timeout=120)


async def _ask(runner: LlamaCppRunner, prompt: str) -> tuple[str, Usage]:
    request = Request(model="m", raw_prompt=prompt, max_tokens=12, sampling=Sampling(temperature=0.0))
    text, usage = "", Usage()
    async for event in runner.generate(request):
        if isinstance(event, TextDelta):
            text += event.text
        elif isinstance(event, Usage):
            usage = event
    return text, usage


async def test_a_runner_fetches_a_prompt_from_its_peers_tier_when_that_beats_prefilling(packaged_gguf, tmp_path):
    processes = []
    try:
        processes = [await _runner(packaged_gguf, tmp_path / name) for name in ("a", "b")]
        async with httpx.AsyncClient(timeout=300) as http:
            a, b = (LlamaCppRunner(RunnerClient(f"http://127.0.0.1:{p.port}", http)) for p in processes)
            fast, slow = _prompt("Fetched", 700), _prompt("Prefilled", 700)
            text, computed = await _ask(a, fast)
            await _ask(a, slow)
            assert computed.cached_tokens == 0 and computed.prompt_tokens > 1024

            await b.kv("peers", {"peers": [{"url": a.client.base_url, "bandwidth": 1e9, "latency": 0.001}]})
            fetched_text, fetched = await _ask(b, fast)
            assert fetched.cached_tokens == tail(computed.prompt_tokens), fetched.cache_note
            assert fetched_text == text
            assert "fetched" in fetched.cache_note and a.client.base_url in fetched.cache_note

            await b.kv("peers", {"peers": [{"url": a.client.base_url, "bandwidth": 1000.0, "latency": 0.001}]})
            _, prefilled = await _ask(b, slow)
            assert prefilled.cached_tokens == 0 and prefilled.cache_note.endswith("prefilled"), prefilled.cache_note
            tier = (await b.health())["kv_tier"]
            assert tier["received"] == 1 and tier["refused"] == 0, tier

            processes.append(await _runner(packaged_gguf, tmp_path / "c"))  # a new replica warms from a peer
            c = LlamaCppRunner(RunnerClient(f"http://127.0.0.1:{processes[-1].port}", http))
            await c.kv("warm", {"url": a.client.base_url, "count": 8})
            deadline = time.monotonic() + 60
            while (await c.health())["kv_tier"]["warmed"] < 2 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            warm_text, warm = await _ask(c, fast)
            assert warm.cached_tokens == tail(computed.prompt_tokens) and warm.cache_note == "", "from its own tier"
            assert warm_text == text
    finally:
        for process in processes:
            await process.stop()


async def test_each_entry_is_copied_as_it_is_made_to_a_peer_on_another_node_which_serves_it_when_the_node_dies(
    packaged_gguf, tmp_path
):
    processes = []
    try:
        processes = [await _runner(packaged_gguf, tmp_path / name) for name in ("a", "b", "c")]
        async with httpx.AsyncClient(timeout=300) as http:
            a, b, c = (LlamaCppRunner(RunnerClient(f"http://127.0.0.1:{p.port}", http)) for p in processes)
            same_node = {"url": c.client.base_url, "bandwidth": 2e9, "latency": 0.0, "node": "n1"}
            other_node = {"url": b.client.base_url, "bandwidth": 1e9, "latency": 0.001, "node": "n2"}
            await a.kv("peers", {"peers": [same_node, other_node], "node": "n1"})
            prompt = _prompt("Copied", 700)
            text, computed = await _ask(a, prompt)
            assert computed.cached_tokens == 0 and computed.prompt_tokens > 1024
            deadline = time.monotonic() + 60
            while (await b.health())["kv_tier"]["disk_entries"] < 1 and time.monotonic() < deadline:
                await asyncio.sleep(0.2)
            copied, kept, untouched = [(await r.health())["kv_tier"] for r in (b, a, c)]
            assert copied["received"] == 1 and copied["disk_entries"] == 1, copied
            assert copied["ram_entries"] == 0, "a copy waits on disk: it does not push out the peer's own entries"
            assert kept["replicated"] == 1 and untouched["received"] == 0, "one copy, never on the same node"

            processes[0].proc.kill()  # node n1's runner is gone; b takes its requests with their prompts
            await processes[0].proc.wait()
            again, restored = await _ask(b, prompt)
            assert restored.cached_tokens == tail(computed.prompt_tokens) and restored.cache_note == "", "from b's tier"
            assert again == text
            assert (await b.health())["kv_tier"]["hits_disk"] == 1
    finally:
        for process in processes:
            await process.stop()
