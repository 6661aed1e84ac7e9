"""A runner whose link goes down mid-stream: no FIN ever comes, and the stream must still end soon as
``BackendUnavailable`` (so the gateway resumes it elsewhere) rather than after the read timeout.

A network namespace joined to this one by a veth pair holds a "runner" (a plain socket server that answers the
POST with a 200 head and one chunk, then stays silent, as a runner mid-decode). With the stream open, the
namespace's end of the link is set down: the peer neither answers nor closes. TCP keep-alive
(``http_stream.KEEPALIVE``) ends the connection in about 11 s.
"""

from __future__ import annotations

import asyncio
import secrets
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from meshgate.backends.runner.http_stream import KEEPALIVE, post_stream
from meshgate.protocols.model import BackendUnavailable

SERVER = r"""
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 8700)); s.listen()
print("listening", flush=True)
c, _ = s.accept(); c.recv(65536)
c.sendall(b"HTTP/1.1 200 OK\r\ntransfer-encoding: chunked\r\n\r\n6\r\nhello\n\r\n")
time.sleep(120)
"""


def sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True, timeout=30)


@pytest.fixture
def far_host() -> Iterator[tuple[str, str, str]]:
    """A namespace at 10.213.x.y behind a veth pair; yields its name, its link's name in it, and its address. The
    subnet is one no interface here has: a run killed before its clean-up leaves its pair behind, and a fixed
    address then failed every later run."""
    tag = secrets.token_hex(3)
    ns, outer, inner = f"mglink-{tag}", f"mgo{tag}", f"mgi{tag}"
    used = subprocess.run(["ip", "-o", "-4", "addr", "show"], capture_output=True, text=True, timeout=30).stdout
    free = [x for x in range(220, 256) if f" 10.213.{x}." not in used]  # test_netns_links takes 20-219
    subnet, first = f"10.213.{free[secrets.randbelow(len(free))]}", 4 * secrets.randbelow(64)  # a /30
    here, there = f"{subnet}.{first + 1}", f"{subnet}.{first + 2}"
    sh("ip", "netns", "add", ns)
    try:
        sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner)
        sh("ip", "link", "set", inner, "netns", ns)
        sh("ip", "addr", "add", f"{here}/30", "dev", outer)
        sh("ip", "link", "set", outer, "up")
        sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{there}/30", "dev", inner)
        sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "up")
        sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        yield ns, inner, there
    finally:
        subprocess.run(["ip", "link", "del", outer], capture_output=True, timeout=30)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)


def test_a_stream_from_a_runner_whose_link_went_down_ends_unavailable(far_host):
    ns, inner, address = far_host
    server = subprocess.Popen(
        ["ip", "netns", "exec", ns, sys.executable, "-c", SERVER, address], stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "listening"

        async def read() -> tuple[list[bytes], float, BaseException | None]:
            chunks: list[bytes] = []
            stream = post_stream(f"http://{address}:8700/generate", b"{}", read_timeout=300)
            cut = 0.0
            try:
                async for chunk in stream:
                    chunks.append(chunk)
                    sh("ip", "netns", "exec", ns, "ip", "link", "set", inner, "down")  # gone, without a word
                    cut = time.monotonic()
            except BaseException as exc:  # what the test is about
                return chunks, time.monotonic() - cut, exc
            return chunks, time.monotonic() - cut, None

        chunks, waited, error = asyncio.run(asyncio.wait_for(read(), 120))
    finally:
        server.kill()
        server.wait()
    assert b"".join(chunks).endswith(b"hello\n"), chunks
    assert isinstance(error, BackendUnavailable), error
    idle, interval, count = KEEPALIVE
    assert waited < idle + interval * count + 10, f"took {waited:.1f} s to notice the lost link"
    print(f"lost link noticed {waited:.1f} s after it went down")
