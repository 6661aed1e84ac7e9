"""Read a GGUF file's metadata (the key/value header) without loading the model.

Enough for listings and placement: architecture, context length, layer count, quantization, parameter count.
Tensor data is never read. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md
"""

from __future__ import annotations

import struct
from typing import Any, BinaryIO

__all__ = ["FILE_TYPES", "longest_token", "read_metadata", "tensor_sizes"]

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9

# general.file_type values (llama_ftype) for the quantizations people meet.
FILE_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    7: "Q8_0",
    8: "Q5_0",
    9: "Q5_1",
    10: "Q2_K",
    11: "Q3_K_S",
    12: "Q3_K_M",
    13: "Q3_K_L",
    14: "Q4_K_S",
    15: "Q4_K_M",
    16: "Q5_K_S",
    17: "Q5_K_M",
    18: "Q6_K",
    32: "BF16",
}


def _read(f: BinaryIO, fmt: str) -> Any:
    size = struct.calcsize(fmt)
    data = f.read(size)
    if len(data) != size:
        raise ValueError("truncated GGUF header")
    return struct.unpack(fmt, data)[0]


def _string(f: BinaryIO) -> str:
    return f.read(_read(f, "<Q")).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int, keep_arrays: bool) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind == _ARRAY:
        item_kind, count = _read(f, "<I"), _read(f, "<Q")
        if not keep_arrays and item_kind in _SCALARS:  # skip big arrays (token tables) cheaply
            f.seek(struct.calcsize(_SCALARS[item_kind]) * count, 1)
            return count
        values = [_value(f, item_kind, keep_arrays) for _ in range(count)]
        return values if keep_arrays else len(values)
    raise ValueError(f"unknown GGUF value type {kind}")


def _header(f: BinaryIO, path: str) -> tuple[int, dict[str, Any]]:
    if f.read(4) != b"GGUF":
        raise ValueError(f"{path} is not a GGUF file")
    version = _read(f, "<I")
    if version < 2:
        raise ValueError(f"GGUF version {version} is not supported")
    n_tensors, count = _read(f, "<Q"), _read(f, "<Q")
    meta: dict[str, Any] = {}
    for _ in range(count):
        key = _string(f)
        meta[key] = _value(f, _read(f, "<I"), keep_arrays=False)
    return n_tensors, meta


def read_metadata(path: str) -> dict[str, Any]:
    """The GGUF key/value metadata; arrays are replaced by their length."""
    with open(path, "rb") as f:
        return _header(f, path)[1]


def longest_token(path: str) -> int:
    """Bytes of the longest entry of the GGUF's token table (``tokenizer.ggml.tokens``); 0 if it has none.

    A token's text as stored is never shorter than the prompt text it stands for (SentencePiece writes a space
    as the 3-byte ``▁``, a byte token as ``<0xAB>``), so this bounds the bytes one token consumes.
    """
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF" or _read(f, "<I") < 2:
            raise ValueError(f"{path} is not a GGUF file of version 2 or later")
        _, count = _read(f, "<Q"), _read(f, "<Q")
        for _ in range(count):
            key = _string(f)
            kind = _read(f, "<I")
            if key != "tokenizer.ggml.tokens" or kind != _ARRAY:
                _value(f, kind, keep_arrays=False)
                continue
            item_kind, n = _read(f, "<I"), _read(f, "<Q")
            if item_kind != _STRING:
                return 0
            longest = 0
            for _ in range(n):
                size = _read(f, "<Q")
                f.seek(size, 1)
                longest = max(longest, size)
            return longest
    return 0


def tensor_sizes(path: str) -> dict[str, int]:
    """Bytes each tensor occupies in the file, by tensor name (from the gaps between data offsets)."""
    with open(path, "rb") as f:
        n_tensors, meta = _header(f, path)
        offsets = []
        for _ in range(n_tensors):
            name = _string(f)
            n_dims = _read(f, "<I")
            f.seek(8 * n_dims + 4, 1)  # dims, type
            offsets.append((_read(f, "<Q"), name))
        alignment = int(meta.get("general.alignment", 32))
        data_start = -(-f.tell() // alignment) * alignment
        f.seek(0, 2)
        data_size = f.tell() - data_start
    offsets.sort()
    ends = [o for o, _ in offsets[1:]] + [data_size]
    return {name: end - start for (start, name), end in zip(offsets, ends, strict=True)}
