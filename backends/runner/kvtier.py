"""A runner's KV tiers: prompt states kept in host memory and on the node's disk, found again by their tokens.

An ``Entry`` is what a runtime needs to start a sequence from a prompt without evaluating it: the sequence's KV
state at the end of the prompt (the runtime's bytes, opaque here), the logits of the prompt's last position, and
*restore points*: token counts the state may be cut back to, each with the bytes the runtime needs to do so (for
llama.cpp, the sliding-window layers' cells at that position, which a whole-sequence state holds only for its
end). A prompt that is an entry's tokens needs no decode before its first token; one that goes on from a restore
point prefills only the rest.

Keys. A restore point is found by a digest of (namespace, scope, the prompt's first ``n`` tokens). The namespace
is what makes KV comparable (model digest, runtime version, KV type, the settings the numbers depend on: another
namespace is another cache); the scope is the tenant (an entry never serves another scope). ``find`` hashes the
prompt once, incrementally, at every length some entry of its scope can restore, and takes the longest match.

Host memory: ``ram_budget`` bytes, least recently used out. Disk: a directory and ``disk_budget`` bytes for all of
it (the runners of a node share it), least recently used (by mtime) out. Every entry put is written by a writer
thread, off the decode loop, to a temporary file renamed into place (mode 0600), in the entry format of
``kvformat`` (a header, a checksum); a file that does not check is refused: deleted, counted (``refused``) and
logged, and the prompt is computed again; it is never loaded. A restarted runner indexes the headers of its
namespace's files; a body is read at its first use. Peers (``kvpeers``) ask what a tier holds by digest
(``offer``), fetch entries in the same format (``export``, ``receive``: checked the same way) and warm from the
entries it used last (``hot``); each entry carries its prompt's prefix key (``tags``: what routing may send here).

Runs in runner processes; imports numpy and the entry format.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import queue
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from meshgate.backends.runner.kvformat import Entry, decode, encode, parse, read_header

__all__ = ["Entry", "Hit", "KVTier"]

log = logging.getLogger("meshgate.kvtier")

COUNTS = (
    "hits_ram",
    "hits_disk",
    "hits_peer",
    "misses",
    "restored_tokens",
    "saved",
    "refused",
    "received",
    "warmed",
    "replicated",
)
"""What ``stats`` counts: hits by tier, prompts no tier held, tokens restored, entries kept, files refused, entries
received from peers (on demand, warming or as copies), entries sent to a peer on another node as they were made."""
SUFFIX = ".kv"
BACKLOG = 4
"""Entries waiting for the disk writer at most; more are not written (counted as ``dropped``)."""


@dataclass(frozen=True)
class Hit:
    """``length`` tokens of a prompt restorable from ``entry``; ``length == len(entry.tokens)`` starts from its end
    (with its logits when that is the whole prompt). ``tier``: where it was found, "ram" or "disk"."""

    entry: Entry
    length: int
    tier: str


@dataclass
class _OnDisk:
    path: Path
    size: int
    lengths: list[int]  # its restore points and end
    tag: str = ""


class KVTier:
    """Host-memory and disk tiers of one runner; thread-safe."""

    def __init__(
        self, namespace: str, *, ram_budget: int, directory: str | Path | None = None, disk_budget: int = 0
    ) -> None:
        self.namespace = namespace
        self.ram_budget = max(0, ram_budget)
        self.directory = Path(directory) if directory and disk_budget > 0 else None
        self.disk_budget = disk_budget if self.directory else 0
        self._lock = threading.RLock()
        self._ram: OrderedDict[str, Entry] = OrderedDict()
        self._ram_bytes = 0
        self._disk: dict[str, _OnDisk] = {}
        self._points: dict[str, tuple[str, int]] = {}  # digest of a restorable prefix -> (entry key, its length)
        self._lengths: dict[str, Counter[int]] = {}  # scope -> restorable lengths (with multiplicity)
        self._scopes: dict[str, str] = {}  # entry key -> scope
        self._pending: set[str] = set()  # entry keys waiting for the disk writer
        self.counts: Counter[str] = Counter()
        self._queue: queue.Queue[Entry | None] = queue.Queue()
        self._writer: threading.Thread | None = None
        self.on_made: Callable[[Entry], None] | None = None  # told of each entry this runner made (``kvpeers``)
        self.warming = 0  # warm-ups from a peer in progress (``kvpeers``): the gateway sends no traffic meanwhile
        if self.directory is not None:
            self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            self._index_directory()
            self._writer = threading.Thread(target=self._write_loop, name="kv-tier-writer", daemon=True)
            self._writer.start()

    # -- keys

    def _hasher(self, scope: str) -> hashlib.blake2b:
        h = hashlib.blake2b(digest_size=20)
        h.update(f"{self.namespace}\0{scope}\0".encode())
        return h

    def digests(self, scope: str, tokens: np.ndarray, lengths: Sequence[int]) -> dict[int, str]:
        """The digest of ``tokens[:n]`` for each ``n`` in ``lengths``, hashing ``tokens`` once."""
        out: dict[int, str] = {}
        h, done = self._hasher(scope), 0
        for n in sorted(set(lengths)):
            h.update(tokens[done:n].tobytes())
            done = n
            out[n] = h.copy().hexdigest()
        return out

    # -- the index

    def _index(self, key: str, scope: str, digests: dict[int, str]) -> None:
        if key in self._scopes:
            return
        self._scopes[key] = scope
        lengths = self._lengths.setdefault(scope, Counter())
        for n, digest in digests.items():
            self._points[digest] = (key, n)
            lengths[n] += 1

    def _unindex(self, key: str, digests: dict[int, str]) -> None:
        scope = self._scopes.pop(key, None)
        if scope is None:
            return
        lengths = self._lengths.get(scope, Counter())
        for n, digest in digests.items():
            if self._points.get(digest, ("", 0))[0] == key:
                del self._points[digest]
            lengths[n] -= 1
            if lengths[n] <= 0:
                del lengths[n]

    # -- putting and finding

    def put(self, entry: Entry, *, made: bool = True, ram: bool = True) -> None:
        """Keep ``entry`` (its ``digests`` filled in here): in host memory within the budget (unless ``ram`` is
        false and a disk tier takes it), and on disk. ``made``: this runner computed it (``on_made`` is told)."""
        lengths = [*entry.points, len(entry.tokens)]
        entry.digests = self.digests(entry.scope, entry.tokens, lengths)
        key = entry.key
        with self._lock:
            if key in self._ram or key in self._disk:
                if key in self._ram:
                    self._ram.move_to_end(key)
                return
            self.counts["saved"] += 1
            self._index(key, entry.scope, entry.digests)
            if ram or self._writer is None:
                self._keep_in_ram(entry)
            if self._writer is not None and len(self._pending) < BACKLOG:
                self._pending.add(key)
                self._queue.put(entry)
            elif self._writer is not None:
                self.counts["dropped"] += 1
        self._forget_if_nowhere(entry)
        if made and self.on_made is not None:
            self.on_made(entry)

    def _keep_in_ram(self, entry: Entry) -> None:
        size = entry.nbytes()
        if size > self.ram_budget:
            return
        self._ram[entry.key] = entry
        self._ram_bytes += size
        while self._ram_bytes > self.ram_budget:
            _, old = self._ram.popitem(last=False)
            self._ram_bytes -= old.nbytes()
            self._forget_if_nowhere(old)

    def _forget_if_nowhere(self, entry: Entry) -> None:
        """Drop ``entry`` from the index when no tier holds it (nor will: it is not waiting to be written)."""
        with self._lock:
            key = entry.key
            if key not in self._ram and key not in self._disk and key not in self._pending:
                self._unindex(key, entry.digests)

    def find(
        self, scope: str, prompt: Sequence[int], *, usable: int = 1, ends: bool = False, whole: bool = True
    ) -> Hit | None:
        """The longest restorable prefix of ``prompt`` in ``scope``: a restore point, or an entry's end when that
        is the whole prompt (unless ``whole`` is false) or, with ``ends``, any prefix of it; ``None`` when none is
        ``usable`` tokens or more."""
        tokens = np.asarray(prompt, dtype=np.int32)
        with self._lock:
            longest = len(tokens) if whole else len(tokens) - 1
            lengths = [n for n in self._lengths.get(scope, ()) if usable <= n <= longest]
        if not lengths:
            self.counts["misses"] += 1
            return None
        for n, digest in sorted(self.digests(scope, tokens, lengths).items(), reverse=True):
            with self._lock:
                found = self._points.get(digest)
            if found is None:
                continue
            key, _ = found
            entry, tier = self._fetch(key)
            if entry is None or not np.array_equal(entry.tokens[:n], tokens[:n]):
                continue
            if n == len(tokens) and n != len(entry.tokens):
                continue  # the prompt's last token needs its logits: only an entry's end has them
            if n < len(tokens) and n not in entry.points and not (ends and n == len(entry.tokens)):
                continue  # an entry's end serves a longer prompt only where it is also a restore point
            self.counts[f"hits_{tier}"] += 1
            return Hit(entry, n, tier)
        self.counts["misses"] += 1
        return None

    def offer(self, scope: str, digests: Sequence[tuple[int, str]]) -> tuple[int, str, int] | None:
        """For a peer: the longest of ``digests`` (``(length, digest)`` of a prompt's prefixes, in ``scope``) an
        entry here can restore, as ``(length, entry key, its body's bytes)``; ``None`` when none. (What is sent adds
        a header of a few kilobytes.)"""
        for n, digest in sorted(digests, reverse=True):
            with self._lock:
                key, length = self._points.get(digest, ("", 0))
                if not key or length != n or self._scopes.get(key) != scope:
                    continue
                entry = self._ram.get(key)
                on_disk = self._disk.get(key)
            if entry is not None:
                return n, key, entry.nbytes()  # not encoded here: that would checksum the whole entry per offer
            if on_disk is not None:
                return n, key, on_disk.size
        return None

    def hot(self, count: int) -> list[tuple[str, int]]:
        """The ``count`` most recently used entries, newest first: ``(key, bytes to send)``."""
        with self._lock:
            recent = [(key, entry.nbytes()) for key, entry in reversed(self._ram.items())]
            on_disk = sorted(self._disk.items(), key=lambda item: _mtime(item[1].path), reverse=True)
        seen = {key for key, _ in recent}
        recent += [(key, d.size) for key, d in on_disk if key not in seen]
        return recent[: max(0, count)]

    def tags(self, count: int) -> list[str]:
        """The prefix keys (``Entry.tag``) of the most recently used entries, up to ``count``, newest first: what
        the gateway's routing may send here."""
        with self._lock:
            recent = [entry.tag for entry in reversed(self._ram.values())]
            recent += [d.tag for _, d in sorted(self._disk.items(), key=lambda item: -_mtime(item[1].path))]
        return list(dict.fromkeys(tag for tag in recent if tag))[: max(0, count)]

    def holds(self, key: str) -> bool:
        with self._lock:
            return key in self._ram or key in self._disk

    def export(self, key: str) -> list[Any] | None:
        """Entry ``key`` in the entry format (``kvformat``), for a peer; ``None`` when it is gone."""
        entry, _ = self._fetch(key)
        return encode(entry, self.namespace) if entry is not None else None

    def receive(self, data: bytes | bytearray | memoryview, *, copy: bool = False) -> Entry:
        """An entry a peer sent, checked as a file is (``ValueError`` says what is wrong), then kept here; a ``copy``
        (a peer's own entry, sent as it was made in case its node fails) goes to disk only where there is one, so
        it does not push this runner's own entries out of host memory."""
        header, body = parse(data if not isinstance(data, bytes) else bytearray(data))  # restores write into it
        entry = decode(header, body, self.namespace, self.digests)
        self.counts["received"] += 1
        self.put(entry, made=False, ram=not copy)
        return entry

    def restored(self, tokens: int) -> None:
        """Count ``tokens`` taken from a hit (the runtime may take none of it: a slot held as much)."""
        self.counts["restored_tokens"] += tokens

    def _fetch(self, key: str) -> tuple[Entry | None, str]:
        with self._lock:
            entry = self._ram.get(key)
            if entry is not None:
                self._ram.move_to_end(key)
                return entry, "ram"
            on_disk = self._disk.get(key)
        if on_disk is None:
            return None, ""
        entry = self._load(key, on_disk)
        if entry is None:
            return None, ""
        with self._lock:
            if key not in self._ram:
                self._keep_in_ram(entry)
        return entry, "disk"

    # -- disk

    def _index_directory(self) -> None:
        assert self.directory is not None
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                with path.open("rb") as f:
                    header = read_header(f)
                size = path.stat().st_size
            except (OSError, ValueError):
                self._refuse(path, "its header cannot be read")
                continue
            if header["namespace"] != self.namespace:
                continue  # another model's or runtime's entry: not ours to judge
            digests = {int(n): d for n, d in header["digests"]}
            key = digests.get(int(header["tokens"]), "")
            if path.name != key + SUFFIX:
                self._refuse(path, "its name is not its key")
                continue
            self._disk[key] = _OnDisk(path, size, sorted(digests), str(header.get("tag", "")))
            self._index(key, header["scope"], digests)

    def _load(self, key: str, on_disk: _OnDisk) -> Entry | None:
        """Read and check an entry's file; a bad one is refused and ``None`` returned."""
        path = on_disk.path
        try:
            with path.open("rb") as f:
                header = read_header(f)
                body = bytearray(os.fstat(f.fileno()).st_size - f.tell())
                f.readinto(body)
            with contextlib.suppress(OSError):
                os.utime(path)  # least recently used goes first
            return decode(header, body, self.namespace, self.digests)
        except FileNotFoundError:  # evicted by a neighbour sharing the directory
            self._drop_disk(key)
        except (OSError, ValueError) as exc:
            self._refuse(path, str(exc), key)
        return None

    def _refuse(self, path: Path, why: str, key: str | None = None) -> None:
        log.warning("KV tier: refused %s (%s); its prompt is computed again", path.name, why)
        self.counts["refused"] += 1
        with contextlib.suppress(OSError):
            path.unlink()
        if key is not None:
            self._drop_disk(key)

    def _drop_disk(self, key: str) -> None:
        with self._lock:
            gone = self._disk.pop(key, None)
            if gone is not None and key not in self._ram:
                digests = {n: d for d, (k, n) in self._points.items() if k == key}
                self._unindex(key, digests)

    def _write_loop(self) -> None:
        while True:
            entry = self._queue.get()
            if entry is None:
                return
            try:
                self._write(entry)
            except OSError as exc:
                log.warning("KV tier: could not write an entry to %s: %s", self.directory, exc)
                self.counts["dropped"] += 1
            finally:
                with self._lock:
                    self._pending.discard(entry.key)
                self._forget_if_nowhere(entry)
                self._queue.task_done()

    def _write(self, entry: Entry) -> None:
        assert self.directory is not None
        key = entry.key
        if entry.nbytes() > self.disk_budget:
            return
        final = self.directory / f"{key}{SUFFIX}"
        temporary = self.directory / f".{key}.{os.getpid()}.tmp"
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            with os.fdopen(fd, "wb") as f:
                for part in encode(entry, self.namespace):
                    f.write(part)
            os.replace(temporary, final)
        except BaseException:
            with contextlib.suppress(OSError):
                temporary.unlink()
            raise
        with self._lock:
            self._disk[key] = _OnDisk(final, final.stat().st_size, sorted(entry.digests), entry.tag)
            self.counts["written"] += 1
        self._evict_disk()

    def _evict_disk(self) -> None:
        """Delete the least recently used files of the directory (every runner's) until it is within budget."""
        assert self.directory is not None
        files = []
        for path in self.directory.iterdir():
            with contextlib.suppress(OSError):
                stat = path.stat()
                if path.suffix == SUFFIX or (path.suffix == ".tmp" and time.time() - stat.st_mtime > 3600):
                    files.append((stat.st_mtime, stat.st_size, path))
        total = sum(size for _, size, _ in files)
        for _, size, path in sorted(files):
            if total <= self.disk_budget:
                break
            with contextlib.suppress(OSError):
                path.unlink()
            total -= size
            self._drop_disk(path.name.removesuffix(SUFFIX))

    def close(self) -> None:
        """Stop the disk writer once what is queued is written."""
        if self._writer is not None:
            self._queue.put(None)
            self._writer.join(timeout=30)

    def flush(self, timeout: float = 30.0) -> None:
        """Wait until the entries put so far are written (tests, a runner stopping)."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.01)

    def stats(self) -> dict[str, int]:
        with self._lock:
            disk_bytes = sum(d.size for d in self._disk.values())
            return {
                "ram_bytes": self._ram_bytes,
                "ram_budget": self.ram_budget,
                "ram_entries": len(self._ram),
                "disk_bytes": disk_bytes,
                "disk_budget": self.disk_budget,
                "disk_entries": len(self._disk),
                "warming": self.warming,
                **{name: self.counts[name] for name in COUNTS},
            }


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return 0.0
