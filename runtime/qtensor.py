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
        row selection stays valid for every quantized type)."""
        data = self.data[rows]
        n = data.shape[0]
        shape = (n, self.n_cols) if len(self.shape) > 1 else (n * self.n_cols,)
        if len(self.shape) == 1:
            raise ValueError("take_rows needs a matrix")
        return QTensor(name or self.name, self.qtype, shape, data)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)
