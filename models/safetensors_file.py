"""Read Hugging Face safetensors checkpoints (one file or a sharded index), memory-mapped, f32/f16/bf16.

The format is an 8-byte little-endian header length, a JSON header {name: {dtype, shape,
data_offsets}}, then the data. We parse the header ourselves so that bf16 (which NumPy lacks)
stays as raw 16-bit rows like GGUF's, and every tensor becomes a QTensor view of the mapping.
"""
from __future__ import annotations

import json
import os

import numpy as np

from ringllm.runtime.errors import ModelFileError, UnsupportedModelError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import GGMLType

DTYPES = {"F32": (GGMLType.F32, 4), "F16": (GGMLType.F16, 2), "BF16": (GGMLType.BF16, 2)}
MAX_HEADER = 100 * 1024 * 1024


def read_safetensors(path: str) -> dict[str, QTensor]:
    """All float tensors of one .safetensors file as QTensors (HF names). Non-float tensors are skipped."""
    size = os.path.getsize(path)
    with open(path, "rb") as fh:
        raw = fh.read(8)
        if len(raw) < 8:
            raise ModelFileError(path, "file too short to be safetensors")
        n = int.from_bytes(raw, "little")
        if n <= 0 or n > MAX_HEADER or 8 + n > size:
            raise ModelFileError(path, f"bad safetensors header length {n} for a {size}-byte file (truncated or corrupt)")
        try:
            header = json.loads(fh.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ModelFileError(path, f"safetensors header is not valid JSON: {exc}") from exc
    if not isinstance(header, dict):
        raise ModelFileError(path, f"safetensors header is a JSON {type(header).__name__}, expected an object")
    data_start = 8 + n
    mm = np.memmap(path, dtype=np.uint8, mode="r")
    out: dict[str, QTensor] = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        if not isinstance(info, dict):
            raise ModelFileError(path, f"tensor '{name}': header entry is not an object")
        dtype = info.get("dtype")
        if not isinstance(dtype, str):
            raise ModelFileError(path, f"tensor '{name}': dtype {dtype!r} is not a string")
        if dtype not in DTYPES:
            if dtype in ("I64", "I32", "BOOL", "U8", "I8"):
                continue   # buffers such as position ids, not weights
            raise UnsupportedModelError(path, f"tensor '{name}' has dtype {dtype}; supported: {sorted(DTYPES)}")
        qtype, itemsize = DTYPES[dtype]
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not (isinstance(shape, list) and all(type(d) is int and 0 <= d < 1 << 40 for d in shape)):
            raise ModelFileError(path, f"tensor '{name}': shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(x) is int for x in offsets)
                and 0 <= offsets[0] <= offsets[1]):
            raise ModelFileError(path, f"tensor '{name}': data_offsets {offsets!r} is not [begin, end]")
        shape, (begin, end) = tuple(shape), offsets
        count = int(np.prod(shape, dtype=object)) if shape else 1
        if end - begin != count * itemsize:
            raise ModelFileError(path, f"tensor '{name}': {end - begin} bytes for shape {shape} {dtype}")
        if data_start + end > size:
            raise ModelFileError(path, f"tensor '{name}' ends past the end of the file (truncated)")
        buf = mm[data_start + begin:data_start + end]
        if len(shape) == 1:
            out[name] = QTensor(name, qtype, shape, buf.reshape(1, -1))
        elif len(shape) == 2:
            out[name] = QTensor(name, qtype, shape, buf.reshape(shape[0], shape[1] * itemsize))
        else:
            raise UnsupportedModelError(path, f"tensor '{name}' has {len(shape)} dimensions; expected 1 or 2")
    return out


def read_checkpoint_dir(path: str) -> dict[str, QTensor]:
    """Tensors of an HF directory: model.safetensors, or the shards listed in model.safetensors.index.json."""
    single = os.path.join(path, "model.safetensors")
    index = os.path.join(path, "model.safetensors.index.json")
    if os.path.isfile(index):
        try:
            with open(index, encoding="utf-8") as fh:
                weight_map = json.load(fh)["weight_map"]
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ModelFileError(index, f"not a valid safetensors index ({exc})") from exc
        out: dict[str, QTensor] = {}
        for shard in sorted(set(weight_map.values())):
            shard_path = os.path.join(path, shard)
            if not os.path.isfile(shard_path):
                raise ModelFileError(shard_path, "shard listed in model.safetensors.index.json is missing")
            out.update(read_safetensors(shard_path))
        return out
    if os.path.isfile(single):
        return read_safetensors(single)
    raise ModelFileError(path, "no model.safetensors or model.safetensors.index.json in this directory")
