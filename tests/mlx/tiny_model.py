"""Build a tiny deterministic mlx-lm model ("llama" or "gemma3") in a directory, with no hub access.

``build(path, family="llama")`` writes ``tokenizer.json`` (a ``tokenizers`` byte-level BPE trained on ``TEXT`` below),
``tokenizer_config.json`` (with a small chat template), ``config.json``, seeded random float32 weights under
mlx-lm's parameter names in ``model.safetensors`` and ``model.safetensors.index.json`` (mlx-lm's pipeline loader
reads the index even for one file). The same call writes byte-identical files on every run, so greedy output is
the same in every process that loads it.

Runs in the MLX venv (``.cache/venvs/mlx``: needs ``tokenizers``, ``numpy``, ``safetensors``; not ``mlx``), as a
script too: ``python tests/mlx/tiny_model.py DIR [FAMILY]``. Four layers split over 2 or 4 pipeline stages.

- ``llama``: four KV heads and even widths keep it shardable over 1, 2 or 4 tensor ranks.
- ``gemma3`` (mlx-lm's ``gemma3_text``): shaped like Gemma 3 270M: four query heads and one KV head (tensor
  ranks replicate it), tied embeddings, sliding-window layers with a global one every ``sliding_window_pattern``
  (layers 0, 1, 3 slide, 2 is global) and a window of 8 tokens, so test prompts outgrow it. Norm weights are
  stored as Gemma does (the layer scales by ``1 + w``); a sharp final norm keeps greedy picks far from ties.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

__all__ = ["CONFIG", "CONFIGS", "GEMMA3_CONFIG", "TEXT", "build"]

TEXT = """\
The gateway speaks three protocols over one internal model. A request comes in, it is decoded, placed and
streamed back as events. Each event is a small frozen struct: text, reasoning, a tool call, usage, finished.
The runner loads the model once and generates for one request at a time; a client that goes away cancels it.
Ranks talk over a ring of sockets. Rank zero is the head: it reads the request, the others follow its lead.
Tensor sharding splits every layer across the ranks; pipeline sharding gives each rank its own slice of layers.
The quick brown fox jumps over the lazy dog. One, two, three, four, five, six, seven, eight, nine, ten.
Hello world! How are you today? I am fine, thank you. What is the capital of France? Paris is the capital.
"""

SPECIALS = ["<s>", "</s>", "<unk>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}<|end|>{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
VOCAB = 384  # the BPE's vocabulary size and the model's (merges fill it up to this)
CONFIG = {
    "model_type": "llama",
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "head_dim": 16,
    "rms_norm_eps": 1e-5,
    "vocab_size": VOCAB,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
GEMMA3_CONFIG = {
    "model_type": "gemma3_text",
    "architectures": ["Gemma3ForCausalLM"],
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 16,
    "query_pre_attn_scalar": 16,
    "rms_norm_eps": 1e-6,
    "vocab_size": VOCAB,
    "rope_theta": 1000000.0,
    "rope_local_base_freq": 10000.0,
    "sliding_window": 8,
    "sliding_window_pattern": 3,
    "layer_types": ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "max_position_embeddings": 512,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "torch_dtype": "float32",
}
CONFIGS = {"llama": CONFIG, "gemma3": GEMMA3_CONFIG}
# families whose greedy decoding never ends by itself: the EOS row of the head is zero, so its logit (0) never beats
# the largest of the other 383 sharp random logits; a fault test can then count on a generation still running
NO_EOS: set[str] = set()
SEED = 1234


def _tokenizer(path: Path) -> int:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB,
        special_tokens=SPECIALS,
        show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([TEXT], trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<s>",
        "eos_token": "</s>",
        "unk_token": "<unk>",
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": CONFIG["max_position_embeddings"],
        "chat_template": CHAT_TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}, indent=1)
    )
    return tok.get_vocab_size()


def _weights(family: str) -> dict:
    import numpy as np

    rng = np.random.default_rng(SEED)
    c = CONFIGS[family]
    h, f, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d

    def w(rows: int, cols: int, scale: float = 1.0) -> np.ndarray:
        return (rng.standard_normal((rows, cols)) * scale / np.sqrt(cols)).astype(np.float32)

    if family == "gemma3":
        return _gemma3_weights(c, w)
    out = {
        "model.embed_tokens.weight": w(v, h, np.sqrt(h)),
        "model.norm.weight": np.ones(h, np.float32),
        "lm_head.weight": w(v, h, 4.0),
    }  # a sharp head keeps greedy picks far from ties
    if family in NO_EOS:
        out["lm_head.weight"][c["eos_token_id"]] = 0.0
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
            p + "input_layernorm.weight": np.ones(h, np.float32),
            p + "post_attention_layernorm.weight": np.ones(h, np.float32),
        }
    return out


def _gemma3_weights(c: dict, w: Any) -> dict:
    """Gemma's layout: q/k norms, four norms per layer, no ``lm_head`` (the embedding doubles as the head)."""
    import numpy as np

    h, f, v, d = c["hidden_size"], c["intermediate_size"], c["vocab_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    # the model scales embeddings by sqrt(h) and norms by 1 + w: a final norm of 1 + 3 sharpens the tied head
    out = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": np.full(h, 3.0, np.float32)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {
            p + "self_attn.q_proj.weight": w(q, h),
            p + "self_attn.k_proj.weight": w(kv, h),
            p + "self_attn.v_proj.weight": w(kv, h),
            p + "self_attn.o_proj.weight": w(h, q),
            p + "self_attn.q_norm.weight": np.zeros(d, np.float32),
            p + "self_attn.k_norm.weight": np.zeros(d, np.float32),
            p + "mlp.gate_proj.weight": w(f, h),
            p + "mlp.up_proj.weight": w(f, h),
            p + "mlp.down_proj.weight": w(h, f),
        }
        for norm in ("input", "pre_feedforward"):
            out[f"{p}{norm}_layernorm.weight"] = np.zeros(h, np.float32)
        for norm in ("post_attention", "post_feedforward"):  # x4: the layers, not the embedding, pick tokens
            out[f"{p}{norm}_layernorm.weight"] = np.full(h, 3.0, np.float32)
    return out


def build(path: str | Path, family: str = "llama") -> Path:
    """Write the tiny model of ``family`` (``llama`` or ``gemma3``) into ``path`` (created if missing)."""
    from safetensors.numpy import save_file

    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    size = _tokenizer(path)
    if size != VOCAB:
        raise RuntimeError(f"the BPE has {size} tokens, the model expects {VOCAB}: lengthen TEXT")
    (path / "config.json").write_text(json.dumps(CONFIGS[family], indent=1))
    weights = _weights(family)
    save_file(weights, str(path / "model.safetensors"), metadata={"format": "mlx"})
    total = sum(a.nbytes for a in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": {k: "model.safetensors" for k in sorted(weights)}}
    (path / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
    return path


if __name__ == "__main__":
    print(build(sys.argv[1] if len(sys.argv) > 1 else "tiny-mlx-llama", *sys.argv[2:3]))
