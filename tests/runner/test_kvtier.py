"""The KV tier's store as plain functions: keys, scopes, budgets and the disk format (no runtime: opaque bytes)."""

from __future__ import annotations

import numpy as np
import pytest

from meshgate.backends.runner.kvtier import Entry, KVTier


def _entry(scope: str, tokens: list[int], size: int = 1000, points: dict[int, int] | None = None) -> Entry:
    rng = np.random.default_rng(len(tokens))
    return Entry(
        scope,
        np.asarray(tokens, dtype=np.int32),
        bytearray(rng.bytes(size)),
        bytearray(rng.bytes(16)),
        {n: bytearray(rng.bytes(n)) for n in (points or {})},
    )


PROMPT = list(range(100, 1400))


def test_the_longest_restorable_prefix_is_found_within_its_scope_only():
    tier = KVTier("ns", ram_budget=1 << 20)
    tier.put(_entry("a", PROMPT, points={512: 0, 1024: 0}))
    assert tier.find("a", PROMPT).length == len(PROMPT), "the whole prompt: its end, with its logits"
    longer = tier.find("a", PROMPT + [7, 8, 9])
    assert longer.length == 1024, "a longer prompt restores at the last restore point, not at the entry's end"
    assert tier.find("a", PROMPT + [7, 8, 9], ends=True).length == len(PROMPT), "inexact: from the entry's end"
    assert tier.find("a", PROMPT[:700] + [1, 2, 3]).length == 512
    assert tier.find("a", PROMPT[:1024]).length == 512, "a prompt ending at a restore point needs logits it lacks"
    assert tier.find("b", PROMPT) is None, "another scope's entry is never served"
    assert KVTier("other", ram_budget=1 << 20).find("a", PROMPT) is None
    assert tier.stats()["hits_ram"] == 5


def test_host_memory_keeps_the_most_recently_used_within_its_budget():
    tier = KVTier("ns", ram_budget=7500)  # two entries of ~3.4 kB
    first, second, third = (_entry("", [n] * 600) for n in (1, 2, 3))
    tier.put(first)
    tier.put(second)
    assert tier.find("", [1] * 600) is not None  # first is now the most recently used
    tier.put(third)
    assert tier.find("", [2] * 600) is None, "the least recently used went"
    assert tier.find("", [1] * 600) is not None and tier.find("", [3] * 600) is not None
    assert tier.stats()["ram_bytes"] <= 7500


def test_disk_entries_survive_a_restart_and_a_bad_file_is_refused_never_loaded(tmp_path):
    tier = KVTier("ns", ram_budget=0, directory=tmp_path, disk_budget=1 << 20)
    for n in range(4):
        tier.put(_entry("", [n] * 600, points={512: 0}))
    tier.flush()
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) == 4 and all(f.stat().st_mode & 0o777 == 0o600 for f in files)
    corrupt, short, wrong_version = files[0], files[1], files[2]
    data = bytearray(corrupt.read_bytes())
    data[-5] ^= 0xFF
    corrupt.write_bytes(bytes(data))
    short.write_bytes(short.read_bytes()[:-100])
    raw = bytearray(wrong_version.read_bytes())
    raw[4] = 99  # the format version
    wrong_version.write_bytes(bytes(raw))
    reopened = KVTier("ns", ram_budget=1 << 20, directory=tmp_path, disk_budget=1 << 20)
    found = [reopened.find("", [n] * 600) for n in range(4)]
    assert sum(hit is not None for hit in found) == 1, "only the untouched file is loaded"
    assert all(hit.tier == "disk" for hit in found if hit is not None)
    assert reopened.stats()["refused"] == 3
    assert sorted(tmp_path.glob("*.kv")) == [files[3]], "refused files are deleted"


def test_the_disk_keeps_the_most_recently_used_files_within_its_budget(tmp_path):
    tier = KVTier("ns", ram_budget=0, directory=tmp_path, disk_budget=5000)
    for n in range(5):
        tier.put(_entry("", [n] * 300, size=1000))
        tier.flush()
    total = sum(f.stat().st_size for f in tmp_path.glob("*.kv"))
    assert 0 < total <= 5000
    assert tier.find("", [4] * 300) is not None, "the newest is kept"
    assert tier.find("", [0] * 300) is None, "the oldest went"


def test_a_peers_entry_is_read_whole_and_checked_and_a_cut_or_corrupt_transfer_is_refused():
    """``Peers._fetch`` over a real socket (a plain HTTP server standing in for a peer's ``/kv/entry`` route):
    the entry arrives byte for byte and loads; a transfer cut short, a flipped byte or more bytes than were
    offered never load."""
    import http.server
    import threading

    from meshgate.backends.runner.kvformat import encode
    from meshgate.backends.runner.kvpeers import Peer, Peers

    source = KVTier("ns", ram_budget=1 << 24)
    entry = _entry("", PROMPT, size=1_500_000, points={512: 0})
    source.put(entry)
    good = b"".join(bytes(part) for part in encode(entry, "ns"))
    flipped = bytearray(good)
    flipped[-7] ^= 0x01
    served: dict[str, tuple[bytes, int]] = {
        "good": (good, len(good)),
        "cut": (good[: len(good) // 2], len(good)),  # announces the whole, sends half, closes
        "flipped": (bytes(flipped), len(good)),
    }

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body, length = served[self.path.rsplit("/", 1)[-1]]
            self.send_response(200)
            self.send_header("content-length", str(length))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        peer = Peer(f"http://127.0.0.1:{server.server_address[1]}")
        peers = Peers(KVTier("ns", ram_budget=1 << 24), 256)
        data = peers._fetch(peer, "good", entry.nbytes())
        assert data == good
        received = peers.tier.receive(data)
        assert received.key == entry.key and bytes(received.state) == bytes(entry.state)
        assert peers.tier.find("", PROMPT) is not None
        with pytest.raises(OSError):
            peers._fetch(peer, "cut", entry.nbytes())
        with pytest.raises(ValueError):
            KVTier("ns", ram_budget=1 << 24).receive(peers._fetch(peer, "flipped", entry.nbytes()))
        with pytest.raises(ValueError):
            peers._fetch(peer, "good", 1000)  # offered 1 kB, announces 1.5 MB (headers get 1 MiB of room)
    finally:
        server.shutdown()
