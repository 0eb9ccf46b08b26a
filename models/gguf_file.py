"""Read a GGUF file through the `gguf` package's reader: metadata as Python values, tensors memory-mapped.

Quantized tensors stay as the file stores them: a (n_rows, row_bytes) uint8 view of the mapping,
one row per output feature, blocks of the GGML type along the row. Nothing is copied at open.

Every way a file can be wrong (missing, not GGUF, truncated, offsets past the end, a tensor type
ringllm does not implement) raises ModelFileError / UnsupportedModelError naming the file.
"""
from __future__ import annotations

import os
from typing import Any

import numpy as np

from ringllm.runtime.errors import ModelFileError, UnsupportedModelError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import SUPPORTED_TYPES, GGMLType, row_bytes

GGUF_MAGIC = b"GGUF"


GGUFTensor = QTensor  # tensors of a GGUF file are QTensors named as in the file


class GGUFFile:
    """An opened GGUF file: `metadata` (dict of Python values) and `tensors` (dict name -> QTensor).

    Metadata values: str, int, float, bool; arrays of strings become list[str], arrays of numbers
    become 1-D numpy arrays.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        _check_header(self.path)
        try:
            import gguf

            reader = gguf.GGUFReader(self.path, "r")
        except (ValueError, IndexError, OSError, KeyError, UnicodeDecodeError, OverflowError) as exc:
            raise ModelFileError(self.path, f"not a readable GGUF file ({type(exc).__name__}: {exc}); "
                                 "the file is truncated or corrupt, re-download it") from exc
        self.metadata: dict[str, Any] = {}
        for key, field in reader.fields.items():
            if key.startswith("GGUF."):
                continue
            self.metadata[key] = _field_value(field)
        file_size = os.path.getsize(self.path)
        self.tensors: dict[str, QTensor] = {}
        for t in reader.tensors:
            self.tensors[t.name] = _make_tensor(self.path, t, file_size)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(self.path, "metadata key 'general.architecture' is missing")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value `key`, or a ModelFileError naming the missing key."""
        if key not in self.metadata:
            raise ModelFileError(self.path, f"metadata key '{key}' is missing")
        return self.metadata[key]


def _check_header(path: str) -> None:
    if not os.path.exists(path):
        raise ModelFileError(path, "no such file")
    if os.path.isdir(path):
        raise ModelFileError(path, "is a directory, expected a .gguf file")
    with open(path, "rb") as fh:
        head = fh.read(8)
    if len(head) < 8:
        raise ModelFileError(path, f"file is {len(head)} bytes long, too short to be GGUF")
    if head[:4] != GGUF_MAGIC:
        raise ModelFileError(path, f"wrong magic {head[:4]!r}, expected {GGUF_MAGIC!r}: not a GGUF file")


def _field_value(field) -> Any:
    import gguf

    types = field.types
    if not types:
        return None
    if types[0] == gguf.GGUFValueType.ARRAY:
        if len(types) > 1 and types[1] == gguf.GGUFValueType.STRING:
            return [bytes(field.parts[i]).decode("utf-8", errors="replace") for i in field.data]
        if not field.data:
            return np.zeros(0, dtype=np.float32)
        return np.concatenate([np.asarray(field.parts[i]).reshape(-1) for i in field.data])
    if types[0] == gguf.GGUFValueType.STRING:
        return bytes(field.parts[field.data[0]]).decode("utf-8", errors="replace")
    value = field.parts[field.data[0]][0]
    if types[0] == gguf.GGUFValueType.BOOL:
        return bool(value)
    return value.item()


def _make_tensor(path: str, t, file_size: int) -> QTensor:
    try:
        qtype = GGMLType(int(t.tensor_type))
    except ValueError:
        qtype = None
    if qtype is None or qtype not in SUPPORTED_TYPES:
        name = getattr(t.tensor_type, "name", str(int(t.tensor_type)))
        raise UnsupportedModelError(
            path, f"tensor '{t.name}' has type {name}, which ringllm does not support "
            f"(supported: {', '.join(x.name for x in SUPPORTED_TYPES)})")
    dims = [int(d) for d in t.shape]  # GGUF order: fastest-varying first
    shape = tuple(reversed(dims)) if len(dims) > 1 else (dims[0],)
    n_cols = dims[0]
    n_rows = int(np.prod(dims[1:])) if len(dims) > 1 else 1
    rb = row_bytes(qtype, n_cols)
    if rb is None:
        raise ModelFileError(path, f"tensor '{t.name}': row length {n_cols} is not a multiple of "
                             f"the {qtype.name} block size")
    end = int(t.data_offset) + n_rows * rb
    if end > file_size:
        raise ModelFileError(path, f"tensor '{t.name}' ends at byte {end} but the file has "
                             f"{file_size} bytes: the file is truncated")
    raw = np.asarray(t.data)
    data = raw.view(np.uint8).reshape(n_rows, rb)
    return QTensor(t.name, qtype, shape, data)
