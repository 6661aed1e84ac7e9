"""How the ranks of one MLX instance, started by different node agents, learn the ring's hostfile.

The ring backend needs every rank's ``ip:port`` before any rank calls ``mx.distributed.init``, but each agent
only knows its own node. So a follower (rank > 0) starts first and waits, unjoined, behind a tiny control
endpoint on its node's cluster address:

    follower: reserve a ring port, serve ``GET /ring`` -> ``{"ring": "ip:port"}`` and ``POST /join``
              ``{"rank": r, "hosts": [[...], ...]}``; print the ready line with the control port; wait.
    head:     ``await peers()`` (every follower reported ready), ``GET /ring`` from each, pick its own ring
              port, write the hostfile in rank order, ``POST /join`` to each, then start rank 0 with it.

After ``/join`` the follower calls ``init`` with the hostfile it was sent and keeps its control endpoint open for
the rest of its life: the head's ``watch`` connects to it every second, so a rank that dies is noticed even where
the ring itself would wait on it forever. Every wait is bounded: a follower never joined exits after its timeout.

``serve_join`` runs in the follower (standard library only); ``gather`` and ``join`` run in the head's agent. The
control endpoint answers only callers presenting the cluster secret (``backends.runner.control``); ``gather`` and
``join`` present it.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Sequence
from typing import Any

from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.control import JsonHandler, serve_control
from meshgate.backends.runner.net import free_port, host_port

__all__ = ["Joined", "gather", "join", "serve_join", "watch"]


class Joined:
    """What a follower was told: its rank and the ring's hosts, one list per rank."""

    def __init__(self, rank: int, hosts: list[list[str]]) -> None:
        self.rank, self.hosts = rank, hosts


def serve_join(host: str, rank: int, timeout: float, ready: Any) -> Joined:
    """Follower side: serve ``/ring`` and ``/join`` on ``host`` until joined (or ``TimeoutError``); the endpoint
    stays up afterwards (a daemon thread) as this rank's liveness signal.

    ``ready(port)`` is called once the control endpoint listens (the runner prints its ready line there).
    """
    ring = host_port(host, free_port(host))
    joined: list[Joined] = []
    done = threading.Event()

    class Handler(JsonHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path == "/ring":
                self.reply(200, {"ring": ring, "rank": rank})
            elif self.path == "/health":
                self.reply(200, {"status": "joined" if done.is_set() else "waiting", "rank": rank})
            else:
                self.reply(404, {"error": "not found"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path != "/join":
                self.reply(404, {"error": "not found"})
                return
            try:
                body = self.body()
                hosts = [[str(a) for a in entry] for entry in body["hosts"]]
                if int(body["rank"]) != rank or hosts[rank] != [ring]:
                    raise ValueError(f"this follower is rank {rank} at {ring}, not {body['rank']} at {hosts[rank]}")
            except (ValueError, KeyError, IndexError, TypeError) as exc:
                self.reply(400, {"error": str(exc)})
                return
            joined.append(Joined(rank, hosts))
            self.reply(200, {"joined": True})
            done.set()

    server = serve_control(host, 0, Handler, "mlx-join")
    ready(server.server_address[1])
    if not done.wait(timeout):
        server.shutdown()
        server.server_close()
        raise TimeoutError(f"rank {rank} was not joined into a ring within {timeout:.0f}s")
    return joined[0]


def watch(urls: Sequence[str], gone: Any, *, every: float = 1.0, patience: float = 30.0) -> threading.Thread:
    """Head side: a daemon thread that connects to each follower's control endpoint every ``every`` seconds and
    calls ``gone(url, why)`` once one refuses (its process is dead) or has not answered for ``patience`` seconds
    (a lost machine). Plain TCP connects: the kernel accepts them while the process lives, even when its Python
    threads are busy."""

    def run() -> None:
        silent: dict[str, float] = {}
        while True:
            for url in urls:
                host, _, port = url.removeprefix("http://").rstrip("/").rpartition(":")
                try:
                    socket.create_connection((host.strip("[]"), int(port)), timeout=every).close()
                    silent.pop(url, None)
                except ConnectionRefusedError:
                    gone(url, "its process is gone")
                    return
                except OSError:
                    first = silent.setdefault(url, time.monotonic())
                    if time.monotonic() - first > patience:
                        gone(url, f"no answer for {patience:.0f}s")
                        return
            time.sleep(every)

    thread = threading.Thread(target=run, name="mlx-ring-watch", daemon=True)
    thread.start()
    return thread


async def gather(http: Any, urls: Sequence[str]) -> list[str]:
    """Head side: each follower's ring address, in the order of ``urls`` (rank 1, 2, ...)."""
    out = []
    for url in urls:
        reply = await http.get(f"{url}/ring", headers=cluster_secret.headers(), timeout=10.0)
        reply.raise_for_status()
        out.append(str(reply.json()["ring"]))
    return out


async def join(http: Any, urls: Sequence[str], hosts: list[list[str]]) -> None:
    """Head side: send the hostfile to every follower (``urls[i]`` is rank ``i + 1``)."""
    for rank, url in enumerate(urls, start=1):
        reply = await http.post(
            f"{url}/join", json={"rank": rank, "hosts": hosts}, headers=cluster_secret.headers(), timeout=10.0
        )
        reply.raise_for_status()
