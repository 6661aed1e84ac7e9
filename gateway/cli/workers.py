"""``meshgate serve --workers N``: N gateway processes on one address, and the parent that keeps them.

The parent (``supervise``) serves no request itself. In order:

1. **The address.** It binds ``host:port`` (port 0 picks one) and keeps that socket for its lifetime, so the port
   stays taken while workers come and go. On Linux the socket is bound with ``SO_REUSEPORT`` and never listened
   on; every worker binds and listens on a socket of its own on the same port, and the kernel hands each new
   connection to one of them, by a hash of the connection, so load spreads evenly (a connection stays with its
   worker). Elsewhere (macOS, the BSDs: their ``SO_REUSEPORT`` gives every connection to the socket bound last)
   the parent listens and every worker inherits that one socket, as uvicorn's own ``--workers`` does: the workers
   then take turns accepting.
2. **Shared state.** With ``--redis URL`` it starts N workers, each a gateway on that Redis, and nothing else: node
   agents are ``meshgate node``'s, as with gateways on several machines. The embedded default (no Redis) keeps
   state in one process's memory, which workers cannot share, so the parent starts a private ``redis-server``
   (``PATH`` or ``MESHGATE_REDIS_SERVER``; missing, the command says to install it or pass ``--redis``) on a unix
   socket in a 0700 folder, ``<data_dir>/workers/<port>/`` (a temporary one when that path is too long for a
   socket), without persistence; ONE node agent (``meshgate node`` with the same settings: models, data dir,
   plugins, memory); and, once that agent's node is registered, N workers on that Redis (as the embedded gateway
   starts its agent before it serves). What the embedded gateway persists in the data dir stays there:
   API keys (``<data_dir>/keys.json``) are copied into the private Redis at start and back into the file when
   they change (read every second) and at exit (``KeyMirror``), so keys made with ``meshgate keys create``, with
   or without workers, keep working; models and ``registry.json`` are files every process reads.
3. **Supervision.** A worker, or the agent, that exits unasked is started again; one that exits within
   ``FAST_CRASH`` seconds of its start ``MAX_FAST_CRASHES`` times in a row makes the parent stop everything and
   exit 1. The private Redis exiting stops everything too (the cluster state is gone).
4. **Stopping.** ``SIGTERM`` or ``SIGINT`` is forwarded to every worker: each stops accepting and lets its open
   streams finish within ``MESHGATE_DRAIN_GRACE`` (uvicorn's graceful shutdown); a second signal is forwarded
   too and cuts them. Once every worker is gone (killed ``STOP_MARGIN`` seconds past the grace), the agent stops
   (``SIGINT``: no gateway is left to drain for), then the private Redis, and its folder is removed.

Children never outlive the parent: each reads its ``Launch`` (settings, role, index) from a pipe on stdin that the
parent holds open, and EOF there means the parent is gone: a worker then stops as on ``SIGTERM`` (and exits
after the grace regardless), the agent at once (its runners follow it the same way). The private Redis gets
``PR_SET_PDEATHSIG`` on Linux; elsewhere a parent killed with ``SIGKILL`` leaves it running on a socket in a
0700 folder. Children run in process groups of their own, so a terminal's Ctrl-C reaches the parent alone, which
then stops them in the order above. POSIX only (inherited descriptors, process groups).

Imports ``gateway.auth.keys`` (the key mirror) and, in a child, ``gateway.cli.commands``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO, TYPE_CHECKING, Literal

import msgspec

from meshgate.plugins.settings import Settings

if TYPE_CHECKING:
    from meshgate.gateway.auth.keys import Accounts, ApiKey

__all__ = ["Launch", "RedisServerMissing", "Worker", "child_main", "supervise"]

log = logging.getLogger("meshgate.workers")

FAST_CRASH = 10.0
"""Seconds: a child that exits sooner after its start crashed fast."""
MAX_FAST_CRASHES = 3
"""Fast crashes in a row of one child after which the parent gives up (exit 1)."""
STOP_MARGIN = 10.0
"""Seconds past ``drain_grace`` a worker may take to stop before it is killed."""
REUSE_PORT = sys.platform.startswith("linux") and hasattr(socket, "SO_REUSEPORT")
"""Each worker listens on a socket of its own (Linux spreads connections over them). Not on macOS and the BSDs:
their ``SO_REUSEPORT`` hands every TCP connection to one socket (the last bound), so there the workers share the
parent's one listening socket and accept in turn."""
NODE_WAIT = 120.0
"""Seconds the parent waits for the embedded default's agent to register its node before starting workers."""
BACKLOG = 2048  # uvicorn's


class Launch(msgspec.Struct, frozen=True, kw_only=True):
    """What a child is told on stdin (one JSON line): its role and settings, and for a worker its place."""

    role: Literal["gateway", "node"]
    settings: Settings
    index: int = 0
    workers: int = 1
    fd: int | None = None  # a listening socket inherited from the parent (no SO_REUSEPORT)
    ready: int | None = None  # a pipe's write end: ``ready <models>`` once the worker serves


@dataclass(frozen=True)
class Worker:
    """A gateway process's place among the workers, for ``commands.run_gateway``."""

    index: int
    count: int
    socket: socket.socket
    ready: int | None = None

    def tell_ready(self, models: str) -> None:
        """Tell the parent this worker serves (``models``: the catalog's names, for its start-up line)."""
        if self.ready is not None:
            with contextlib.suppress(OSError):
                os.write(self.ready, f"ready {models}\n".encode())
                os.close(self.ready)


class RedisServerMissing(RuntimeError):
    """No ``redis-server`` to run for the embedded default's workers."""


# ------------------------------------------------------------------ sockets


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def reserve(host: str, port: int) -> socket.socket:
    """The parent's socket on ``host:port``: bound with ``SO_REUSEPORT`` (never listened on) where the OS has it,
    else listening and inheritable (the workers accept on it)."""
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if REUSE_PORT:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    try:
        sock.bind((host, port))
    except OSError:
        sock.close()
        raise
    if not REUSE_PORT:
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
    return sock


def worker_socket(host: str, port: int, fd: int | None) -> socket.socket:
    """A worker's listening socket: the parent's (``fd``), or its own on the same port with ``SO_REUSEPORT``."""
    if fd is not None:
        return socket.socket(fileno=fd)
    sock = socket.socket(_family(host), socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
    sock.bind((host, port))
    sock.listen(BACKLOG)
    return sock


# ------------------------------------------------------------------ the private Redis


def _die_with_parent() -> None:
    """In a child before exec: SIGTERM when the parent exits (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing)."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)


class PrivateRedis:
    """A ``redis-server`` on a unix socket in a 0700 folder, no persistence, for one ``serve --workers``."""

    def __init__(self, data_dir: str, port: int) -> None:
        binary = os.environ.get("MESHGATE_REDIS_SERVER") or shutil.which("redis-server")
        if not binary or not os.access(binary, os.X_OK):
            raise RedisServerMissing(
                "meshgate serve --workers without --redis runs a private redis-server, and none is installed: "
                "install it (apt-get install redis-server, brew install redis) or pass --redis URL"
            )
        folder = Path(data_dir).resolve() / "workers" / str(port)
        self.temporary = len(str(folder / "redis.sock")) > 100  # a unix socket's path has ~104 bytes at most
        if self.temporary:
            folder = Path(tempfile.mkdtemp(prefix="meshgate-workers-"))
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(folder, 0o700)
        self.folder = folder
        self.path = folder / "redis.sock"
        self.path.unlink(missing_ok=True)  # a socket a killed run left behind
        self.proc = subprocess.Popen(
            [
                binary,
                "--port",
                "0",
                "--unixsocket",
                str(self.path),
                "--unixsocketperm",
                "700",
                "--save",
                "",
                "--appendonly",
                "no",
                "--dir",
                str(folder),
                "--logfile",
                str(folder / "redis.log"),
                "--daemonize",
                "no",
            ],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.STDOUT,
            process_group=0,
            preexec_fn=_die_with_parent,
        )
        deadline = time.monotonic() + 10.0
        while not self._ping():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                tail = self._log_tail()
                self.stop()
                raise RuntimeError(f"the private redis-server did not start:\n{tail}")
            time.sleep(0.02)

    @property
    def url(self) -> str:
        return f"unix://{self.path}"

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def _ping(self) -> bool:
        try:
            with socket.socket(socket.AF_UNIX) as s:
                s.settimeout(0.5)
                s.connect(str(self.path))
                s.sendall(b"PING\r\n")
                return s.recv(64).startswith(b"+PONG")
        except OSError:
            return False

    def _log_tail(self) -> str:
        try:
            return "\n".join((self.folder / "redis.log").read_text(errors="replace").splitlines()[-10:])
        except OSError:
            return "(no log)"

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)
        if not self.temporary:
            with contextlib.suppress(OSError):
                self.folder.parent.rmdir()  # ``<data_dir>/workers``, when no other run's folder is in it


class KeyMirror:
    """The embedded default's API keys (``<data_dir>/keys.json``) in the private Redis, and back.

    ``load`` copies the file's keys (and its seal) into Redis once, before any worker starts; ``sync`` writes what
    Redis holds back into the file when it changed since the last look (keys made, revoked). Both go through
    ``gateway.auth.keys``'s own classes, so the file keeps its format and mode."""

    def __init__(self, data_dir: str, url: str) -> None:
        from meshgate.gateway.auth.keys import open_accounts

        self.path = Path(data_dir) / "keys.json"
        self.accounts = open_accounts(url, data_dir)
        self.seen: tuple[list[ApiKey], bool] | None = None

    async def load(self) -> None:
        from meshgate.gateway.auth.keys import MemoryAccounts

        saved = MemoryAccounts(self.path)
        keys = await saved.keys()
        for key in keys:
            await self.accounts.put_key(key)
        if await saved.sealed() and not keys:  # sealed with every key revoked: sealed in Redis too
            await self._seal(self.accounts)
        self.seen = (keys, await saved.sealed())

    async def sync(self) -> None:
        from meshgate.gateway.auth.keys import MemoryAccounts

        now = (await self.accounts.keys(), await self.accounts.sealed())
        if now == self.seen:
            return
        keys, sealed = now
        saved = MemoryAccounts(self.path)
        wanted = {k.id: k for k in keys}
        for old in await saved.keys():
            if old.id not in wanted:
                await saved.delete_key(old.id)
        for key in keys:
            if await saved.get_key(key.id) != key:
                await saved.put_key(key)
        if sealed and not await saved.sealed():
            await self._seal(saved)
        self.seen = now

    @staticmethod
    async def _seal(accounts: Accounts) -> None:
        """Seal ``accounts`` with no key in it: made and revoked at once (the seal outlives its key)."""
        from meshgate.gateway.auth.keys import ApiKey

        await accounts.put_key(ApiKey(id="sealonly", name="(seal)", digest="-"))
        await accounts.delete_key("sealonly")

    async def close(self) -> None:
        await self.accounts.close()


# ------------------------------------------------------------------ children


class Child:
    """One child process (a worker or the agent) and its restarts."""

    def __init__(self, launch: Launch, name: str) -> None:
        self.launch = launch
        self.name = name
        self.proc: subprocess.Popen[bytes] | None = None
        self.started = 0.0
        self.fast_crashes = 0
        self.ready = launch.role == "node"  # the agent is taken as up once started
        self.models = ""
        self._ready_pipe: int | None = None
        self._buffer = b""

    def start(self) -> None:
        launch, fds = self.launch, []
        if launch.role == "gateway":
            read, write = os.pipe()
            os.set_blocking(read, False)
            self._close_pipe()
            self._ready_pipe, self._buffer, self.ready = read, b"", False
            launch = msgspec.structs.replace(launch, ready=write)
            fds.append(write)
        if launch.fd is not None:
            fds.append(launch.fd)
        argv = [sys.executable, "-m", "meshgate.gateway.cli.workers", launch.role, str(launch.index)]
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, pass_fds=fds, process_group=0)
        if launch.ready is not None:
            os.close(launch.ready)
        stdin: IO[bytes] | None = self.proc.stdin
        assert stdin is not None  # stdin=PIPE
        stdin.write(msgspec.json.encode(launch) + b"\n")
        stdin.flush()  # and kept open: its EOF tells the child the parent is gone
        self.started = time.monotonic()

    def poll_ready(self) -> None:
        if self.ready or self._ready_pipe is None:
            return
        with contextlib.suppress(BlockingIOError, OSError):
            self._buffer += os.read(self._ready_pipe, 4096)
        line, sep, _ = self._buffer.partition(b"\n")
        if sep and line.startswith(b"ready"):
            self.ready, self.models = True, line.decode(errors="replace").removeprefix("ready").strip()
            self._close_pipe()

    def _close_pipe(self) -> None:
        if self._ready_pipe is not None:
            with contextlib.suppress(OSError):
                os.close(self._ready_pipe)
            self._ready_pipe = None

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def signal(self, sig: int) -> None:
        if self.alive:
            assert self.proc is not None
            with contextlib.suppress(ProcessLookupError):
                self.proc.send_signal(sig)

    def reap(self) -> None:
        """Close what the parent holds of an exited child (its stdin, the ready pipe)."""
        if self.proc is not None and self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        self._close_pipe()

    def kill(self) -> None:
        if self.alive:
            assert self.proc is not None
            self.proc.kill()
            self.proc.wait()
        self.reap()


# ------------------------------------------------------------------ the parent


def supervise(settings: Settings) -> int:
    """Run ``settings.workers`` gateways on ``settings.host:port`` (see the module docstring); the exit status."""
    try:
        listener = reserve(settings.host, settings.port)
    except OSError as exc:
        log.error("cannot bind %s:%d: %s", settings.host, settings.port, exc.strerror or exc)
        return 1
    try:
        return asyncio.run(_supervise(settings, listener))
    except RedisServerMissing as exc:
        print(exc, file=sys.stderr)
        return 2
    finally:
        listener.close()


async def _supervise(settings: Settings, listener: socket.socket) -> int:
    port = listener.getsockname()[1]
    count = settings.workers
    settings = settings.replace(port=port, workers=1)
    redis: PrivateRedis | None = None
    keys: KeyMirror | None = None
    children: list[Child] = []
    signals: asyncio.Queue[int] = asyncio.Queue()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, signals.put_nowait, sig)
    try:
        shared = settings
        if not settings.redis:
            redis = await asyncio.to_thread(PrivateRedis, settings.data_dir, port)
            shared = settings.replace(redis=redis.url)
            keys = KeyMirror(settings.data_dir, redis.url)
            await keys.load()
            children.append(Child(Launch(role="node", settings=shared), "node agent"))
        fd = None if REUSE_PORT else listener.fileno()
        workers = [
            Child(Launch(role="gateway", settings=shared, index=i, workers=count, fd=fd), f"worker {i}")
            for i in range(count)
        ]
        for child in children:  # the agent, first: a worker serving before any node is up would refuse requests
            child.start()
            code = await _node_up(shared, child, signals)
            if code is not None or not signals.empty():
                await _stop(settings, children, [], signals, code or 0)
                return code or 0
        children += workers
        for child in workers:
            child.start()
        code = await _keep(settings, children, workers, redis, keys, signals)
        await _stop(settings, children, workers, signals, code)
        return code
    finally:
        for child in children:
            child.kill()
        if keys is not None:
            with contextlib.suppress(Exception):
                await keys.sync()  # what the last requests changed
            await keys.close()
        if redis is not None:
            redis.stop()


async def _node_up(settings: Settings, agent: Child, signals: asyncio.Queue[int]) -> int | None:
    """Wait until a node is registered in the store (the agent is up), as the embedded gateway starts its agent
    before it serves: ``None`` then (or after ``NODE_WAIT`` seconds, with a warning), 1 if the agent exited."""
    from meshgate.gateway.http.runtime import make_store

    store = make_store(settings)
    deadline = time.monotonic() + NODE_WAIT
    try:
        while signals.empty():
            with contextlib.suppress(Exception):  # the store's trouble: asked again
                if await store.nodes():
                    return None
            if not agent.alive:
                assert agent.proc is not None
                log.error("the node agent exited with status %s before it came up", agent.proc.returncode)
                return 1
            if time.monotonic() > deadline:
                log.warning("no node registered in %gs; starting the workers anyway", NODE_WAIT)
                return None
            await asyncio.sleep(0.1)
        return None
    finally:
        await store.close()


async def _keep(
    settings: Settings,
    children: list[Child],
    workers: list[Child],
    redis: PrivateRedis | None,
    keys: KeyMirror | None,
    signals: asyncio.Queue[int],
) -> int:
    """Watch the children until a signal (0) or a failure (1); restart those that exit."""
    announced, synced = False, time.monotonic()
    while True:
        try:
            signals.put_nowait(await asyncio.wait_for(signals.get(), 0.2))  # left for ``_stop`` to forward
            return 0
        except TimeoutError:
            pass
        if redis is not None and not redis.alive:
            log.error("the private redis-server exited (%s): stopping every worker", redis.proc.returncode)
            return 1
        for child in children:
            child.poll_ready()
            if child.alive:
                continue
            assert child.proc is not None
            ran = time.monotonic() - child.started
            child.fast_crashes = child.fast_crashes + 1 if ran < FAST_CRASH else 0
            child.reap()
            if child.fast_crashes >= MAX_FAST_CRASHES:
                log.error(
                    "%s exited %d times in a row within %gs of its start (last: status %s): giving up",
                    child.name,
                    child.fast_crashes,
                    FAST_CRASH,
                    child.proc.returncode,
                )
                return 1
            log.warning(
                "%s (pid %d) exited with status %s after %.1fs; starting it again",
                child.name,
                child.proc.pid,
                child.proc.returncode,
                ran,
            )
            child.start()
        if not announced and all(w.ready for w in workers):
            announced = True
            host = f"[{settings.host}]" if ":" in settings.host else settings.host
            log.info(
                "meshgate serving at http://%s:%d with %d workers (OpenAI /v1, Anthropic /v1/messages, Ollama /api, "
                "dashboard /ui); state in %s; models: %s",
                host,
                settings.port,
                len(workers),
                "redis" if settings.redis else "a private redis-server with one node agent",
                workers[0].models or "none yet",
            )
        if keys is not None and time.monotonic() - synced >= 1.0:
            synced = time.monotonic()
            try:
                await keys.sync()
            except Exception as exc:  # the store's trouble: tried again in a second
                log.warning("could not copy API keys to keys.json: %r", exc)


async def _stop(
    settings: Settings, children: list[Child], workers: list[Child], signals: asyncio.Queue[int], code: int
) -> None:
    """Forward the stop to the workers (a failure: SIGTERM), wait out their drain, then stop the agent."""
    first = signals.get_nowait() if not signals.empty() else signal.SIGTERM
    log.info("stopping %d workers (%s)", len(workers), signal.Signals(first).name)
    for w in workers:
        w.signal(first)
    deadline = time.monotonic() + settings.drain_grace + STOP_MARGIN
    while any(w.alive for w in workers) and time.monotonic() < deadline:
        try:
            again = await asyncio.wait_for(signals.get(), 0.1)
        except TimeoutError:
            continue
        for w in workers:  # a second signal: uvicorn stops at once
            w.signal(again)
    for w in workers:
        if w.alive:
            log.warning("%s did not stop within the drain grace: killing it", w.name)
        w.kill()
    for child in children:
        if child not in workers:  # the agent: nothing left to drain for
            child.signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                if child.proc is not None:
                    await asyncio.to_thread(child.proc.wait, 15)
            child.kill()


# ------------------------------------------------------------------ a child


def _watch_parent(launch: Launch) -> None:
    """Block on stdin; at EOF the parent is gone: stop (a worker drains, the agent stops at once), then exit."""
    with contextlib.suppress(OSError):
        while os.read(0, 1024):  # not ``sys.stdin``: its lock would stop the interpreter's own exit
            pass
    worker = launch.role == "gateway"
    os.kill(os.getpid(), signal.SIGTERM if worker else signal.SIGINT)
    time.sleep((launch.settings.drain_grace if worker else 0.0) + STOP_MARGIN)
    os._exit(1)


def child_main() -> int:
    """A child's life: read its ``Launch`` from stdin, then serve as a worker or run the node agent."""
    from meshgate.gateway.cli import commands

    line = b""
    while not line.endswith(b"\n"):  # byte by byte: nothing past the line is read from stdin here
        byte = os.read(0, 1)
        if not byte:
            return 1  # the parent went before it told us anything
        line += byte
    launch = msgspec.json.decode(line, type=Launch)
    threading.Thread(target=_watch_parent, args=(launch,), name="parent-watch", daemon=True).start()
    settings = launch.settings
    if launch.role == "node":
        return commands.run_node(settings)
    sock = worker_socket(settings.host, settings.port, launch.fd)
    worker = Worker(index=launch.index, count=launch.workers, socket=sock, ready=launch.ready)
    return commands.run_gateway(settings, worker)


if __name__ == "__main__":
    sys.exit(child_main())
