"""Random weight matrices of any supported GGML type, for benchmarks and kernel warm-up.

Quantized types get random bytes with every f16 scale set to a small finite value (random bytes in a
scale field would be NaN or infinity one time in 30); float types get standard normal values. The
matrices are valid input for every kernel, not for a model.
"""
from __future__ import annotations

import numpy as np

from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

# byte offsets of each block's f16 fields (scales d, and dmin / m where the type has them)
SCALE_OFFSETS: dict[GGMLType, tuple[int, ...]] = {
    GGMLType.Q4_0: (0,), GGMLType.Q4_1: (0, 2), GGMLType.Q5_0: (0,), GGMLType.Q5_1: (0, 2), GGMLType.Q8_0: (0,),
    GGMLType.Q4_K: (0, 2), GGMLType.Q5_K: (0, 2), GGMLType.Q6_K: (208,), GGMLType.Q2_K: (80, 82),
    GGMLType.Q3_K: (108,), GGMLType.IQ4_NL: (0,), GGMLType.IQ4_XS: (0,),
}


def random_qtensor(qtype: GGMLType, n_rows: int, n_cols: int, rng: np.random.Generator,
                   scale: float = 0.01) -> QTensor:
    """A (n_rows, n_cols) QTensor of `qtype` (n_cols a whole number of blocks) with random contents."""
    block, size = BLOCK_LAYOUT[qtype]
    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        v = rng.standard_normal((n_rows, n_cols)).astype(np.float32)
        if qtype == GGMLType.F16:
            v = v.astype(np.float16)
        elif qtype == GGMLType.BF16:
            v = (v.view(np.uint32) >> 16).astype(np.uint16)
        data = v.view(np.uint8).reshape(n_rows, -1)
    else:
        data = rng.integers(0, 256, (n_rows, n_cols // block, size), dtype=np.uint8)
        for o in SCALE_OFFSETS[qtype]:
            data[..., o:o + 2] = np.array([scale], np.float16).view(np.uint8)
        data = data.reshape(n_rows, -1)
    return QTensor(f"random_{qtype.name}", qtype, (n_rows, n_cols), data)
