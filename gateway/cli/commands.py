"""``meshgate``: the command line. Builds Settings once and passes them down.

    meshgate serve [--redis URL] [--host H] [--port P] [--workers N] [--data-dir D] [--model NAME=PATH ...]
                   [--plugin MODULE]                       N gateway processes on one port (gateway.cli.workers)
    meshgate node --redis URL [--name N] [--address A]     a node agent
    meshgate models                                        what this machine can serve
    meshgate ps [--url U]                                  instances of a running gateway
    meshgate place MODEL [--preview] [--nodes a,b] [--replicas N] [--no-wait] [--url U]   progress until ready
    meshgate convert MODEL [--dtype D] [--name NAME] [--out DIR]   a GGUF as a Hugging Face checkpoint (MLX, vLLM)
    meshgate keys create NAME [--scope S] [--model M ...] [--rpm N] [--tpm N] [--priority C] [--weight W]
                                | keys list | keys revoke ID
    meshgate bench [--model M] [-p 128,512] [-n 64,128] [-c 1,4,8] [-r 3] [--json] [--plot FILE]   (gateway.cli.bench)

Plugins add commands through ``meshgate_register_commands`` (``convert`` is the llama.cpp plugin's), on a plugin
manager built from the environment; this module imports no backend.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from meshgate.plugins.manager import build_plugin_manager
from meshgate.plugins.settings import Settings

if TYPE_CHECKING:
    from meshgate.gateway.cli.workers import Worker


def _settings(args: argparse.Namespace) -> Settings:
    base = Settings.from_env(os.environ)
    overrides = {
        "host": args.host,
        "port": args.port,
        "data_dir": args.data_dir,
        "log_level": args.log_level,
        "log_format": getattr(args, "log_format", None),  # a Namespace made by hand may lack it
        "n_ctx": args.n_ctx,
        "threads": args.threads,
        "redis": args.redis,
        "workers": getattr(args, "workers", None),  # serve's only
        "node_name": args.name,
        "cluster_address": args.address,
        "placement": args.placement,
        "node_memory": args.memory,
        "models": base.models + tuple(args.model) if args.model else None,
        "plugins": base.plugins + tuple(args.plugin) if args.plugin else None,
        "api_keys": base.api_keys + tuple(args.api_key) if args.api_key else None,
    }
    return base.replace(**{k: v for k, v in overrides.items() if v is not None})


def _serve(settings: Settings, args: argparse.Namespace) -> int:
    _logging(settings)
    if not _loopback(settings.host) and not settings.api_keys and not _stored_keys(settings):
        if not args.insecure_no_auth:
            print(
                f"refusing to serve on {settings.host} without API keys: anyone who can reach it could use and "
                "administer it. Set MESHGATE_API_KEYS (or --api-key), make keys with `meshgate keys create`, "
                "or pass --insecure-no-auth if this network is trusted.",
                file=sys.stderr,
            )
            return 2
        logging.getLogger("meshgate").warning(
            "serving on %s WITHOUT authentication (--insecure-no-auth): "
            "anyone who can reach this port can use and administer it",
            settings.host,
        )
    if settings.workers > 1:
        from meshgate.gateway.cli import workers

        return workers.supervise(settings)
    return run_gateway(settings)


def run_gateway(settings: Settings, worker: Worker | None = None) -> int:
    """Serve one gateway until told to stop: the whole of ``meshgate serve``, or one of its ``--workers``
    (``worker``: its index and listening socket; ``gateway.cli.workers``)."""
    import uvicorn

    from meshgate.gateway.http.app import create_app
    from meshgate.gateway.http.ticks import tick_once_a_second

    if worker is not None:
        _logging(settings)
    _return_freed_memory()
    app = create_app(settings, build_plugin_manager(settings), worker=worker.index if worker else None)
    server = uvicorn.Server(
        uvicorn.Config(
            app,
            host=settings.host,
            port=settings.port,
            log_level=settings.log_level,
            access_log=settings.log_level == "debug",
            # SIGTERM: stop accepting, let open requests (streams too) finish for up to MESHGATE_DRAIN_GRACE
            timeout_graceful_shutdown=max(1, round(settings.drain_grace)),
            log_config=None,  # uvicorn's loggers go to the root handler _logging set up (text or JSON)
            timeout_keep_alive=75,  # above clients' idle limits (httpx: 5 s), so a reused connection is never
            # closed under a request that is already on its way
        )
    )
    tick_once_a_second(server)  # an idle gateway wakes once a second, not ten times
    _announce(server, app, settings, worker)
    server.run(sockets=[worker.socket] if worker else None)
    return 0


def _announce(server: Any, app: Any, settings: Settings, worker: Worker | None) -> None:
    """End the start-up log with where the gateway listens and what it offers, once its socket is bound (as
    Ollama and llama.cpp's server do). A worker tells its parent instead, which says it once for all."""
    startup = server.startup

    async def announced(sockets: Any = None) -> None:
        await startup(sockets=sockets)
        if not server.started:
            return
        bound = [sock.getsockname() for srv in server.servers for sock in (srv.sockets or ())]
        port = bound[0][1] if bound else settings.port
        host = f"[{settings.host}]" if ":" in settings.host else settings.host
        models = ", ".join(c.name for c in app.state.plane.catalog.models()) or "none yet"
        if worker is not None:
            log = logging.getLogger("meshgate")
            log.debug("worker %d of %d serving (pid %d)", worker.index, worker.count, os.getpid())
            worker.tell_ready(models)
            return
        logging.getLogger("meshgate").info(
            "meshgate serving at http://%s:%d (OpenAI /v1, Anthropic /v1/messages, Ollama /api, dashboard /ui); "
            "models: %s",
            host,
            port,
            models,
        )

    server.startup = announced


def _return_freed_memory() -> None:
    """Have glibc serve buffers of 128 KiB and more with mmap, so a large request body freed goes back to the
    system (by default glibc raises that threshold as large blocks come and go, and keeps them)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if sys.platform.startswith("linux") and name:
        try:
            ctypes.CDLL(name).mallopt(-3, 128 << 10)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):  # not glibc (musl has no mallopt): nothing to tune
            pass


def _node(settings: Settings, args: argparse.Namespace) -> int:
    return run_node(settings)


def run_node(settings: Settings) -> int:
    """``meshgate node``: a node agent until told to stop (also the one agent of ``serve --workers``)."""
    import asyncio
    import faulthandler
    import signal

    from meshgate.gateway.http.runtime import control_plane

    if not settings.redis:
        print("meshgate node needs --redis URL (or MESHGATE_REDIS): the agents and gateways share it", file=sys.stderr)
        return 2
    _logging(settings)

    async def run() -> None:
        # SIGTERM drains (the node's replicas finish their streams, within MESHGATE_DRAIN_GRACE, while gateways
        # place them elsewhere); SIGINT, or a second signal, stops at once (streams resume on other replicas).
        signals: asyncio.Queue[int] = asyncio.Queue()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, signals.put_nowait, sig)
        async with control_plane(settings, build_plugin_manager(settings), gateway=False, agent=True) as plane:
            agent = plane.agent
            assert agent is not None  # control_plane(agent=True) starts one
            logging.getLogger("meshgate").info("node %s up; probes at %s", agent.name, agent.agent_url)
            first = await signals.get()
            # A stop that outlasts its bounds (the drain's grace and margin, the runners' own 5 s) prints every
            # thread's stack to the log: what an operator, or a test, needs to see why it did not end.
            faulthandler.dump_traceback_later(settings.drain_grace + 60.0, exit=False)
            if first == signal.SIGTERM and settings.drain_grace > 0:
                draining = asyncio.create_task(agent.drain(settings.drain_grace))
                again = asyncio.create_task(signals.get())
                await asyncio.wait({draining, again}, return_when=asyncio.FIRST_COMPLETED)
                again.cancel()

    asyncio.run(run())
    return 0


def _models(settings: Settings, args: argparse.Namespace) -> int:
    from meshgate.gateway.serving.catalog import Catalog

    pm = build_plugin_manager(settings)
    sources: list = []
    pm.hook.meshgate_register_model_sources(register=sources.append, settings=settings)
    for card in Catalog(sources).refresh():
        print(f"{card.name:30} {card.family:10} {card.parameter_size:8} {card.quantization:8} {card.path}")
    return 0


def _loopback(host: str) -> bool:
    import ipaddress

    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def _stored_keys(settings: Settings) -> bool:
    """Whether ``meshgate keys create`` ever made a key this gateway will read (then auth is on for good)."""
    import asyncio

    from meshgate.gateway.auth.keys import open_accounts

    async def any_key() -> bool:
        accounts = open_accounts(settings.redis, settings.data_dir)
        try:
            return await accounts.sealed()
        finally:
            await accounts.close()

    return asyncio.run(any_key())


def _client(args: argparse.Namespace):
    import httpx

    key = (
        args.api_key or os.environ.get("MESHGATE_ADMIN_KEY") or next(iter(Settings.from_env(os.environ).api_keys), None)
    )
    headers = {"authorization": f"Bearer {key}"} if key else {}
    return httpx.Client(base_url=args.url, timeout=300, trust_env=False, headers=headers)


def _fail(response) -> int:
    try:
        message = response.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        message = response.text
    print(f"{response.status_code}: {message}", file=sys.stderr)
    return 1


def _keys(settings: Settings, args: argparse.Namespace) -> int:
    with _client(args) as http:
        if args.action == "create":
            payload = {
                "name": args.key_name,
                "scope": args.scope,
                "models": args.model,
                "rpm": args.rpm,
                "tpm": args.tpm,
                "tenant": args.tenant,
                "priority": args.priority,
                "weight": args.weight,
            }
            response = http.post("/keys", json=payload)
            if response.status_code != 201:
                return _fail(response)
            made = response.json()
            print(made["key"])
            print(f"id {made['id']}, scope {made['scope']}: shown once, keep it now", file=sys.stderr)
        elif args.action == "list":
            response = http.get("/keys")
            if response.status_code != 200:
                return _fail(response)
            print(f"{'ID':14} {'NAME':20} {'SCOPE':10} {'RPM':>6} {'TPM':>8} {'CLASS':12} {'WEIGHT':>6} MODELS")
            for k in response.json()["keys"]:
                print(
                    f"{k['id']:14} {k['name']:20} {k['scope']:10} {k['rpm'] or '-':>6} {k['tpm'] or '-':>8} "
                    f"{k.get('priority') or 'default':12} {k.get('weight', 1):>6g} {', '.join(k['models']) or 'all'}"
                )
        else:
            response = http.delete(f"/keys/{args.key_id}")
            if response.status_code != 204:
                return _fail(response)
            print(f"revoked {args.key_id}")
    return 0


def _ps(settings: Settings, args: argparse.Namespace) -> int:
    with _client(args) as http:
        cluster = http.get("/cluster").raise_for_status().json()
        deployments = http.get("/deployments").raise_for_status().json()
    print(f"{'NODE':20} {'ADDRESS':16} {'MEMORY FREE':>12} {'CPUS':>5} RUNTIMES")
    for n in cluster["nodes"]:
        print(
            f"{n['name']:20} {n['address']:16} {n['memory_available'] / 2**30:10.1f}Gi {n['cpu_count']:5} "
            f"{', '.join(f'{k} {v}' for k, v in n['runtimes'].items())}"
        )
    print(
        f"\n{'INSTANCE':14} {'MODEL':24} {'REPLICA':>7} {'STATE':10} {'BACKEND':10} {'STRATEGY':9} {'CTX':>6} "
        f"{'SLOTS':>5} {'RUN':>4} {'WAIT':>4} {'TOK/S':>6} {'KV CACHE':34} NODES"
    )
    replica: dict[str, int] = {}
    for i in cluster["instances"]:
        replica[i["model"]] = replica.get(i["model"], 0) + 1
        of = sum(1 for j in cluster["instances"] if j["model"] == i["model"])
        nodes = ", ".join(f"{s['node_id']}[{s['layer_start']}:{s['layer_end']}]" for s in i["placement"]["shards"])
        load = i.get("load") or {}
        placement = i["placement"]
        nth = f"{replica[i['model']]}/{of}"
        print(
            f"{i['id']:14} {i['model']:24} {nth:>7} {i['state']['state']:10} "
            f"{placement['backend']:10} {placement['strategy']:9} {placement['context']:6} "
            f"{placement.get('sequences', 1):5} {load.get('running', 0):4} {load.get('queued', 0):4} "
            f"{load.get('tokens_per_s', 0.0):6.1f} {_kv_cache(i.get('kv_tier')):34} {nodes}"
            + (f"  ({i['note']})" if i.get("note") else "")
        )
    if deployments:
        print(f"\n{'DEPLOYMENT':24} {'REPLICAS':>8} {'MIN':>4} {'MAX':>4}")
        for d in deployments:
            print(f"{d['model']:24} {d['replicas']:8} {d['min_replicas']:4} {d['max_replicas']:4}")
    return 0


def _kv_cache(tier: dict[str, int] | None) -> str:
    """``ps``'s KV CACHE column: a replica's KV tier use, ``1.2 GiB/1.5 GiB ram, 3.4 GiB disk`` (a tier without a
    budget left out); ``-`` when its runner reports none."""
    if not tier:
        return "-"
    used = []
    if tier.get("ram_budget"):
        used.append(f"{_bytes(tier.get('ram_bytes', 0))}/{_bytes(tier['ram_budget'])} ram")
    if tier.get("disk_budget"):
        used.append(f"{_bytes(tier.get('disk_bytes', 0))} disk")
    return ", ".join(used) or "-"


def _bytes(size: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if size >= scale:
            return f"{size / scale:.1f} {unit}" if unit == "GiB" else f"{size // scale} {unit}"
    return f"{size} B"


def _place(settings: Settings, args: argparse.Namespace) -> int:
    import json

    with _client(args) as http:
        if args.preview:
            params = {"model": args.model_name, **({"nodes": args.nodes} if args.nodes else {})}
            response = http.get("/instances/previews", params=params)
            body = response.json()
            if response.status_code != 200:
                print(body.get("error", {}).get("message", response.text), file=sys.stderr)
                return 1
            for c in body["candidates"]:
                memory = ", ".join(f"{k}={v / 2**20:.0f}MiB" for k, v in c["memory_per_node"].items())
                verdict = f"{c['tok_s']:.1f} tok/s" if c["fits"] else f"rejected: {c['reason']}"
                print(f"{c['id']:12} {c['backend']:10} {c['strategy']:9} {memory:40} {verdict}")
            return 0
        payload = {"model": args.model_name, **({"nodes": args.nodes.split(",")} if args.nodes else {})}
        if args.replicas != 1:
            payload["replicas"] = args.replicas
        response = http.post("/instances", json=payload)
        if response.status_code != 201:
            print(response.json().get("error", {}).get("message", response.text), file=sys.stderr)
            return 1
        placed = response.json().pop("replicas", None) or [response.json()]
        if not args.no_wait:
            from meshgate.gateway.cli.place_progress import describe_placement, follow

            for n, instance in enumerate(placed):
                name = f"replica {n + 1}/{len(placed)}: " if len(placed) > 1 else ""
                print(f"placing {name}{describe_placement(instance)}", file=sys.stderr, flush=True)
                placed[n] = follow(http, instance["id"], lambda line: print(line, file=sys.stderr, flush=True))
                if placed[n] is None or placed[n]["state"]["state"] != "ready":
                    return 1
        print(json.dumps(placed[0] if len(placed) == 1 else placed, indent=2))
        return 0


def _bench(settings: Settings, args: argparse.Namespace) -> int:
    from meshgate.gateway.cli import bench

    return bench.main(args)


def _logging(settings: Settings) -> None:
    from meshgate.gateway.telemetry import logs

    logs.configure(settings.log_level, settings.log_format)


def main(argv: list[str] | None = None) -> int:
    environment = Settings.from_env(os.environ)
    parser, commands = build_parser(environment)
    args = parser.parse_args(argv)
    settings = _settings(args) if args.command in ("serve", "node", "models") else environment
    return commands[args.command](settings, args)


def build_parser(
    environment: Settings,
) -> tuple[argparse.ArgumentParser, dict[str, Callable[[Settings, argparse.Namespace], int]]]:
    """``meshgate``'s argument parser and its commands by name, with those the plugins enabled in ``environment``
    register (``meshgate_register_commands``). ``scripts/config_docs.py`` reads the flags from it."""
    parser = argparse.ArgumentParser(
        prog="meshgate",
        description="An inference gateway for OpenAI, Anthropic and Ollama clients, over models split across machines.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, text in (
        ("serve", "run the gateway"),
        ("node", "run a node agent"),
        ("models", "list the models this machine can serve"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--redis", help="Redis URL for cluster state (default: in memory, one machine)")
        p.add_argument("--host", help="address to bind (default 127.0.0.1)")
        p.add_argument("--port", type=int, help="port to bind (default 11434)")
        if name == "serve":
            p.add_argument(
                "--workers",
                type=int,
                help="gateway processes on this port, sharing state through Redis (default 1; without --redis a "
                "private redis-server and one node agent are started)",
            )
        p.add_argument("--data-dir", help="where models and state live (default $XDG_DATA_HOME/meshgate)")
        p.add_argument("--model", action="append", default=[], help="a GGUF to serve: NAME=PATH or PATH")
        p.add_argument("--plugin", action="append", default=[], help="an extra plugin module to load")
        p.add_argument("--api-key", action="append", default=[], help="require this API key (repeatable)")
        p.add_argument(
            "--n-ctx", type=int, help="fixed context for runners (default: 4096, grown to what a request needs)"
        )
        p.add_argument("--threads", type=int, help="threads per runner (default: all cores)")
        p.add_argument("--name", help="this node's name (default: the host name)")
        p.add_argument("--address", help="cluster address runtimes bind (default 127.0.0.1)")
        p.add_argument("--placement", choices=["auto", "never"], help="place models on first request (auto)")
        p.add_argument("--memory", type=int, help="bytes of memory this node offers for models")
        p.add_argument("--log-level", help="debug, info, warning or error")
        p.add_argument("--log-format", choices=["text", "json"], help="text lines, or one JSON object per line")
        p.add_argument(
            "--insecure-no-auth",
            action="store_true",
            help="serve on a non-loopback address without API keys (otherwise refused)",
        )
    for name, text in (
        ("ps", "show nodes and instances of a running gateway"),
        ("place", "preview or create a placement"),
    ):
        p = sub.add_parser(name, help=text)
        p.add_argument("--url", default="http://127.0.0.1:11434", help="the gateway (default %(default)s)")
        p.add_argument("--api-key", help="an admin key (default: $MESHGATE_ADMIN_KEY, else $MESHGATE_API_KEYS)")
        if name == "place":
            p.add_argument("model_name", metavar="MODEL")
            p.add_argument("--preview", action="store_true", help="list candidates instead of creating")
            p.add_argument("--nodes", help="comma-separated node names to place on")
            p.add_argument("--replicas", type=int, default=1, help="replicas to place, over distinct nodes (1)")
            p.add_argument("--no-wait", action="store_true", help="return once created, not when ready or failed")
    commands: dict[str, Callable[[Settings, argparse.Namespace], int]] = {
        "serve": _serve,
        "node": _node,
        "models": _models,
        "ps": _ps,
        "place": _place,
        "keys": _keys,
        "bench": _bench,
    }

    def register(
        name: str, run: Callable[[Settings, argparse.Namespace], int], *, help: str
    ) -> argparse.ArgumentParser:
        if name in commands:
            raise ValueError(f"a plugin registers the command {name!r}, which is taken")
        commands[name] = run
        return sub.add_parser(name, help=help)

    build_plugin_manager(environment).hook.meshgate_register_commands(register=register)
    p = sub.add_parser("keys", help="make, list and revoke API keys of a running gateway (admin key needed)")
    p.add_argument("--url", default="http://127.0.0.1:11434", help="the gateway (default %(default)s)")
    p.add_argument("--api-key", help="an admin key (default: $MESHGATE_ADMIN_KEY, else $MESHGATE_API_KEYS)")
    actions = p.add_subparsers(dest="action", required=True)
    made = actions.add_parser("create", help="make a key; it is printed once")
    made.add_argument("key_name", metavar="NAME")
    made.add_argument("--scope", choices=["inference", "admin"], default="inference")
    made.add_argument("--model", action="append", default=[], help="a model it may use (repeatable; default all)")
    made.add_argument("--rpm", type=int, default=0, help="requests per minute (default MESHGATE_RATE_LIMIT)")
    made.add_argument("--tpm", type=int, default=0, help="tokens per minute (default no limit)")
    made.add_argument("--tenant", default="", help="keys of one tenant share cached prompts (default: this key only)")
    made.add_argument(
        "--priority",
        choices=["interactive", "batch"],
        default=None,
        help="the class of its requests that send no service_tier (default MESHGATE_DEFAULT_PRIORITY)",
    )
    made.add_argument("--weight", type=float, default=1.0, help="its share of slots within its class (default 1)")
    actions.add_parser("list", help="list keys (never the keys themselves)")
    actions.add_parser("revoke", help="revoke a key").add_argument("key_id", metavar="ID")
    from meshgate.gateway.cli import bench

    bench.add_arguments(sub.add_parser("bench", help="measure prompt and generation speed of a running gateway"))
    return parser, commands


if __name__ == "__main__":
    sys.exit(main())
