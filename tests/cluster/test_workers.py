"""``meshgate serve --workers 2`` for real: one port, two gateway processes, the embedded default's private
``redis-server`` and node agent, all real processes on real sockets (``gateway.cli.workers``).

One server for the module, on a data directory of its own (its keys must not seal the session's shared one), with
the scripted backend only; the last test stops it with ``SIGTERM`` while a stream is open.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.cluster.redis_server import find_redis_server
from tests.conftest import ROOT, Server

ENV = {"MESHGATE_DISABLED_PLUGINS": "llama_cpp,mlx,vllm", "MESHGATE_DRAIN_GRACE": "10"}
CHAT = "/v1/chat/completions"


def chat(url: str, text: str, key: str | None = None, **extra: object) -> httpx.Response:
    """One request on a connection of its own (so the kernel may hand it to either worker)."""
    headers = {"authorization": f"Bearer {key}"} if key else {}
    body = {"model": "scripted", "messages": [{"role": "user", "content": text}], **extra}
    return httpx.post(url + CHAT, json=body, headers=headers, timeout=30)


def workers_of(server: Server) -> dict[int, int]:
    """Worker index -> pid, of the server's live workers."""
    found = {}
    for pid in server.children():
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"meshgate.gateway.cli.workers" in argv and b"gateway" in argv:
            found[int(argv[argv.index(b"gateway") + 1])] = pid
    return found


def wait_for(check, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if result := check():
            return result
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def logged(server: Server) -> list[dict[str, str]]:
    """The request lines in the server's log (every process writes to it), as field dicts."""
    lines = server.log.read_text(errors="replace").splitlines()
    return [dict(re.findall(r"(\w+)=(\S+)", line)) for line in lines if "meshgate.requests: request " in line]


@pytest.fixture(scope="module")
def workers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    find_redis_server()
    data = tmp_path_factory.mktemp("workers-data")
    server = Server(data, "--workers", "2", "--plugin", "tests.scripted_plugin", "--log-level", "info", env=ENV)
    try:
        wait_for(lambda: len(workers_of(server)) == 2, 30, "two workers")
        yield server
    finally:
        server.stop()


def test_requests_spread_over_both_workers(workers: Server) -> None:
    for _ in range(24):
        response = chat(workers.url, "hello")
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["message"]["content"] == "Hello, world"
    # every request line names its worker; over 24 connections both must have served
    served = wait_for(
        lambda: {f.get("worker") for f in logged(workers) if f.get("path") == CHAT} >= {"0", "1"}, 10, "both"
    )
    assert served
    # a scrape reaches one worker: its series carry its label
    seen: set[str] = set()
    for _ in range(30):
        text = httpx.get(workers.url + "/metrics", timeout=10).text
        labels = set(re.findall(r'meshgate_requests_total\{[^}]*worker="(\d)"', text))
        assert len(labels) <= 1, "one scrape, one worker"
        seen |= labels
        if seen == {"0", "1"}:
            break
    assert seen == {"0", "1"}
    assert 'process_cpu_seconds_total{worker="' in text
    assert "with 2 workers" in workers.log.read_text()  # the start-up line says how many serve


def test_a_key_made_on_one_worker_works_on_both(workers: Server) -> None:
    made = httpx.post(workers.url + "/keys", json={"name": "w", "scope": "inference"}, timeout=10)
    assert made.status_code == 201, made.text
    key, key_id = made.json()["key"], made.json()["id"]
    assert chat(workers.url, "hello").status_code == 401  # sealed on every worker: the store is shared
    for _ in range(16):
        assert chat(workers.url, "hello", key).status_code == 200
    by_worker = wait_for(
        lambda: (
            {f["worker"] for f in logged(workers) if f.get("key") == key_id and f.get("status") == "200"} >= {"0", "1"}
        ),
        10,
        "the key used on both workers",
    )
    assert by_worker
    # the embedded default keeps keys in <data_dir>/keys.json: the parent copies them back there
    keys_file = workers.log.parent / "keys.json"
    wait_for(lambda: keys_file.exists() and key_id in keys_file.read_text(), 10, "keys.json")
    assert oct(keys_file.stat().st_mode & 0o777) == "0o600"
    workers.key = key  # type: ignore[attr-defined]  # for the tests below


def test_a_killed_worker_is_replaced(workers: Server) -> None:
    key = getattr(workers, "key", None)
    before = workers_of(workers)
    os.kill(before[1], signal.SIGKILL)
    after = wait_for(lambda: (w := workers_of(workers)) and len(w) == 2 and w[1] != before[1] and w, 30, "a new 1")
    assert after[0] == before[0]
    seen = len(logged(workers))

    def new_one_served() -> bool:
        assert chat(workers.url, "hello", key).status_code == 200  # and no request fails meanwhile
        return any(f.get("worker") == "1" for f in logged(workers)[seen:])

    wait_for(new_one_served, 40, "the new worker 1 serving")


def test_sigterm_drains_an_open_stream_then_everything_exits(workers: Server) -> None:
    key = getattr(workers, "key", None)
    processes = [*workers_of(workers).values(), *workers.children()]
    got: dict[str, object] = {}

    def stream() -> None:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        body = {"model": "scripted", "messages": [{"role": "user", "content": "sleep 3"}], "stream": True}
        with httpx.stream("POST", workers.url + CHAT, json=body, headers=headers, timeout=30) as response:
            got["status"] = response.status_code
            got["body"] = response.read().decode()

    reader = threading.Thread(target=stream)
    reader.start()
    time.sleep(1.0)  # the request is in a worker, its runner asleep
    started = time.monotonic()
    workers.proc.send_signal(signal.SIGTERM)
    reader.join(20)
    assert got.get("status") == 200 and "slept" in str(got.get("body")) and "[DONE]" in str(got.get("body"))
    assert workers.proc.wait(30) == 0
    assert time.monotonic() - started < 25
    for pid in processes:  # workers, agent, redis-server: none outlives the parent
        wait_for(lambda pid=pid: not Path(f"/proc/{pid}").exists() or _zombie(pid), 10, f"pid {pid} gone")
    assert not (workers.log.parent / "workers").exists()  # the private Redis's folder


def _zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except OSError:
        return True


def test_without_redis_server_it_says_what_to_install(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "MESHGATE_REDIS_SERVER": str(tmp_path / "none"), **ENV}
    done = subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "serve", "--workers", "2", "--port", "0"]
        + ["--data-dir", str(tmp_path)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "apt-get install redis-server" in done.stderr and "--redis" in done.stderr


def test_with_redis_the_workers_are_all_it_starts(tmp_path_factory: pytest.TempPathFactory) -> None:
    """``--redis URL``: N gateways on that Redis and nothing else; ``meshgate node`` runs the agent, as ever."""
    from tests.cluster.redis_server import RedisServer
    from tests.cluster.test_cluster_e2e import Agent

    data, logs = tmp_path_factory.mktemp("workers-redis-data"), tmp_path_factory.mktemp("workers-redis-logs")
    with RedisServer(tmp_path_factory.mktemp("workers-redis")) as redis:
        agent = Agent(redis.url, "a", data, logs, env=ENV)
        server = Server(data, "--workers", "2", "--redis", redis.url, "--plugin", "tests.scripted_plugin")
        try:
            wait_for(lambda: len(workers_of(server)) == 2, 30, "two workers")
            assert sorted(server.children()) == sorted(workers_of(server).values())  # no Redis, no agent of its own
            for _ in range(16):
                assert chat(server.url, "hello").status_code == 200
            text = httpx.get(server.url + "/metrics", timeout=10).text
            assert re.search(r'meshgate_requests_total\{[^}]*worker="[01]"', text)
        finally:
            server.stop()
            agent.stop()
        assert server.proc.returncode == 0, server.log.read_text()[-2000:]
