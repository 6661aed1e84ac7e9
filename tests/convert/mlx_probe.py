"""Run under the MLX venv: load a converted checkpoint with mlx-lm and report, as one JSON line on stdout,
greedy tokens for plain-completion prompts, token ids for texts, and the chat template's rendering.

    python mlx_probe.py CHECKPOINT REQUEST_JSON

REQUEST_JSON: {"prompts": [...], "max_tokens": N, "texts": [...], "chats": [[message, ...], ...]}
"""

from __future__ import annotations

import json
import sys

import mlx.core as mx
from mlx_lm import load
from mlx_lm.generate import generate_step


def main() -> None:
    path, request = sys.argv[1], json.loads(sys.argv[2])
    model, tokenizer = load(path)
    greedy = []
    for prompt in request.get("prompts", []):
        ids = tokenizer.encode(prompt)  # adds BOS, as the llama.cpp runner does for raw prompts
        out = []
        for token, _ in generate_step(
            mx.array(ids), model, max_tokens=request["max_tokens"], sampler=lambda logits: mx.argmax(logits, axis=-1)
        ):
            out.append(int(token))
        greedy.append({"prompt_ids": ids, "tokens": out})
    hf = tokenizer._tokenizer
    texts = [hf.encode(t, add_special_tokens=False) for t in request.get("texts", [])]
    chats = []
    for messages in request.get("chats", []):
        text = hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        ids = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        chats.append({"text": text, "ids": list(ids)})
    print(json.dumps({"greedy": greedy, "texts": texts, "chats": chats, "eos": sorted(tokenizer.eos_token_ids)}))


if __name__ == "__main__":
    main()
