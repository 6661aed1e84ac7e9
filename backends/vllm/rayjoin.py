"""One Ray node's keeper process (``python -m meshgate.backends.vllm.rayjoin``), started by a node agent.

It serves ``GET /health`` on the node's cluster address: ``{"state": "waiting" | "starting" | "running" |
"failed", "gcs": "ip:port" (a head), "error": ...}``. With ``--head`` it starts ``ray start --head --block`` at once
(``backends.vllm.raynode.head_argv``); a follower waits for ``POST /join {"head": "ip:port"}`` and then runs ``ray
start --address HEAD --block`` (``worker_argv``). ``running`` once Ray says the node runs (a follower's raylet has
registered with the head: the cluster has it). It exits with the node's exit code; a follower not joined within
``--join-timeout`` exits 1. SIGTERM (the agent stopping the instance, or dying: ``PR_SET_PDEATHSIG``) kills the
whole process group, Ray's GCS, raylet and vLLM's worker actors with it; so does a vLLM worker actor of this node
that exits (``_watch_workers``). See ``backends.vllm.raynode`` for the whole exchange.

Runs under meshgate's interpreter; imports ``backends.runner``, ``backends.vllm.launch``, ``backends.vllm.raynode``
and the standard library.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path

from meshgate.backends.runner.control import JsonHandler, serve_control
from meshgate.backends.runner.net import host_port
from meshgate.backends.vllm.launch import group_members
from meshgate.backends.vllm.raynode import RayPorts, head_argv, worker_argv

WORKER_COMM = "ray::RayWorker"  # vLLM's worker actors' process name (RayWorkerProc; RayWorkerWrapper before)
WATCH_EVERY = 0.5


class _Node:
    """The keeper's state: waiting to be joined (a follower), then running its Ray node."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.state = "waiting"
        self.error = ""
        self.gcs = ""
        self.child: subprocess.Popen[bytes] | None = None
        self.started = threading.Event()
        self.lock = threading.Lock()

    def start(self, head: str | None) -> None:
        """Start the Ray node: a head when ``head`` is ``None``, else a worker joining ``head``."""
        a = self.args
        ports = RayPorts(a.host)
        temp = Path(a.temp_dir)
        if head is None:
            argv = head_argv(a.python, a.host, temp, a.slots, ports)
            self.gcs = host_port(a.host, ports.gcs)
        else:
            argv = worker_argv(a.python, a.host, temp, a.slots, ports, head)
        self.child = subprocess.Popen(
            argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=_ray_env()
        )
        self.state = "starting"
        threading.Thread(target=self._watch, daemon=True).start()
        threading.Thread(target=self._watch_workers, daemon=True).start()
        self.started.set()

    def _watch_workers(self) -> None:
        """End the node when one of vLLM's worker actors here exits: vLLM's Ray executor notices a dead worker
        but its engine can stay blocked on it, and the streams with it. Going down makes the agent report the
        runner failed; the instance is stopped on every node (ending those streams) and placed again."""
        seen: set[int] = set()
        while True:
            time.sleep(WATCH_EVERY)
            now = _workers()
            if lost := seen - now:
                print(f"vLLM worker process {sorted(lost)} exited: stopping this Ray node", flush=True)
                self.state, self.error = "failed", f"vLLM worker process {sorted(lost)} exited"
                os.killpg(0, signal.SIGKILL)
            seen |= now

    def _watch(self) -> None:
        """Copy the node's output to our log (stdout); ``running`` once Ray says the node runs."""
        assert self.child is not None and self.child.stdout is not None
        for line in self.child.stdout:
            sys.stdout.buffer.write(line)
            sys.stdout.flush()
            if b"Ray runtime started" in line:
                self.state = "running"
        self.state, self.error = "failed", f"ray start exited with code {self.child.wait()}"


def _workers() -> set[int]:
    """Live vLLM worker actors in our process group (Ray's raylet, our child, starts them there)."""
    return {pid for pid, name in group_members(os.getpgid(0)).items() if name.startswith(WORKER_COMM)}


def _ray_env() -> dict[str, str]:
    """Our environment without meshgate's own root on ``PYTHONPATH`` (Ray and vLLM need only the plugin there)."""
    root = str(Path(sys.modules["meshgate"].__path__[0]).resolve().parent)
    path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p and os.path.abspath(p) != root]
    return {**os.environ, "PYTHONPATH": os.pathsep.join(path)}


def serve(args: argparse.Namespace) -> int:
    """Serve ``/health`` and ``/join``; run the Ray node until it exits (its exit code is ours)."""
    node = _Node(args)

    class Handler(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/health":
                self.reply(200, {"state": node.state, "gcs": node.gcs, "error": node.error})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/join" or args.head:
                self.reply(404, {"error": "not found"})
                return
            try:
                head = str(self.body()["head"])
                host, _, port = head.rpartition(":")
                ipaddress.ip_address(host.strip("[]"))
                int(port)
            except (ValueError, KeyError, TypeError) as exc:
                self.reply(400, {"error": f"not a head address: {exc}"})
                return
            with node.lock:
                if node.child is None:
                    node.start(head)
            self.reply(200, {"state": node.state})

    # stopped (or orphaned): take the Ray node's processes along, they share our process group
    signal.signal(signal.SIGTERM, lambda *_: os.killpg(0, signal.SIGKILL))
    serve_control(args.host, args.port, Handler, "ray-node")
    if args.head:
        node.start(None)
    if not node.started.wait(args.join_timeout):
        print(f"not joined to a Ray head within {args.join_timeout:.0f}s", flush=True)
        return 1
    assert node.child is not None
    return node.child.wait()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="One Ray node of a vLLM placement across machines.")
    parser.add_argument("--host", required=True, help="this node's cluster address")
    parser.add_argument("--port", type=int, required=True, help="the /health and /join endpoint's port")
    parser.add_argument("--python", required=True, help="interpreter with vLLM and Ray")
    parser.add_argument("--temp-dir", required=True, help="Ray's --temp-dir")
    parser.add_argument("--slots", type=int, required=True, help="vLLM workers this node runs")
    parser.add_argument("--head", action="store_true", help="start the cluster's head now")
    parser.add_argument("--join-timeout", type=float, default=600.0)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
