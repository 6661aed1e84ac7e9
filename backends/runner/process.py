"""Start and supervise one runner process.

The runner prints ``MESHGATE_RUNNER_READY port=N`` once its model is loaded and its socket listens; until then
we wait (bounded). The runner's stdin is a pipe we hold: if the gateway dies, the runner sees EOF and exits, so
none is left behind. ``stop`` terminates, then kills after a grace period.

Imports protocols only.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
from collections.abc import Mapping, Sequence

from protocols.model import BackendTimeout, BackendUnavailable

__all__ = ["RunnerProcess"]

READY_PREFIX = b"MESHGATE_RUNNER_READY port="
FAILED_PREFIX = b"MESHGATE_RUNNER_FAILED "


class RunnerProcess:
    """A started runner process and the port it serves on."""

    def __init__(self, proc: asyncio.subprocess.Process, port: int, name: str) -> None:
        self.proc = proc
        self.port = port
        self.name = name

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.returncode is None

    @classmethod
    async def start(cls, argv: Sequence[str], *, name: str, env: Mapping[str, str] | None = None,
                    ready_timeout: float = 120.0) -> RunnerProcess:
        """Spawn ``argv`` and wait for its ready line; raise ``BackendUnavailable``/``BackendTimeout`` if none."""
        proc = await asyncio.create_subprocess_exec(
            *argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=None,
            env={**os.environ, **(env or {})}, start_new_session=True,
        )
        try:
            port, why = await asyncio.wait_for(_read_ready(proc), ready_timeout)
        except TimeoutError:
            await _terminate(proc)
            raise BackendTimeout(f"runner for {name} was not ready within {ready_timeout:.0f}s") from None
        except BaseException:
            await _terminate(proc)
            raise
        if port is None:
            code = await proc.wait()
            raise BackendUnavailable(why or f"runner for {name} exited with code {code} before it was ready")
        runner = cls(proc, port, name)
        asyncio.ensure_future(_drain(proc))
        return runner

    async def stop(self, grace: float = 5.0) -> None:
        await _terminate(self.proc, grace)


async def _read_ready(proc: asyncio.subprocess.Process) -> tuple[int | None, str | None]:
    """The port from the ready line, or the reason from a failed line (or neither, at EOF)."""
    assert proc.stdout is not None
    while line := await proc.stdout.readline():
        if line.startswith(READY_PREFIX):
            return int(line[len(READY_PREFIX):].strip()), None
        if line.startswith(FAILED_PREFIX):
            return None, line[len(FAILED_PREFIX):].decode(errors="replace").strip()
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
