"""Start the ranks of a distributed MLX job on this machine: our own launcher, not ``mlx.launch``.

``hostfile(hosts)`` writes the ring backend's JSON hostfile (one ``["ip:port"]`` list per rank) with free ports;
``launch(n, argv)`` starts ``n`` processes of ``argv`` with ``MLX_RANK`` and ``MLX_HOSTFILE`` set and returns
them. ``mlx.launch`` always exits 0, needs literally ``127.0.0.1`` and leaves temp files; here the caller owns
the processes, their exit codes and the hostfile (removed by ``Ranks.close``). Node agents will do the same with
cluster addresses from the placement: one ``hostfile`` entry per shard, in rank order.
"""

from __future__ import annotations

import json
import os
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field

from meshgate.backends.runner.net import free_port

__all__ = ["Ranks", "hostfile", "launch"]


def hostfile(hosts: Sequence[str], directory: str | None = None) -> str:
    """Write a ring hostfile for one rank per entry of ``hosts`` (IP addresses, not names); return its path."""
    entries = [[f"{host}:{free_port(host)}"] for host in hosts]
    fd, path = tempfile.mkstemp(prefix="mlx-hosts-", suffix=".json", dir=directory)
    with os.fdopen(fd, "w") as f:
        json.dump(entries, f)
    return path


@dataclass
class Ranks:
    """The processes of one job, rank order; ``close`` kills what still runs and removes the hostfile."""

    procs: list[subprocess.Popen]
    hostfile: str
    extra: dict = field(default_factory=dict)

    def wait(self, timeout: float) -> list[int]:
        """Exit codes, in rank order; kills every rank if any outlives ``timeout`` (then raises)."""
        try:
            return [p.wait(timeout=timeout) for p in self.procs]
        except subprocess.TimeoutExpired:
            self.close()
            raise

    def close(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait(timeout=10)
        if os.path.exists(self.hostfile):
            os.unlink(self.hostfile)


def launch(
    n: int, argv: Sequence[str], *, env: dict[str, str] | None = None, host: str = "127.0.0.1", **popen: object
) -> Ranks:
    """Start ``n`` ranks of ``argv`` on ``host`` with the ring backend's environment.

    ``n == 1`` starts one plain process with no ring environment: the ring backend with a one-entry hostfile
    hangs in ``init`` (seen with mlx 0.32.4), so a single rank must not join a group at all.
    """
    path = hostfile([host] * n)
    procs = []
    try:
        for rank in range(n):
            rank_env = {**os.environ, **(env or {})}
            if n > 1:
                rank_env |= {"MLX_RANK": str(rank), "MLX_HOSTFILE": path}
            procs.append(subprocess.Popen(list(argv), env=rank_env, **popen))  # type: ignore[call-overload]  # popen: keyword arguments of Popen
    except BaseException:
        Ranks(procs, path).close()
        raise
    return Ranks(procs, path)
