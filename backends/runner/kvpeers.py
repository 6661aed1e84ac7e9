"""Prompt states fetched from peer runners' KV tiers over the cluster link, when that beats prefilling them.

The gateway tells each runner with a tier which runners of the same model it may ask (``POST /kv/peers``: their URLs,
and the measured bandwidth and latency of the link to each). A prompt the runner's own tier restores less of than
``MIN_GAIN`` tokens short of its whole length asks every peer at once (``POST /kv/offer``: the digests of the
prompt's restorable prefixes, never its tokens) for the longest one it holds. The best offer is fetched
(``GET /kv/entry/<key>``, streamed, in the entry format of ``kvformat``, checked as a file is: a bad one is refused)
when its estimated transfer time (latency + bytes / bandwidth) is below the prefill it saves (tokens / the runner's
measured prompt rate); the entry is then kept in this runner's tiers too. Every call carries the cluster secret.
The estimate and the choice are the request's ``Usage.cache_note`` (the gateway's request log).

Copies. Each entry this runner makes is also sent, as it is made, to one peer on another node (``POST /kv/copy``;
the peer is picked by rendezvous hashing of the entry's key, so a runner's copies spread over the other nodes and
one entry always goes to the same peer), which keeps it on its disk tier: when this node dies, the replica that
takes over its streams (``Request.resume``) and its next turns restores their prompts from its own tier. A sender
thread does it, off the decode loop, at most ``BACKLOG`` entries waiting (more are not copied); peers on this
runner's own node get no copies (they would die with it), nor do peers of unknown node.

Runs in runner processes; imports httpx (and ``http.client`` for entries' bytes) and the tier.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import http.client
import logging
import queue
import threading
import time
import urllib.parse
from collections.abc import Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from meshgate.backends.runner import secret as cluster_secret
from meshgate.backends.runner.kvformat import encode
from meshgate.backends.runner.kvtier import Entry, Hit, KVTier

__all__ = ["BACKLOG", "MIN_GAIN", "Peer", "Peers"]

log = logging.getLogger("meshgate.kvpeers")

MIN_GAIN = 512
"""Tokens a peer's entry must restore beyond this runner's own hit to be asked for."""
UNMEASURED = 100e6
"""Bytes/second assumed of a link not measured yet (gigabit Ethernet, less its overheads)."""
OFFER_TIMEOUT = 1.0
"""Seconds a peer has to say what it holds."""
FETCH_TIMEOUT = 30.0
"""Seconds a fetch may wait on its peer at any one step (connecting, each read)."""
BACKLOG = 4
"""Entries waiting to be copied to a peer at most."""


@dataclass(frozen=True)
class Peer:
    """A runner of the same model: its URL, its node (``""``: unknown) and the link to it (``bandwidth`` bytes/s, 0:
    not measured)."""

    url: str
    bandwidth: float = 0.0
    latency: float = 0.0
    node: str = ""


class Peers:
    """The peers of one runner's tier, and fetches from them."""

    def __init__(self, tier: KVTier, align: int) -> None:
        self.tier = tier
        self.align = align  # the runtime's restore points are multiples of this
        self.peers: tuple[Peer, ...] = ()
        self.node = ""  # this runner's node, as the gateway named it
        secret = cluster_secret.from_environ()
        headers = {"authorization": f"Bearer {secret.decode()}"} if secret else {}
        self._headers = headers
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(30.0, connect=OFFER_TIMEOUT))
        self._copies: queue.Queue[tuple[Entry, Peer]] = queue.Queue(BACKLOG)
        self._sender: threading.Thread | None = None
        self._lock = threading.Lock()
        tier.on_made = self.copy

    def set(self, peers: Sequence[Peer], node: str = "") -> None:
        self.peers, self.node = tuple(peers), node

    def copy(self, entry: Entry) -> None:
        """Send ``entry`` (just made here) to its peer on another node, in the background; none: nothing to do."""
        remote = [p for p in self.peers if p.node and self.node and p.node != self.node]
        if not remote:
            return
        peer = max(remote, key=lambda p: hashlib.blake2b(f"{entry.key} {p.url}".encode(), digest_size=8).digest())
        try:
            self._copies.put_nowait((entry, peer))
        except queue.Full:
            log.info("KV tier: %d entries already wait to be copied; %s is not", BACKLOG, entry.key)
            return
        if self._sender is None:
            self._sender = threading.Thread(target=self._send_copies, name="kv-copies", daemon=True)
            self._sender.start()

    def _send_copies(self) -> None:
        while True:
            entry, peer = self._copies.get()
            parts = encode(entry, self.tier.namespace)
            size = sum(len(part) for part in parts)
            try:
                response = self._http.post(
                    f"{peer.url}/kv/copy",
                    content=(bytes(part) for part in parts),
                    headers={"content-length": str(size)},
                    timeout=httpx.Timeout(30.0 + _seconds(peer, size), connect=OFFER_TIMEOUT),
                )
                response.raise_for_status()
                self.tier.counts["replicated"] += 1
            except httpx.HTTPError as exc:
                log.warning("KV tier: copying %s to %s failed: %s", entry.key, peer.url, exc)

    def improve(
        self, scope: str, prompt: Sequence[int], hit: Hit | None, rate: float, *, whole: bool = True
    ) -> tuple[Hit | None, str]:
        """``hit``, or a longer one fetched from a peer when that is faster than prefilling the difference at
        ``rate`` prompt tokens/second; and what was weighed (``""``: no peer was asked). Restore points are asked
        for at every multiple of ``align`` (a runtime's points sit at some of them), and the whole prompt unless
        ``whole`` is false (the runtime restores no entry's end)."""
        have = hit.length if hit is not None else 0
        if not self.peers or len(prompt) - have < MIN_GAIN:
            return hit, ""
        tokens = np.asarray(prompt, dtype=np.int32)
        lengths = [n for n in range(self.align, len(tokens), self.align) if n >= have + MIN_GAIN]
        lengths += [len(tokens)] if whole else []
        if not lengths:
            return hit, ""
        digests = sorted(self.tier.digests(scope, tokens, lengths).items())
        offers = self._offers(scope, digests)
        if not offers:
            return hit, ""
        peer, length, key, size = max(offers, key=lambda o: (o[1], -_seconds(o[0], o[3])))
        transfer, prefill = _seconds(peer, size), (length - have) / max(rate, 1.0)
        note = (
            f"kv: {peer.url} holds {length} prompt tokens ({size / 2**20:.1f} MiB): "
            f"transfer ~{transfer:.2f} s against prefill ~{prefill:.2f} s"
        )
        if transfer >= prefill:
            return hit, note + ": prefilled"
        started = time.monotonic()
        try:
            entry = self.tier.receive(self._fetch(peer, key, size))
        except (httpx.HTTPError, OSError, ValueError) as exc:
            log.warning("KV tier: fetching %s from %s failed: %s", key, peer.url, exc)
            return hit, note + f": the fetch failed ({exc}), prefilled"
        self.tier.counts["hits_peer"] += 1
        return Hit(entry, length, "peer"), note + f": fetched in {time.monotonic() - started:.2f} s"

    def _offers(self, scope: str, digests: list[tuple[int, str]]) -> list[tuple[Peer, int, str, int]]:
        """What each peer holds of ``digests``, asked all at once; a peer that fails or is slow offers nothing."""

        def ask(peer: Peer) -> tuple[Peer, int, str, int] | None:
            try:
                response = self._http.post(
                    f"{peer.url}/kv/offer", json={"scope": scope, "digests": digests}, timeout=OFFER_TIMEOUT
                )
                response.raise_for_status()
                offer = response.json()
            except (httpx.HTTPError, ValueError):
                return None
            if not isinstance(offer, dict) or not offer.get("length"):
                return None
            return peer, int(offer["length"]), str(offer["key"]), int(offer["size"])

        with concurrent.futures.ThreadPoolExecutor(max_workers=min(8, len(self.peers))) as pool:
            return [offer for offer in pool.map(ask, self.peers) if offer is not None]

    def warm(self, url: str, count: int) -> None:
        """Fetch, in the background, the ``count`` entries the runner at ``url`` used last that this tier lacks
        (``tier.warming`` counts it from now until it ends)."""
        with self._lock:
            self.tier.warming += 1
        threading.Thread(target=self._warm, args=(url, count), name="kv-warm", daemon=True).start()

    def _warm(self, url: str, count: int) -> None:
        try:
            self._fetch_hot(url, count)
        finally:
            with self._lock:
                self.tier.warming -= 1

    def _fetch_hot(self, url: str, count: int) -> None:
        try:
            response = self._http.post(f"{url}/kv/hot", json={"count": count}, timeout=OFFER_TIMEOUT * 5)
            response.raise_for_status()
            entries = [(str(key), int(size)) for key, size in response.json()["entries"]]
        except (httpx.HTTPError, ValueError, KeyError, TypeError) as exc:
            log.warning("KV tier: could not ask %s what it holds: %s", url, exc)
            return
        peer = Peer(url)
        for key, size in entries:
            if self.tier.holds(key):
                continue
            try:
                self.tier.receive(self._fetch(peer, key, size))
                self.tier.counts["warmed"] += 1
            except (httpx.HTTPError, OSError, ValueError) as exc:
                log.warning("KV tier: warming from %s stopped at %s: %s", url, key, exc)
                return

    def _fetch(self, peer: Peer, key: str, size: int) -> bytearray:
        """Entry ``key`` as ``peer`` sends it, read straight from the socket into one buffer of the length the peer
        announces (at most ``size``, what it offered, plus room for its headers). ``http.client`` rather than httpx
        here: its ``readinto`` fills the buffer with no copy between, and a 176 MB entry came over loopback in
        0.20 s against httpx's 0.39 s (64 KiB reads through h11, each copied). ``OSError`` when the transfer fails,
        ``ValueError`` when the peer answers otherwise than it offered."""
        url = urllib.parse.urlsplit(peer.url)
        kind = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
        connection = kind(url.hostname or "127.0.0.1", url.port, timeout=FETCH_TIMEOUT)
        try:
            connection.request("GET", f"{url.path.rstrip('/')}/kv/entry/{key}", headers=self._headers)
            response = connection.getresponse()
            if response.status != 200:
                raise ValueError(f"the peer answered {response.status} for entry {key}")
            length = int(response.getheader("content-length") or -1)
            if not 0 <= length <= size + (1 << 20):
                raise ValueError(f"the peer announced {length} bytes for an entry of {size}")
            data, at = bytearray(length), 0
            view = memoryview(data)
            while at < length and (got := response.readinto(view[at:])):
                at += got
        except http.client.HTTPException as exc:
            raise ConnectionError(f"the transfer from {peer.url} failed: {exc!r}") from exc
        finally:
            connection.close()
        if at != length:
            raise ConnectionError(f"the peer sent {at} of the {length} bytes it announced")
        return data


def _seconds(peer: Peer, size: int) -> float:
    return peer.latency + size / (peer.bandwidth or UNMEASURED)
