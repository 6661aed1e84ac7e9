"""Placement previews against what the placements then do: estimated vs measured decode and prompt tok/s.

    .venv/bin/python benchmarks/previews.py [--runs 4] [--tokens 128] [--contexts 4096,32768] [--no-pipeline]
                                            [--recalibrate] [--json]

Starts Redis, two node agents (``a`` and ``b``, ``meshgate node``) and, for each context, a gateway (``meshgate
serve --redis ... --n-ctx CONTEXT``) on loopback, all on the packaged Gemma 3 270M, and waits until both agents
have measured llama.cpp (``Backend.calibrate``, cached for the machine) and their links. For each candidate
(single node at every context; the 2-node llama.cpp RPC pipeline at the first), it reads ``GET
/instances/previews`` (the candidate's ``tok_s`` and ``prompt_tok_s``), creates that very candidate (``POST
/instances`` with its ``candidate_id``), and sends ``--runs`` + 1 requests one after another (the first warms
up): Ollama ``/api/generate``, raw, greedy, a distinct prompt of about ``costs.TYPICAL_PROMPT`` one-token words
(distinct from its first word, so no cached prefix is reused) and ``--tokens`` tokens to generate
(``costs.TYPICAL_ANSWER`` by default: the request the estimate is for). Measured speeds are the runner's own
timings as Ollama reports them: decode = (``eval_count`` - 1) / ``eval_duration``, prompt = ``prompt_eval_count``
/ ``prompt_eval_duration`` (median of the runs). The ratio is measured / estimated; the target is 0.75-1.25.

The load average before and after each candidate is printed: on a shared machine other work slows the
measurement, not the estimate (which was measured when the agents calibrated). Every wait is bounded.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meshgate.backends.llama_cpp.calibrate import default_cache_dir  # noqa: E402
from meshgate.gateway.cluster import costs  # noqa: E402
from tests.cluster.redis_server import RedisServer, free_port  # noqa: E402

MODEL = "gemma3:270m"
WORDS = (
    "the of and to in is that it was for on are as with his they at be this have from or one had by word but not "
    "what all were we when your can said there use an each which she do how their if will up other about out many "
    "then them these so some her would make like him into time has look two more write go see number no way could "
    "people my than first water been call who oil its now find long down day did get come made may part"
).split()


def wait_for(check: Callable[[], Any], timeout: float, what: str) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := check():
                return result
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError(f"timed out after {timeout:.0f}s waiting for {what}")


def start(args: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    with open(log, "wb") as out:
        return subprocess.Popen(
            [sys.executable, "-m", "meshgate.gateway.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            cwd=ROOT,
            env={**os.environ, "PYTHONPATH": str(ROOT), **env},
        )


def stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def prompt(seed: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(costs.TYPICAL_PROMPT - 1))


def measure(url: str, runs: int, seed: int, tokens: int) -> dict[str, float]:
    decode, prefill, prompt_tokens = [], [], []
    with httpx.Client(timeout=600) as http:
        for n in range(runs + 1):
            body = {
                "model": MODEL,
                "prompt": prompt(seed * 1000 + n),
                "raw": True,
                "stream": False,
                "options": {"temperature": 0, "num_predict": tokens, "seed": n},
            }
            r = http.post(f"{url}/api/generate", json=body)
            r.raise_for_status()
            out = r.json()
            if n == 0:
                continue  # warm-up: the first request pays for loading
            decode.append((out["eval_count"] - 1) / (out["eval_duration"] / 1e9))
            prefill.append(out["prompt_eval_count"] / (out["prompt_eval_duration"] / 1e9))
            prompt_tokens.append(out["prompt_eval_count"])
    return {
        "decode": statistics.median(decode),
        "prefill": statistics.median(prefill),
        "prompt_tokens": statistics.median(prompt_tokens),
    }


def cluster_ready(url: str) -> bool:
    """Both agents have a llama.cpp calibration on record and have measured their links."""
    view = httpx.get(f"{url}/cluster", timeout=5).json()
    calibrated = [n for n in view["nodes"] if "llama_cpp" in n.get("calibration", {})]
    return len(calibrated) == 2 and len(view["links"]) >= 2


def describe_cluster(url: str) -> None:
    """Print each node's calibration and the measured links (to stderr)."""
    view = httpx.get(f"{url}/cluster", timeout=5).json()
    for n in view["nodes"]:
        c = n["calibration"]["llama_cpp"]
        print(
            f"node {n['id']}: decode {c['decode_bytes_per_s'] / 1e9:.2f} GB/s, step {c['step_seconds'] * 1e3:.2f} ms, "
            f"prefill {c['prefill_flops'] / 1e9:.1f} GFLOP/s, measured at load {c['load']:.2f}/core",
            file=sys.stderr,
        )
    for link in view["links"]:
        print(
            f"link {link['src']}->{link['dst']}: {link['latency'] * 1e3:.3f} ms, {link['bandwidth'] / 1e9:.2f} GB/s",
            file=sys.stderr,
        )


def run_candidate(url: str, params: dict[str, Any], runs: int, seed: int, tokens: int) -> dict[str, Any]:
    preview = httpx.get(f"{url}/instances/previews", params={"model": MODEL, **params}, timeout=30).json()
    candidate = next(c for c in preview["candidates"] if c["fits"])
    created = httpx.post(f"{url}/instances", json={"model": MODEL, "candidate_id": candidate["id"]}, timeout=60).json()
    instance_id = created["id"]
    try:
        wait_for(
            lambda: httpx.get(f"{url}/instances/{instance_id}").json()["state"]["state"] == "ready",
            300,
            "the instance",
        )
        load_before = os.getloadavg()[0]
        measured = measure(url, runs, seed, tokens)
        load_after = os.getloadavg()[0]
    finally:
        httpx.delete(f"{url}/instances/{instance_id}", timeout=60)
        time.sleep(2)  # the agents stop its processes
    layers = "+".join(f"{s['node_id']}:{s['layer_end'] - s['layer_start']}" for s in candidate["shards"])
    return {
        "candidate": f"{candidate['strategy']} {layers} ctx {candidate['context']}",
        "estimate_decode": candidate["tok_s"],
        "measured_decode": measured["decode"],
        "estimate_prefill": candidate["prompt_tok_s"],
        "measured_prefill": measured["prefill"],
        "prompt_tokens": measured["prompt_tokens"],
        "link_cost_ms": candidate["link_cost"] * 1e3,
        "load": (load_before, load_after),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--contexts", default="4096,32768")
    parser.add_argument("--no-pipeline", action="store_true")
    parser.add_argument("--json", action="store_true")
    parser.add_argument("--tokens", type=int, default=costs.TYPICAL_ANSWER, help="tokens to generate per request")
    parser.add_argument(
        "--recalibrate", action="store_true", help="forget this machine's cached calibration: measure it now"
    )
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))  # stopped: still stop what it started (the finally blocks)
    if args.recalibrate:
        (default_cache_dir() / "calibration.json").unlink(missing_ok=True)
    contexts = [int(c) for c in args.contexts.split(",")]
    data_dir = Path(os.environ.get("MESHGATE_TEST_DATA", ROOT / ".cache" / "test-data"))
    scratch = Path(tempfile.mkdtemp(prefix="meshgate-previews-"))
    env = {"MESHGATE_HEARTBEAT": "0.5", "MESHGATE_NODE_TTL": "30"}  # members through a busy machine's stalls
    results = []
    with RedisServer(scratch / "redis") as redis:
        common = ["--redis", redis.url, "--data-dir", str(data_dir), "--log-level", "info"]
        agents = [start(["node", "--name", n, *common], scratch / f"agent-{n}.log", env) for n in ("a", "b")]
        try:
            for i, context in enumerate(contexts):
                port = free_port()
                gateway = start(
                    ["serve", "--port", str(port), "--n-ctx", str(context), *common], scratch / f"gw-{context}.log", env
                )
                url = f"http://127.0.0.1:{port}"
                try:
                    wait_for(lambda url=url: cluster_ready(url), 900, "two calibrated, linked agents")
                    if i == 0:
                        describe_cluster(url)
                    cases = [{"strategy": "single", "nodes": "a"}]
                    if i == 0 and not args.no_pipeline:
                        cases.append({"strategy": "pipeline", "min_nodes": 2})
                    for n, params in enumerate(cases):
                        results.append(run_candidate(url, params, args.runs, seed=10 * i + n, tokens=args.tokens))
                        print(json.dumps(results[-1]), file=sys.stderr, flush=True)
                finally:
                    stop(gateway)
        finally:
            for agent in agents:
                stop(agent)
    shutil.rmtree(scratch, ignore_errors=True)
    if args.json:
        print(json.dumps(results, indent=2))
        return
    print(
        f"Gemma 3 270M Q4_K_M through meshgate, prompt ~{costs.TYPICAL_PROMPT} tokens, {args.tokens} "
        f"generated, greedy; median of {args.runs}; {os.cpu_count()} cores"
    )
    print(
        f"{'candidate':34} {'decode est':>10} {'measured':>9} {'ratio':>6} {'prefill est':>11} {'measured':>9} "
        f"{'ratio':>6}  load before/after"
    )
    for r in results:
        print(
            f"{r['candidate']:34} {r['estimate_decode']:10.1f} {r['measured_decode']:9.1f} "
            f"{r['measured_decode'] / r['estimate_decode']:6.2f} {r['estimate_prefill']:11.1f} "
            f"{r['measured_prefill']:9.1f} {r['measured_prefill'] / r['estimate_prefill']:6.2f}  "
            f"{r['load'][0]:.1f}/{r['load'][1]:.1f}"
        )
    print("ratio = measured / estimated; target 0.75-1.25")


if __name__ == "__main__":
    main()
