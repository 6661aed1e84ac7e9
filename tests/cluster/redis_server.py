"""A real ``redis-server`` for tests: a free loopback port, its own temp directory, no persistence unless asked.

``RedisServer(dir)`` starts it (``appendonly=True`` for AOF), waits for ``PING``, and ``stop()``s it;
``restart()`` brings it back on the same port and directory, so an AOF file written before is replayed.
The binary is ``redis-server`` on ``PATH`` or ``$MESHGATE_REDIS_SERVER``; without it, ``RedisServerMissing``
says how to install it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

__all__ = ["RedisServer", "RedisServerMissing", "find_redis_server", "free_port"]


class RedisServerMissing(RuntimeError):
    """No ``redis-server`` binary to run."""


def find_redis_server() -> str:
    binary = os.environ.get("MESHGATE_REDIS_SERVER") or shutil.which("redis-server")
    if not binary or not os.access(binary, os.X_OK):
        raise RedisServerMissing(
            "redis-server is not installed (needed for the RedisStore tests): `apt-get install -y redis-server`, "
            "or point MESHGATE_REDIS_SERVER at the binary"
        )
    return binary


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RedisServer:
    """One ``redis-server`` process bound to 127.0.0.1, data and log under ``directory``."""

    def __init__(
        self, directory: Path, *, appendonly: bool = False, port: int | None = None, timeout: float = 10.0
    ) -> None:
        self.binary = find_redis_server()
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.appendonly = appendonly
        self.port = port or free_port()
        self.timeout = timeout
        self.log = self.directory / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        args = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            "127.0.0.1",
            "--dir",
            str(self.directory),
            "--save",
            "",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.log),
            "--protected-mode",
            "yes",
        ]
        self.proc = subprocess.Popen(
            args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT
        )
        deadline = time.monotonic() + self.timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}:\n{self._log_tail()}")
            if self.ping():
                return
            time.sleep(0.02)
        self.stop()
        raise RuntimeError(
            f"redis-server did not answer PING on port {self.port} in {self.timeout}s:\n{self._log_tail()}"
        )

    def ping(self) -> bool:
        try:
            with socket.create_connection(("127.0.0.1", self.port), timeout=0.5) as s:
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def stop(self, *, kill: bool = False) -> None:
        """Stop the server: SIGTERM (a clean shutdown) or, with ``kill``, SIGKILL (a crash)."""
        if self.proc is None or self.proc.poll() is not None:
            self.proc = None
            return
        self.proc.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.proc.wait(timeout=self.timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=self.timeout)
        self.proc = None

    def pause(self) -> None:
        """SIGSTOP: the server holds its connections and answers nothing (a stalled or black-holed Redis)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause`` (nothing when it is not running)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)

    def restart(self, *, kill: bool = False) -> None:
        """Stop and start again on the same port and directory."""
        self.stop(kill=kill)
        self.start()

    def _log_tail(self) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-20:])
        except OSError:
            return "(no log)"

    def __enter__(self) -> RedisServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()
