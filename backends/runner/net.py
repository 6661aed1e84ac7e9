"""Addresses and ports on a node's cluster interface, IPv4 or IPv6, for every runtime's processes.

Imports the standard library only.
"""

from __future__ import annotations

import socket

__all__ = ["family", "free_port", "host_port", "url_host"]


def family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def free_port(host: str) -> int:
    """A port free on ``host`` now (whoever needs it binds it a moment later)."""
    with socket.socket(family(host), socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def url_host(host: str) -> str:
    """``host`` as it goes in a URL or an ``ip:port``: IPv6 addresses in brackets."""
    return f"[{host}]" if ":" in host else host


def host_port(host: str, port: int) -> str:
    return f"{url_host(host)}:{port}"
