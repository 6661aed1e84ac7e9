"""``MlxBackend.launch`` as node agents call it: ranks joined over the ring, served, stopped, and their faults.

Two "nodes" (``a`` holds the head, ``b`` a follower) on loopback, each rank a real process of the MLX venv's
python, placements written by hand the way the planner writes them. Every process is bounded and killed on the
way out.
"""

from __future__ import annotations

import asyncio
import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from meshgate.backends.base import ModelCard
from meshgate.backends.mlx import LaunchedRank, MlxBackend
from meshgate.backends.placement import Candidate, NodeId, Shard
from meshgate.backends.runner import secret as cluster_secret
from meshgate.protocols.model import Failed, Finished, Request, Sampling, TextDelta, Usage
from tests.mlx.test_mlx_engine import HERE, _mlx, mlx_python

PROMPTS = ["Hello world", "Ranks talk over a ring"]
TOKENS = 24


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-backend") / "model"
    _mlx(str(HERE / "tiny_model.py"), str(path))
    return path


def placement(strategy: str) -> Candidate:
    a, b = NodeId("a"), NodeId("b")
    if strategy == "single":
        shards: tuple[Shard, ...] = (Shard(node_id=a, layer_start=0, layer_end=4),)
    elif strategy == "pipeline":  # uneven on purpose: the placement's ranges, not an even split
        shards = (Shard(node_id=b, layer_start=1, layer_end=4), Shard(node_id=a, layer_start=0, layer_end=1))
    else:
        shards = (
            Shard(node_id=b, layer_start=0, layer_end=4, tensor_rank=1, tensor_size=2),
            Shard(node_id=a, layer_start=0, layer_end=4, tensor_rank=0, tensor_size=2),
        )
    return Candidate(
        id=f"test-{strategy}",
        model="tiny",
        backend="mlx",
        strategy=strategy,  # type: ignore[arg-type]
        context=256,
        shards=shards,
        memory_per_node={},
    )


def request(prompt: str, max_tokens: int = TOKENS) -> Request:
    return Request(model="tiny", raw_prompt=prompt, sampling=Sampling(temperature=0.0), max_tokens=max_tokens)


async def launch_all(backend: MlxBackend, card: ModelCard, plan: Candidate) -> dict[str, LaunchedRank]:
    """What the agents do: every shard launched at once; the head's ``peers`` waits for the followers' URLs."""
    launched: dict[str, LaunchedRank] = {}
    up = asyncio.Event()

    async def peers() -> dict[str, str]:
        await asyncio.wait_for(up.wait(), 60)
        return {n: r.url for n, r in launched.items() if r.url}

    async def one(shard: Shard) -> None:
        launched[shard.node_id] = await backend.launch(card, plan, shard, host="127.0.0.1", peers=peers)
        if len(launched) == len(plan.shards) - 1 and "a" not in launched:
            up.set()

    if len(plan.shards) == 1:
        up.set()
    await asyncio.wait_for(asyncio.gather(*(one(s) for s in plan.shards)), 180)
    return launched


async def generate(
    backend: MlxBackend, card: ModelCard, plan: Candidate, launched: dict[str, LaunchedRank], req: Request
) -> list[Any]:
    runner = backend.connect(card, plan, {n: r.url for n, r in launched.items() if r.url})
    return [event async for event in runner.generate(req)]


def text(events: list[Any]) -> str:
    return "".join(e.text for e in events if isinstance(e, TextDelta))


async def with_instance(
    tiny_dir: Path,
    tmp_path: Path,
    strategy: str,
    body: Callable[[MlxBackend, ModelCard, Candidate, dict[str, LaunchedRank]], Any],
) -> Any:
    async with httpx.AsyncClient(timeout=60) as http:
        backend = MlxBackend(http, python=str(mlx_python()), runtime_dir=str(tmp_path / "runtime"))
        card = ModelCard(name="tiny", path=str(tiny_dir), format="safetensors")
        plan = placement(strategy)
        launched = await launch_all(backend, card, plan)
        try:
            return await body(backend, card, plan, launched)
        finally:
            await asyncio.gather(*(r.stop() for r in launched.values()), return_exceptions=True)


@pytest.fixture(scope="module")
def single_texts(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> list[str]:
    async def body(backend, card, plan, launched) -> list[str]:
        return [text(await generate(backend, card, plan, launched, request(p))) for p in PROMPTS]

    return asyncio.run(with_instance(tiny_dir, tmp_path_factory.mktemp("single"), "single", body))


@pytest.mark.parametrize("strategy", ["pipeline", "tensor"])
def test_two_ranks_joined_by_the_backend_serve_the_single_process_text_and_stop_cleanly(
    tiny_dir: Path, tmp_path: Path, single_texts: list[str], strategy: str
) -> None:
    async def body(backend, card, plan, launched) -> dict[str, Any]:
        head = launched["a"]
        health = (await backend.http.get(f"{head.url}/health", headers=cluster_secret.headers())).json()
        texts = []
        for prompt in PROMPTS:
            events = await generate(backend, card, plan, launched, request(prompt))
            assert isinstance(events[-1], Finished) and isinstance(events[-2], Usage), events[-3:]
            assert events[-2].completion_tokens == TOKENS
            texts.append(text(events))
        hostfile = head.hostfile
        assert hostfile and Path(hostfile).exists()
        started = time.monotonic()
        await asyncio.gather(*(r.stop() for r in launched.values()))
        return {
            "health": health,
            "texts": texts,
            "codes": {n: r.process.proc.returncode for n, r in launched.items()},
            "stop_s": time.monotonic() - started,
            "hostfile_left": Path(hostfile).exists(),
        }

    out = asyncio.run(with_instance(tiny_dir, tmp_path, strategy, body))
    assert out["health"]["ranks"] == 2 and out["health"]["sharding"] == strategy
    if strategy == "pipeline":
        assert out["health"]["layers"] == [0, 1]  # the head's range from the placement
    assert out["texts"] == single_texts
    # a clean stop: the head tells the follower, both meet at the barrier and exit 0 (no SIGKILL needed)
    assert out["codes"] == {"a": 0, "b": 0} and out["stop_s"] < 8
    assert not out["hostfile_left"]


def test_a_follower_killed_mid_generation_fails_the_stream_and_the_head_exits(tiny_dir: Path, tmp_path: Path) -> None:
    async def body(backend, card, plan, launched) -> dict[str, Any]:
        runner = backend.connect(card, plan, {n: r.url for n, r in launched.items() if r.url})
        events: list[Any] = []
        async for event in runner.generate(request("Hello world", max_tokens=200)):
            events.append(event)
            if len(events) == 6:
                os.kill(launched["b"].pid, signal.SIGKILL)
                killed = time.monotonic()
        ended = time.monotonic() - killed
        deadline = time.monotonic() + 10
        while launched["a"].alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return {"events": events, "ended_s": ended, "head_alive": launched["a"].alive}

    out = asyncio.run(with_instance(tiny_dir, tmp_path, "pipeline", body))
    last = out["events"][-1]
    assert isinstance(last, Failed) and last.error.kind == "BackendUnavailable", last
    assert "lost" in last.error.message
    assert out["ended_s"] < 10 and not out["head_alive"]


def test_a_head_killed_takes_its_followers_down(tiny_dir: Path, tmp_path: Path) -> None:
    async def body(backend, card, plan, launched) -> bool:
        os.kill(launched["a"].pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while launched["b"].alive and time.monotonic() < deadline:
            await asyncio.sleep(0.1)
        return launched["b"].alive

    assert asyncio.run(with_instance(tiny_dir, tmp_path, "tensor", body)) is False


def test_a_follower_that_is_never_joined_gives_up(tiny_dir: Path, tmp_path: Path) -> None:
    async def run() -> tuple[bool, float]:
        async with httpx.AsyncClient(timeout=60) as http:
            backend = MlxBackend(http, python=str(mlx_python()), runtime_dir=str(tmp_path), ready_timeout=3)
            card = ModelCard(name="tiny", path=str(tiny_dir), format="safetensors")
            plan = placement("tensor")
            follower = await backend.launch(card, plan, plan.shards[0], host="127.0.0.1", peers=None)  # type: ignore[arg-type]
            started = time.monotonic()
            try:
                ring = (await http.get(f"{follower.url}/ring", headers=cluster_secret.headers())).json()["ring"]
                assert ring.startswith("127.0.0.1:")
                while follower.alive and time.monotonic() - started < 20:
                    await asyncio.sleep(0.1)
                return follower.alive, time.monotonic() - started
            finally:
                await follower.stop()

    alive, waited = asyncio.run(run())
    assert not alive and waited < 10


def test_an_idle_head_notices_a_dead_follower_and_exits(tiny_dir: Path, tmp_path: Path) -> None:
    """The ring only notices a dead peer on its next transfer (or never, when it waits on it): the head watches
    its followers' control endpoints and leaves at once, so its agent can report the instance for re-placing."""

    async def body(backend, card, plan, launched) -> float:
        os.kill(launched["b"].pid, signal.SIGKILL)
        killed = time.monotonic()
        while launched["a"].alive and time.monotonic() - killed < 15:
            await asyncio.sleep(0.1)
        return time.monotonic() - killed

    assert asyncio.run(with_instance(tiny_dir, tmp_path, "pipeline", body)) < 5
