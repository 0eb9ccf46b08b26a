"""Which q8 kernels a matrix takes: the widest integer dot product the CPU has, or the one asked for.

    avx2     vpmaddubsw / vpmaddwd on 8 lanes (quant_tiles_q8.Q8_KERNELS): every x86-64 the engine runs on
    vnni     vpdpbusd on 8 lanes (quant_tiles_q8.Q8_KERNELS_VNNI): AVX512-VNNI + VL or AVX-VNNI
    vnni512  vpdpbusd on 16 lanes for 4+ rows of x (quant_tiles_q8_wide.py), where a type has them,
             else vnni: AVX512-VNNI with Numba compiling for AVX-512

All three compute the same bits. RINGLLM_Q8_DOT names one (to measure or test a narrower variant on
a CPU that has a wider one); a variant the CPU lacks is a ConfigError.

The kernel modules are imported at the first call: creating their hundreds of dispatchers is a
share of every process's import, and only a model packed with precision="q8" uses them.
"""
from __future__ import annotations

import os

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.quant_types import GGMLType

__all__ = ["DOTS", "q8_kernels"]

DOTS = ("avx2", "vnni", "vnni512")


def q8_kernels(qtype: GGMLType, dot: str | None = None) -> tuple:
    """(parallel, serial) q8 entry kernels of qtype, each kernel(out (T, n_rows), buf, X (T, n_cols)
    float32, xq, dx, s16, s32, nb) (quant_tiles_q8.py). dot: one of DOTS; None takes RINGLLM_Q8_DOT
    when set, else the widest the CPU has."""
    from ringllm.runtime.quant_tiles_q8 import HAS_VNNI, Q8_KERNELS, Q8_KERNELS_VNNI
    from ringllm.runtime.quant_tiles_q8_wide import HAS_VNNI512, Q8_KERNELS_VNNI512
    if dot is None:
        dot = os.environ.get("RINGLLM_Q8_DOT", "").lower() or ("vnni512" if HAS_VNNI512 else
                                                               "vnni" if HAS_VNNI else "avx2")
    if dot not in DOTS:
        raise ConfigError(f"q8 dot-product variant {dot!r} unknown; valid: {', '.join(DOTS)}")
    if dot == "vnni" and not HAS_VNNI:
        raise ConfigError("this CPU has no VNNI dot-product instruction (vpdpbusd)")
    if dot == "vnni512" and not HAS_VNNI512:
        raise ConfigError("this CPU (or Numba's target) has no 512-bit vpdpbusd (AVX512-VNNI)")
    if dot == "vnni512":
        return Q8_KERNELS_VNNI512.get(qtype) or Q8_KERNELS_VNNI[qtype]
    return (Q8_KERNELS_VNNI if dot == "vnni" else Q8_KERNELS)[qtype]
