"""Hugging Face checkpoint directories (``config.json`` + safetensors) as models meshgate lists and places.

``CheckpointSource`` lists the checkpoints under ``<data_dir>/models/hf/`` (what ``meshgate convert`` writes) and
any configured model path that is a directory holding ``config.json``, as ``ModelCard``s with
``format="safetensors"``. The name comes from the ``meshgate.json`` the converter writes beside the weights (else
the directory's name). ``spec_from_checkpoint`` reads ``config.json`` and the safetensors headers (never the
weights) into the planner's ``ModelSpec``; ``describe_checkpoint`` reads them (and ``tokenizer_config.json``'s chat
template) into what ``/api/show`` shows, for every backend that serves checkpoints (MLX, vLLM); ``read_checkpoint``
is the user-model registry's reader for them. ``SafetensorsWriter`` streams a safetensors file tensor by tensor
(bfloat16 from float32 by rounding to nearest even, so no ``ml_dtypes`` or torch is needed).

Safetensors format: an 8-byte little-endian header length, a JSON header naming each tensor's dtype, shape and
byte range, then the raw little-endian data (https://github.com/huggingface/safetensors).

Imports numpy (only to write), ``backends.base`` and ``backends.placement``.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from collections.abc import Iterable, Sequence
from math import prod
from pathlib import Path
from typing import Any, BinaryIO

from meshgate.backends.base import ModelCard, ModelDescription, basic_model_info
from meshgate.backends.placement import ModelSpec

__all__ = [
    "MESHGATE_FILE",
    "CheckpointSource",
    "SafetensorsWriter",
    "card_from_checkpoint",
    "checkpoint_itemsize",
    "describe_checkpoint",
    "is_checkpoint",
    "read_checkpoint",
    "read_safetensors_header",
    "spec_from_checkpoint",
]

MESHGATE_FILE = "meshgate.json"
_ITEM_BYTES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1}
_CODES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32"}


def is_checkpoint(path: str | os.PathLike) -> bool:
    """A directory with ``config.json`` and at least one ``.safetensors`` file."""
    p = Path(path)
    return p.is_dir() and (p / "config.json").is_file() and any(p.glob("*.safetensors"))


def read_safetensors_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file (tensor name -> dtype, shape, data_offsets; plus ``__metadata__``)."""
    with open(path, "rb") as f:
        (length,) = struct.unpack("<Q", f.read(8))
        return json.loads(f.read(length))


def _tensors(path: Path) -> dict[str, dict[str, Any]]:
    tensors: dict[str, dict[str, Any]] = {}
    for file in sorted(path.glob("*.safetensors")):
        header = read_safetensors_header(file)
        header.pop("__metadata__", None)
        tensors.update(header)
    return tensors


def _nbytes(info: dict[str, Any]) -> int:
    start, end = info["data_offsets"]
    return end - start


def _meta(path: Path) -> dict[str, Any]:
    file = path / MESHGATE_FILE
    return json.loads(file.read_text()) if file.is_file() else {}


def checkpoint_itemsize(path: str | os.PathLike) -> int:
    """Bytes per weight element of the checkpoint at ``path``, from its ``config.json`` dtype."""
    config = json.loads((Path(path) / "config.json").read_text())
    config = config.get("text_config", config)
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return {"float32": 4, "float64": 8}.get(dtype, 2)


def spec_from_checkpoint(name: str, path: str | os.PathLike) -> ModelSpec:
    """The planner's view of the checkpoint at ``path``, from ``config.json`` and the safetensors headers."""
    p = Path(path)
    config = json.loads((p / "config.json").read_text())
    config = config.get("text_config", config)
    tensors = _tensors(p)
    n_layers = int(config["num_hidden_layers"])
    layer_total = sum(_nbytes(t) for k, t in tensors.items() if ".layers." in k)
    embedding = next((t for k, t in tensors.items() if k.endswith("embed_tokens.weight")), None)
    output = tensors.get("lm_head.weight")
    heads = int(config["num_attention_heads"])
    dtype = str(config.get("torch_dtype") or config.get("dtype") or "bfloat16")
    return ModelSpec(
        name=name,
        n_layers=n_layers,
        hidden_size=int(config["hidden_size"]),
        n_heads=heads,
        n_kv_heads=int(config.get("num_key_value_heads", heads)),
        head_dim=int(config.get("head_dim") or config["hidden_size"] // heads),
        context_length=int(config.get("max_position_embeddings", 0)),
        layer_bytes=-(-layer_total // n_layers),
        embedding_bytes=_nbytes(embedding) if embedding else 0,
        output_bytes=_nbytes(output) if output else 0,
        tied_output=output is None,
        kv_bytes_per_element=4 if dtype == "float32" else 2,
    )


def card_from_checkpoint(path: str | os.PathLike, *, name: str | None = None, source: str = "") -> ModelCard:
    """Describe the checkpoint at ``path`` (cheap: reads JSON and headers, hashes config + index only)."""
    p = Path(path)
    config_bytes = (p / "config.json").read_bytes()
    config = json.loads(config_bytes)
    text = config.get("text_config", config)
    meta = _meta(p)
    weights = sorted(p.glob("*.safetensors"))
    index = p / "model.safetensors.index.json"
    digest = hashlib.sha256(config_bytes + (index.read_bytes() if index.is_file() else b""))
    dtype = str(meta.get("dtype") or text.get("torch_dtype") or text.get("dtype") or "")
    return ModelCard(
        name=name or str(meta.get("name") or p.name),
        path=str(p),
        format="safetensors",
        family=str(text.get("model_type", "")),
        parameter_size=str(meta.get("parameter_size", "")),
        quantization=_CODES.get(dtype, dtype.upper()),
        size=sum(w.stat().st_size for w in weights),
        digest=digest.hexdigest(),
        created=(p / "config.json").stat().st_mtime,
        context_length=int(text.get("max_position_embeddings", 0)),
        source=source,
    )


def read_checkpoint(path: str) -> ModelCard | None:
    """The card of the checkpoint directory at ``path``, or ``None`` when it is none (a ``RegistrySource`` reader)."""
    return card_from_checkpoint(path) if is_checkpoint(path) else None


# config.json (its ``text_config`` for multimodal models) -> the GGUF key under the architecture, as Ollama's
# ``model_info`` names them (llama.cpp's convert_hf_to_gguf.py maps them the same way).
_MODEL_INFO_KEYS = (
    ("hidden_size", "embedding_length"),
    ("num_hidden_layers", "block_count"),
    ("intermediate_size", "feed_forward_length"),
    ("num_attention_heads", "attention.head_count"),
    ("num_key_value_heads", "attention.head_count_kv"),
    ("head_dim", "attention.key_length"),
    ("head_dim", "attention.value_length"),
    ("rms_norm_eps", "attention.layer_norm_rms_epsilon"),
    ("sliding_window", "attention.sliding_window"),
    ("rope_theta", "rope.freq_base"),
    ("vocab_size", "vocab_size"),
)


def _chat_template(path: Path) -> str:
    """The checkpoint's own chat template: ``chat_template.jinja``, else ``tokenizer_config.json``'s (the default
    one of a named list); empty when it has none."""
    jinja = path / "chat_template.jinja"
    if jinja.is_file():
        return jinja.read_text()
    config_file = path / "tokenizer_config.json"
    template = json.loads(config_file.read_text()).get("chat_template") if config_file.is_file() else None
    if isinstance(template, list):  # [{"name": "default", "template": ...}, {"name": "tool_use", ...}]
        template = next((t.get("template") for t in template if t.get("name") == "default"), None)
    return template if isinstance(template, str) else ""


def describe_checkpoint(card: ModelCard, context: int) -> ModelDescription:
    """What ``/api/show`` shows of the checkpoint ``card`` names (``Backend.describe`` for MLX and vLLM).

    ``model_info``: ``config.json`` under GGUF's key names (``general.architecture`` is its ``model_type``, the
    card's family; ``general.parameter_count`` is counted from the safetensors headers), with ``context`` (the
    context a runner gets; 0: the model's own) as ``<arch>.context_length``. ``template``: the checkpoint's own
    chat template (Jinja, as the runtimes apply it). A checkpoint that has gone or changed gives the card's basics.
    """
    p = Path(card.path)
    try:
        config = json.loads((p / "config.json").read_text())
        template = _chat_template(p)
        parameters = sum(prod(t["shape"]) for t in _tensors(p).values())
    except (OSError, ValueError, KeyError, TypeError):
        return ModelDescription(model_info=basic_model_info(card, context))
    text = config.get("text_config", config)
    arch = str(text.get("model_type") or card.family)
    info: dict[str, Any] = {"general.architecture": arch, "general.parameter_count": parameters}
    if card.parameter_size:
        info["general.size_label"] = card.parameter_size
    for key, name in _MODEL_INFO_KEYS:
        value = text.get(key)
        if isinstance(value, (int, float, str)) and not isinstance(value, bool):
            info[f"{arch}.{name}"] = value
    info[f"{arch}.context_length"] = context or int(text.get("max_position_embeddings", 0))
    return ModelDescription(model_info=info, template=template)


class CheckpointSource:
    """HF checkpoint directories: those under ``hf_dir`` and the configured ``(name, path)`` directories."""

    name = "checkpoints"

    def __init__(self, hf_dir: Path, entries: Sequence[tuple[str, str]] = ()) -> None:
        self.hf_dir = hf_dir
        self.entries = entries

    def models(self) -> Sequence[ModelCard]:
        cards = []
        if self.hf_dir.is_dir():
            for child in sorted(self.hf_dir.iterdir()):
                if not child.name.startswith(".") and is_checkpoint(child):  # ".x.partial-N": being written
                    cards.append(card_from_checkpoint(child, source=self.name))
        for name, path in self.entries:
            if is_checkpoint(path):
                explicit = name if name != Path(path).stem else None  # a bare path: meshgate.json names it
                cards.append(card_from_checkpoint(path, name=explicit, source=self.name))
        return cards


class SafetensorsWriter:
    """Streams one safetensors file: ``add`` every tensor, ``write_header``, ``write`` blocks in name order, ``finish``.

    Blocks are float32 arrays (any shape, rows of the tensor in order); they are cast to the writer's dtype.
    """

    def __init__(self, dtype: str) -> None:
        self.code = _CODES[dtype]
        self.item = _ITEM_BYTES[self.code]
        self.shapes: dict[str, tuple[int, ...]] = {}
        self.written: dict[str, int] = {}
        self.total_bytes = 0

    def add(self, name: str, shape: Iterable[int]) -> None:
        self.shapes[name] = tuple(shape)

    def write_header(self, f: BinaryIO, metadata: dict[str, str] | None = None) -> None:
        header: dict[str, Any] = {"__metadata__": metadata} if metadata else {}
        offset = 0
        for name in sorted(self.shapes):
            size = prod(self.shapes[name]) * self.item
            header[name] = {
                "dtype": self.code,
                "shape": list(self.shapes[name]),
                "data_offsets": [offset, offset + size],
            }
            offset += size
        self.total_bytes = offset
        raw = json.dumps(header, separators=(",", ":")).encode()
        raw += b" " * (-len(raw) % 8)
        f.write(struct.pack("<Q", len(raw)) + raw)
        self._order = iter(sorted(self.shapes))
        self._current: str | None = None

    def write(self, f: BinaryIO, name: str, block: Any) -> None:
        import numpy as np

        if name != self._current:
            self._check_done()
            self._current = next(self._order)
            if name != self._current:
                raise ValueError(f"tensor {name} written out of order (expected {self._current})")
            self.written[name] = 0
        block = np.asarray(block, dtype=np.float32)
        if self.code == "BF16":  # round to nearest even on the top 16 bits
            bits = block.view(np.uint32)
            data = ((bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16).astype("<u2")
        else:
            data = block.astype("<f2" if self.code == "F16" else "<f4")
        f.write(data.tobytes())
        self.written[name] += data.nbytes

    def _check_done(self) -> None:
        if self._current is not None and self.written[self._current] != prod(self.shapes[self._current]) * self.item:
            raise ValueError(
                f"tensor {self._current}: wrote {self.written[self._current]} bytes, expected "
                f"{prod(self.shapes[self._current]) * self.item}"
            )

    def finish(self, f: BinaryIO) -> None:
        self._check_done()
        missing = set(self.shapes) - set(self.written)
        if missing:
            raise ValueError(f"tensors never written: {sorted(missing)[:5]}")
