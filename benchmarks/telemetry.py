"""Gateway CPU per request and per streamed token with telemetry on and off, measured in the same run.

    .venv/bin/python benchmarks/telemetry.py [--pairs 3] [--rounds 5] [--requests 400] [--streams 20] [--tokens 1000]

Gateways run side by side with the scripted backend (instant answers) and the relay plugin (a scripted runner
process, ``benchmarks.relay_plugin``): ``--pairs`` of them "on", with metrics and the request log
(``MESHGATE_METRICS=1``, ``--log-level info``, lines written to the server log file, ``/metrics`` scraped once
per round), and as many "off", with neither (``MESHGATE_METRICS=0``, ``--log-level warning``: the middleware
then only adds the request id). Two identical gateway processes differ by up to 10% here (memory layout, hash
seeds; ``--control`` runs them all off to show it), hence several of each kind. Rounds alternate the order. Per
round and gateway it measures server CPU per non-streaming chat completion (``--requests`` sequential, as
``benchmarks/step1.py``) and per relayed token (``--streams`` OpenAI chat streams of ``--tokens`` tokens, back to
back, as ``benchmarks/relay.py``), net of the gateway's idle CPU. CPU time is read from
``/proc/<pid>/task/*/schedstat`` (nanoseconds; ``/proc/<pid>/stat`` counts 10 ms ticks, too coarse for a 5%
difference). Prints the medians and their ratio (target <= 1.05).

Then it measures the telemetry alone, in this process (``in_process``): the middleware and the dispatcher's relay
around a scripted stream, on and off, which gives what it adds per request and per token without process noise.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.conftest import Server  # noqa: E402

CHAT = {"model": "scripted", "messages": [{"role": "user", "content": "hello"}]}


def cpu_seconds(pid: int) -> float:
    """CPU time of every thread of ``pid`` (nanosecond resolution)."""
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (OSError, IndexError, ValueError):
            pass  # a thread that just ended
    return total / 1e9


def idle_rate(pid: int, seconds: float = 2.0) -> float:
    before, started = cpu_seconds(pid), time.perf_counter()
    time.sleep(seconds)
    return (cpu_seconds(pid) - before) / (time.perf_counter() - started)


def per_request(server: Server, client: httpx.Client, requests: int, idle: float) -> float:
    before, started = cpu_seconds(server.proc.pid), time.perf_counter()
    for _ in range(requests):
        client.post("/v1/chat/completions", json=CHAT).raise_for_status()
    spent = cpu_seconds(server.proc.pid) - before - idle * (time.perf_counter() - started)
    return spent / requests


def per_token(server: Server, client: httpx.Client, streams: int, tokens: int, idle: float) -> float:
    body = {
        "model": "relay",
        "messages": [{"role": "user", "content": "burst=1 interval=0"}],
        "max_tokens": tokens,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    before, started = cpu_seconds(server.proc.pid), time.perf_counter()
    for _ in range(streams):
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            response.raise_for_status()
            for _chunk in response.iter_raw():
                pass
    spent = cpu_seconds(server.proc.pid) - before - idle * (time.perf_counter() - started)
    return spent / (streams * tokens)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--pairs", type=int, default=3, help="gateways of each kind (identical ones differ too)")
    parser.add_argument("--requests", type=int, default=400)
    parser.add_argument("--streams", type=int, default=20)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--control", action="store_true", help="run every gateway off: the noise floor (A/A)")
    args = parser.parse_args()
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    plugins = ("--plugin", "tests.scripted_plugin", "--plugin", "benchmarks.relay_plugin")
    env = {"MESHGATE_DISABLED_PLUGINS": "llama_cpp,mlx,vllm"}
    on = ("--log-level", "info"), {**env, "MESHGATE_METRICS": "1"}
    off = ("--log-level", "warning"), {**env, "MESHGATE_METRICS": "0"}
    servers: dict[tuple[str, int], Server] = {}
    for i in range(args.pairs):
        for kind, (flags, variables) in (("on", off if args.control else on), ("off", off)):
            servers[kind, i] = Server(data_dir, *plugins, *flags, env=variables)
    results: dict[str, dict[str, list[float]]] = {kind: {"request": [], "token": []} for kind in ("on", "off")}
    try:
        clients = {key: httpx.Client(base_url=s.url, timeout=120) for key, s in servers.items()}
        for key, server in servers.items():  # load both models, warm every path
            per_request(server, clients[key], 50, 0.0)
            per_token(server, clients[key], 2, args.tokens, 0.0)
        time.sleep(1.0)
        idle = {key: idle_rate(s.proc.pid, 1.0) for key, s in servers.items()}
        for round_ in range(args.rounds):
            order = list(servers) if round_ % 2 == 0 else list(reversed(servers))
            for key in order:
                server, client, kind = servers[key], clients[key], key[0]
                results[kind]["request"].append(per_request(server, client, args.requests, idle[key]))
                results[kind]["token"].append(per_token(server, client, args.streams, args.tokens, idle[key]))
                if kind == "on" and not args.control:
                    client.get("/metrics").raise_for_status()
    finally:
        for server in servers.values():
            server.stop()
    label = "all off (control: the noise floor)" if args.control else "on vs off"
    print(
        f"gateway CPU, {label}: median over {args.pairs} gateways of each kind x {args.rounds} interleaved rounds; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    for what, unit, scale in (("request", "ms", 1e3), ("token", "us", 1e6)):
        median_on = statistics.median(results["on"][what])
        median_off = statistics.median(results["off"][what])
        print(
            f"  per {what:7} ({unit})   on {median_on * scale:8.3f}   off {median_off * scale:8.3f}   "
            f"ratio {median_on / median_off:6.3f}"
        )
    in_process()


def in_process(requests: int = 20000, tokens: int = 200000) -> None:
    """What the telemetry alone adds, in this process without sockets: the middleware around an app that answers
    at once after relaying a scripted stream through the dispatcher's ``_chain`` (as a generation does), with
    metrics and the request log on (lines to a file) and off; CPU time per request and per relayed token."""
    import asyncio
    import logging
    import tempfile

    from meshgate.gateway.serving.streams import chain as _chain
    from meshgate.gateway.telemetry import logs
    from meshgate.gateway.telemetry.metrics import GatewayMetrics
    from meshgate.gateway.telemetry.middleware import RequestTelemetry
    from meshgate.gateway.telemetry.record import note_model
    from meshgate.protocols.model import Finished, TextDelta, Usage

    def script(n: int) -> list:
        return [Usage(prompt_tokens=7), *[TextDelta(text="x")] * n, Usage(prompt_tokens=7, completion_tokens=n)]

    class App:
        def __init__(self, n: int) -> None:
            self.events = script(n)

        async def __call__(self, scope, receive, send) -> None:
            note_model("scripted")

            async def rest():
                for event in self.events[1:]:
                    yield event
                yield Finished(reason="stop")

            async for _ in _chain(self.events[0], rest(), lambda: None, served=("scripted", "abc123")):
                pass
            await send({"type": "http.response.start", "status": 200, "headers": []})
            await send({"type": "http.response.body", "body": b"{}"})

    scope = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": [], "state": {}}
    scope["path_template"] = "/v1/chat/completions"

    async def noop(_message) -> None:
        pass

    async def run(app, count: int) -> float:
        started = time.process_time()
        for _ in range(count):
            await app(dict(scope), None, noop)
        app.flush()  # the requests' batched lines and counts
        return time.process_time() - started

    with tempfile.NamedTemporaryFile("w", suffix=".log") as sink:
        results = {}
        for name, level, metrics in (("on", "info", GatewayMetrics()), ("off", "warning", None)):
            logs.configure(level)
            logging.getLogger().handlers[0].setStream(open(sink.name, "a"))  # noqa: SIM115
            short, long_ = RequestTelemetry(App(2), None, metrics), RequestTelemetry(App(1000), None, metrics)
            asyncio.run(run(short, 200))
            per_request = asyncio.run(run(short, requests)) / requests
            per_stream = asyncio.run(run(long_, tokens // 1000)) / (tokens // 1000)
            results[name] = (per_request, (per_stream - per_request) / 998)
    print("in process (telemetry alone, no HTTP): CPU per request, per relayed token")
    for name, (request, token) in results.items():
        print(f"  {name:3}  {request * 1e6:8.2f} us per request   {token * 1e9:7.1f} ns per token")
    print(
        f"  added by telemetry: {(results['on'][0] - results['off'][0]) * 1e6:.2f} us per request, "
        f"{(results['on'][1] - results['off'][1]) * 1e9:.1f} ns per token"
    )


if __name__ == "__main__":
    main()
