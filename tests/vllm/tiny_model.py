"""The tiny deterministic llama of ``tests/mlx/tiny_model.py``, shaped for vLLM's CPU attention.

vLLM's CPU attention kernels take head sizes of 32 and up (16 fails at the first forward), so this registers a
``vllm_llama`` family there: the same tokenizer, text and seed, four heads of 32 (four KV heads, so it splits over 1,
2 or 4 tensor ranks; four layers, so 2 pipeline stages), float32 weights under HF names.

Runs as a script under the vLLM venv (it has ``tokenizers``, ``numpy`` and ``safetensors``; the main venv does
not): ``python tests/vllm/tiny_model.py DIR``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "mlx"))

import tiny_model  # noqa: E402  (tests/mlx/tiny_model.py)

FAMILY = "vllm_llama"
# a long context, so a fault test can keep a generation running long after vLLM notices a dead worker
tiny_model.CONFIGS[FAMILY] = {**tiny_model.CONFIG, "head_dim": 32, "max_position_embeddings": 4096}
# and no end of its own: a greedy generation runs to max_tokens, so a stream is surely running when a worker dies
tiny_model.NO_EOS.add(FAMILY)


def build(path: str | Path) -> Path:
    return tiny_model.build(path, FAMILY)


if __name__ == "__main__":
    print(build(sys.argv[1]))
