"""``meshgate``: the command line. Builds Settings once and passes them down.

    meshgate serve [--host H] [--port P] [--data-dir D] [--model NAME=PATH ...] [--plugin MODULE ...]
    meshgate models
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from plugins.manager import build_plugin_manager
from plugins.settings import Settings


def _settings(args: argparse.Namespace) -> Settings:
    base = Settings.from_env(os.environ)
    overrides = {
        "host": args.host, "port": args.port, "data_dir": args.data_dir, "log_level": args.log_level,
        "n_ctx": args.n_ctx, "threads": args.threads,
        "models": base.models + tuple(args.model) if args.model else None,
        "plugins": base.plugins + tuple(args.plugin) if args.plugin else None,
        "api_keys": base.api_keys + tuple(args.api_key) if args.api_key else None,
    }
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})


def _serve(settings: Settings) -> int:
    import uvicorn

    from gateway.app import create_app

    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    app = create_app(settings, build_plugin_manager(settings))
    uvicorn.run(app, host=settings.host, port=settings.port, log_level=settings.log_level,
                access_log=settings.log_level == "debug", timeout_graceful_shutdown=5)
    return 0


def _models(settings: Settings) -> int:
    from gateway.dispatch import Dispatcher

    pm = build_plugin_manager(settings)
    sources: list = []
    pm.hook.meshgate_register_model_sources(register=sources.append, settings=settings)
    for card in Dispatcher([], sources, pm.hook.meshgate_choose_backend).refresh():
        print(f"{card.name:30} {card.family:10} {card.parameter_size:8} {card.quantization:8} {card.path}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="meshgate", description="An inference gateway for OpenAI, Anthropic "
                                     "and Ollama clients.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (("serve", "run the gateway"), ("models", "list the models meshgate can serve")):
        p = sub.add_parser(name, help=text)
        p.add_argument("--host", help="address to bind (default 127.0.0.1)")
        p.add_argument("--port", type=int, help="port to bind (default 11434)")
        p.add_argument("--data-dir", help="where models and state live (default $XDG_DATA_HOME/meshgate)")
        p.add_argument("--model", action="append", default=[], help="a GGUF to serve: NAME=PATH or PATH")
        p.add_argument("--plugin", action="append", default=[], help="an extra plugin module to load")
        p.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
        p.add_argument("--n-ctx", type=int, help="context length for llama.cpp runners (default 4096)")
        p.add_argument("--threads", type=int, help="threads per runner (default: all cores)")
        p.add_argument("--log-level", help="debug, info, warning or error")
    args = parser.parse_args(argv)
    settings = _settings(args)
    return {"serve": _serve, "models": _models}[args.command](settings)


if __name__ == "__main__":
    sys.exit(main())
