"""The llama.cpp runner process: ``python -m meshgate.backends.llama_cpp.runner --model PATH``.

Loads the GGUF, then serves it over the internal streaming protocol on loopback (or ``--host``). Started and
supervised by ``LlamaCppBackend``; exits when the gateway that started it goes away.
"""

from __future__ import annotations

import argparse
import json
import sys

from meshgate.backends.llama_cpp.batch import PAUSE_AGING
from meshgate.backends.llama_cpp.engine import PARALLEL, STREAM_INTERVAL, LlamaEngine
from meshgate.backends.runner.server import FAILED_LINE, serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-llama-runner")
    parser.add_argument("--model", required=True, help="path of the GGUF file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument(
        "--shards",
        default="[]",
        help="JSON [[endpoint or null, layer_start, layer_end], ...]: "
        "split the blocks over llama.cpp RPC workers (null: held by this process)",
    )
    parser.add_argument("--repack", action="store_true", help="let llama.cpp repack CPU weights")
    parser.add_argument(
        "--parallel", type=int, default=PARALLEL, help="sequences decoded together (each holds up to --n-ctx tokens)"
    )
    parser.add_argument(
        "--spares",
        type=int,
        default=0,
        help="sequences beyond --parallel where batch-class requests are paused for interactive ones",
    )
    parser.add_argument(
        "--batch-aging",
        type=float,
        default=PAUSE_AGING,
        help="seconds a paused batch-class request waits at most before it goes on (MESHGATE_BATCH_AGING)",
    )
    parser.add_argument(
        "--stream-interval",
        type=float,
        default=STREAM_INTERVAL,
        help="seconds the streams hold their next tokens after sending some (first tokens and ends go at once)",
    )
    parser.add_argument(
        "--inexact",
        action="store_true",
        help="decode every sequence in one call with llama.cpp's kernels as they are: faster, "
        "but greedy text may then depend on the load (see batch.decode_group)",
    )
    parser.add_argument("--kv-ram", type=int, default=0, help="bytes of host memory for the KV tier (0: none)")
    parser.add_argument("--kv-dir", default=None, help="the node's KV tier directory")
    parser.add_argument("--kv-disk", type=int, default=0, help="bytes of --kv-dir the node's KV tier may fill")
    parser.add_argument("--model-digest", default="", help="the weights' digest (KV is shared only between equals)")
    args = parser.parse_args(argv)
    try:
        shards = [(e, int(a), int(b)) for e, a, b in json.loads(args.shards)]
        engine = LlamaEngine(
            args.model,
            n_ctx=args.n_ctx,
            n_threads=args.threads,
            shards=shards,
            repack=args.repack,
            parallel=args.parallel,
            spares=args.spares,
            batch_aging=args.batch_aging,
            exact=not args.inexact,
            kv_ram=args.kv_ram,
            kv_dir=args.kv_dir,
            kv_disk=args.kv_disk,
            digest=args.model_digest,
            stream_interval=args.stream_interval,
        )
    except Exception as exc:  # tell the supervisor why, then exit: nothing is served
        print(f"{FAILED_LINE} {exc}", flush=True)
        sys.exit(1)
    serve(engine, args.host, args.port)


if __name__ == "__main__":
    main()
