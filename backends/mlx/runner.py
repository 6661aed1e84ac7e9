"""The MLX runner process: ``python -m meshgate.backends.mlx.runner --model DIR ...`` (run with a python that has mlx).

One rank of an instance:

- alone (``--ranks 1``): load the whole model and serve it over the internal streaming protocol, decoding up to
  ``--parallel`` requests together (``MESHGATE_PARALLEL``, default 4), with a KV tier when ``--kv-ram`` or
  ``--kv-dir``/``--kv-disk`` give it room (and its ``/kv`` routes: ``runner.kv_routes``);
- the head (``--rank 0`` of N, ``MLX_HOSTFILE`` set by the backend): join the ring, load its shard, serve (batched
  as alone: the followers run every batch operation the head sends; with the ``--kv-*`` flags every rank keeps
  its shard of prompts' KV in a tier of its own, the head deciding for all, and its ``/kv`` routes share nothing
  with peers: no other runner can use one rank's shard); when the server stops (SIGTERM), tell the followers to
  shut down and meet them at a barrier, then flush its tier's disk writes and exit (as each follower does);
- a follower (``--rank r`` > 0): serve ``/ring`` and ``/join`` (``backends.mlx.rendezvous``) until the head's
  agent sends the hostfile, then join the ring, load its shard and follow the head's batch operations until the
  head shuts it down. SIGTERM does not cut a follower off mid-transfer: it waits for the head's shutdown (its
  supervisor kills it after a grace period if that never comes).

Every wait before serving is bounded (``--ready-timeout``; the ring's ``init`` otherwise waits forever for a
missing peer). A head that loses a rank mid-generation reports the failure on that stream and exits: its ring
is gone, so its agent reports the instance failed and the gateway places it again.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import threading
from collections.abc import Iterator
from typing import Any

from meshgate.backends.mlx.rendezvous import serve_join, watch
from meshgate.backends.runner.server import FAILED_LINE, READY_LINE, exit_when_parent_goes, serve
from meshgate.protocols.model import BackendUnavailable, Event, Request


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-mlx-runner")
    parser.add_argument("--model", required=True, help="directory of an mlx-lm (Hugging Face) checkpoint")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--sharding", default="single", choices=["single", "tensor", "pipeline"])
    parser.add_argument("--layers", default=None, help="this rank's layer range START:END (pipeline)")
    parser.add_argument("--rank", type=int, default=0)
    parser.add_argument("--ranks", type=int, default=1)
    parser.add_argument("--ready-timeout", type=float, default=300.0)
    parser.add_argument("--dtype", default=None, help="compute in this float type (float32 on CPUs)")
    parser.add_argument("--followers", default="", help="the head: followers' control URLs, comma-separated")
    parser.add_argument(
        "--parallel",
        type=int,
        default=int(os.environ.get("MESHGATE_PARALLEL") or 4),
        help="requests decoded together (default: MESHGATE_PARALLEL, else 4)",
    )
    parser.add_argument("--kv-ram", type=int, default=0, help="bytes of host memory for the KV tier (0: none)")
    parser.add_argument("--kv-dir", default=None, help="the node's KV tier directory")
    parser.add_argument("--kv-disk", type=int, default=0, help="bytes of --kv-dir the node's KV tier may fill")
    parser.add_argument("--model-digest", default="", help="the weights' digest (KV is shared only between equals)")
    args = parser.parse_args(argv)
    launched = os.environ.get("MLX_HOSTFILE")  # started by a ring launcher (backends.mlx.launch): no join
    if launched:
        with open(launched) as f:
            args.ranks, args.rank = len(json.load(f)), int(os.environ.get("MLX_RANK", "0"))
    threading.Thread(target=exit_when_parent_goes, name="parent-watch", daemon=True).start()
    # join + init + load, bounded: a watchdog thread says why; SIGALRM (default action: terminate) is the hard
    # stop should the ring's init hold the interpreter so that the thread cannot run
    watchdog = threading.Timer(args.ready_timeout, _timed_out)
    watchdog.daemon = True
    watchdog.start()
    signal.alarm(int(args.ready_timeout) + 10)
    try:
        if args.ranks > 1 and args.rank > 0 and not launched:
            _join(args)
        engine = _load(args, own_hostfile=args.rank > 0 and not launched)
    except Exception as exc:  # tell the supervisor why, then exit: nothing is served
        print(f"{FAILED_LINE} {exc}", flush=True)
        _leave(1)
    watchdog.cancel()
    signal.alarm(0)
    if engine.lockstep.size == 1:
        serve(engine, args.host, args.port, watch_parent=False)
        _leave(0)
    if engine.rank != 0:
        signal.signal(signal.SIGTERM, lambda *_: None)  # leave through the head's shutdown barrier only
        try:
            engine.follow()
        except RuntimeError as exc:  # the head went away without a shutdown: nothing left to follow
            print(f"meshgate-mlx-runner rank {engine.rank}: {exc}", file=sys.stderr, flush=True)
            _leave(1)
        _flush(engine)
        _leave(0)
    # uvicorn turns SIGTERM into a graceful stop, then raises it again once it has stopped; this handler takes
    # that second one, so the ring's shutdown below still runs
    signal.signal(signal.SIGTERM, lambda *_: None)
    if args.followers:
        watch(args.followers.split(","), _follower_gone)
    serve(_Head(engine), args.host, args.port, watch_parent=False)
    try:
        engine.shutdown()  # followers leave their loop; every rank meets at a barrier before exiting
    except RuntimeError as exc:
        print(f"meshgate-mlx-runner: shutdown: {exc}", file=sys.stderr, flush=True)
        _leave(1)
    _flush(engine)
    _leave(0)


def _flush(engine: Any) -> None:
    """A ring rank leaving: let its tier's disk writer finish what is queued (bounded), so that every rank's
    directory holds the entries the ring kept when it starts again."""
    if engine.tier is not None:
        engine.tier.flush(timeout=10)


def _leave(code: int) -> None:
    """Exit now: the parent-watch thread blocks in a stdin read that interpreter shutdown would trip over."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


class _Head:
    """The head's engine as the server sees it: a ring error ends the stream as ``BackendUnavailable`` and the
    process (the ring is gone: this instance cannot generate again). Its ``tier``, for the server's ``/kv`` routes,
    is a ``_ShardTier`` when the engine has one: the gateway may tell it peers as it tells every runner whose
    health shows a tier, and it answers them without sharing anything."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.count_tokens = engine.count_tokens
        self.parallel = engine.parallel
        self.tier = _ShardTier() if engine.tier is not None else None
        self.kv_peers = None

    def health(self) -> dict[str, Any]:
        return self.engine.health()

    def generate(self, request: Request, cancel: threading.Event) -> Iterator[Event]:
        try:
            yield from self.engine.generate(request, cancel)
        except RuntimeError as exc:
            if "[ring]" not in str(exc):
                raise
            _exit_soon()
            raise BackendUnavailable(f"a rank of this MLX instance was lost ({exc}); it is being placed again") from exc


class _ShardTier:
    """A ring head's KV tier as its peers see it (``runner.kv_routes``): it holds the head's shard of each entry,
    which no other runner can restore, so it offers nothing, exports nothing and takes no peer's entry."""

    def offer(self, scope: str, digests: object) -> None:
        return None

    def export(self, key: str) -> None:
        return None

    def hot(self, count: int) -> list[tuple[str, int]]:
        return []

    def receive(self, data: object, *, copy: bool = False) -> None:
        raise ValueError("a ring's KV tier holds one rank's shard of each entry: it takes no peer's entries")


def _join(args: argparse.Namespace) -> None:
    """A follower: wait for the hostfile, then point the ring backend at it."""

    def ready(port: int) -> None:
        print(f"{READY_LINE} port={port}", flush=True)

    joined = serve_join(args.host, args.rank, args.ready_timeout, ready)
    fd, path = tempfile.mkstemp(prefix="mlx-ring-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(joined.hosts, f)
    os.environ["MLX_HOSTFILE"], os.environ["MLX_RANK"] = path, str(joined.rank)


def _load(args: argparse.Namespace, *, own_hostfile: bool):
    from meshgate.backends.mlx.engine import MlxEngine

    group = None
    if args.ranks > 1:
        import mlx.core as mx

        group = mx.distributed.init(strict=True, backend="ring")
        if own_hostfile:
            os.unlink(os.environ["MLX_HOSTFILE"])  # the one _join wrote; a launcher's belongs to the launcher
        if group.size() != args.ranks or group.rank() != args.rank:
            raise RuntimeError(f"joined as rank {group.rank()} of {group.size()}, expected {args.rank} of {args.ranks}")
    layers = None
    if args.layers:
        start, end = args.layers.split(":")
        layers = (int(start), int(end))
    return MlxEngine(
        args.model,
        group=group,
        mode=args.sharding,
        layers=layers,
        n_ctx=args.n_ctx,
        dtype=args.dtype,
        parallel=args.parallel,
        kv_ram=args.kv_ram,
        kv_dir=args.kv_dir,
        kv_disk=args.kv_disk,
        digest=args.model_digest,
    )


def _timed_out() -> None:
    print(f"{FAILED_LINE} not ready within the ready timeout (a rank of the ring never came)", flush=True)
    os._exit(1)


def _follower_gone(url: str, why: str) -> None:
    """A follower died (or its machine went silent): the ring may wait on it forever, so end this rank now; the
    stream in flight breaks, which the gateway reports as the backend being unavailable."""
    print(
        f"meshgate-mlx-runner: the follower at {url} is lost ({why}); this instance cannot generate again",
        file=sys.stderr,
        flush=True,
    )
    os._exit(3)


def _exit_soon() -> None:
    """The ring lost a rank: this instance cannot generate again. Let the failed stream flush, then go."""
    threading.Timer(0.5, os._exit, (3,)).start()


if __name__ == "__main__":
    main()
