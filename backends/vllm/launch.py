"""Start and supervise vLLM's own OpenAI server for one placed model (runs in a node agent).

``layout(placement)`` reads the placement record as vLLM's parallel sizes; ``server_argv`` and ``server_env`` build
the command line and the environment; ``VllmServer.start`` runs it in its own process group and waits (bounded)
until ``/health`` answers 200. Everything vLLM writes goes under one folder per instance (``RuntimeFolder``):
IPC sockets (``VLLM_RPC_BASE_PATH``), ``TMPDIR`` (rendezvous files), ``VLLM_CACHE_ROOT``,
``TORCHINDUCTOR_CACHE_DIR``, ``XDG_CACHE_HOME``, ``VLLM_CONFIG_ROOT``; ``stop`` kills the group, removes the folder
and the ``/dev/shm`` segments the instance made. Usage reporting is off (``VLLM_NO_USAGE_STATS``,
``DO_NOT_TRACK``) and the hub is never asked (``HF_HUB_OFFLINE``).

The child gets ``PR_SET_PDEATHSIG`` = SIGTERM, so an agent that dies takes its vLLM server with it. Its environment
(never ``layout.json``, never argv) carries the cluster secret: ``MESHGATE_RUNNER_SECRET`` for a Ray node's keeper,
and the same value as ``VLLM_API_KEY``, so vLLM's API server demands it (``Authorization: Bearer``) on its ``/v1``
routes; the health check presents it.

Imports ``backends.placement``, ``backends.runner.secret``, ``protocols.model`` and the standard library; vLLM
itself only ever runs in the child process (its interpreter is ``Settings.vllm_python``).
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import os
import shutil
import signal
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx
import msgspec

from meshgate.backends.placement import Candidate, NodeId
from meshgate.backends.runner import secret as cluster_secret
from meshgate.protocols.model import BackendTimeout, BackendUnavailable

__all__ = [
    "Layout",
    "RuntimeFolder",
    "VllmServer",
    "group_members",
    "layout",
    "server_argv",
    "server_env",
    "threads_bind",
]

SHM = Path("/dev/shm")
IPC_PATH_MAX = 107  # sizeof(sockaddr_un.sun_path) - 1 on Linux


class Layout(msgspec.Struct, frozen=True, kw_only=True):
    """A placement as vLLM sees it: parallel sizes, the executor and the head node.

    ``layers`` is the pipeline split (``VLLM_PP_LAYER_PARTITION``) when the record fixes one; ``ranks`` maps each
    node to how many vLLM workers run there.
    """

    tensor: int = 1
    pipeline: int = 1
    ray: bool = False
    head: NodeId
    ranks: dict[str, int] = msgspec.field(default_factory=dict)
    layers: tuple[int, ...] | None = None


def layout(placement: Candidate, *, tensor_per_node: int = 1, pipeline_per_node: int = 1) -> Layout:
    """vLLM's sizes for ``placement``.

    - ``single``: one node, ``tensor_per_node`` x ``pipeline_per_node`` workers over the mp executor.
    - Shards on one node (a ``tensor`` or ``pipeline`` record whose shards share a node): TP = the shards'
      ``tensor_size``, PP = their distinct layer ranges, the mp executor.
    - Shards on several nodes: the Ray executor. Pipeline stages across nodes each run ``tensor_per_node``
      tensor ranks (GPUStack's hybrid); a tensor record across nodes is TP = its ``tensor_size``.
    """
    shards = placement.shards
    nodes = list(dict.fromkeys(s.node_id for s in shards))
    head = next((s.node_id for s in shards if s.layer_start == 0 and s.tensor_rank == 0), nodes[0])
    ranges = sorted({(s.layer_start, s.layer_end) for s in shards})
    if placement.strategy == "single" or len(shards) <= 1:
        tensor, pipeline = tensor_per_node, pipeline_per_node
        return Layout(tensor=tensor, pipeline=pipeline, head=head, ranks={head: tensor * pipeline})
    tensor = max(s.tensor_size for s in shards)
    pipeline = len(ranges)
    layers = tuple(end - start for start, end in ranges) if pipeline > 1 else None
    if len(nodes) == 1:
        return Layout(tensor=tensor, pipeline=pipeline, head=head, ranks={head: tensor * pipeline}, layers=layers)
    if placement.strategy == "pipeline":
        tensor = tensor_per_node
    ranks: dict[str, int] = {}
    for shard in shards:
        ranks[shard.node_id] = ranks.get(shard.node_id, 0) + (tensor if placement.strategy == "pipeline" else 1)
    return Layout(tensor=tensor, pipeline=pipeline, ray=True, head=head, ranks=ranks, layers=layers)


def threads_bind(workers: int, cpus: Sequence[int] | None = None) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` giving each local worker its own slice of this process's CPUs.

    ``"0-3|4-7"`` for two workers on eight CPUs; with fewer CPUs than workers, workers share them round-robin.
    """
    cpus = sorted(cpus if cpus is not None else os.sched_getaffinity(0))
    if workers <= len(cpus):
        size = len(cpus) // workers
        groups = [cpus[i * size : (i + 1) * size] for i in range(workers)]
    else:
        groups = [[cpus[i % len(cpus)]] for i in range(workers)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


STRUCTURED_OUTPUTS = '{"backend": "guidance", "disable_any_whitespace": true}'
"""vLLM's structured output engine: llguidance, as in the llama.cpp and MLX runners, so a schema is held to the same
keywords everywhere (``protocols.schema_rules``); compact JSON (no free whitespace between tokens, which a small
model may otherwise repeat until ``max_tokens``)."""


FORCED_TOOLS_PARSER = "pythonic"
"""vLLM 0.32 answers a forced tool call (``tool_choice`` ``required`` or named) only with ``--enable-auto-tool-choice``
and a ``--tool-call-parser`` set (it builds no parser otherwise), although it then generates the call under the
tools' JSON schemas and reads it back as JSON, never through the parser. The parser would read calls out of free
text for ``auto``, which ``runner.structured`` refuses before vLLM is asked, since one parser cannot fit every
model. ``pythonic`` is one that leaves the request as the base parser does: no model-specific tokens or tags."""


def server_argv(
    python: str,
    model: str,
    served_name: str,
    *,
    host: str,
    port: int,
    lay: Layout,
    max_model_len: int,
    dtype: str = "auto",
    eager: bool = False,
) -> list[str]:
    """``python -m vllm.entrypoints.openai.api_server ...`` (``vllm serve`` fails: the distribution is vllm-cpu).

    ``eager`` skips torch.compile; with pipeline stages vLLM 0.32 on CPU asserts under ``--enforce-eager``, so
    those get compilation mode 2 with the eager backend instead (equally fast to start).
    """
    argv = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--served-model-name",
        served_name,
        "--host",
        host,
        "--port",
        str(port),
        "--tensor-parallel-size",
        str(lay.tensor),
        "--pipeline-parallel-size",
        str(lay.pipeline),
        "--max-model-len",
        str(max_model_len),
        "--dtype",
        dtype,
        "--disable-uvicorn-access-log",
        "--structured-outputs-config",
        STRUCTURED_OUTPUTS,
        "--enable-auto-tool-choice",  # vLLM 0.32 answers forced tool calls only with both flags (see below)
        "--tool-call-parser",
        FORCED_TOOLS_PARSER,
    ]
    if lay.ray:
        argv += ["--distributed-executor-backend", "ray"]
    elif lay.tensor * lay.pipeline > 1:
        argv += ["--distributed-executor-backend", "mp"]
    if eager:
        argv += ["--compilation-config", '{"mode": 2, "backend": "eager"}'] if lay.pipeline > 1 else ["--enforce-eager"]
    return argv


class RuntimeFolder:
    """One instance's folder under meshgate's runtime dir, and the ``/dev/shm`` segments made while it lived."""

    def __init__(self, root: str | Path, name: str) -> None:
        self.path = Path(root).absolute() / name
        if len(str(self.path / "tmp")) + 38 > IPC_PATH_MAX:  # vLLM names its sockets <tmp>/<uuid4>
            raise BackendUnavailable(
                f"the runtime dir {root} is too long a path for vLLM's unix sockets "
                f"({IPC_PATH_MAX} bytes); set MESHGATE_RUNTIME_DIR to a shorter one"
            )
        self.path.mkdir(parents=True, exist_ok=True)
        for sub in ("tmp", "cache", "inductor", "xdg", "config"):
            (self.path / sub).mkdir(exist_ok=True)
        self.shm_before = _shm_names()

    def env(self) -> dict[str, str]:
        p = self.path
        return {
            "VLLM_RPC_BASE_PATH": str(p / "tmp"),
            "TMPDIR": str(p / "tmp"),
            "VLLM_CACHE_ROOT": str(p / "cache"),
            "TORCHINDUCTOR_CACHE_DIR": str(p / "inductor"),
            "XDG_CACHE_HOME": str(p / "xdg"),
            "VLLM_CONFIG_ROOT": str(p / "config"),
            "TRITON_CACHE_DIR": str(p / "cache" / "triton"),
        }

    def remove(self) -> None:
        """Remove the folder, and every ``/dev/shm`` segment that appeared since it was made and is held by no
        live process (the instance's processes are gone by now; another instance's segments are still held)."""
        shutil.rmtree(self.path, ignore_errors=True)
        new = _shm_names() - self.shm_before
        if new:
            held = _held_shm()
            for name in new - held:
                with contextlib.suppress(OSError):
                    (SHM / name).unlink()


def server_env(
    folder: RuntimeFolder, *, host_ip: str, kv_cache_gib: int, workers: int, layers: tuple[int, ...] | None = None
) -> dict[str, str]:
    """The environment vLLM must have (see docs/runtimes.md): KV cache bound, binding, no usage stats, offline, and
    exit when the engine dies (vLLM's watchdog then stops the API server within ~5 s)."""
    env = {
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": threads_bind(workers),
        "VLLM_HOST_IP": host_ip,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        # a dead engine (a worker killed) must end the server, so the agent sees it and the instance is re-placed
        "VLLM_KEEP_ALIVE_ON_ENGINE_DEATH": "0",
        **folder.env(),
    }
    if layers:
        env["VLLM_PP_LAYER_PARTITION"] = ",".join(str(n) for n in layers)
    return env


def _shm_names() -> set[str]:
    try:
        return {p.name for p in SHM.iterdir()}
    except OSError:
        return set()


def _held_shm() -> set[str]:
    """``/dev/shm`` names some live process has open or mapped."""
    held: set[str] = set()
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (proc / "fd").iterdir():
                with contextlib.suppress(OSError):
                    target = os.readlink(fd)
                    if target.startswith("/dev/shm/"):
                        held.add(target[9:].removesuffix(" (deleted)"))
        with contextlib.suppress(OSError):
            for line in (proc / "maps").read_text().splitlines():
                if "/dev/shm/" in line:
                    held.add(line.split("/dev/shm/", 1)[1].removesuffix(" (deleted)"))
    return held


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM when the agent that started us exits (Linux ``PR_SET_PDEATHSIG``)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class VllmServer:
    """A started process group (vLLM's API server and its engine and workers, or a Ray node) and its folder."""

    def __init__(self, proc: asyncio.subprocess.Process, folder: RuntimeFolder, url: str | None, log: Path) -> None:
        self.proc = proc
        self.folder = folder
        self.url = url
        self.pid: int | None = proc.pid
        self.log = log

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    @classmethod
    async def start(
        cls,
        argv: Sequence[str],
        *,
        env: Mapping[str, str],
        folder: RuntimeFolder,
        url: str | None,
        ready_timeout: float,
        name: str,
        health: str | None = None,
        http: httpx.AsyncClient | None = None,
    ) -> VllmServer:
        """Spawn ``argv``; with ``health``, wait until it answers 200 (else kill it and raise ``GatewayError``)."""
        log = folder.path / "server.log"
        with open(log, "ab") as out:
            proc = await asyncio.create_subprocess_exec(
                *argv,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=out,
                stderr=asyncio.subprocess.STDOUT,
                env={**os.environ, **cluster_secret.child_env(), "VLLM_API_KEY": cluster_secret.current(), **env},
                start_new_session=True,
                preexec_fn=_die_with_parent,
            )
        server = cls(proc, folder, url, log)
        if health is None:
            return server
        try:
            await asyncio.wait_for(server._wait_healthy(health, http, name), ready_timeout)
        except TimeoutError:
            await server.stop()
            raise BackendTimeout(f"vLLM for {name} was not ready within {ready_timeout:.0f}s") from None
        except BaseException:
            await server.stop()
            raise
        return server

    async def _wait_healthy(self, health: str, http: httpx.AsyncClient | None, name: str) -> None:
        async with contextlib.AsyncExitStack() as stack:
            client = http if http is not None else await stack.enter_async_context(httpx.AsyncClient(trust_env=False))
            while True:
                if self.proc.returncode is not None:
                    raise BackendUnavailable(
                        f"vLLM for {name} exited with code {self.proc.returncode} before it was ready: {self.tail()}"
                    )
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(health, headers=cluster_secret.headers(), timeout=2.0)).status_code == 200:
                        return
                await asyncio.sleep(0.5)

    def tail(self, lines: int = 15) -> str:
        with contextlib.suppress(OSError):
            return " | ".join(self.log.read_text(errors="replace").splitlines()[-lines:])
        return ""

    async def stop(self, grace: float = 10.0) -> None:
        """SIGTERM the group (vLLM shuts its engine and workers down), SIGKILL what is left, clean the folder."""
        if self.proc.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                await asyncio.wait_for(self.proc.wait(), grace)
            except TimeoutError:
                pass
        await _kill_group(self.proc.pid)
        await self.proc.wait()
        self.folder.remove()


async def _kill_group(pgid: int, timeout: float = 10.0) -> None:
    """SIGKILL whatever is left in the process group (workers may outlive the API server) until none runs."""
    deadline = time.monotonic() + timeout
    while group_members(pgid) and time.monotonic() < deadline:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGKILL)
        await asyncio.sleep(0.1)


def group_members(pgid: int) -> dict[int, str]:
    """The running processes of group ``pgid`` (zombies waiting to be reaped do not count): pid -> name."""
    members = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        with contextlib.suppress(OSError, IndexError, ValueError):
            text = stat.read_text()
            name, fields = text[text.find("(") + 1 : text.rfind(")")], text[text.rfind(")") + 2 :].split()
            if int(fields[2]) == pgid and fields[0] not in "ZX":
                members[int(stat.parent.name)] = name
    return members
