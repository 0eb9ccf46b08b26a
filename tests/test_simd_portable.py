"""runtime/simd.py's portable lowering of the x86 byte instructions gives the x86 instructions' bits.

On x86-64 the integer intrinsics call vpshufb / vpmaddubsw / vpmaddwd / vpsignb by name; on other
targets they emit generic LLVM IR instead (lut16: NEON tbl on aarch64, a per-byte select
elsewhere). Here both are compiled on the host (simd.X86 patched off for the second, so lut16 takes
its per-byte form) and run on the same random vectors, edge values included: table indices with
bit 7 set, products at int16 saturation, -128. On aarch64 (scripts/test_aarch64.sh) the kernels
that use them, tbl included, run against their oracles (IQ4 matvecs, the q8 suite).
"""
from __future__ import annotations

import numpy as np
import pytest
from numba import njit

from ringllm.runtime import simd
from ringllm.runtime.simd import abs8, hadd16, iand, isrl, itof, ld_i32, lut16, maddubs, sign8, vstore


@njit(inline="always", cache=False)
def _bytes_out(v, out, i):
    """Store the 32 bytes of the i32x8 v as exact floats: out[i + 8k + lane] = byte k of lane."""
    for k in range(4):
        vstore(out, i + 8 * k, itof(iand(isrl(v, 8 * k), 0xFF)))


def kernels():
    """Fresh (uncached) njit functions, compiled under whatever simd.X86 says at their first call."""
    @njit(cache=False)
    def run(a, b, out):
        x, y = ld_i32(a, 0), ld_i32(b, 0)
        _bytes_out(lut16(x, y), out, 0)
        _bytes_out(maddubs(x, y), out, 32)
        _bytes_out(hadd16(x), out, 64)
        _bytes_out(abs8(x), out, 96)
        _bytes_out(sign8(x, y), out, 128)
    return run


@pytest.fixture(scope="module")
def both():
    if not simd.X86:
        pytest.skip("the x86 instructions exist only on x86-64 (this target uses the portable lowering)")
    native = kernels()
    native(np.zeros(32, np.uint8), np.zeros(32, np.uint8), np.zeros(160, np.float32))
    simd.X86 = False
    try:
        portable = kernels()
        portable(np.zeros(32, np.uint8), np.zeros(32, np.uint8), np.zeros(160, np.float32))
    finally:
        simd.X86 = True
    return native, portable


def inputs(rng):
    table = rng.integers(0, 256, 16, dtype=np.uint8)
    yield np.concatenate([table, table]), rng.integers(0, 256, 32, dtype=np.uint8)        # any index, bit 7 too
    yield rng.integers(0, 256, 32, dtype=np.uint8), rng.integers(0, 256, 32, dtype=np.uint8)
    yield np.full(32, 255, np.uint8), np.full(32, 0x80, np.uint8)                           # 255 * -128 twice: saturates
    yield np.full(32, 255, np.uint8), np.full(32, 0x7F, np.uint8)                           # 255 * 127 twice: saturates
    yield np.tile(np.array([0x80, 0, 1, 0x7F], np.uint8), 8), np.tile(np.array([0xFF, 0, 0x80, 1], np.uint8), 8)


def test_portable_lowering_gives_the_x86_bits(both):
    native, portable = both
    ir_native, ir_portable = (next(iter(f.inspect_llvm().values())) for f in (native, portable))
    assert "llvm.x86.avx2.pshuf.b" in ir_native and "llvm.x86.avx2.pmadd.ub.sw" in ir_native
    assert "llvm.x86.avx2" not in ir_portable and "llvm.sadd.sat" in ir_portable
    rng = np.random.default_rng(0)
    for _ in range(50):
        for a, b in inputs(rng):
            want, got = np.zeros(160, np.float32), np.full(160, -1.0, np.float32)
            native(a, b, want)
            portable(a, b, got)
            for part, name in enumerate(("lut16", "maddubs", "hadd16", "abs8", "sign8")):
                np.testing.assert_array_equal(got[32 * part:32 * part + 32], want[32 * part:32 * part + 32], name)
