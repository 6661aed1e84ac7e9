"""Ray nodes for a vLLM placement across machines: the head's Ray head, and a join process on every other node.

vLLM's Ray executor needs one Ray cluster spanning the placement's nodes before its API server starts, but each
node agent only knows its own node. So, as the MLX ring does (``backends.mlx.rendezvous``), every node's agent starts
a keeper process (``backends.vllm.rayjoin``) on its cluster address, and followers wait behind it to be joined:

    follower: ``start_node(head=False)``: the keeper serves ``GET /health`` and ``POST /join {"head": "ip:port"}``;
              on join it runs ``ray start --address HEAD --block`` (``worker_argv``) as its child.
    head:     ``start_node(head=True)``: the keeper runs ``ray start --head --block`` (``head_argv``) at once;
              ``wait_running`` gives its GCS address; ``await peers()`` (every follower's keeper listens);
              ``join`` each; ``wait_running`` on each (its raylet registered: the Ray cluster has every node);
              then vLLM's API server with ``RAY_ADDRESS`` and ``--distributed-executor-backend ray``. ``RayHead``
              is both, stopped in that order.

Every Ray node gets explicit ports (``RayPorts``: GCS, node manager, object manager, client server, agents,
metrics, a worker port range), so several nodes can share one machine; ``--temp-dir`` inside the instance's runtime
folder (Ray's sessions, logs and sockets), no dashboard, no usage stats (``--disable-usage-stats``,
``RAY_USAGE_STATS_ENABLED=0``). ``--num-gpus`` is the count of vLLM workers on that node, which
``backends.vllm.ray_platform`` (put on the node's ``PYTHONPATH`` by ``plugin_dir``) makes vLLM's per-worker Ray
resource on CPU. Ray's GCS, raylet and autoscaler monitor would listen on every interface (Ray 2.56 has no option
to bind them to one address), so every Ray process runs with ``backends.runner.bindshim`` preloaded: all of a
node's ports are on its cluster address. Ray takes loopback (``127.0.0.1``/``::1``) for "this machine"
and swaps in its routable address, so nodes on one test machine use other loopback addresses (``127.0.0.2``...).

vLLM's Ray executor ranks the driver's node first and the others by Ray node id, so each node gets an id that
sorts by its place in the placement (``stage_env``): stage ``k`` of the record is stage ``k`` in vLLM.

Stopping is killing the process group (the join process and its Ray node, or the head's Ray node); never
``ray stop``, which stops every Ray node of the machine, another instance's or another agent's included.

Keepers run under meshgate's own interpreter, ``ray`` under ``Settings.vllm_python``. Imports
``backends.placement``, ``backends.runner.bindshim``/``net``/``secret``, ``backends.vllm.launch``, httpx and the
standard library. The keepers' endpoints demand the cluster secret (``backends.runner.control``); the calls here
present it.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import secrets
import socket
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import httpx

from meshgate.backends.placement import Candidate, NodeId
from meshgate.backends.runner import bindshim
from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.net import family, free_port, url_host
from meshgate.backends.vllm.launch import RuntimeFolder, VllmServer

__all__ = [
    "RayHead",
    "RayPorts",
    "head_argv",
    "join",
    "loopback",
    "node_env",
    "plugin_dir",
    "stage",
    "stage_env",
    "start_node",
    "wait_running",
    "worker_argv",
]

PLATFORM_ENTRY = "meshgate_cpu_ray = meshgate_vllm_platform:platform"
SOCKET_TAIL = 60  # Ray's socket paths: <temp-dir>/session_<date>_<time>_<micros>_<pid>/sockets/plasma_store
IPC_PATH_MAX = 107
NODE_ID_BYTES = 28  # Ray's NodeID
WORKER_PORTS = 48  # Ray's worker processes (vLLM's actors, Ray's own) on one node


class RayPorts:
    """Ports one Ray node listens on, all free on ``host`` when chosen."""

    def __init__(self, host: str) -> None:
        taken: set[int] = set()
        (
            self.node_manager,
            self.object_manager,
            self.client_server,
            self.agent_listen,
            self.agent_grpc,
            self.runtime_env_agent,
            self.metrics,
            self.gcs,
        ) = (_free(host, taken) for _ in range(8))
        self.min_worker = _free_range(host, WORKER_PORTS, taken)
        self.max_worker = self.min_worker + WORKER_PORTS - 1

    def argv(self) -> list[str]:
        return [
            "--node-manager-port",
            str(self.node_manager),
            "--object-manager-port",
            str(self.object_manager),
            "--min-worker-port",
            str(self.min_worker),
            "--max-worker-port",
            str(self.max_worker),
            "--ray-client-server-port",
            str(self.client_server),
            "--dashboard-agent-listen-port",
            str(self.agent_listen),
            "--dashboard-agent-grpc-port",
            str(self.agent_grpc),
            "--runtime-env-agent-port",
            str(self.runtime_env_agent),
            "--metrics-export-port",
            str(self.metrics),
        ]


def _free(host: str, taken: set[int]) -> int:
    while (port := free_port(host)) in taken:
        pass
    taken.add(port)
    return port


def _free_range(host: str, size: int, taken: set[int]) -> int:
    """The first of ``size`` consecutive ports free on ``host`` (below the kernel's ephemeral range)."""
    for _ in range(200):
        base = random.randrange(20000, 32000 - size)
        ports = range(base, base + size)
        if taken.intersection(ports):
            continue
        try:
            with contextlib.ExitStack() as stack:
                for port in ports:
                    stack.enter_context(socket.socket(family(host))).bind((host, port))
        except OSError:
            continue
        taken.update(ports)
        return base
    raise OSError(f"no {size} consecutive free ports on {host}")


def loopback(host: str) -> bool:
    """Whether Ray would take ``host`` for "this machine" and replace it with the machine's routable address."""
    return host in ("localhost", "127.0.0.1", "::1", "0.0.0.0", "::")


def _common(python: str, host: str, temp_dir: Path, slots: int, ports: RayPorts) -> list[str]:
    if len(str(temp_dir)) + SOCKET_TAIL > IPC_PATH_MAX:
        raise OSError(f"{temp_dir} is too long a path for Ray's unix sockets; set a shorter MESHGATE_RUNTIME_DIR")
    return [
        python,
        "-m",
        "ray.scripts.scripts",
        "start",
        "--block",
        "--node-ip-address",
        host,
        "--num-cpus",
        str(slots),
        "--num-gpus",
        str(slots),
        "--temp-dir",
        str(temp_dir),
        "--disable-usage-stats",
        "--object-store-memory",
        str(128 << 20),
        *ports.argv(),
    ]


def head_argv(python: str, host: str, temp_dir: Path, slots: int, ports: RayPorts) -> list[str]:
    """``ray start --head`` on ``host`` with ``slots`` vLLM workers here; its GCS listens on ``ports.gcs``."""
    return [
        *_common(python, host, temp_dir, slots, ports),
        "--head",
        "--port",
        str(ports.gcs),
        "--include-dashboard=false",
    ]


def worker_argv(python: str, host: str, temp_dir: Path, slots: int, ports: RayPorts, head: str) -> list[str]:
    """``ray start --address HEAD`` joining the head's cluster from ``host``."""
    return [*_common(python, host, temp_dir, slots, ports), "--address", head]


def stage(placement: Candidate, node: NodeId) -> int:
    """``node``'s place in the placement: its first layer, then its tensor rank (the head's node is 0)."""
    ordered = sorted(placement.shards, key=lambda s: (s.layer_start, s.tensor_rank))
    return list(dict.fromkeys(s.node_id for s in ordered)).index(node)


def stage_env(index: int) -> dict[str, str]:
    """A Ray node id that sorts by ``index``: vLLM's Ray executor ranks the driver's node first and the others by
    Ray node id (random otherwise), so pipeline stages land on the nodes the placement put them on."""
    return {"RAY_OVERRIDE_NODE_ID_FOR_TESTING": f"{index:08x}{secrets.token_hex(NODE_ID_BYTES - 4)}"}


def plugin_dir(folder: Path) -> Path:
    """A folder for ``PYTHONPATH`` holding ``backends/vllm/ray_platform.py`` as the top-level module
    ``meshgate_vllm_platform`` and a distribution that names it as a ``vllm.platform_plugins`` entry point."""
    code = folder / "plugin"
    info = code / "meshgate_vllm_platform-0.dist-info"
    info.mkdir(parents=True, exist_ok=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: meshgate-vllm-platform\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[vllm.platform_plugins]\n{PLATFORM_ENTRY}\n")
    link = code / "meshgate_vllm_platform.py"
    if not link.is_symlink():
        link.symlink_to(Path(__file__).resolve().parent / "ray_platform.py")
    return code


def node_env(
    folder_env: dict[str, str], plugin: Path, shim: Path, *, host: str, kv_cache_gib: int, threads: str
) -> dict[str, str]:
    """What a Ray node's processes (vLLM's worker actors among them) must have: the same rules as the API server
    (``launch.server_env``), this node's own address and CPU slices, the platform plugin, no usage stats, and
    ``shim`` (``backends.runner.bindshim``) keeping every port they listen on to ``host``."""
    path = os.pathsep.join(p for p in (str(plugin), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **bindshim.confine(folder_env, shim, host),
        "PYTHONPATH": path,
        "MESHGATE_VLLM_RAY": "1",
        "RAY_USAGE_STATS_ENABLED": "0",
        "VLLM_HOST_IP": host,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
        "VLLM_CPU_OMP_THREADS_BIND": threads,
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        "HF_HUB_OFFLINE": "1",
        "TRANSFORMERS_OFFLINE": "1",
        "VLLM_LOGGING_LEVEL": "WARNING",
        "RAY_DEDUP_LOGS": "0",
    }


# ------------------------------------------------------------------------------------------------ agents' side


async def start_node(
    folder: RuntimeFolder,
    *,
    host: str,
    python: str,
    slots: int,
    env: Mapping[str, str],
    head: bool,
    timeout: float,
    name: str,
    http: httpx.AsyncClient,
) -> VllmServer:
    """Start this node's keeper (``backends.vllm.rayjoin``) in its own process group; up once ``/health``
    answers (a follower then waits to be joined; a head is already starting its Ray node)."""
    port = free_port(host)
    url = f"http://{url_host(host)}:{port}"
    argv = [
        sys.executable,
        "-m",
        "meshgate.backends.vllm.rayjoin",
        "--host",
        host,
        "--port",
        str(port),
        "--python",
        python,
        "--temp-dir",
        str(folder.path / "ray"),
        "--slots",
        str(slots),
        "--join-timeout",
        str(timeout),
    ]
    root = str(Path(sys.modules["meshgate"].__path__[0]).resolve().parent)  # the keeper imports meshgate's ``backends``
    path = os.pathsep.join(p for p in (root, env.get("PYTHONPATH", "")) if p)
    return await VllmServer.start(
        [*argv, "--head"] if head else argv,
        env={**env, "PYTHONPATH": path},
        folder=folder,
        url=url,
        ready_timeout=60.0,
        name=f"{name} (Ray node)",
        health=f"{url}/health",
        http=http,
    )


async def wait_running(http: httpx.AsyncClient, nodes: Sequence[str], timeout: float) -> list[str]:
    """Until every keeper at ``nodes`` says its Ray node runs (a follower's has registered with the head); their
    GCS addresses (a head's; empty for followers). ``TimeoutError`` after ``timeout``, ``RuntimeError`` if one
    failed."""
    deadline = time.monotonic() + timeout
    out = []
    for url in nodes:
        while True:
            state = (await http.get(f"{url}/health", headers=cluster_secret.headers(), timeout=5.0)).json()
            if state["state"] == "running":
                out.append(str(state["gcs"]))
                break
            if state["state"] == "failed":
                raise RuntimeError(f"the Ray node at {url} failed: {state['error']}")
            if time.monotonic() > deadline:
                raise TimeoutError(f"the Ray node at {url} was not running within {timeout:.0f}s")
            await asyncio.sleep(0.3)
    return out


async def join(http: httpx.AsyncClient, followers: Sequence[str], head: str) -> None:
    """Tell every follower's keeper the head's GCS address (``ip:port``)."""
    for url in followers:
        reply = await http.post(f"{url}/join", json={"head": head}, headers=cluster_secret.headers(), timeout=10.0)
        reply.raise_for_status()


class RayHead:
    """What the head node's agent runs for a placement across nodes: vLLM's API server and the Ray head."""

    def __init__(self, api: VllmServer, node: VllmServer) -> None:
        self.api = api
        self.node = node
        self.url = api.url
        self.pid: int | None = api.pid

    @property
    def alive(self) -> bool:
        return self.api.alive and self.node.alive

    async def stop(self) -> None:
        """The API server first (it stops using the workers), then the Ray head's group (the workers with it):
        the Ray folder was made first, so its removal also takes the workers' ``/dev/shm`` segments."""
        try:
            await self.api.stop()
        finally:
            await self.node.stop()
