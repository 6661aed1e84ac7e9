"""How fast llama.cpp runs on this node, measured with llama.cpp itself: the planner's ``Calibration``.

``calibrate`` (in the node agent, through ``LlamaCppBackend.calibrate``) answers from a cache file keyed by the
CPU model, core count, llama-cpp-python version, threads and the model measured; otherwise it runs
``python -m meshgate.backends.llama_cpp.calibrate --model PATH`` (llama.cpp never loads into the agent), which
measures, caches and prints the result. The cache is the machine's, not a data directory's
(``$XDG_CACHE_HOME/meshgate``, ``~/.cache/meshgate``): every agent and gateway on the machine shares one
measurement. The subprocess measures under a file lock, so one measures and the others read its result; it
finishes (within its ``--timeout``) even when the agent that asked is stopped, so a short-lived gateway's
measurement is not lost. A measurement taken while other work loaded the machine (load average above one per
core) is measured again by the first start that finds the machine quiet.

The measurement (``measure``), on a small GGUF (the packaged Gemma 3 270M), with the runner's own engine
(``LlamaEngine``: its scheduler, sampler and threads) and one extra raw context on the same weights:

1. Generate from distinct prompts of ``PROMPT`` tokens, ``TOKENS`` tokens each, greedy (the first run warms up):
   seconds per decoded token (``t_tok``: the 20th percentile of the gaps between tokens, so a neighbour's bursts
   of load are not kept) and seconds to read the prompt (``t_prompt``, the best run's), as the runner times them.
2. Raw single-token decodes, with the output layer's logits asked for and without (llama.cpp then skips the
   output matmul): the difference is the output layer's bytes over the decode rate, ``decode_bytes_per_s``.
3. ``step_seconds`` = ``t_tok`` less every weight and the KV cache read at that rate (sampling, the graph, the
   scheduler's loop); ``prefill_flops`` = the prompt's layer matmul and attention FLOPs over ``t_prompt`` less
   one step and the last token's output layer, as ``gateway.cluster.costs`` adds them back.

Imports llama_cpp only inside ``measure`` (the subprocess).
"""

from __future__ import annotations

import argparse
import contextlib
import fcntl
import itertools
import logging
import os
import platform
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from importlib import metadata
from pathlib import Path
from typing import Any

import msgspec

from meshgate.backends.placement import Calibration

__all__ = ["PROMPT", "TOKENS", "cache_key", "calibrate", "default_cache_dir", "measure"]

log = logging.getLogger("meshgate.llama_cpp.calibrate")
PROMPT = 512
"""Prompt tokens of each calibration request (the planner's typical prompt, ``costs.TYPICAL_PROMPT``)."""
TOKENS = 32
"""Tokens decoded by each calibration request."""
RUNS = 3
"""Calibration requests (the first warms up)."""
RAW_STEPS = 8
"""Raw single-token decodes of each kind (with and without logits); the fastest of each counts."""


def cpu_model() -> str:
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def cache_key(model: str, threads: int, parallel: int) -> str:
    """What a measurement holds for: the CPU, the runtime, the threads and sequences, the model file."""
    try:
        version = metadata.version("llama-cpp-python")
    except metadata.PackageNotFoundError:
        version = "?"
    stat = os.stat(model)
    return (
        f"{cpu_model()} x{os.cpu_count()}|llama-cpp-python {version}|threads {threads}|parallel {parallel}|"
        f"{os.path.basename(model)} {stat.st_size}"
    )


def default_cache_dir() -> Path:
    """This machine's cache for calibrations: ``$XDG_CACHE_HOME/meshgate``, else ``~/.cache/meshgate``."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "meshgate"


def _load() -> float:
    return os.getloadavg()[0] / (os.cpu_count() or 1)


def calibrate(
    model: str, *, python: str, threads: int, parallel: int, cache_dir: str | None = None, timeout: float = 300.0
) -> Calibration | None:
    """This node's llama.cpp speed on the GGUF ``model``: from the cache (``cache_dir``, the machine's by
    default), else measured in a subprocess, which caches it (and finishes, so the next start reads it, even if
    this agent is stopped meanwhile); ``None`` when that fails."""
    path = Path(cache_dir or default_cache_dir()) / "calibration.json"
    known = _cached(path, cache_key(model, threads, parallel))
    if known is not None:
        return known
    argv = [python, "-m", "meshgate.backends.llama_cpp.calibrate", "--model", model, "--threads", str(threads)]
    argv += ["--parallel", str(parallel), "--cache-dir", str(path.parent), "--timeout", str(timeout)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout + 5, env={**os.environ})
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("llama.cpp calibration failed: %s", exc)
        return None
    if done.returncode != 0:
        log.warning("llama.cpp calibration failed: %s", done.stderr.strip()[-500:])
        return None
    return msgspec.json.decode(done.stdout.strip().splitlines()[-1], type=Calibration)


def _cached(path: Path, key: str) -> Calibration | None:
    """The cached measurement for ``key``, unless it was taken on a loaded machine that is quiet now."""
    known = _read(path).get(key)
    if known is not None and (known.load <= 1.0 or _load() > 0.5):
        return known
    return None


def _measure_and_cache(model: str, threads: int, parallel: int, cache_dir: Path) -> Calibration:
    """In the subprocess: under the machine's lock, the cached measurement (another process may have just made
    it), else a new one, cached."""
    key = cache_key(model, threads, parallel)
    path = cache_dir / "calibration.json"
    with _locked(path):
        known = _cached(path, key)
        if known is not None:
            return known
        load = _load()
        found = msgspec.convert(measure(model, threads, parallel), Calibration)
        found = msgspec.structs.replace(found, key=key, measured_at=time.time(), load=round(max(load, _load()), 2))
        cached = _read(path)
        cached[key] = found
        partial = path.with_suffix(".partial")
        partial.write_bytes(msgspec.json.encode(cached))
        partial.replace(path)
        return found


def _read(path: Path) -> dict[str, Calibration]:
    try:
        return msgspec.json.decode(path.read_bytes(), type=dict[str, Calibration])
    except (OSError, msgspec.DecodeError):
        return {}


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path.with_suffix(".lock"), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def measure(model: str, threads: int, parallel: int) -> dict[str, Any]:
    """Run the calibration (see the module docstring); the ``Calibration`` fields as a dict."""
    import llama_cpp as lib

    from meshgate.backends.llama_cpp import spec_from_gguf
    from meshgate.backends.llama_cpp.engine import LlamaEngine
    from meshgate.protocols.model import Request, Sampling, TextDelta, Usage

    spec = spec_from_gguf("calibration", model)
    engine = LlamaEngine(model, n_ctx=PROMPT + TOKENS + 64, n_threads=threads, parallel=parallel)
    rng = random.Random(0)
    n_vocab = engine.llm.n_vocab()
    per_token, prompt_time, gaps = [], [], []
    for run in range(RUNS):
        words = [engine.llm.detokenize([rng.randrange(1000, min(n_vocab, 30000))]) for _ in range(PROMPT - 1)]
        text = b"".join(words).decode(errors="ignore")
        request = Request(model="m", raw_prompt=text, max_tokens=TOKENS, sampling=Sampling(temperature=0.0))
        arrivals, usage = [], None
        for event in engine.generate(request, threading.Event()):
            if isinstance(event, TextDelta):
                arrivals.append(time.perf_counter())
            elif isinstance(event, Usage):
                usage = event
        if run and usage is not None and usage.completion_tokens > 1:
            per_token.append(usage.eval_ns / 1e9 / (usage.completion_tokens - 1))
            prompt_time.append((usage.prompt_ns / 1e9, usage.prompt_tokens))
            gaps += [b - a for a, b in itertools.pairwise(arrivals)]
    full, bare = _raw_steps(lib, engine.llm._model.model, threads)
    layers = spec.n_layers * spec.layer_bytes
    output = spec.embedding_bytes if spec.tied_output else spec.output_bytes
    rate = output / (full - bare) if full > bare else (layers + output) / full
    # A token's time when this process had the CPU: a low percentile of the gaps between tokens (a neighbour's
    # load stretches some gaps, never shortens one), else the best request's mean.
    t_tok = statistics.quantiles(gaps, n=5)[0] if len(gaps) >= 10 else min(per_token)
    kv = spec.kv_bytes(PROMPT + TOKENS // 2)
    step = max(0.0, t_tok - (layers + output + kv) / rate)
    n_params = lib.llama_model_n_params(engine.llm._model.model)
    embedding_params = n_vocab * spec.hidden_size * (1 if spec.tied_output else 2)
    params_per_byte = (n_params - embedding_params) / layers
    t_prompt, n = min(prompt_time)
    flops = n * (2 * params_per_byte * layers + spec.n_layers * 4 * spec.n_heads * spec.head_dim * n / 2)
    compute = max(t_prompt - step - output / rate, t_prompt / 4)
    return {
        "decode_bytes_per_s": rate,
        "prefill_flops": flops / compute,
        "step_seconds": step,
        "params_per_byte": params_per_byte,
        "threads": threads,
    }


def _raw_steps(lib: Any, model: Any, threads: int) -> tuple[float, float]:
    """The fastest single-token decode with logits and without, on a context of its own (seconds)."""
    params = lib.llama_context_default_params()
    params.n_ctx = params.n_batch = params.n_ubatch = 256
    params.n_threads = params.n_threads_batch = threads
    params.flash_attn_type = lib.LLAMA_FLASH_ATTN_TYPE_DISABLED  # as the runner makes its context
    ctx = lib.llama_init_from_model(model, params)
    if not ctx:
        raise RuntimeError("llama.cpp could not make a calibration context")
    batch = lib.llama_batch_init(1, 0, 1)
    times: dict[bool, list[float]] = {True: [], False: []}
    try:
        for pos in range(2 * RAW_STEPS + 2):
            logits = pos % 2 == 0
            batch.n_tokens = 1
            batch.token[0], batch.pos[0], batch.n_seq_id[0] = 1000 + pos, pos, 1
            batch.seq_id[0][0], batch.logits[0] = 0, logits
            started = time.perf_counter()
            if lib.llama_decode(ctx, batch) != 0:
                raise RuntimeError("llama_decode failed during calibration")
            if pos >= 2:  # the first of each kind warms up
                times[logits].append(time.perf_counter() - started)
    finally:
        lib.llama_batch_free(batch)
        lib.llama_free(ctx)
    return min(times[True]), min(times[False])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="meshgate-llama-calibrate")
    parser.add_argument("--model", required=True, help="path of a (small) GGUF file to measure with")
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--cache-dir", default=str(default_cache_dir()))
    parser.add_argument("--timeout", type=float, default=300.0, help="give up after this many seconds")
    args = parser.parse_args(argv)
    signal.alarm(max(1, int(args.timeout)))  # bounded, even when the agent that asked is gone
    found = _measure_and_cache(args.model, args.threads, args.parallel, Path(args.cache_dir))
    sys.stdout.write(msgspec.json.encode(found).decode() + "\n")


if __name__ == "__main__":
    main()
