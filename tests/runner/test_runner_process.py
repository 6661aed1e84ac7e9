"""``RunnerProcess`` with real child processes: a runner that dies on its own is logged with its exit status and
its last stderr lines (an abort's message is there); one that is stopped is not; one that dies before it is ready
says why in the error."""

from __future__ import annotations

import asyncio
import logging
import sys

import pytest

from meshgate.backends.runner.process import RunnerProcess
from meshgate.protocols.model import BackendUnavailable

ABORTS = """
import os, sys, time
print("MESHGATE_RUNNER_READY port=1", flush=True)
sys.stderr.write("loading the model\\n")
time.sleep(0.3)
sys.stderr.write("terminate called after throwing an instance of 'std::runtime_error'\\n")
sys.stderr.write("  what():  Unexpected empty grammar stack after accepting piece: <unused24> (30)\\n")
sys.stderr.flush()
os.abort()
"""

SERVES = """
import sys, time
print("MESHGATE_RUNNER_READY port=1", flush=True)
sys.stdin.read()
"""

FAILS_EARLY = """
import sys
sys.stderr.write("ggml: out of memory\\n")
sys.exit(3)
"""


async def _wait_dead(runner: RunnerProcess) -> None:
    await asyncio.wait_for(runner.proc.wait(), 10)
    for _ in range(100):  # the watcher logs once it has read the last lines
        await asyncio.sleep(0.05)


async def test_a_runner_that_dies_is_logged_with_why(caplog):
    caplog.set_level(logging.WARNING, logger="meshgate.runner")
    runner = await RunnerProcess.start([sys.executable, "-c", ABORTS], name="gemma3:270m", ready_timeout=30)
    await _wait_dead(runner)
    lines = [r.getMessage() for r in caplog.records if r.name == "meshgate.runner"]
    assert len(lines) == 1, lines
    assert f"runner for gemma3:270m (pid {runner.pid}) was killed by SIGABRT" in lines[0]
    assert "Unexpected empty grammar stack" in lines[0] and "terminate called" in lines[0]
    await runner.stop()


async def test_a_stopped_runner_is_not_reported(caplog):
    caplog.set_level(logging.WARNING, logger="meshgate.runner")
    runner = await RunnerProcess.start([sys.executable, "-c", SERVES], name="m", ready_timeout=30)
    await runner.stop()
    await asyncio.sleep(0.2)
    assert not [r for r in caplog.records if r.name == "meshgate.runner"]


async def test_a_runner_that_fails_to_start_says_why():
    with pytest.raises(BackendUnavailable, match="exited with code 3 before it was ready.*out of memory"):
        await RunnerProcess.start([sys.executable, "-c", FAILS_EARLY], name="m", ready_timeout=30)
