"""Prefill fairness in the MLX scheduler, on the tiny llama model in the MLX venv.

A long prompt (three chunks) and a short one submitted while the long prompt's first chunk is being evaluated:
the short prompt is prefilled and gets its first pick before the long prompt's next chunk (shortest remaining
first), and both greedy texts are their texts alone. The long prompt's first chunk is held until the short one
is in the queue, so the order does not depend on timing.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.mlx.test_mlx_engine import HERE, _mlx

SCRIPT = """
import json, os, sys, threading
from meshgate.backends.mlx.batch import CHUNK, Sequence
from meshgate.backends.mlx.engine import MlxEngine

engine = MlxEngine(sys.argv[1], parallel=2)
tok = engine.tokenizer
eos = set(tok.eos_token_ids)
text = " ".join(f"Line {i}: the gateway streams events back to the client." for i in range(400))
long = list(tok.encode(text))[: 2 * CHUNK + 100]
short = list(tok.encode("Hello world"))
assert len(long) > 2 * CHUNK and len(short) < 16, (len(long), len(short))
batch, scheduler = engine.scheduler.batch, engine.scheduler
admit, log, hold = batch.admit, [], {}

def held(values):
    chunk = len(values) - 2
    log.append((chunk, values[1]))
    if hold and chunk == CHUNK and len(log) == 1:  # the long prompt's first chunk: wait for the short one
        hold["started"].set()
        assert hold["go"].wait(60)
    return admit(values)

batch.admit = held

def picks(seq):
    out = []
    while (pick := seq.next()) is not None and not seq.ended:
        out.append(pick)
    out.append(pick)
    return out

def alone(tokens):
    seq = Sequence(tokens, 12, eos, None, threading.Event())
    scheduler.submit(seq)
    return picks(seq)

alone_long, alone_short = alone(long), alone(short)
log.clear()
hold.update(started=threading.Event(), go=threading.Event())
long_seq = Sequence(long, 12, eos, None, threading.Event())
short_seq = Sequence(short, 12, eos, None, threading.Event())
got = {}
reader = threading.Thread(target=lambda: got.update(long=picks(long_seq)))
reader.start()
scheduler.submit(long_seq)
assert hold["started"].wait(60)
scheduler.submit(short_seq)
hold["go"].set()
got["short"] = picks(short_seq)
reader.join(60)
scheduler.close()
print(json.dumps({"log": log, "alone": [alone_long, alone_short], "together": [got["long"], got["short"]]}))
sys.stdout.flush()
os._exit(0)  # as rank_check.py leaves: the scheduler thread's MLX caches must not be freed at finalization
"""


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("tiny-fairness") / "llama"
    _mlx(str(HERE / "tiny_model.py"), str(path), "llama")
    return path


def test_a_short_prompt_is_prefilled_between_a_long_ones_chunks(tiny: Path) -> None:
    out = json.loads(_mlx("-c", SCRIPT, str(tiny)).stdout.splitlines()[-1])
    last = 1  # ``admit``'s flag after a prompt's last chunk
    sizes = [(chunk, then) for chunk, then in out["log"]]
    # the long prompt's first chunk, then the short prompt whole, then the long prompt's other two chunks
    assert sizes[0] == (512, 0) and sizes[1][1] == last and sizes[1][0] < 16, sizes
    assert sizes[2:] == [(512, 0), (100, last)], sizes
    assert out["together"] == out["alone"]
