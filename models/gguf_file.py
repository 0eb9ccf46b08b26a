"""Read a GGUF file: metadata as Python values, tensors memory-mapped and kept in their blocks.

Format (GGUF v2/v3, little-endian): magic "GGUF", u32 version, u64 tensor count, u64 kv count; kv
pairs (string key, u32 value type, value; arrays are u32 element type + u64 count + elements);
tensor infos (name, u32 n_dims, u64 dims fastest-first, u32 ggml type, u64 offset); the data
section starts at the next multiple of `general.alignment` (default 32).

We parse the header ourselves rather than through `gguf.GGUFReader`: the reader builds a NumPy
object per vocabulary string and takes ~14 s on Gemma 3's 262,144-token vocabulary, this takes a
fraction of a second, and a long string array read once comes back from the cache of its bytes
(models/gguf_strings_cache.py) in one split. tests/test_gguf_file.py checks metadata and tensor tables against
gguf.GGUFReader on both bundled models.

Quantized tensors stay as the file stores them: a (n_rows, row_bytes) uint8 view of the mapping.
Every way a file can be wrong (missing, not GGUF, truncated, offsets past the end, an
unsupported tensor type) raises ModelFileError / UnsupportedModelError naming the file.
"""
from __future__ import annotations

import math
import os
import struct
from typing import Any

import numpy as np

from ringllm.models import gguf_strings_cache
from ringllm.runtime.errors import ModelFileError, UnsupportedModelError
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import SUPPORTED_TYPES, GGMLType, row_bytes

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# value type -> (struct code, numpy dtype) for fixed-size scalars; 8 = string, 9 = array
_SCALARS = {0: ("B", np.uint8), 1: ("b", np.int8), 2: ("H", np.uint16), 3: ("h", np.int16),
            4: ("I", np.uint32), 5: ("i", np.int32), 6: ("f", np.float32), 7: ("?", np.bool_),
            10: ("Q", np.uint64), 11: ("q", np.int64), 12: ("d", np.float64)}
_STRING, _ARRAY = 8, 9
_U64 = struct.Struct("<Q")

GGUFTensor = QTensor  # tensors of a GGUF file are QTensors named as in the file


class _Cursor:
    """Bounds-checked little-endian reads over the mapped file."""

    def __init__(self, buf: memoryview, path: str):
        self.buf, self.path, self.pos = buf, path, 0

    def need(self, n: int) -> None:
        if n < 0 or self.pos + n > len(self.buf):
            raise ModelFileError(self.path, f"header runs past the end of the file at byte {self.pos} "
                                 "(truncated or corrupt); re-download it")

    def scalar(self, code: str):
        size = struct.calcsize("<" + code)
        self.need(size)
        val = struct.unpack_from("<" + code, self.buf, self.pos)[0]
        self.pos += size
        return val

    def string(self) -> str:
        n = self.scalar("Q")
        self.need(n)
        raw = bytes(self.buf[self.pos:self.pos + n])
        self.pos += n
        return raw.decode("utf-8", errors="replace")

    def strings(self, count: int) -> list[str]:
        """`count` strings in a row (a vocabulary: 10^5 of them): from the cache of this array's bytes
        (models/gguf_strings_cache.py) when it has them, else read in one loop and cached."""
        if count < gguf_strings_cache.MIN_CACHED:
            return self._read_strings(count)
        start = self.pos
        cached = gguf_strings_cache.read_cached(self.buf, start, count)
        if cached is not None:
            strings, self.pos = cached
            return strings
        strings = self._read_strings(count)
        gguf_strings_cache.store(self.buf, start, self.pos, strings)
        return strings

    def _read_strings(self, count: int) -> list[str]:
        buf, pos, end, length = self.buf, self.pos, len(self.buf), _U64.unpack_from
        out = []
        append = out.append
        for _ in range(count):
            if pos + 8 > end:
                self.pos = pos
                self.need(8)             # raises
            n = length(buf, pos)[0]
            pos += 8
            if pos + n > end:
                self.pos = pos
                self.need(n)             # raises
            append(str(buf[pos:pos + n], "utf-8", "replace"))
            pos += n
        self.pos = pos
        return out

    def value(self, vtype: int, key: str) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.scalar("I"), self.scalar("Q")
            if etype == _STRING:
                return self.strings(count)
            if etype not in _SCALARS:
                raise ModelFileError(self.path, f"metadata '{key}': unsupported array element type {etype}")
            dtype = np.dtype(_SCALARS[etype][1]).newbyteorder("<")
            self.need(count * dtype.itemsize)
            arr = np.frombuffer(self.buf, dtype=dtype, count=count, offset=self.pos).copy()
            self.pos += count * dtype.itemsize
            return arr
        if vtype not in _SCALARS:
            raise ModelFileError(self.path, f"metadata '{key}': unknown value type {vtype} (corrupt file?)")
        val = self.scalar(_SCALARS[vtype][0])
        return bool(val) if vtype == 7 else val


class GGUFFile:
    """An opened GGUF file: `metadata` (dict of Python values) and `tensors` (dict name -> QTensor).

    Metadata values: str, int, float, bool; arrays of strings become list[str], arrays of numbers
    become 1-D numpy arrays. `version` and `alignment` are the file's.
    """

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        _check_header(self.path)
        self._map = np.memmap(self.path, dtype=np.uint8, mode="r")
        cur = _Cursor(memoryview(self._map), self.path)
        cur.pos = 4
        self.version = cur.scalar("I")
        if self.version not in (2, 3):
            raise ModelFileError(self.path, f"GGUF version {self.version} is not supported (2 or 3); "
                                 "convert the model with a current llama.cpp")
        n_tensors, n_kv = cur.scalar("Q"), cur.scalar("Q")
        if n_tensors > 1 << 24 or n_kv > 1 << 24:
            raise ModelFileError(self.path, f"implausible counts ({n_tensors} tensors, {n_kv} keys): corrupt header")
        self.metadata: dict[str, Any] = {}
        self.keys_read: set[str] = set()     # every key get/require was asked for (the loader refuses unread ones)
        for _ in range(n_kv):
            key = cur.string()
            self.metadata[key] = cur.value(cur.scalar("I"), key)
        self.alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        if self.alignment <= 0 or self.alignment & (self.alignment - 1):
            raise ModelFileError(self.path, f"general.alignment {self.alignment} is not a power of two")
        infos = []
        for _ in range(n_tensors):
            name = cur.string()
            n_dims = cur.scalar("I")
            if not 1 <= n_dims <= 4:
                raise ModelFileError(self.path, f"tensor '{name}' has {n_dims} dimensions (corrupt header)")
            dims = [cur.scalar("Q") for _ in range(n_dims)]
            infos.append((name, dims, cur.scalar("I"), cur.scalar("Q")))
        data_start = -(-cur.pos // self.alignment) * self.alignment
        self.tensors: dict[str, QTensor] = {}
        for name, dims, qtype, offset in infos:
            self.tensors[name] = self._tensor(name, dims, qtype, data_start + offset)

    def _tensor(self, name: str, dims: list[int], qtype_id: int, start: int) -> QTensor:
        try:
            qtype = GGMLType(qtype_id)
        except ValueError:
            qtype = None
        if qtype is None or qtype not in SUPPORTED_TYPES:
            label = qtype.name if qtype is not None else _gguf_type_name(qtype_id)
            raise UnsupportedModelError(
                self.path, f"tensor '{name}' has type {label}, which ringllm does not support "
                f"(supported: {', '.join(x.name for x in sorted(SUPPORTED_TYPES))})")
        if not all(1 <= d < 1 << 40 for d in dims) or math.prod(dims) >= 1 << 48:
            raise ModelFileError(self.path, f"tensor '{name}' has dimensions {dims} (corrupt header)")
        n_cols = dims[0]
        n_rows = math.prod(dims[1:])             # Python ints: a corrupt header cannot wrap around
        rb = row_bytes(qtype, n_cols)
        if rb is None:
            raise ModelFileError(self.path, f"tensor '{name}': row length {n_cols} is not a multiple of "
                                 f"the {qtype.name} block size")
        end = start + n_rows * rb
        if end > self._map.size:
            raise ModelFileError(self.path, f"tensor '{name}' ends at byte {end} but the file has "
                                 f"{self._map.size} bytes: the file is truncated")
        shape = tuple(reversed(dims)) if len(dims) > 1 else (n_cols,)
        data = self._map[start:end].view(np.ndarray).reshape(n_rows, rb)
        return QTensor(name, qtype, shape, data)

    @property
    def architecture(self) -> str:
        arch = self.metadata.get("general.architecture")
        if not isinstance(arch, str):
            raise ModelFileError(self.path, "metadata key 'general.architecture' is missing")
        return arch

    def get(self, key: str, default: Any = None) -> Any:
        self.keys_read.add(key)
        return self.metadata.get(key, default)

    def require(self, key: str) -> Any:
        """Metadata value `key`, or a ModelFileError naming the missing key."""
        self.keys_read.add(key)
        if key not in self.metadata:
            raise ModelFileError(self.path, f"metadata key '{key}' is missing")
        return self.metadata[key]


def _gguf_type_name(qtype_id: int) -> str:
    try:
        import gguf
        return gguf.GGMLQuantizationType(qtype_id).name
    except (ImportError, ValueError):
        return f"#{qtype_id}"


def _check_header(path: str) -> None:
    if not os.path.exists(path):
        raise ModelFileError(path, "no such file")
    if os.path.isdir(path):
        raise ModelFileError(path, "is a directory, expected a .gguf file")
    with open(path, "rb") as fh:
        head = fh.read(24)
    if len(head) < 24:
        raise ModelFileError(path, f"file is {len(head)} bytes long, too short to be GGUF")
    if head[:4] != GGUF_MAGIC:
        raise ModelFileError(path, f"wrong magic {head[:4]!r}, expected {GGUF_MAGIC!r}: not a GGUF file")
