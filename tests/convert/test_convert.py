"""The GGUF -> Hugging Face converter on the real Gemma 3 270M: config, tensors, undone transforms, the CLI, the
checkpoint source, and the decisive check: mlx-lm on the converted checkpoint generates what llama.cpp generates
from the GGUF.

The converted checkpoint is the session fixture ``converted_gemma`` (tests/conftest.py), made once and reused.
mlx-lm runs in the MLX venv (``tests/mlx/test_mlx_engine.py``'s ``mlx_python``); llama.cpp in this process.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from meshgate.backends.checkpoints import CheckpointSource, is_checkpoint, read_safetensors_header, spec_from_checkpoint
from meshgate.backends.llama_cpp.convert import default_name
from meshgate.backends.llama_cpp.prompt import render_gemma
from meshgate.protocols.model import Message, Request, TextPart

ROOT = Path(__file__).resolve().parents[2]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "HF_HUB_OFFLINE": "1"}
PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time, in a small village,"]
MAX_TOKENS = 16
MUST_MATCH = 4  # quantized (llama.cpp) vs dequantized bf16 (MLX) math: the first tokens must agree exactly,
NEAR_TIE = 0.1  # and any later difference be a near-tie in llama.cpp's own logits (its batch and incremental
# paths already disagree on 'Once upon a time...' at token 6: ' Mr' 17.925 vs ' John' 17.904)
TEXTS = [
    "Hello world",
    "  two  spaces\n\nnewlines\t tab",
    "héllo 日本語 🙂 naïve café",
    "<start_of_turn>user\nHi",
    "x = [i ** 2 for i in range(10)]  # squares",
    "https://example.com/a?b=c&d=e",
    "1234567890 3.14159",
]
CHAT = (
    ("system", "You answer in one word."),
    ("user", "What color is the sky?"),
    ("assistant", "Blue."),
    ("user", "And grass?"),
)


def _bf16(raw: bytes, shape: list[int]) -> np.ndarray:
    return (np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16).view(np.float32).reshape(shape)


def _tensor(ckpt: Path, name: str, rows: list[int] | None = None) -> np.ndarray:
    """A BF16 tensor of the checkpoint as float32; with ``rows``, only those rows are read (the 335 MB embedding
    need not be read whole to compare two rows)."""
    file = ckpt / "model.safetensors"
    with open(file, "rb") as f:
        length = int.from_bytes(f.read(8), "little")
        info = json.loads(f.read(length))[name]
        start, end = info["data_offsets"]
        assert info["dtype"] == "BF16"
        if rows is None:
            f.seek(8 + length + start)
            return _bf16(f.read(end - start), info["shape"])
        row_shape = info["shape"][1:]
        row_bytes = 2 * int(np.prod(row_shape))
        out = []
        for row in rows:
            assert 0 <= row < info["shape"][0]
            f.seek(8 + length + start + row * row_bytes)
            out.append(_bf16(f.read(row_bytes), row_shape))
        return np.stack(out)


@dataclass(frozen=True)
class GGUFTensor:
    tensor_type: Any  # gguf.GGMLQuantizationType
    data: np.ndarray  # as gguf.GGUFReader gives it: values for float types, raw blocks (uint8) for quantized ones


def read_gguf_tensors(path: Path) -> dict[str, GGUFTensor]:
    """The GGUF's tensors, memory-mapped straight from the file (format: ggml's docs/gguf.md).

    ``gguf.GGUFReader`` gives the same arrays but first turns every metadata value into numpy objects, the 262,144
    token strings included: ~25 s on the test machine, where this takes well under one.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    floats = {GGMLQuantizationType.F32: np.float32, GGMLQuantizationType.F16: np.float16}
    scalar_bytes = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}  # GGUF value types

    with open(path, "rb") as f:

        def u32() -> int:
            return struct.unpack("<I", f.read(4))[0]

        def u64() -> int:
            return struct.unpack("<Q", f.read(8))[0]

        def skip(kind: int) -> None:
            if kind == 8:  # string
                f.seek(u64(), 1)
            elif kind == 9:  # array
                item, count = u32(), u64()
                if item in scalar_bytes:
                    f.seek(scalar_bytes[item] * count, 1)
                else:
                    for _ in range(count):
                        skip(item)
            else:
                f.seek(scalar_bytes[kind], 1)

        assert f.read(4) == b"GGUF" and u32() >= 2
        n_tensors, n_values = u64(), u64()
        alignment = 32
        for _ in range(n_values):
            key, kind = f.read(u64()), u32()
            if key == b"general.alignment":
                assert kind == 4
                alignment = u32()
            else:
                skip(kind)
        infos = []
        for _ in range(n_tensors):
            name = f.read(u64()).decode()
            dims = [u64() for _ in range(u32())]
            infos.append((name, dims, GGMLQuantizationType(u32()), u64()))
        data_start = -(-f.tell() // alignment) * alignment
    raw = np.memmap(path, dtype=np.uint8, mode="r")
    tensors = {}
    for name, dims, kind, offset in infos:
        shape = tuple(reversed(dims))  # GGUF lists the fastest-varying dimension first
        block, block_bytes = GGML_QUANT_SIZES[kind]
        size = int(np.prod(shape)) // block * block_bytes
        data = raw[data_start + offset : data_start + offset + size]
        if kind in floats:
            data = data.view(floats[kind]).reshape(shape)
        else:
            data = data.reshape(*shape[:-1], shape[-1] // block * block_bytes)
        tensors[name] = GGUFTensor(kind, data)
    return tensors


@pytest.fixture(scope="module")
def gguf_tensors(packaged_gguf: Path) -> dict[str, GGUFTensor]:
    return read_gguf_tensors(packaged_gguf)


def test_config_comes_from_the_gguf(converted_gemma: Path) -> None:
    config = json.loads((converted_gemma / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForCausalLM"] and config["model_type"] == "gemma3_text"
    assert (config["num_hidden_layers"], config["hidden_size"], config["intermediate_size"]) == (18, 640, 2048)
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["head_dim"]) == (4, 1, 256)
    assert (config["rope_theta"], config["rope_local_base_freq"]) == (1_000_000.0, 10_000.0)
    assert (config["sliding_window"], config["sliding_window_pattern"]) == (512, 6)
    assert [i for i, t in enumerate(config["layer_types"]) if t == "full_attention"] == [5, 11, 17]
    assert config["rms_norm_eps"] == 1e-6 and config["query_pre_attn_scalar"] == 256
    assert (config["vocab_size"], config["max_position_embeddings"]) == (262_144, 32_768)
    assert config["tie_word_embeddings"] is True
    assert (config["bos_token_id"], config["eos_token_id"], config["pad_token_id"]) == (2, 1, 0)
    assert config["torch_dtype"] == "bfloat16"
    generation = json.loads((converted_gemma / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [1, 106]  # <eos> and <end_of_turn>, llama.cpp's end-of-generation set


def test_tensor_names_and_shapes(converted_gemma: Path) -> None:
    header = read_safetensors_header(converted_gemma / "model.safetensors")
    header.pop("__metadata__")
    per_layer = {
        "self_attn.q_proj": [1024, 640],
        "self_attn.k_proj": [256, 640],
        "self_attn.v_proj": [256, 640],
        "self_attn.o_proj": [640, 1024],
        "self_attn.q_norm": [256],
        "self_attn.k_norm": [256],
        "input_layernorm": [640],
        "post_attention_layernorm": [640],
        "pre_feedforward_layernorm": [640],
        "post_feedforward_layernorm": [640],
        "mlp.gate_proj": [2048, 640],
        "mlp.up_proj": [2048, 640],
        "mlp.down_proj": [640, 2048],
    }
    expected = {"model.embed_tokens.weight": [262_144, 640], "model.norm.weight": [640]}
    expected |= {f"model.layers.{i}.{k}.weight": v for i in range(18) for k, v in per_layer.items()}
    assert {k: v["shape"] for k, v in header.items()} == expected
    assert {v["dtype"] for v in header.values()} == {"BF16"}
    index = json.loads((converted_gemma / "model.safetensors.index.json").read_text())
    assert index["weight_map"] == dict.fromkeys(expected, "model.safetensors")


def test_norms_are_undone_and_weights_dequantized(converted_gemma: Path, gguf_tensors) -> None:
    from gguf.quants import dequantize

    tensors = gguf_tensors
    assert len(tensors) == 236 and {t.tensor_type.name for t in tensors.values()} >= {"F32", "Q5_0"}
    for gguf_name, hf_name in (
        ("blk.3.attn_norm.weight", "model.layers.3.input_layernorm.weight"),
        ("blk.7.attn_q_norm.weight", "model.layers.7.self_attn.q_norm.weight"),
        ("blk.17.post_ffw_norm.weight", "model.layers.17.post_feedforward_layernorm.weight"),
        ("output_norm.weight", "model.norm.weight"),
    ):
        gguf_value = np.asarray(tensors[gguf_name].data, dtype=np.float32)
        np.testing.assert_allclose(_tensor(converted_gemma, hf_name), gguf_value - 1, rtol=2**-8, atol=1e-6)
    embedding = tensors["token_embd.weight"]
    rows = dequantize(np.asarray(embedding.data[[9259, 100_000]]), embedding.tensor_type)
    converted = _tensor(converted_gemma, "model.embed_tokens.weight", rows=[9259, 100_000])
    np.testing.assert_allclose(converted, rows, rtol=2**-8, atol=1e-6)
    q = tensors["blk.0.attn_q.weight"]  # Q5_0, not permuted for gemma3
    np.testing.assert_allclose(
        _tensor(converted_gemma, "model.layers.0.self_attn.q_proj.weight"),
        dequantize(np.asarray(q.data), q.tensor_type),
        rtol=2**-8,
        atol=1e-6,
    )


def test_default_names() -> None:
    assert default_name("gemma3:270m", "bfloat16") == "gemma3:270m-bf16"
    assert default_name("gemma3:270m", "float32") == "gemma3:270m-f32"
    assert default_name("mymodel", "float16") == "mymodel:f16"


@pytest.fixture(scope="module")
def cli_checkpoint(tmp_path_factory: pytest.TempPathFactory, data_dir: Path, packaged_gguf: Path) -> Path:
    out = tmp_path_factory.mktemp("convert-cli") / "hf" / "gemma3-270m-bf16"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshgate.gateway.cli",
            "convert",
            "gemma3:270m",
            "--out",
            str(out),
            "--data-dir",
            str(data_dir),
        ],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    print(
        f"meshgate convert took {time.monotonic() - started:.1f}s; "
        f"{(out / 'model.safetensors').stat().st_size / 2**20:.0f} MiB of weights"
    )
    assert done.stdout.splitlines() == [str(out), "gemma3:270m-bf16"]
    steps = done.stderr.splitlines()  # progress for a person: each step, each tensor numbered
    assert steps[0].startswith("reading ") and any(s.startswith("[1/") for s in steps), done.stderr[-2000:]
    assert any(s.startswith("wrote ") for s in steps)
    return out


def test_cli_writes_a_complete_checkpoint(cli_checkpoint: Path) -> None:
    assert is_checkpoint(cli_checkpoint)
    assert not [p for p in cli_checkpoint.parent.iterdir() if p.name.startswith(".")]  # no partial left behind
    names = {p.name for p in cli_checkpoint.iterdir()}
    assert names >= {
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "meshgate.json",
    }
    assert json.loads((cli_checkpoint / "meshgate.json").read_text())["name"] == "gemma3:270m-bf16"


def test_cli_rejects_an_unknown_model(data_dir: Path, tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "meshgate.gateway.cli",
            "convert",
            "no-such:model",
            "--out",
            str(tmp_path / "x"),
            "--data-dir",
            str(data_dir),
        ],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 1 and "unknown model" in done.stderr and not (tmp_path / "x").exists()


def test_source_and_spec_describe_the_checkpoint(cli_checkpoint: Path) -> None:
    [card] = CheckpointSource(cli_checkpoint.parent).models()
    assert (card.name, card.format, card.family, card.quantization) == (
        "gemma3:270m-bf16",
        "safetensors",
        "gemma3_text",
        "BF16",
    )
    assert card.context_length == 32_768 and card.parameter_size == "270M" and len(card.digest) == 64
    assert card.size == (cli_checkpoint / "model.safetensors").stat().st_size
    spec = spec_from_checkpoint(card.name, card.path)
    assert (spec.n_layers, spec.hidden_size, spec.n_heads, spec.n_kv_heads, spec.head_dim) == (18, 640, 4, 1, 256)
    assert spec.embedding_bytes == 262_144 * 640 * 2 and spec.tied_output and spec.output_bytes == 0
    per_layer = 2 * (1024 * 640 * 2 + 256 * 640 * 2 + 3 * 2048 * 640 + 256 * 2 + 640 * 4)
    assert spec.layer_bytes == per_layer and spec.context_length == 32_768


def test_meshgate_models_lists_a_configured_checkpoint_dir(cli_checkpoint: Path, data_dir: Path) -> None:
    env = {**ENV, "MESHGATE_MODELS": str(cli_checkpoint)}
    done = subprocess.run(
        [sys.executable, "-m", "meshgate.gateway.cli", "models", "--data-dir", str(data_dir)],
        env=env,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    line = next(line for line in done.stdout.splitlines() if line.startswith("gemma3:270m-bf16"))
    assert "gemma3_text" in line and str(cli_checkpoint) in line
    assert "failed" not in done.stderr  # the GGUF path source leaves the directory alone


# ------------------------------------------------------------------------------------------- against llama.cpp


def _chat_request() -> Request:
    return Request(model="m", messages=tuple(Message(role=r, parts=(TextPart(text=t),)) for r, t in CHAT))


@pytest.fixture(scope="module")
def mlx_answers(converted_gemma: Path) -> dict:
    sys.path.insert(0, str(ROOT))
    from tests.mlx.test_mlx_engine import mlx_python

    request = {
        "prompts": PROMPTS,
        "max_tokens": MAX_TOKENS,
        "texts": TEXTS,
        "chats": [[{"role": r, "content": t} for r, t in CHAT]],
    }
    done = subprocess.run(
        [str(mlx_python()), str(Path(__file__).parent / "mlx_probe.py"), str(converted_gemma), json.dumps(request)],
        env=ENV,
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.splitlines()[-1])


@pytest.fixture(scope="module")
def llama(packaged_gguf: Path):
    from llama_cpp import Llama

    llm = Llama(str(packaged_gguf), n_ctx=512, n_threads=2, logits_all=True, verbose=False)
    yield llm
    llm.close()


def _llama_greedy(llm, prompt: str) -> tuple[list[int], list[int]]:
    ids = llm.tokenize(prompt.encode(), add_bos=True, special=False)  # as the runner does for a raw prompt
    out: list[int] = []
    for token in llm.generate(ids, temp=0.0, top_k=1, reset=True):
        out.append(token)
        if len(out) == MAX_TOKENS:
            break
    return ids, out


def test_mlx_generates_what_llama_cpp_generates(mlx_answers: dict, llama) -> None:
    """Greedy tokens agree for the first MUST_MATCH tokens; where they part later, it is at a near-tie: along
    MLX's whole sequence, every MLX token is within NEAR_TIE logits of llama.cpp's best (teacher-forced)."""
    matched = []
    for prompt, mlx in zip(PROMPTS, mlx_answers["greedy"], strict=True):
        ids, expected = _llama_greedy(llama, prompt)
        assert mlx["prompt_ids"] == ids
        same = next((i for i, (a, b) in enumerate(zip(mlx["tokens"], expected, strict=False)) if a != b), MAX_TOKENS)
        matched.append(same)
        llama.reset()
        llama.eval(ids + mlx["tokens"][:-1])
        gaps = [
            float(np.max(llama.scores[len(ids) - 1 + i]) - llama.scores[len(ids) - 1 + i][token])
            for i, token in enumerate(mlx["tokens"])
        ]
        print(
            f"{prompt!r}: {same}/{MAX_TOKENS} greedy tokens equal, largest logit gap along MLX's path "
            f"{max(gaps):.3f}; llama.cpp {llama.detokenize(expected).decode(errors='replace')!r}, "
            f"MLX {llama.detokenize(mlx['tokens']).decode(errors='replace')!r}"
        )
        assert same >= MUST_MATCH, (prompt, mlx["tokens"], expected)
        assert max(gaps) < NEAR_TIE, (prompt, gaps)
    print(f"greedy tokens equal: {matched} of {MAX_TOKENS}")


def test_tokenizer_matches_llama_cpp(mlx_answers: dict, llama) -> None:
    for text, ids in zip(TEXTS, mlx_answers["texts"], strict=True):
        assert ids == llama.tokenize(text.encode(), add_bos=False, special=True), text


def test_chat_template_renders_what_the_runner_renders(mlx_answers: dict, llama) -> None:
    [chat] = mlx_answers["chats"]
    prompt = render_gemma(_chat_request())
    assert chat["text"] == "<bos>" + prompt
    assert chat["ids"] == llama.tokenize(prompt.encode(), add_bos=True, special=True)
    assert mlx_answers["eos"] == [1, 106]
