"""A runner's KV tier routes, for its peers and the gateway (``RunnerApp`` sends ``/kv/...`` here when its engine has
a ``tier``; the cluster secret is checked before):

- ``POST /kv/offer`` ``{"scope", "digests": [[length, digest], ...]}``: the longest of those prefixes the tier can
  restore, ``{"length", "key", "size"}`` (``{"length": 0}``: none);
- ``GET /kv/entry/<key>``: that entry in the entry format (``kvformat``), streamed;
- ``POST /kv/copy`` (an entry in the entry format): a peer's entry, sent as it was made, kept on this runner's disk
  tier (checked as a file is: a bad one is refused with 400);
- ``POST /kv/peers`` ``{"peers": [{"url", "bandwidth", "latency", "node"}, ...], "node"}``: the runners it may fetch
  from and copy its entries to (``kvpeers``), and its own node, from the gateway;
- ``POST /kv/hot`` ``{"count"}``: its ``count`` most recently used entries, ``{"entries": [[key, size], ...]}``;
- ``POST /kv/warm`` ``{"url", "count"}``: fetch (in the background) the most recently used entries of the runner
  at ``url``: a new replica warms itself from a peer, a draining replica's sessions move to the ones that stay.

Runs in runner processes.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from typing import Any

from meshgate.backends.runner.asgi import read_body
from meshgate.backends.runner.kvpeers import Peer

__all__ = ["serve"]

PIECE = 8 << 20
"""Bytes sent per ASGI message of an entry (views of the entry's buffers: the server writes them without a copy)."""


async def serve(engine: Any, path: str, method: str, receive: Callable[..., Any], send: Callable[..., Any]) -> None:
    tier = engine.tier
    try:
        if path == "/kv/offer" and method == "POST":
            asked = json.loads(await read_body(receive))
            digests = [(int(n), str(d)) for n, d in asked["digests"]]
            offer = await asyncio.to_thread(tier.offer, str(asked["scope"]), digests)
            answer = {"length": offer[0], "key": offer[1], "size": offer[2]} if offer else {"length": 0}
            await _json(send, 200, answer)
        elif path.startswith("/kv/entry/") and method == "GET":
            parts = await asyncio.to_thread(tier.export, path.removeprefix("/kv/entry/"))
            if parts is None:
                await _json(send, 404, {"error": "no such entry (evicted since it was offered)"})
                return
            await _stream(send, parts)
        elif path == "/kv/copy" and method == "POST":
            data = await read_body(receive)
            entry = await asyncio.to_thread(tier.receive, data, copy=True)
            await _json(send, 201, {"key": entry.key})
        elif path == "/kv/hot" and method == "POST":
            count = int(json.loads(await read_body(receive)).get("count", 8))
            await _json(send, 200, {"entries": [[key, size] for key, size in tier.hot(count)]})
        elif path == "/kv/warm" and method == "POST":
            asked = json.loads(await read_body(receive))
            if getattr(engine, "kv_peers", None) is not None:
                engine.kv_peers.warm(str(asked["url"]), int(asked.get("count", 8)))
            await _json(send, 202, {"warming": True})
        elif path == "/kv/peers" and method == "POST":
            told = json.loads(await read_body(receive))
            peers = [_peer(p) for p in told["peers"]]
            if getattr(engine, "kv_peers", None) is not None:
                engine.kv_peers.set(peers, str(told.get("node", "")))
            await _json(send, 200, {"peers": len(peers)})
        else:
            await _json(send, 404, {"error": "not found"})
    except (ValueError, KeyError, TypeError) as exc:
        await _json(send, 400, {"error": f"bad KV tier request: {exc}"})


def _peer(told: dict[str, Any]) -> Peer:
    bandwidth, latency = float(told.get("bandwidth") or 0), float(told.get("latency") or 0)
    return Peer(str(told["url"]), bandwidth, latency, str(told.get("node") or ""))


async def _stream(send: Callable[..., Any], parts: list[Any]) -> None:
    size = sum(len(part) for part in parts)
    headers = [(b"content-type", b"application/octet-stream"), (b"content-length", str(size).encode())]
    await send({"type": "http.response.start", "status": 200, "headers": headers})
    for part in parts:
        view = memoryview(part).cast("B")
        for at in range(0, len(view), PIECE):
            await send({"type": "http.response.body", "body": view[at : at + PIECE], "more_body": True})
    await send({"type": "http.response.body", "body": b"", "more_body": False})


async def _json(send: Callable[..., Any], status: int, body: dict[str, Any]) -> None:
    headers = [(b"content-type", b"application/json")]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})
