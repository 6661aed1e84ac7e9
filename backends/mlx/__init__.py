"""MLX through mlx-lm: Hugging Face checkpoints served by rank processes joined over MLX's ring backend.

``MlxBackend.launch`` (in a node agent) starts one rank per shard of a placement (``python -m
backends.mlx.runner`` with a python that has mlx): rank 0, the head, is the first pipeline stage or tensor rank 0
and speaks the internal streaming protocol; the others follow its generation loop. Ranks are in placement order
(layer range, then tensor rank); followers start first and wait to be joined (``rendezvous``), the head's agent
builds the ring's hostfile from their addresses on the cluster interface. ``MlxBackend.connect`` (in the
gateway) gives a runner client for the head. mlx itself is only ever imported in the rank processes. Every rank
keeps prompts' KV in a tier (``runner.kvtier``, as llama.cpp runners do: ``kv_ram``, ``kv_dir``, ``kv_disk``): a
placement of one rank the whole cache, a ring's ranks each their shard, restored together (``mlx.batch``).

Imports protocols, backends.base/placement/runner and ``backends.checkpoints``; never the gateway.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from collections.abc import AsyncIterator, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import msgspec

from meshgate.backends.base import Backend, Capabilities, ModelCard, ModelDescription, Peers
from meshgate.backends.checkpoints import checkpoint_itemsize, describe_checkpoint, spec_from_checkpoint
from meshgate.backends.mlx import rendezvous
from meshgate.backends.placement import Candidate, ModelSpec, Shard, ShardCosts, Strategy
from meshgate.backends.runner.net import free_port, host_port
from meshgate.backends.runner.process import RunnerProcess
from meshgate.protocols.model import Embeddings, EmbedRequest, Event, Request, UnsupportedFeature

if TYPE_CHECKING:  # the gateway's side only: rank processes import this package too, and their python need not
    from meshgate.backends.runner.client import RunnerClient  # have the client's HTTP parser (httptools)

__all__ = ["LaunchedRank", "MlxBackend", "MlxRunner", "rank_order"]

MiB = 1 << 20
_PACKAGES = ("meshgate",)  # what a rank imports: the package (from a checkout it finds the folders itself)
# MLX on Linux is CPU only: compute in float32 there (CPUs have no fast bfloat16; measured on Gemma 3 270M with
# mlx 0.32.4: 4.0 tok/s float32 vs 3.6 bfloat16, and tensor-parallel sums then match one process exactly).
_CPU_DTYPE = "float32" if sys.platform == "linux" else None


def rank_order(placement: Candidate) -> list[Shard]:
    """The shards of ``placement`` in rank order: rank 0 (the head) holds layer 0 and tensor rank 0."""
    return sorted(placement.shards, key=lambda s: (s.layer_start, s.tensor_rank))


class MlxRunner:
    """The gateway's client for an MLX head rank."""

    def __init__(self, client: RunnerClient) -> None:
        self.client = client

    def generate(self, request: Request) -> AsyncIterator[Event]:
        return self.client.generate(request)

    async def count_tokens(self, request: Request) -> int:
        return await self.client.count_tokens(request)

    async def embed(self, request: EmbedRequest) -> Embeddings:
        raise UnsupportedFeature("the MLX backend does not compute embeddings", param="model")

    async def health(self) -> dict[str, object]:
        """The head's ``/health``: its batch and its KV tier's figures (over a ring, its own shard's)."""
        return await self.client.health()

    async def kv(self, action: str, body: dict[str, object]) -> None:
        """Tell the head's KV tier something (``runner.kv_routes``): ``peers`` or ``warm``."""
        client = self.client
        response = await client.http.post(f"{client.base_url}/kv/{action}", json=body, headers=client.headers)
        response.raise_for_status()


class LaunchedRank:
    """One rank process an agent started: the head (serving) or a follower (its join endpoint, then nothing)."""

    def __init__(self, process: RunnerProcess, host: str, *, grace: float, hostfile: str | None = None) -> None:
        self.process = process
        self.pid: int | None = process.pid
        self.url: str | None = f"http://{host_port(host, process.port)}"
        self.grace = grace
        self.hostfile = hostfile

    @property
    def alive(self) -> bool:
        return self.process.alive

    async def stop(self) -> None:
        await self.process.stop(self.grace)
        if self.hostfile and os.path.exists(self.hostfile):
            os.unlink(self.hostfile)


class MlxBackend(Backend):
    """Serves Hugging Face checkpoints (``format="safetensors"``) with mlx-lm, whole or sharded over ranks.

    ``python`` is an interpreter with ``mlx``, ``mlx-lm`` and ``llguidance`` (and msgspec, uvicorn); meshgate's own
    ``backends`` and ``protocols`` packages reach it through ``PYTHONPATH``. Pipeline ranks load only their layer
    range; tensor ranks split every layer. ``parallel``: requests an instance decodes together (its head's batch;
    the runner's ``--parallel``). Response formats are enforced (llguidance, ``structured.py``); no tools or
    embeddings. ``kv_ram``, ``kv_dir``, ``kv_disk``: the KV tiers of every rank (each rank its own budgets and its
    node's directory; over a ring each holds its shard of an entry), as the llama.cpp backend's, except that
    ``kv_ram`` ``None`` (the default setting) means no host tier, only the disk one: a share of every node's
    memory sized from the node squeezed the two-rank placements out of small nodes (the MLX cluster tests' nodes,
    CI run 15), so the planner's figures stay those of no host tier. A set ``kv_ram`` is counted as every rank's
    memory (each rank may fill it).
    """

    name = "mlx"

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        python: str | None = None,
        n_ctx: int = 4096,
        runtime_dir: str | None = None,
        ready_timeout: float = 300.0,
        dtype: str | None = _CPU_DTYPE,
        parallel: int | None = None,
        kv_ram: int | None = 0,
        kv_dir: str | None = None,
        kv_disk: int = 0,
    ) -> None:
        self.http = http
        self.kv_ram, self.kv_dir, self.kv_disk = kv_ram, kv_dir, kv_disk
        self.parallel = parallel
        self.dtype = dtype
        self.python = python or sys.executable
        self.n_ctx = n_ctx
        self.runtime_dir = Path(runtime_dir or tempfile.gettempdir()) / "mlx"
        self.ready_timeout = ready_timeout

    def supports(self, card: ModelCard) -> bool:
        return card.format == "safetensors"

    def capabilities(self, card: ModelCard) -> Capabilities:
        return Capabilities(tools=False, vision=False, json_schema=True, raw_prompt=True, embeddings=False)

    def strategies(self, card: ModelCard) -> frozenset[Strategy]:
        return frozenset({"single", "pipeline", "tensor"})

    def costs(self, card: ModelCard) -> ShardCosts:
        # Measured with mlx 0.32.4 on CPU: a rank process (python, mlx, mlx-lm, the tokenizer) is ~190 MiB
        # resident before weights, the head's HTTP server ~25 MiB more; compute buffers grow ~16 KiB per
        # context token on Gemma 3 270M.
        return ShardCosts(
            base_bytes=190 * MiB + (self.kv_ram or 0),  # a host KV tier of a set size, on every rank
            head_bytes=25 * MiB,
            cache_share=0.0,  # ``kv_ram`` None: no host tier (above)
            per_token_bytes=16 << 10,
            vocab_parallel=False,
            sequences=self.parallel or 0,  # 0: the planner sizes the slots from the nodes' memory
        )

    def spec(self, card: ModelCard) -> ModelSpec:
        spec = spec_from_checkpoint(card.name, card.path)
        if self.dtype != "float32":
            return spec
        grow = 4 / max(checkpoint_itemsize(card.path), 1)  # weights held as float32 (see ``dtype``)
        return msgspec.structs.replace(
            spec,
            layer_bytes=int(spec.layer_bytes * grow),
            embedding_bytes=int(spec.embedding_bytes * grow),
            output_bytes=int(spec.output_bytes * grow),
            kv_bytes_per_element=4,
        )

    def context(self, card: ModelCard) -> int:
        return min(self.n_ctx, card.context_length or self.n_ctx)

    def describe(self, card: ModelCard) -> ModelDescription:
        return describe_checkpoint(card, self.context(card))

    async def launch(
        self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers
    ) -> LaunchedRank:
        order = rank_order(placement)
        rank, ranks = order.index(shard), len(order)
        mode = "single" if ranks == 1 else "tensor" if placement.strategy == "tensor" else "pipeline"
        argv = [
            self.python,
            "-m",
            "meshgate.backends.mlx.runner",
            "--model",
            card.path,
            "--host",
            host,
            "--n-ctx",
            str(placement.context or self.context(card)),
            "--sharding",
            mode,
            "--rank",
            str(rank),
            "--ranks",
            str(ranks),
            "--ready-timeout",
            str(self.ready_timeout),
            "--parallel",
            str(self.parallel or placement.sequences),
        ]
        if mode == "pipeline":
            argv += ["--layers", f"{shard.layer_start}:{shard.layer_end}"]
        argv += ["--dtype", self.dtype] if self.dtype else []
        # the KV tier, every rank alike (over a ring each keeps its shard in its node's directory)
        argv += ["--kv-ram", str(self.kv_ram or 0), "--model-digest", card.digest]  # None: no host tier
        argv += ["--kv-dir", self.kv_dir, "--kv-disk", str(self.kv_disk)] if self.kv_dir and self.kv_disk else []
        env = self._env()
        if rank > 0:  # a follower: up as soon as its join endpoint listens
            process = await RunnerProcess.start(argv, name=f"{card.name} rank {rank}", env=env, ready_timeout=60)
            return LaunchedRank(process, host, grace=15.0)
        hostfile = None
        if ranks > 1:
            urls = await peers()
            followers = [urls[s.node_id] for s in order[1:]]
            hostfile = await self._ring(host, followers)
            env |= {"MLX_HOSTFILE": hostfile, "MLX_RANK": "0"}
            argv += ["--followers", ",".join(followers)]
        try:
            process = await RunnerProcess.start(argv, name=card.name, env=env, ready_timeout=self.ready_timeout + 15)
        except BaseException:
            if hostfile:
                os.unlink(hostfile)
            raise
        return LaunchedRank(process, host, grace=10.0, hostfile=hostfile)

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> MlxRunner:
        from meshgate.backends.runner.client import RunnerClient

        return MlxRunner(RunnerClient(urls[rank_order(placement)[0].node_id], self.http))

    async def _ring(self, host: str, followers: Sequence[str]) -> str:
        """Learn the followers' ring addresses, write the hostfile (head first), join them; its path."""
        rings = await rendezvous.gather(self.http, followers)
        while (own := host_port(host, free_port(host))) in rings:
            pass
        hosts = [[own], *([r] for r in rings)]
        self.runtime_dir.mkdir(parents=True, exist_ok=True)
        fd, path = tempfile.mkstemp(prefix="ring-", suffix=".json", dir=self.runtime_dir)
        with os.fdopen(fd, "w") as f:
            json.dump(hosts, f)
        await rendezvous.join(self.http, followers, hosts)
        return path

    def _env(self) -> dict[str, str]:
        """Our package on the path (the rank's python may be another venv: only a link to ``meshgate``, never
        the directory it is installed in), no hub, MLX's JIT cache kept."""
        tmp, code = self.runtime_dir / "tmp", self.runtime_dir / "code"
        tmp.mkdir(parents=True, exist_ok=True)
        code.mkdir(exist_ok=True)
        root = Path(sys.modules["meshgate"].__path__[0]).resolve().parent
        for name in _PACKAGES:
            link = code / name
            if not link.is_symlink() or link.resolve() != root / name:
                link.unlink(missing_ok=True)
                with contextlib.suppress(FileExistsError):  # another agent on this machine made it just now
                    link.symlink_to(root / name, target_is_directory=True)
        path = os.pathsep.join(p for p in (str(code), os.environ.get("PYTHONPATH", "")) if p)
        return {"PYTHONPATH": path, "HF_HUB_OFFLINE": "1", "TMPDIR": str(tmp)}
