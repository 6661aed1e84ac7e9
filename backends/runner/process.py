"""Start and supervise one runner process.

The runner prints ``MESHGATE_RUNNER_READY port=N`` once its model is loaded and its socket listens; until then
we wait (bounded). The runner's stdin is a pipe we hold: if the gateway dies, the runner sees EOF and exits, so
none is left behind. ``stop`` terminates, then kills after a grace period.

The runner's environment carries this process's cluster secret (``MESHGATE_RUNNER_SECRET``, see
``backends.runner.secret``; never argv, which ``ps`` shows), so every backend's runner demands it without the
backend having to pass it.

A runner that exits without being asked to (a runtime that aborts, the OOM killer) is logged as a warning on the
``meshgate.runner`` logger with why: its exit code or signal and the last lines it wrote to stderr (an abort's
message is there). Its stderr still reaches ours as it comes, as when it was inherited.

Imports protocols only.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import logging
import os
import signal
from collections.abc import Mapping, Sequence

from meshgate.backends.runner import secret as cluster_secret
from meshgate.protocols.model import BackendTimeout, BackendUnavailable

__all__ = ["RunnerProcess"]

log = logging.getLogger("meshgate.runner")

READY_PREFIX = b"MESHGATE_RUNNER_READY port="
FAILED_PREFIX = b"MESHGATE_RUNNER_FAILED "
TAIL_LINES = 20
"""Lines of a runner's stderr kept to say why it died."""


class RunnerProcess:
    """A started runner process and the port it serves on."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, name: str, stderr: _Stderr | None = None) -> None:
        self.proc = proc
        self.port = port
        self.name = name
        self._stderr = stderr
        self._stopping = False

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    @classmethod
    async def start(
        cls, argv: Sequence[str], *, name: str, env: Mapping[str, str] | None = None, ready_timeout: float = 120.0
    ) -> RunnerProcess:
        """Spawn ``argv`` with ``env`` (and the cluster secret) added to ours and wait for its ready line; raise
        ``BackendUnavailable``/``BackendTimeout`` if none."""
        proc = await asyncio.create_subprocess_exec(
            *argv,
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            env={**os.environ, **cluster_secret.child_env(), **(env or {})},
            start_new_session=True,
        )
        stderr = _Stderr(proc)
        try:
            port, why = await asyncio.wait_for(_read_ready(proc), ready_timeout)
        except TimeoutError:
            await _terminate(proc)
            raise BackendTimeout(f"runner for {name} was not ready within {ready_timeout:.0f}s") from None
        except BaseException:
            await _terminate(proc)
            raise
        if port is None:
            await proc.wait()
            raise BackendUnavailable(why or f"runner for {name} {await stderr.exit_reason(' before it was ready')}")
        runner = cls(proc, port, name, stderr)
        asyncio.ensure_future(_drain(proc))
        asyncio.ensure_future(runner._watch())
        return runner

    async def stop(self, grace: float = 5.0) -> None:
        self._stopping = True
        await _terminate(self.proc, grace)

    async def _watch(self) -> None:
        """Log a runner that exits without ``stop``: its exit status and its last words."""
        with contextlib.suppress(Exception):
            await self.proc.wait()
            if not self._stopping and self._stderr is not None:
                log.warning("runner for %s (pid %s) %s", self.name, self.pid, await self._stderr.exit_reason())


class _Stderr:
    """Relays a process's stderr to ours, keeping its last ``TAIL_LINES`` lines."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.tail: collections.deque[str] = collections.deque(maxlen=TAIL_LINES)
        self.task = asyncio.ensure_future(self._relay())

    async def _relay(self) -> None:
        """Copy chunks as they come (a line of any length never stalls the pipe); keep the lines' last 1000 bytes."""
        assert self.proc.stderr is not None
        partial = b""
        with contextlib.suppress(Exception):
            while chunk := await self.proc.stderr.read(65536):
                with contextlib.suppress(OSError):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(2, view) :]
                *lines, partial = (partial + chunk).split(b"\n")
                partial = partial[-1000:]
                self._keep(lines)
        self._keep([partial])

    def _keep(self, lines: list[bytes]) -> None:
        for line in lines:
            if text := line[-1000:].decode(errors="replace").strip():
                self.tail.append(text)

    async def exit_reason(self, when: str = "") -> str:
        """``exited with code N`` or ``was killed by SIGX``, then ``when``, then the stderr lines that say why
        (once the process has exited)."""
        with contextlib.suppress(Exception):
            await asyncio.wait_for(asyncio.shield(self.task), 2.0)  # the last lines, written just before it died
        code = self.proc.returncode
        if code is not None and code < 0:
            try:
                status = f"was killed by {signal.Signals(-code).name}"
            except ValueError:
                status = f"was killed by signal {-code}"
        else:
            status = f"exited with code {code}"
        said = [line for line in self.tail if "MESHGATE_RUNNER" not in line][-5:]
        return status + when + (f"; its last output: {' | '.join(said)}" if said else "")


async def _read_ready(proc: asyncio.subprocess.Process) -> tuple[int | None, str | None]:
    """The port from the ready line, or the reason from a failed line (or neither, at EOF)."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        if line.startswith(READY_PREFIX):
            return int(line[len(READY_PREFIX) :].strip()), None
        if line.startswith(FAILED_PREFIX):
            return None, line[len(FAILED_PREFIX) :].decode(errors="replace").strip()
    return None, None


async def _drain(proc: asyncio.subprocess.Process) -> None:
    """Keep reading the runner's stdout so it never blocks on a full pipe."""
    assert proc.stdout is not None
    with contextlib.suppress(Exception):
        while await proc.stdout.read(65536):
            pass


async def _terminate(proc: asyncio.subprocess.Process, grace: float = 5.0) -> None:
    if proc.returncode is not None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        await asyncio.wait_for(proc.wait(), grace)
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
