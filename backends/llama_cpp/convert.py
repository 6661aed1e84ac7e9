"""Turn a GGUF model into a normal Hugging Face checkpoint directory that mlx-lm, transformers and vLLM load.

``convert(gguf_path, out_dir, dtype=..., name=...)`` dequantizes every tensor (F32, F16, Q4_K, Q5_0, Q6_K, Q8_0 and
the other types the ``gguf`` package's numpy dequantizer knows), renames it to the Hugging Face name, undoes
llama.cpp's conversion transforms and writes ``model.safetensors`` (+ ``model.safetensors.index.json``, which
mlx-lm's pipeline loader needs even for one file), ``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (with the chat template) and ``meshgate.json`` (the name meshgate lists it under). It
writes into a hidden temporary directory beside ``out_dir`` and renames it when complete, so a half-written
checkpoint is never listed.

Supported: ``gemma3`` (Gemma 3 text models). llama.cpp's ``convert_hf_to_gguf.py`` (``Gemma3Model``) adds 1 to
every ``*norm.weight`` (Gemma's RMSNorm scales by ``1 + w``) and does not permute Q/K for this architecture (the
permutation lives in its Llama converter only), so only the norm shift is undone here. Layer kinds, the local
(sliding-window) RoPE base and the attention scale follow llama.cpp's own reading of the GGUF
(``src/models/gemma3.cpp``: window pattern 6 unless the GGUF says otherwise, local base 10000, query scale
``head_dim`` except for the 62-layer 27B, which uses ``hidden / heads``).

Imports ``gguf`` and numpy (the ``llama`` extra), ``backends.checkpoints`` and ``backends.llama_cpp.hf_tokenizer``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from meshgate.backends.checkpoints import MESHGATE_FILE, SafetensorsWriter
from meshgate.backends.llama_cpp.hf_tokenizer import GEMMA_CHAT_TEMPLATE, tokenizer_config, tokenizer_json

__all__ = ["CONVERTER_VERSION", "DTYPES", "convert", "default_name"]

CONVERTER_VERSION = 1  # in meshgate.json; bump when the output changes, so cached conversions are redone
DTYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}

_BLOCK = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.weight")
_CHUNK_BYTES = 32 << 20  # dequantize big tensors this many source bytes at a time


def default_name(model: str, dtype: str) -> str:
    """``gemma3:270m`` -> ``gemma3:270m-bf16``; an untagged name gets the dtype as its tag."""
    return f"{model}-{DTYPES[dtype]}" if ":" in model else f"{model}:{DTYPES[dtype]}"


def hf_name(gguf_name: str) -> str:
    """The Hugging Face (Gemma 3 text) name of a GGUF tensor; ``KeyError`` for one it does not know."""
    if m := _BLOCK_NAME.fullmatch(gguf_name):
        return f"model.layers.{m[1]}.{_BLOCK[m[2]]}.weight"
    return f"{_TOP[gguf_name.removesuffix('.weight')]}.weight"


def _f32(value: Any) -> float:
    """A float32 metadata value as the decimal it was written from (9.99999997e-07 -> 1e-06)."""
    return float(str(np.float32(value)))


def _metadata(reader: Any) -> dict[str, Any]:
    """Scalar and string metadata; arrays other than the tokenizer's are left out."""
    meta = {}
    for key, field in reader.fields.items():
        if not field.types or key.startswith("tokenizer.ggml.") and field.types[0].name == "ARRAY":
            continue
        meta[key] = field.contents()
    return meta


def hf_config(meta: dict[str, Any], *, vocab_size: int, tied: bool, dtype: str) -> dict[str, Any]:
    """``config.json`` for a Gemma 3 text model from the GGUF metadata."""
    arch = meta.get("general.architecture")
    if arch != "gemma3":
        raise ValueError(f"converting architecture {arch!r} is not supported (only gemma3)")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"{arch}.{key}", default)

    layers, hidden, heads = int(get("block_count")), int(get("embedding_length")), int(get("attention.head_count"))
    head_dim = int(get("attention.key_length", hidden // heads))
    window = get("attention.sliding_window")
    pattern = get("attention.sliding_window_pattern", 6)
    if not window:
        layer_types, pattern = ["full_attention"] * layers, 1
    elif isinstance(pattern, list):  # per-layer flags: true = sliding
        layer_types = ["sliding_attention" if flag else "full_attention" for flag in pattern]
    else:
        layer_types = ["sliding_attention" if i % pattern < pattern - 1 else "full_attention" for i in range(layers)]
    softcap = get("final_logit_softcapping")
    return {
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "vocab_size": vocab_size,
        "hidden_size": hidden,
        "intermediate_size": int(get("feed_forward_length")),
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": int(get("attention.head_count_kv", heads)),
        "head_dim": head_dim,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": int(get("context_length")),
        "rms_norm_eps": _f32(get("attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": _f32(get("rope.freq_base", 1_000_000.0)),
        "rope_local_base_freq": _f32(get("rope.freq_base_swa", 10_000.0)),
        "rope_scaling": None,
        "sliding_window": int(window) if window else None,
        "sliding_window_pattern": pattern if isinstance(pattern, int) else 0,
        "layer_types": layer_types,
        "query_pre_attn_scalar": hidden // heads if layers == 62 else head_dim,
        "final_logit_softcapping": _f32(softcap) if softcap else None,
        "attn_logit_softcapping": None,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_bidirectional_attention": False,
        "initializer_range": 0.02,
        "tie_word_embeddings": tied,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "use_cache": True,
        "torch_dtype": dtype,
        "dtype": dtype,
    }


def _dequantized(tensor: Any, shift: float):
    """The tensor as float32 in row blocks (Hugging Face shape order), minus ``shift``."""
    from gguf.quants import dequantize

    data = tensor.data
    shape = tuple(int(n) for n in reversed(tensor.shape))
    if data.ndim < 2:
        yield dequantize(data, tensor.tensor_type).reshape(shape) - np.float32(shift)
        return
    rows = max(1, _CHUNK_BYTES // max(1, data[0].nbytes))
    for start in range(0, data.shape[0], rows):
        block = dequantize(np.ascontiguousarray(data[start : start + rows]), tensor.tensor_type)
        yield (block - np.float32(shift)) if shift else block


def _special_ids(tokens: list[str], eos_id: int | None) -> list[int]:
    """EOS plus Gemma's end-of-turn token: the tokens llama.cpp also treats as end of generation."""
    ids = [eos_id] if eos_id is not None else []
    if "<end_of_turn>" in tokens:
        ids.append(tokens.index("<end_of_turn>"))
    return ids


Progress = Callable[[str], None]
"""Told each step of a conversion in words (``meshgate convert`` prints them to stderr)."""


def convert(
    gguf_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    dtype: str = "bfloat16",
    name: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write the Hugging Face checkpoint of ``gguf_path`` to ``out_dir`` (replacing one there); returns it.

    ``progress`` is told each step: reading the GGUF, each tensor as it is written (``[3/236] name shape``), the
    tokenizer and config files, the rename into place.
    """
    from gguf import GGUFReader

    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}")
    say = progress or (lambda _: None)
    out = Path(out_dir)
    say(f"reading {gguf_path}")
    reader = GGUFReader(str(gguf_path))
    meta = _metadata(reader)
    fields = reader.fields
    tokens = [str(t) for t in fields["tokenizer.ggml.tokens"].contents()]
    tensors = {t.name: t for t in reader.tensors}
    tied = "output.weight" not in tensors
    config = hf_config(meta, vocab_size=len(tokens), tied=tied, dtype=dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    partial = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir()
    try:
        writer = SafetensorsWriter(dtype)
        plan = []
        for gname, tensor in tensors.items():
            hname = hf_name(gname)
            shape = tuple(int(n) for n in reversed(tensor.shape))
            writer.add(hname, shape)
            plan.append((hname, tensor, 1.0 if gname.endswith("norm.weight") else 0.0))
        say(f"writing {len(plan)} tensors as {dtype} to {partial / 'model.safetensors'}")
        with open(partial / "model.safetensors", "wb") as f:
            writer.write_header(f, {"format": "pt"})
            for i, (hname, tensor, shift) in enumerate(sorted(plan, key=lambda item: item[0]), 1):
                dims = "x".join(str(int(n)) for n in reversed(tensor.shape))
                say(f"[{i}/{len(plan)}] {hname} {dims} {tensor.tensor_type.name}")
                for block in _dequantized(tensor, shift):
                    writer.write(f, hname, block)
            writer.finish(f)
        _dump(
            partial / "model.safetensors.index.json",
            {
                "metadata": {"total_size": writer.total_bytes},
                "weight_map": {hname: "model.safetensors" for hname, _, _ in sorted(plan)},
            },
        )
        say("writing config.json, generation_config.json, tokenizer.json, tokenizer_config.json")
        _dump(partial / "config.json", config)
        eos = config["eos_token_id"]
        _dump(
            partial / "generation_config.json",
            {
                "bos_token_id": config["bos_token_id"],
                "eos_token_id": _special_ids(tokens, eos),
                "pad_token_id": config["pad_token_id"],
                "do_sample": False,
            },
        )
        scores = [float(s) for s in fields["tokenizer.ggml.scores"].contents()]
        types = [int(t) for t in fields["tokenizer.ggml.token_type"].contents()]
        bos_id, unk_id = meta.get("tokenizer.ggml.bos_token_id"), meta.get("tokenizer.ggml.unknown_token_id")
        _dump(
            partial / "tokenizer.json",
            tokenizer_json(
                tokens,
                scores,
                types,
                bos_id=bos_id,
                unk_id=unk_id,
                add_bos=bool(meta.get("tokenizer.ggml.add_bos_token", True)),
            ),
            indent=None,
        )
        _dump(
            partial / "tokenizer_config.json",
            tokenizer_config(
                tokens, meta, context=config["max_position_embeddings"], chat_template=GEMMA_CHAT_TEMPLATE
            ),
        )  # what the llama.cpp runner renders
        _dump(
            partial / MESHGATE_FILE,
            {
                "name": name or out.name,
                "source": str(Path(gguf_path).resolve()),
                "dtype": dtype,
                "parameter_size": str(meta.get("general.size_label", "")),
                "converted_at": time.time(),
                "converter": CONVERTER_VERSION,
            },
        )
        if out.exists():
            shutil.rmtree(out)
        partial.rename(out)
        say(f"wrote {out}")
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    return out


def _dump(path: Path, document: Any, indent: int | None = 2) -> None:
    path.write_text(json.dumps(document, indent=indent, ensure_ascii=False) + "\n", encoding="utf-8")
