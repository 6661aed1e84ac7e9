"""The llama.cpp runner process: ``python -m backends.llama_cpp.runner --model PATH``.

Loads the GGUF, then serves it over the internal streaming protocol on loopback (or ``--host``). Started and
supervised by ``LlamaCppBackend``; exits when the gateway that started it goes away.
"""

from __future__ import annotations

import argparse

from backends.llama_cpp.engine import LlamaEngine
from backends.runner.server import serve


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-llama-runner")
    parser.add_argument("--model", required=True, help="path of the GGUF file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--n-ctx", type=int, default=4096)
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args(argv)
    engine = LlamaEngine(args.model, n_ctx=args.n_ctx, n_threads=args.threads)
    serve(engine, args.host, args.port)


if __name__ == "__main__":
    main()
