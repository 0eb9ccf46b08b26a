"""QTensor: one weight as a file stores it, the unit every loader hands to every engine.

Loaders (GGUF, safetensors) never convert: a quantized tensor stays in its GGML blocks, an f16/bf16
tensor stays 16-bit. Engines decide how to use it (the reference engine dequantizes once, the Numba
engine runs kernels over the blocks).
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ringllm.runtime.quant_types import GGMLType


@dataclass(frozen=True)
class QTensor:
    """A weight in its stored encoding.

    name:  internal (GGUF-style) tensor name, e.g. "blk.0.attn_q.weight".
    qtype: GGMLType of the stored values (F32, F16, BF16 or a block-quantized type).
    shape: logical numpy shape: (n_rows, n_cols) for a matrix (n_rows = output features), (n,) for a vector.
    data:  uint8 array (n_rows, row_bytes), rows of blocks along n_cols; usually a read-only view of
           a memory map.
    """

    name: str
    qtype: GGMLType
    shape: tuple[int, ...]
    data: np.ndarray

    @property
    def n_rows(self) -> int:
        return self.shape[0] if len(self.shape) > 1 else 1

    @property
    def n_cols(self) -> int:
        return self.shape[-1]

    def take_rows(self, rows: np.ndarray | slice, name: str | None = None) -> "QTensor":
        """A new QTensor made of some rows (row permutation or slice; blocks run along rows, so any
        row selection stays valid for every quantized type). A slice is a view of this tensor's data;
        an index array gives a GatheredRows, which gathers the rows each time its data is read."""
        if len(self.shape) == 1:
            raise ValueError("take_rows needs a matrix")
        if isinstance(rows, slice):
            data = self.data[rows]
            return QTensor(name or self.name, self.qtype, (data.shape[0], self.n_cols), data)
        return GatheredRows(self, rows, name)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    @property
    def stored(self) -> np.ndarray:
        """The array this tensor's bytes are read from (data; a GatheredRows' source's): what to release
        once the weights are packed, without gathering them again."""
        return self.data


class GatheredRows(QTensor):
    """Rows of another QTensor in a given order (a permutation of a checkpoint's rows, such as the
    rotate-half order of q/k weights), gathered from the source each time `data` is read rather than
    held: the engine packs the weights once into buffers of its own, and a gathered copy kept beside
    them would be resident memory nothing reads again. Readers that come later (a press reading W_q, a
    layer draft packing its own copy) gather again. Equal in every field to the QTensor the gather
    would make."""

    def __init__(self, source: QTensor, rows, name: str | None = None):
        rows = np.asarray(rows)
        if rows.dtype == np.bool_:
            if rows.shape != (source.n_rows,):
                raise IndexError(f"a row mask for {source.name} needs {source.n_rows} entries, got {rows.shape}")
            rows = np.flatnonzero(rows)
        rows = rows.astype(np.int64).reshape(-1)
        if rows.size and (rows.min() < -source.n_rows or rows.max() >= source.n_rows):
            raise IndexError(f"rows out of range for {source.name} with {source.n_rows} rows")
        object.__setattr__(self, "name", name or source.name)
        object.__setattr__(self, "qtype", source.qtype)
        object.__setattr__(self, "shape", (int(rows.size), source.n_cols))
        object.__setattr__(self, "_source", source)
        object.__setattr__(self, "_rows", rows)

    @property
    def data(self) -> np.ndarray:
        return self._source.data[self._rows]

    @property
    def nbytes(self) -> int:
        stored = self._source.stored
        return int(self._rows.size * stored.shape[1] * stored.itemsize)

    @property
    def stored(self) -> np.ndarray:
        return self._source.stored
