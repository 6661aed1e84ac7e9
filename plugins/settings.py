"""meshgate's one Settings object, built once (environment ``MESHGATE_*`` + CLI flags) and passed down, and the
base of each plugin's own settings.

Example::

    settings = Settings.from_env(os.environ).replace(port=8080)
    app = create_app(settings, build_plugin_manager(settings))

Every field reads from ``MESHGATE_<FIELD>``; list fields take comma-separated values
(``MESHGATE_MODELS="mymodel=/models/x.gguf,/models/y.gguf"``). ``Settings`` holds the core's fields only; a runtime's
own (``MESHGATE_LLAMA_REPACK``, ``MESHGATE_MLX_PYTHON``, ``MESHGATE_VLLM_*``) belong to its plugin, which reads
them into its own ``PluginSettings`` from ``Settings.environ`` (the ``MESHGATE_*`` variables no core field reads)::

    class VllmSettings(PluginSettings, frozen=True):
        vllm_python: str | None = None            # MESHGATE_VLLM_PYTHON

    own = VllmSettings.from_settings(settings)
"""

from __future__ import annotations

import os
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, Self, get_origin

import msgspec

__all__ = ["DEFAULT_CONTEXT", "PluginSettings", "Settings", "default_data_dir"]


def default_data_dir() -> str:
    """``$XDG_DATA_HOME/meshgate``, or ``~/.local/share/meshgate``."""
    base = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return str(Path(base) / "meshgate")


DEFAULT_CONTEXT = 4096
"""Tokens of context a model's first runner gets unless ``n_ctx`` is set: 16 slots of the packaged model in 5 GiB
of memory (docs/operations.md, "Slots and batching"); requests that need more get a bigger replica
(``Settings.grow_context``)."""


class Settings(msgspec.Struct, frozen=True, kw_only=True):
    """Configuration for a gateway: the core's fields (each runtime's own are its plugin's ``PluginSettings``).

    Attributes:
        host: Address to bind; loopback unless told otherwise.
        port: Port to bind; Ollama's, so Ollama clients work unconfigured.
        workers: Gateway processes serving ``host:port`` (``MESHGATE_WORKERS``, ``meshgate serve --workers``). 1,
            the default, is one process as ever; more share the address (``SO_REUSEPORT`` on Linux) and
            their state through Redis: ``--redis``'s, or without it a private ``redis-server`` the command starts
            beside one node agent (``gateway.cli.workers``; docs/operations.md, "Gateway workers").
        data_dir: Where models are assembled and state is kept.
        models: Extra GGUF files, ``name=path`` or a bare path (named after the file).
        model_dirs: Directories, besides ``<data_dir>/models``, from which Ollama's ``/api/create`` may read GGUF
            files (``MESHGATE_MODEL_DIRS="/srv/gguf,/mnt/models"``); paths are resolved, symlinks followed.
        plugins: Extra plugin modules to register, besides the ``meshgate`` entry points.
        disabled_plugins: Plugin names (entry-point names) not to load.
        api_keys: When non-empty, clients must present one of these keys.
        n_ctx: Context length runners get (capped by the model's own), fixed. Unset (the default), a model's
            first runner gets ``DEFAULT_CONTEXT`` tokens and a request that sets no ``num_ctx`` and does not fit
            gets a replica as big as it needs, up to the model's own context (``runner_context``; docs/operations.md,
            "Context sizes without eviction").
        threads: Threads per runner; all cores when unset.
        runner_python: Interpreter for runner processes (a runtime's own virtual environment).
        backend_preference: Backend names in the order they are tried for a model that several can serve
            (``MESHGATE_BACKEND_PREFERENCE="mlx,vllm"``); unnamed backends follow in registration order. Only
            backends whose runtime is present are registered, so the default prefers vLLM where it is installed.
        runtime_dir: Where runtime processes keep sockets, rendezvous files and compile caches, one folder per
            instance, removed when it stops (``<data_dir>/runtime`` by default).
        log_level: uvicorn/logging level.
        log_format: ``text`` or ``json`` (one JSON object per line, every logger; ``MESHGATE_LOG_FORMAT`` or
            ``--log-format``).
        metrics: Serve ``GET /metrics`` and count requests for it (``MESHGATE_METRICS=0`` turns both off; the
            request log follows ``log_level``).
        redis: Redis URL for cluster state; without it state is in memory and the gateway embeds a local agent.
        node_name: This node's name (agents); the host name by default.
        cluster_address: Address this node's agent and runtime processes bind (loopback by default).
        cluster_secret: What runner processes and node agents demand of every caller (``MESHGATE_CLUSTER_SECRET``;
            environment only, never a flag, so ``ps`` never shows it). Unset: a random one per gateway, or with
            Redis the one the first process stored there.
        agent_port: Port of the agent's link-probe endpoint (0 picks a free one).
        heartbeat: Seconds between an agent's heartbeats.
        node_ttl: Seconds without a heartbeat after which a node leaves the topology.
        placement: ``auto`` places a model on its first request; ``never`` requires ``POST /instances``.
        node_memory: Bytes of memory this node offers for models (default: what the OS reports available).
        node_flops: This node's compute speed for the planner (FLOP/s); measured at start when unset.
        link_probe_every: Seconds between an agent's link measurements (also re-measured when nodes change).
        rate_limit: Generation requests allowed per minute per API key (or per client address without keys);
            0 means no limit. Counted in the state store, so gateway replicas share the budget.
        max_body_bytes: Largest request body accepted (413 above it).
        keepalive: Seconds between keep-alives while a streaming request waits for its model to come up (or for
            its turn in the queue).
        parallel: Sequences a runner generates at once (its slots), and so the most requests one gateway has in
            flight on an instance. Unset (the default), the planner sizes them per placement from the nodes'
            memory: as many whole-context KV caches as a quarter of the smallest node's available memory holds,
            1 to 16 (``gateway.cluster.planner.auto_sequences``).
        routing: How a gateway picks among a model's ready replicas: ``affinity`` (the default: a prompt's prefix
            keeps its replica while that replica's load is within bounds, else the less loaded of two;
            ``gateway.cluster.routing``), ``least_loaded`` (the less loaded of two, no affinity) or ``round_robin``
            (in turn; for comparison, ``benchmarks/replicas.py``).
        max_queue: Requests of one gateway that may wait for an instance's runner; beyond it a request is refused
            at once as overloaded (429/529/503 with ``retry-after``).
        min_replicas: Autoscaling: the fewest replicas a new deployment keeps (``MESHGATE_MIN_REPLICAS``; raised to
            the replicas ``POST /instances`` places at once unless it gives its own ``min_replicas``).
        max_replicas: Autoscaling: the most replicas a new deployment grows to when requests wait
            (``MESHGATE_MAX_REPLICAS``); 1 and 1, the defaults, mean no autoscaling unless a deployment asks for it
            (``POST /instances``, ``PUT /deployments/{model}``). docs/operations.md, "Autoscaling".
        scale_up_wait: Seconds a model's requests must keep waiting for a slot before a replica is added.
        scale_down_idle: Seconds a replica must be idle (nothing running or queued) before it is removed, while
            more than ``min_replicas`` exist: its keep-alive under autoscaling.
        scale_cooldown: Seconds after one scaling of a model before the next (every gateway's).
        resume_wait: Seconds a stream whose replica failed mid-stream may wait for another replica (placed if need
            be) to continue it (``MESHGATE_RESUME_WAIT``); past it the client gets its protocol's mid-stream error.
        drain_grace: Seconds the streams of a replica being drained (deleted, scaled down, on a node told to stop)
            and of a gateway told to stop (``SIGTERM``) have to finish (``MESHGATE_DRAIN_GRACE``); what still
            runs then resumes on another replica, or is cut at a gateway.
        store_timeout: Seconds any one call to the state store (Redis) may take before it fails
            (``MESHGATE_STORE_TIMEOUT``): a request that needs the store then gets a 503 with ``retry-after``, never
            a hang; what can be served from the last known state is (docs/operations.md, "When Redis is away").
        max_tokens: The most output tokens one request may ask for (``MESHGATE_MAX_TOKENS``). More is refused
            with a 400 by OpenAI and Anthropic endpoints and cut to it for Ollama's ``num_predict``; every request
            is also held to the room left in its instance's context (docs/endpoints.md, "Output limits").
        kv_sharing: Whose cached prompt states a request may use (runners' KV tiers): ``tenant`` (the default),
            only those of its API key's tenant (``meshgate keys create --tenant``; a key without one, its own;
            without keys, everyone's), as OpenAI and Anthropic scope their prompt caches: a cache hit's speed
            tells what another caller sent; ``all``: every caller's.
        default_priority: The class of a request whose protocol sends no ``service_tier`` and whose API key sets no
            ``priority`` (``MESHGATE_DEFAULT_PRIORITY``): ``interactive`` (the default) or ``batch``. Admission serves
            interactive requests first (docs/operations.md, "Tiers and batch jobs").
        batch_aging: Seconds a batch-class request may wait while interactive ones take every free slot before it
            takes the next one itself (at most one such slot per this many seconds): bulk work never starves.
        batch_spares: Sequences a llama.cpp runner holds beyond its ``parallel`` slots, each with a whole-context
            KV cache (the planner counts them): while batch-class requests hold slots, that many interactive
            requests more are sent to it, and it pauses as many batch sequences at a step boundary (their KV kept
            in their sequences) until a slot frees up; their text is unchanged. 0 (the default: each spare costs a
            whole context's KV, and placements stay as they were): interactive requests wait for a free slot.
        batch_concurrency: Lines of batch jobs (``/v1/batches``, ``/v1/messages/batches``) one gateway runs at once.
        batch_lease: Seconds a gateway's claim on a batch line lasts unless renewed (it is renewed every third of
            that while the line runs); a line whose gateway died is run again by another once its lease expires.
        batch_max_bytes: Largest batch input (an uploaded file, an Anthropic batch's body) and largest output kept
            per batch, in bytes: bodies live in the state store, so every gateway can read them.
        batch_max_lines: Most requests in one batch (OpenAI's limit is 50,000).
        environ: The ``MESHGATE_*`` variables no core field reads, for plugins' own settings
            (``PluginSettings.from_settings``); filled by ``from_env``, never read from a variable itself.
    """

    host: str = "127.0.0.1"
    port: int = 11434
    workers: Annotated[int, msgspec.Meta(ge=1)] = 1
    data_dir: str = msgspec.field(default_factory=default_data_dir)
    models: tuple[str, ...] = ()
    model_dirs: tuple[str, ...] = ()
    plugins: tuple[str, ...] = ()
    disabled_plugins: tuple[str, ...] = ()
    api_keys: tuple[str, ...] = ()
    n_ctx: Annotated[int, msgspec.Meta(ge=1)] | None = None
    threads: int | None = None
    runner_python: str | None = None
    log_level: str = "info"
    log_format: Literal["text", "json"] = "text"
    metrics: bool = True
    redis: str | None = None
    node_name: str | None = None
    cluster_address: str = "127.0.0.1"
    cluster_secret: str | None = None
    agent_port: int = 0
    heartbeat: float = 1.0
    node_ttl: float = 3.0
    placement: str = "auto"
    node_memory: int | None = None
    node_flops: float | None = None
    keepalive: float = 2.0
    parallel: Annotated[int, msgspec.Meta(ge=1)] | None = None
    routing: Literal["affinity", "least_loaded", "round_robin"] = "affinity"
    max_queue: Annotated[int, msgspec.Meta(ge=0)] = 64
    max_tokens: Annotated[int, msgspec.Meta(ge=1)] = 65536
    min_replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    max_replicas: Annotated[int, msgspec.Meta(ge=1)] = 1
    scale_up_wait: Annotated[float, msgspec.Meta(ge=0)] = 10.0
    scale_down_idle: Annotated[float, msgspec.Meta(ge=0)] = 300.0
    scale_cooldown: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    resume_wait: Annotated[float, msgspec.Meta(ge=0)] = 60.0
    drain_grace: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    store_timeout: Annotated[float, msgspec.Meta(gt=0)] = 2.0
    rate_limit: int = 0
    max_body_bytes: int = 64 << 20
    link_probe_every: float = 30.0
    runtime_dir: str | None = None
    backend_preference: tuple[str, ...] = ("vllm", "mlx")
    kv_sharing: Literal["tenant", "all"] = "tenant"
    default_priority: Literal["interactive", "batch"] = "interactive"
    batch_aging: Annotated[float, msgspec.Meta(ge=0)] = 30.0
    batch_spares: Annotated[int, msgspec.Meta(ge=0)] = 0
    batch_concurrency: Annotated[int, msgspec.Meta(ge=1)] = 4
    batch_lease: Annotated[float, msgspec.Meta(gt=0)] = 30.0
    batch_max_bytes: Annotated[int, msgspec.Meta(ge=1)] = 64 << 20
    batch_max_lines: Annotated[int, msgspec.Meta(ge=1)] = 50_000
    environ: dict[str, str] = msgspec.field(default_factory=dict)

    @classmethod
    def from_env(cls, environ: Mapping[str, str], **overrides: Any) -> Settings:
        """Settings from ``MESHGATE_*`` variables, then ``overrides`` (CLI flags; ``None`` means not given)."""
        values = _read_env(cls, environ, _LIST_FIELDS, skip={"environ"})
        core = {f"MESHGATE_{field.name.upper()}" for field in msgspec.structs.fields(cls)}
        values["environ"] = {k: v for k, v in environ.items() if k.startswith("MESHGATE_") and k not in core}
        values.update({k: v for k, v in overrides.items() if v is not None})
        return msgspec.convert(values, cls, strict=False)

    def replace(self, **changes: Any) -> Settings:
        return msgspec.structs.replace(self, **changes)

    @property
    def runner_context(self) -> int:
        """The context a model's first runner gets: ``n_ctx``, else ``DEFAULT_CONTEXT``."""
        return self.n_ctx or DEFAULT_CONTEXT

    @property
    def grow_context(self) -> bool:
        """Whether a request that sets no ``num_ctx`` may get a bigger replica: ``n_ctx`` is unset."""
        return self.n_ctx is None

    @property
    def models_dir(self) -> Path:
        return Path(self.data_dir) / "models"

    @property
    def run_dir(self) -> Path:
        """``runtime_dir``, or ``<data_dir>/runtime``."""
        return Path(self.runtime_dir) if self.runtime_dir else Path(self.data_dir) / "runtime"

    def model_paths(self) -> list[tuple[str, str]]:
        """``models`` as (name, path) pairs."""
        pairs = []
        for entry in self.models:
            name, sep, path = entry.partition("=")
            if not sep:
                path, name = entry, Path(entry).stem
            pairs.append((name, os.path.expanduser(path)))
        return pairs


_LIST_FIELDS = {"models", "model_dirs", "plugins", "disabled_plugins", "api_keys", "backend_preference"}


class PluginSettings(msgspec.Struct, frozen=True, kw_only=True):
    """Base of a plugin's own settings: each field reads ``MESHGATE_<FIELD>`` as the core ``Settings`` fields do
    (tuple fields take comma-separated values), from ``Settings.environ``; a plugin's field names start with its
    own prefix (``llama_``, ``mlx_``, ``vllm_``) so they never meet another plugin's or the core's.

    Example::

        class EchoSettings(PluginSettings, frozen=True):  # frozen is inherited; saying it again tells type checkers
            echo_delay: float = 0.0                # MESHGATE_ECHO_DELAY: seconds between words

        @hookimpl
        def meshgate_register_backends(register, settings, http):
            register(EchoBackend(delay=EchoSettings.from_settings(settings).echo_delay))
    """

    @classmethod
    def from_settings(cls, settings: Settings) -> Self:
        """This plugin's settings from the variables ``settings`` was built from (defaults where unset)."""
        lists = {f.name for f in msgspec.structs.fields(cls) if get_origin(f.type) is tuple or f.type is tuple}
        return msgspec.convert(_read_env(cls, settings.environ, lists), cls, strict=False)


def _read_env(
    cls: type[msgspec.Struct], environ: Mapping[str, str], lists: Collection[str], skip: Collection[str] = ()
) -> dict[str, Any]:
    """``cls``'s fields that ``environ`` sets (``MESHGATE_<FIELD>``), as raw strings (``lists`` split on commas)."""
    values: dict[str, Any] = {}
    for field in msgspec.structs.fields(cls):
        raw = environ.get(f"MESHGATE_{field.name.upper()}")
        if raw is not None and field.name not in skip:
            values[field.name] = tuple(v.strip() for v in raw.split(",") if v.strip()) if field.name in lists else raw
    return values
