"""Run simulator episodes: ``python -m tests.sim --seed 17`` replays one (its operations, what broke; ``--verbose``
adds every machine's log on the virtual clock), ``python -m tests.sim --episodes 2000 --workers 2`` runs seeds
0..1999 (``--first`` moves the start) in two processes; ``--plant NAME`` plants a defect (``tests.sim.plants``).

Hash randomization changes the order sets iterate in, so the module runs itself again with
``PYTHONHASHSEED=0`` when it is not set: a seed gives the same episode in every process.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import multiprocessing
import os
import sys
import time
from concurrent.futures import ProcessPoolExecutor

from tests.sim.clock import current_machine
from tests.sim.episode import run
from tests.sim.plants import PLANTS, planted


def _virtual_time(record: logging.LogRecord) -> bool:
    try:
        record.vt = asyncio.get_running_loop().time()
    except RuntimeError:
        record.vt = -1.0
    record.sim_machine = current_machine()
    return True


def main() -> int:
    if os.environ.get("PYTHONHASHSEED") != "0":
        os.execve(
            sys.executable, [sys.executable, "-m", "tests.sim", *sys.argv[1:]], {**os.environ, "PYTHONHASHSEED": "0"}
        )
    parser = argparse.ArgumentParser(prog="python -m tests.sim")
    parser.add_argument("--seed", type=int, help="replay this one episode, with its trace")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--first", type=int, default=0)
    parser.add_argument("--workers", type=int, default=1, help="processes the episodes are shared among")
    parser.add_argument("--plant", choices=sorted(PLANTS), help="plant a defect the checks must find")
    parser.add_argument("--verbose", action="store_true", help="every machine's log too")
    args = parser.parse_args()
    if args.seed is not None:
        if args.verbose:
            handler = logging.StreamHandler()
            handler.addFilter(_virtual_time)
            handler.setFormatter(logging.Formatter("%(vt)8.3f %(sim_machine)s %(name)s %(levelname)s %(message)s"))
            logging.getLogger().addHandler(handler)
        with planted(args.plant):
            outcome = run(args.seed, log_level=logging.INFO if args.verbose else logging.CRITICAL)
        print("\n".join(outcome.trace))
        print(
            f"seed {args.seed}: {outcome.requests} requests, {outcome.finished} finished, {outcome.store_calls} "
            f"store calls, {outcome.virtual_seconds:.0f} virtual s"
        )
        print("\n".join(outcome.violations) or "no violation")
        return 1 if outcome.violations else 0
    began = time.perf_counter()
    seeds = range(args.first, args.first + args.episodes)
    chunks = [seeds[i :: args.workers] for i in range(args.workers)]
    with ProcessPoolExecutor(args.workers, mp_context=multiprocessing.get_context("fork")) as pool:
        results = [r for chunk in pool.map(_episodes, chunks, [args.plant] * len(chunks)) for r in chunk]
    failed = sorted((seed, first) for seed, _, first in results if first)
    for seed, first in failed:
        print(f"seed {seed}: {first}", flush=True)
    requests = sum(r for _, r, _ in results)
    print(
        f"{args.episodes} episodes ({requests} requests) in {time.perf_counter() - began:.1f} s on {args.workers} "
        f"processes; {len(failed)} failed"
        + (f"; replay one with: python -m tests.sim --seed {failed[0][0]}" if failed else "")
    )
    return 1 if failed else 0


def _episodes(seeds: range, plant: str | None) -> list[tuple[int, int, str]]:
    """(seed, requests, its first violation or "") for each of ``seeds``."""
    found = []
    with planted(plant):
        for seed in seeds:
            outcome = run(seed)
            found.append((seed, outcome.requests, outcome.violations[0] if outcome.violations else ""))
    return found


if __name__ == "__main__":
    sys.exit(main())
