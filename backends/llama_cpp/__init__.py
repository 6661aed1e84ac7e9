"""llama.cpp through llama-cpp-python: GGUF models, each served by a runner process.

``LlamaCppBackend.launch`` (in a node agent) starts ``python -m meshgate.backends.llama_cpp.runner`` for a shard;
``LlamaCppBackend.connect`` (in the gateway) gives a ``LlamaCppRunner`` that speaks the internal streaming protocol
to the head runner. llama-cpp-python itself is
only ever imported inside the runner process, so a crash in the runtime cannot take the gateway down.
``LlamaCppBackend.describe`` shows a model's GGUF header (``describe_gguf``), so the gateway never reads GGUF.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import AsyncIterator, Callable, Mapping
from typing import Any

import httpx

from meshgate.backends.base import Backend, Capabilities, ModelCard, ModelDescription, Peers
from meshgate.backends.llama_cpp.gguf import longest_token, read_metadata, tensor_sizes
from meshgate.backends.placement import Calibration, Candidate, ModelSpec, Shard, ShardCosts, Strategy
from meshgate.backends.runner.client import RunnerClient
from meshgate.backends.runner.net import url_host
from meshgate.backends.runner.process import RunnerProcess
from meshgate.protocols.model import Embeddings, EmbedRequest, Event, Request

__all__ = ["GEMMA_TEMPLATE", "LaunchedRunner", "LlamaCppBackend", "LlamaCppRunner", "describe_gguf", "spec_from_gguf"]

# The Gemma turn format backends.llama_cpp.prompt renders, written as the Go template Ollama shows for gemma3.
GEMMA_TEMPLATE = (
    "{{- range $i, $_ := .Messages }}\n"
    "{{- $last := eq (len (slice $.Messages $i)) 1 }}\n"
    '{{- if or (eq .Role "user") (eq .Role "system") }}<start_of_turn>user\n'
    "{{ .Content }}<end_of_turn>\n"
    "{{ if $last }}<start_of_turn>model\n{{ end }}\n"
    '{{- else if eq .Role "assistant" }}<start_of_turn>model\n'
    "{{ .Content }}{{ if not $last }}<end_of_turn>\n{{ end }}\n"
    "{{- end }}\n"
    "{{- end }}"
)
KV_SHARE = 1 / 16
"""The share of a node's memory a head runner's host-memory KV tier takes unless its size is set."""
KV_CAP = 8 << 30
"""The most a host-memory KV tier takes unless its size is set (llama.cpp's server keeps 8 GiB of prompts)."""
_ARRAY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")


class LlamaCppRunner:
    """The gateway's client for a llama.cpp head runner."""

    def __init__(self, client: RunnerClient) -> None:
        self.client = client

    def generate(self, request: Request) -> AsyncIterator[Event]:
        return self.client.generate(request)  # the client's stream itself: no extra hop per token

    async def embed(self, request: EmbedRequest) -> Embeddings:
        return await self.client.embed(request)

    async def count_tokens(self, request: Request) -> int:
        return await self.client.count_tokens(request)

    async def health(self) -> dict[str, object]:
        """The runner's ``/health``: its slots and its KV tier's figures."""
        return await self.client.health()

    async def kv(self, action: str, body: dict[str, object]) -> None:
        """Tell the runner's KV tier something (``runner.kv_routes``): ``peers`` (the runners of its model it may
        fetch from) or ``warm`` (fetch the entries another runner used last)."""
        client = self.client
        url = f"{client.base_url}/kv/{action}"
        response = await client.http.post(url, json=body, headers=client.headers)
        response.raise_for_status()


class LaunchedRunner:
    """A process an agent started for one shard: a head runner (``http://``) or an RPC worker (``rpc://``)."""

    def __init__(self, process: RunnerProcess, host: str, scheme: str = "http") -> None:
        self.process = process
        self.pid: int | None = process.pid
        self.url: str | None = f"{scheme}://{url_host(host)}:{process.port}"

    @property
    def alive(self) -> bool:
        return self.process.alive

    async def stop(self) -> None:
        await self.process.stop()


MiB = 1 << 20
CALIBRATION_SLOTS = 8  # the slots a node's speed is measured with when the planner sizes them


class LlamaCppBackend(Backend):
    """Serves GGUF models with llama-cpp-python in runner processes, split over llama.cpp RPC workers.

    A single-node placement is one runner process. A pipeline places the first layer range in the head runner
    (on the first shard's node, which also keeps the input embedding) and every later range in an RPC worker
    (``python -m meshgate.backends.llama_cpp.rpc``) on its node; the head registers the workers and loads with the
    ``tensor_split`` that puts exactly each range on its worker. Weight repacking is off unless asked for, so a
    split model gives the same tokens as a single process.
    """

    name = "llama_cpp"

    def __init__(
        self,
        http: httpx.AsyncClient,
        *,
        python: str | None = None,
        n_ctx: int = 4096,
        threads: int | None = None,
        ready_timeout: float = 120.0,
        cache_dir: str | None = None,
        repack: bool = False,
        parallel: int | None = None,
        exact: bool = True,
        calibration_model: Callable[[], str | None] | None = None,
        kv_ram: int | None = 0,
        kv_dir: str | None = None,
        kv_disk: int = 0,
        spares: int = 0,
        batch_aging: float = 30.0,
        stream_interval: float | None = None,
    ) -> None:
        """``kv_ram``: bytes of host memory each head runner keeps prompts' KV in (``None``: ``KV_SHARE`` of its
        node's memory, at most ``KV_CAP``; the planner counts it as the runner's memory); ``kv_disk`` bytes of
        ``kv_dir`` for the node's disk tier (``runner.kvtier``). ``spares``: sequences each head runner holds
        beyond its slots, where batch-class sequences are paused for interactive ones (``batch.Scheduler``),
        ``batch_aging`` seconds at most each (the gateway's ``batch_aging`` setting). ``stream_interval``: seconds
        a runner's streams hold their next tokens after sending some (``None``: the runner's default)."""
        self.http = http
        self.calibration_model = calibration_model  # a small GGUF's path to measure the node with (calibrate)
        self.python = python or sys.executable
        self.n_ctx = n_ctx
        self.threads = threads
        self.ready_timeout = ready_timeout
        self.cache_dir = cache_dir
        self.repack = repack
        self.parallel = parallel
        self.exact = exact
        self.kv_ram, self.kv_dir, self.kv_disk = kv_ram, kv_dir, kv_disk
        self.spares = max(0, spares)
        self.batch_aging = batch_aging
        self.stream_interval = stream_interval

    def supports(self, card: ModelCard) -> bool:
        return card.format == "gguf"

    def capabilities(self, card: ModelCard) -> Capabilities:
        return Capabilities(tools=True, vision=False, json_schema=True, raw_prompt=True, embeddings=True)

    def strategies(self, card: ModelCard) -> frozenset[Strategy]:
        return frozenset({"single", "pipeline"})

    def costs(self, card: ModelCard) -> ShardCosts:
        # Measured on Gemma 3 270M (llama-cpp-python 0.3.36, batch 512): an RPC worker with its ggml buffers is
        # ~55 MiB resident, the head runner (Python, its HTTP server, CPU buffers) ~70 MiB more; compute grows ~23 KiB
        # per context token; a split holds a second copy of a tied embedding as the output layer on its last
        # worker, while the head keeps the input embedding (file-backed pages of the GGUF).
        return ShardCosts(
            base_bytes=55 * MiB,
            head_bytes=70 * MiB + (self.kv_ram or 0),  # a KV tier of a set size is the head runner's memory
            cache_share=KV_SHARE if self.kv_ram is None else 0.0,  # else a share of its node's
            cache_cap=KV_CAP,
            per_token_bytes=23 << 10,
            tied_output_copy=True,
            sequences=self.parallel or 0,  # 0: the planner sizes the slots from the nodes' memory
            spares=self.spares,  # each a whole-context KV cache too
        )

    def context(self, card: ModelCard) -> int:
        return min(self.n_ctx, card.context_length or self.n_ctx)

    def describe(self, card: ModelCard) -> ModelDescription:
        return describe_gguf(card, self.context(card))

    def token_bytes(self, card: ModelCard) -> int:
        try:
            return longest_token(card.path)  # read once per model: the dispatcher keeps it
        except (OSError, ValueError):
            return 0

    def spec(self, card: ModelCard) -> ModelSpec:
        return spec_from_gguf(card.name, card.path)

    def calibrate(self) -> Calibration | None:
        """This node's llama.cpp speed, measured on ``calibration_model`` in a subprocess and cached for the
        machine (``backends.llama_cpp.calibrate``); ``None`` without a model to measure with."""
        from meshgate.backends.llama_cpp.calibrate import calibrate

        model = self.calibration_model() if self.calibration_model else None
        if not model:
            return None
        threads = self.threads or os.cpu_count() or 1
        return calibrate(model, python=self.python, threads=threads, parallel=self.parallel or CALIBRATION_SLOTS)

    async def launch(
        self, card: ModelCard, placement: Candidate, shard: Shard, *, host: str, peers: Peers
    ) -> LaunchedRunner:
        if shard.layer_start != 0:
            return await self._worker(card, host)
        shards: list[tuple[str | None, int, int]] = [(None, shard.layer_start, shard.layer_end)]
        if len(placement.shards) > 1:
            urls = await peers()
            shards += [
                (urls[s.node_id].removeprefix("rpc://"), s.layer_start, s.layer_end)
                for s in placement.shards
                if s.layer_start != 0
            ]
        argv = [
            self.python,
            "-m",
            "meshgate.backends.llama_cpp.runner",
            "--model",
            card.path,
            "--host",
            host,
            "--n-ctx",
            str(placement.context or self.context(card)),
            "--shards",
            json.dumps(shards),
        ]
        argv += ["--threads", str(self.threads)] if self.threads else []
        argv += ["--repack"] if self.repack else []
        slots = self.parallel or placement.sequences  # the planner's count unless the operator set one
        argv += ["--parallel", str(slots)] + ([] if self.exact else ["--inexact"])
        argv += ["--spares", str(placement.spares)] if placement.spares else []  # as the planner counted them
        argv += ["--batch-aging", repr(self.batch_aging)] if placement.spares else []  # only paused jobs age there
        argv += ["--stream-interval", repr(self.stream_interval)] if self.stream_interval is not None else []
        kv_ram = shard.cache_bytes if self.kv_ram is None else self.kv_ram  # as the planner counted it
        argv += ["--kv-ram", str(kv_ram), "--model-digest", card.digest]
        argv += ["--kv-dir", self.kv_dir, "--kv-disk", str(self.kv_disk)] if self.kv_dir and self.kv_disk else []
        process = await RunnerProcess.start(
            argv, name=card.name, ready_timeout=self.ready_timeout, env={"GGML_NO_BACKTRACE": "1"}
        )
        return LaunchedRunner(process, host)

    async def _worker(self, card: ModelCard, host: str) -> LaunchedRunner:
        argv = [self.python, "-m", "meshgate.backends.llama_cpp.rpc", "--host", host, "--port", "0"]
        argv += ["--threads", str(self.threads)] if self.threads else []
        argv += ["--cache-dir", self.cache_dir] if self.cache_dir else []
        process = await RunnerProcess.start(argv, name=f"{card.name} worker", ready_timeout=self.ready_timeout)
        return LaunchedRunner(process, host, scheme="rpc")

    def connect(self, card: ModelCard, placement: Candidate, urls: Mapping[str, str]) -> LlamaCppRunner:
        head = next(s.node_id for s in placement.shards if s.layer_start == 0)
        return LlamaCppRunner(RunnerClient(urls[head], self.http))


def describe_gguf(card: ModelCard, context: int) -> ModelDescription:
    """What ``/api/show`` shows of the GGUF ``card`` names, from its header (read again: the file may have changed).

    ``model_info`` is the header with the token tables as ``None`` (as Ollama shows them without ``verbose``) and
    ``context`` (the context a runner gets; 0 keeps the header's) as ``<arch>.context_length``. ``template`` is the
    Gemma turn format as Ollama's Go template for Gemma models (what the runner renders), else the GGUF's own
    ``tokenizer.chat_template`` (which llama-cpp-python applies). A file that went away gives the card's basics.
    """
    try:
        meta = read_metadata(card.path)
    except (OSError, ValueError):  # the file went away or changed since the catalog read it
        meta = {}
    arch = str(meta.get("general.architecture", card.family))
    info: dict[str, Any] = {k: (None if k in _ARRAY_KEYS else v) for k, v in meta.items()}
    if context:
        info[f"{arch}.context_length"] = context
    template = GEMMA_TEMPLATE if card.family.startswith("gemma") else str(meta.get("tokenizer.chat_template") or "")
    return ModelDescription(model_info=info, template=template, license=str(meta.get("general.license") or ""))


def spec_from_gguf(name: str, path: str) -> ModelSpec:
    """The planner's view of a GGUF: shape from its metadata, sizes from its tensor table."""
    meta = read_metadata(path)
    arch = meta.get("general.architecture", "")
    sizes = tensor_sizes(path)
    n_layers = int(meta.get(f"{arch}.block_count", 1))
    hidden = int(meta.get(f"{arch}.embedding_length", 0))
    n_heads = int(meta.get(f"{arch}.attention.head_count", 1))
    layer_total = sum(v for k, v in sizes.items() if k.startswith("blk."))
    output = sizes.get("output.weight", 0)
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden_size=hidden,
        n_heads=n_heads,
        n_kv_heads=int(meta.get(f"{arch}.attention.head_count_kv", n_heads)),
        head_dim=int(meta.get(f"{arch}.attention.key_length", hidden // max(n_heads, 1))),
        context_length=int(meta.get(f"{arch}.context_length", 2048)),
        layer_bytes=-(-layer_total // max(n_layers, 1)),
        embedding_bytes=sizes.get("token_embd.weight", 0),
        output_bytes=output + sum(v for k, v in sizes.items() if k.startswith("output_norm")),
        tied_output=output == 0,
        vocab_size=int(meta.get("tokenizer.ggml.tokens") or 0),  # the token table's length (arrays are not kept)
    )
