"""Listening TCP sockets of given processes, read from ``/proc`` (no ``ss`` needed)."""

from __future__ import annotations

import ipaddress
import socket
import struct
from collections.abc import Iterable
from pathlib import Path

LISTEN = "0A"


def listening(pids: Iterable[int]) -> set[tuple[str, int]]:
    """``(address, port)`` of every TCP socket in LISTEN state that one of ``pids`` holds open."""
    inodes: set[str] = set()
    for pid in pids:
        try:
            links = [fd.readlink() for fd in Path(f"/proc/{pid}/fd").iterdir()]
        except OSError:
            continue
        inodes |= {str(link)[8:-1] for link in links if str(link).startswith("socket:[")}
    found = set()
    for table, family in (("tcp", socket.AF_INET), ("tcp6", socket.AF_INET6)):
        for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == LISTEN and fields[9] in inodes:
                address, port = fields[1].split(":")
                found.add((_address(address, family), int(port, 16)))
    return found


def _address(hex_address: str, family: int) -> str:
    raw = bytes.fromhex(hex_address)
    # /proc prints each 32-bit word in host byte order
    words = struct.unpack(f"<{len(raw) // 4}I", raw)
    packed = struct.pack(f">{len(words)}I", *words)
    address = ipaddress.ip_address(packed)
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped:
        return str(address.ipv4_mapped)
    return str(address)


def public(addresses: Iterable[tuple[str, int]], allowed: Iterable[str]) -> set[tuple[str, int]]:
    """Those of ``addresses`` neither on loopback nor on one of ``allowed`` (a wildcard bind is never allowed)."""
    ok = set(allowed)
    return {
        (a, p)
        for a, p in addresses
        if a not in ok and not ipaddress.ip_address(a).is_loopback or ipaddress.ip_address(a).is_unspecified
    }
