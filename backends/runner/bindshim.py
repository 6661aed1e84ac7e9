"""Confine a runtime's listening sockets to one address, for runtimes that bind every interface.

Ray's GCS server and raylet listen on ``[::]``/``0.0.0.0`` whatever ``--node-ip-address`` says (Ray 2.56 has no
option for it), against our rule that runtime worker ports never sit on a public interface. ``bindshim.c`` is a
small ``LD_PRELOAD`` library that turns a wildcard ``bind()`` into a bind to ``MESHGATE_BIND_HOST``; ``build``
compiles it (``cc``, which ``scripts/install`` makes sure of) into an instance's runtime folder and ``confine``
puts it into a process environment, which every child of that process inherits.

Imports the standard library and ``protocols.model``.
"""

from __future__ import annotations

import ipaddress
import os
import shutil
import socket
import subprocess
from collections.abc import Mapping
from pathlib import Path

from meshgate.protocols.model import BackendUnavailable

__all__ = ["SOURCE", "build", "confine"]

SOURCE = Path(__file__).with_name("bindshim.c")


def build(folder: str | Path) -> Path:
    """``folder/bindshim.so``, compiled from ``SOURCE`` unless already there."""
    out = Path(folder) / "bindshim.so"
    if out.exists():
        return out
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        raise BackendUnavailable(
            "a C compiler (cc) is needed to keep Ray's ports on the cluster address: "
            "install build-essential (scripts/install does)"
        )
    partial = out.with_suffix(".tmp")
    done = subprocess.run(
        [cc, "-shared", "-fPIC", "-O2", "-o", str(partial), str(SOURCE), "-ldl"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise BackendUnavailable(f"building {SOURCE.name} failed: {done.stderr.strip()[-500:]}")
    partial.replace(out)
    return out


def confine(env: Mapping[str, str], library: Path, host: str) -> dict[str, str]:
    """``env`` with ``library`` preloaded and wildcard binds sent to ``host`` (resolved to an address)."""
    preload = " ".join(p for p in (str(library), env.get("LD_PRELOAD", "")) if p)
    return {**env, "LD_PRELOAD": preload, "MESHGATE_BIND_HOST": _address(host)}


def _address(host: str) -> str:
    try:
        return str(ipaddress.ip_address(host.strip("[]")))
    except ValueError:
        return str(socket.getaddrinfo(host, None, proto=socket.IPPROTO_TCP)[0][4][0])
