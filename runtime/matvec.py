"""Quantized matrix-vector product for batch-1 decode: out = W @ x, W in GGML blocks, x float32.

This is the hot loop of the CPU engine, and this module is its public face (`from ringllm.runtime
import matvec as mv`): `pack` repacks a weight once at load into a layout made for 256-bit SIMD
(AVX2 + FMA + F16C), `matvec` streams that layout once per call, `matmul` (X (T, n_cols): prefill,
batched decode, verification) streams it once for all T rows, `unpack` decodes the whole matrix. The
functions here check their arguments and pick a kernel; the work is done in

    simd.py            Numba intrinsics on <8 x float> / <8 x i32> (vfma, ld_f16, andf, ...)
    quant_tiles.py     the packed layout, and one tile kernel per GGML type (a tile of rows @ x)
    quant_tile_pairs.py  two-row tile kernels (a tile of rows @ two x), for few-row products
    matvec_kernels.py  the entry kernels matvec_<type>(out, buf, x, scratch) and rows_<type>(out, buf, X,
                       scratch), generated from one table
    gemm.py            the tile decoder (unpack) and the register-tiled matmul (prefill)
    packing.py         file blocks -> packed records (NumPy), in huge-page slabs
    act_quant.py, quant_tiles_q8.py, packing_q8.py   the q8 mode (below)

Accuracy: x is never quantized. The result is dequantize(W) @ x up to float32 rounding of the
accumulation order (every dequantized weight value is exact in float32, every scale product
d * sc is exact, and the per-block identity sum_j (d q_j + m) x_j = d sum_j q_j x_j + m sum_j x_j
is applied in float32 with fused multiply-adds). x values below ~1e-30 in magnitude may lose bits
to the power-of-two pre-scaling of x (quant_tiles.py); their products are far below the float32
resolution of any real dot product.

Precision. `pack(t, precision="q8")` opts a matrix of a type in Q8_TYPES (Q4_0, Q4_1, Q5_0, Q8_0,
Q4_K, Q6_K) into llama.cpp's numerics: every product (one row or many) quantizes x to 8 bits per
block first (act_quant.py: Q8_0 per 32 values, or Q8_K per 256 for the K-quants, as ggml pairs them)
and multiplies with integer dot products (quant_tiles_q8.py). The result is then
dequantize(W) @ dequantize(quantize(x)) (reference_q8.py) up to float32 rounding, not W @ x. Other
types have no q8 kernels and stay exact under precision="q8".

Threads: the kernels follow the house style (destination first, return None, nogil, cache); only the
entry kernels (`matvec_<type>`, `UNPACK_TILES`, `MATMUL_TILES`) are parallel. matvec runs prange over
tiles, honours numba.set_num_threads, and stays on the calling thread when one thread is set or the
matrix is small, where fork/join would cost more than it saves. `PackedMatrix.kernel` is the entry
kernel itself, callable from other Numba code; `kernel.inspect_asm(kernel.signatures[0])` shows the
vandps / vcvtdq2ps / vfmadd213ps / vbroadcastss inner loops.

Kernels trust their arguments (no bounds checks); the Python entry points here validate.
"""
from __future__ import annotations

import numba
import numpy as np

from ringllm.runtime.act_quant import ActQ8
from ringllm.runtime.errors import ConfigError, UnsupportedModelError
from ringllm.runtime.gemm import MATMUL_TILES, UNPACK_TILES, decoded_rows
from ringllm.runtime.matvec_kernels import KERNELS, PAR_MIN_WEIGHTS, ROWS_KERNELS, x_scales
from ringllm.runtime.packing_kernels import pack_records_fast, pack_records_q8_fast
from ringllm.runtime.packing_q8 import Q8_OWN_LAYOUT, q8_tile_rows
from ringllm.runtime.q8_choice import q8_kernels
from ringllm.runtime.reference_q8 import Q8_TYPES
from ringllm.runtime.qtensor import QTensor
from ringllm.runtime.quant_tiles import tile_rows
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

__all__ = ["PackedMatrix", "pack", "matvec", "matmul", "unpack", "unpack_rows", "tile_rows", "KERNELS", "PRECISIONS",
           "Q8_TYPES", "matmul_q8"]

PRECISIONS = ("f32", "q8")     # f32: exact float32 activations; q8: 8-bit activations (module docstring)


# ==================================================================================================
# Packed matrices
# ==================================================================================================

# from this many rows on, matmul decodes each tile once into a scratch (gemm.py); below, rows go
# through the tiles in pairs (quant_tile_pairs.py). Chosen inside a model's decode step, where the
# tiled kernel's scratch competes with the activations and the KV store for L2: batched decode of
# SmolLM2 on 2 cores is faster in pairs up to 16 rows and tiled from 24 (bench/results/few_rows.md
# times the kernels alone, where tiling wins from about 8 rows).
MATMUL_MIN_T = 20
# a caller that does not ask for the few-row kernels (a single sequence's prefill chunk) runs one matvec
# per row below this many rows (the same bits as the few-row kernels) and the tiled kernel from here on,
# so that a lone sequence never compiles the few-row kernels (1.5-4.5 s per weight type on 2 cores)
TILED_MIN_T = 5


class PackedMatrix:
    """A weight matrix repacked for `matvec` / `matmul`, with its per-call scratch.

    qtype:   GGMLType of the source tensor.
    n_rows, n_cols: logical shape (out features, in features).
    buf:     uint8 packed records (layout in quant_tiles.py), 64-byte aligned, huge-page memory.
    scratch: float32 (56 + n_cols // 16 + n_cols,) used by every call; a PackedMatrix is
             therefore not safe to use from two threads at once.
    kernel:  the entry kernel; kernel(out, buf, x, scratch) is matvec without the argument
             checks (it can also be called from other Numba code).
    rows_kernel: the few-row entry kernel rows_kernel(out, buf, X, rows_scratch) (out (T, n_rows)
             = X @ W.T, 2 <= T <= rows_scratch.shape[0]), or None for a type without two-row tile
             kernels (its few-row products run one matvec per row).
    rows_scratch: float32 (T, len(scratch)), grown by matmul to the largest T it was called with.
    name:    the source tensor's name (names joined by '+' for stacked tensors).
    q8:      None, or in the q8 mode (pack(..., precision="q8")) the (parallel, serial) q8 entry
             kernels; buf is then in their layout (packing_q8.py) and every product goes through
             them (kernel / rows_kernel are not called).
    q8_kernel: the one of the two a call should take (serial below PAR_MIN_WEIGHTS weights).
    q8_acts: ActQ8 buffers for the quantized rows of x (grown to the largest T seen).
    """

    __slots__ = ("qtype", "n_rows", "n_cols", "buf", "scratch", "name", "kernel", "rows_kernel", "rows_scratch",
                 "family", "kind", "tile_rows", "n_tiles", "n_blocks", "q8", "q8_kernel", "q8_acts")

    def __init__(self, qtype: GGMLType, n_rows: int, n_cols: int, buf: np.ndarray, name: str = "",
                 precision: str = "f32"):
        self.qtype, self.n_rows, self.n_cols, self.buf, self.name = qtype, n_rows, n_cols, buf, name
        self.kernel, self.family, self.kind = KERNELS[qtype]
        self.rows_kernel = ROWS_KERNELS.get(qtype)
        self.q8 = q8_kernels(qtype) if precision == "q8" else None
        self.q8_kernel = None if self.q8 is None else self.q8[0 if n_rows * n_cols >= PAR_MIN_WEIGHTS else 1]
        self.q8_acts = ActQ8(n_cols) if self.q8 is not None else None
        self.tile_rows = q8_tile_rows(qtype) if self.q8 is not None else tile_rows(qtype)
        self.scratch = np.zeros(56 + n_cols // 16 + n_cols, np.float32)
        self.scratch[:32] = x_scales(qtype)
        self.rows_scratch = self.scratch[None, :]
        self.n_tiles = (n_rows + self.tile_rows - 1) // self.tile_rows
        block = BLOCK_LAYOUT[qtype][0]
        self.n_blocks = n_cols // block

    @property
    def nbytes(self) -> int:
        """Bytes of packed weights (what one matvec streams)."""
        return int(self.buf.nbytes)

    @property
    def precision(self) -> str:
        """"q8" when the products quantize x to 8 bits (q8 kernels), else "f32"."""
        return "f32" if self.q8 is None else "q8"

    def __repr__(self) -> str:
        return (f"PackedMatrix({self.name!r}, {self.qtype.name}, {self.n_rows}x{self.n_cols}, "
                f"{self.nbytes} bytes, {self.precision})")


def pack(t, precision: str = "f32") -> PackedMatrix:
    """Repack a QTensor matrix (n_rows, n_cols) for matvec / matmul (a new buffer; t is not kept; t's
    pages of a read-only model file leave the RSS as they are packed, readable still: packing.pack_in_chunks).

    `t` may also be a list / tuple of QTensors of one type and one n_cols: their rows are stacked
    in order (e.g. q, k, v -> one matrix and one matvec call per token). precision: "f32" (exact
    float32 activations) or "q8" (8-bit activations for the types in Q8_TYPES; other types stay
    exact: see the module docstring).

    Raises:
        UnsupportedModelError: a GGML type without a layout here.
        ConfigError: not a matrix, parts that do not stack, or data of the wrong size.
    """
    if precision not in PRECISIONS:
        raise ConfigError(f"pack: precision {precision!r} unknown; valid: {PRECISIONS}")
    parts = list(t) if isinstance(t, (list, tuple)) else [t]
    if not parts:
        raise ConfigError("pack: no tensors given")
    for p in parts:
        if not isinstance(p, QTensor):
            raise ConfigError(f"pack: expected QTensor, got {type(p).__name__}")
        if len(p.shape) != 2:
            raise ConfigError(f"{p.name}: pack needs a matrix, got shape {p.shape}")
    first = parts[0]
    try:
        qtype = GGMLType(int(first.qtype))
    except ValueError:
        raise UnsupportedModelError(first.name, f"unknown GGML type {first.qtype!r}") from None
    if qtype not in KERNELS:
        raise UnsupportedModelError(first.name, f"matvec does not support GGML type {qtype.name}")
    for p in parts[1:]:
        if int(p.qtype) != int(qtype) or p.n_cols != first.n_cols:
            raise ConfigError(f"pack: {p.name} ({GGMLType(int(p.qtype)).name}, {p.n_cols} columns) cannot be "
                              f"stacked with {first.name} ({qtype.name}, {first.n_cols} columns)")
    block, size = BLOCK_LAYOUT[qtype]
    n_cols = int(first.n_cols)
    if n_cols <= 0 or n_cols % block:
        raise ConfigError(f"{first.name}: n_cols {n_cols} is not a positive multiple of the "
                          f"{qtype.name} block size {block}")
    rb = n_cols // block * size
    datas = []
    for p in parts:
        d = np.ascontiguousarray(p.data)
        if d.dtype != np.uint8 or d.size != p.n_rows * rb or p.n_rows < 1:
            raise ConfigError(f"{p.name}: expected {p.n_rows * rb} uint8 bytes for {qtype.name} "
                              f"{p.shape}, got {d.size} {d.dtype}")
        datas.append(d.reshape(p.n_rows, rb))
    data = datas[0] if len(datas) == 1 else datas     # stacked parts are packed chunk by chunk, never concatenated
    n_rows = sum(d.shape[0] for d in datas)
    name = "+".join(p.name for p in parts)
    if precision == "q8" and qtype in Q8_TYPES:
        return PackedMatrix(qtype, n_rows, n_cols, pack_records_q8_fast(qtype, data, n_rows, n_cols), name, "q8")
    return PackedMatrix(qtype, n_rows, n_cols, pack_records_fast(qtype, data, n_rows, n_cols), name)


# ==================================================================================================
# Products and decoding: argument checks, then one kernel call
# ==================================================================================================

_F32 = np.dtype(np.float32)


def _bad_vec(a, n: int, what: str, pm: PackedMatrix) -> ConfigError:
    if isinstance(a, np.ndarray):
        got = (f"{a.dtype} {a.shape}{'' if a.flags.c_contiguous else ' (not C-contiguous)'}"
               f"{'' if a.flags.writeable or what != 'out' else ' (read-only)'}")
    else:
        got = type(a).__name__
    return ConfigError(f"matvec {pm.name}: {what} must be a C-contiguous{' writeable' if what == 'out' else ''} "
                       f"float32 array of shape ({n},), got {got}")


def matvec(out: np.ndarray, pm: PackedMatrix, x: np.ndarray) -> None:
    """out (n_rows,) float32 = W @ x for x (n_cols,) float32. Allocates nothing.

    out, x: C-contiguous float32 1-D arrays, out writeable (out may be x itself when the shape
    allows: x is read in full before out is written). Threads: numba.get_num_threads() at the time
    of the call (numba.set_num_threads). Not thread-safe per PackedMatrix (shared scratch).

    Raises:
        ConfigError: wrong type, dtype, shape or layout of out or x.
    """
    if not (type(out) is np.ndarray and out.dtype is _F32 and out.shape == (pm.n_rows,)
            and out.flags.c_contiguous and out.flags.writeable):
        if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.shape == (pm.n_rows,)
                and out.flags.c_contiguous and out.flags.writeable):
            raise _bad_vec(out, pm.n_rows, "out", pm)
    if not (type(x) is np.ndarray and x.dtype is _F32 and x.shape == (pm.n_cols,)
            and x.flags.c_contiguous):
        if not (isinstance(x, np.ndarray) and x.dtype == _F32 and x.shape == (pm.n_cols,)
                and x.flags.c_contiguous):
            raise _bad_vec(x, pm.n_cols, "x", pm)
    if pm.q8 is not None:
        matmul_q8(out[None, :], pm, x[None, :])
    else:
        pm.kernel(out, pm.buf, x, pm.scratch)


def unpack_rows(wt: np.ndarray, pm: PackedMatrix, t0: int, t1: int) -> None:
    """wt[:, :R (t1 - t0)] = rows R t0 .. R t1 of W, transposed, R = pm.tile_rows (float32
    (n_cols, >= R (t1 - t0)), C-contiguous); rows past n_rows come out as zeros."""
    R = pm.tile_rows
    if pm.q8 is not None and pm.qtype in Q8_OWN_LAYOUT:
        raise ConfigError(f"unpack_rows {pm.name}: the q8 layout of {pm.qtype.name} has no decoder "
                          "(unpack the matrix packed with precision='f32')")
    if not (0 <= t0 <= t1 <= pm.n_tiles):
        raise ConfigError(f"unpack_rows {pm.name}: tiles {t0}..{t1} outside 0..{pm.n_tiles}")
    if (not isinstance(wt, np.ndarray) or wt.dtype != _F32 or wt.ndim != 2 or wt.shape[0] != pm.n_cols
            or wt.shape[1] < (t1 - t0) * R or not wt.flags.c_contiguous):
        raise ConfigError(f"unpack_rows {pm.name}: wt must be C-contiguous float32 ({pm.n_cols}, >= "
                          f"{(t1 - t0) * R})")
    UNPACK_TILES[pm.family](wt, pm.buf, pm.kind, R, t0, t1, pm.n_blocks)


def unpack(pm: PackedMatrix) -> np.ndarray:
    """The dequantized matrix (n_rows, n_cols) float32, decoded from the packed layout (a new array)."""
    wt = np.empty((pm.n_cols, pm.n_tiles * pm.tile_rows), np.float32)
    unpack_rows(wt, pm, 0, pm.n_tiles)
    return np.ascontiguousarray(wt[:, :pm.n_rows].T)


def matmul(out: np.ndarray, pm: PackedMatrix, X: np.ndarray, few_rows: bool = True) -> None:
    """out (T, n_rows) float32 = X @ W.T for X (T, n_cols) float32 (prefill, batched decode, verification).

    Which kernel (T rows):
      T = 1, or T < TILED_MIN_T with few_rows=False: one matvec per row;
      2 <= T < MATMUL_MIN_T with few_rows=True: the few-row kernel, the rows in pairs through each
        tile while it is hot in L1, each weight decoded once per pair, the same bits as per-row
        matvecs (one matvec per row for the types without two-row tiles);
      otherwise (from MATMUL_MIN_T, or TILED_MIN_T with few_rows=False): the tiled kernel.
    few_rows=False is for a caller that should not compile the few-row kernels (a single sequence's
    prefill chunk). The tiled kernel decodes each tile of W (16 or 24 rows) once into a small float32
    scratch (n_cols x rows per thread, allocated per call) and multiplied with all T rows (register
    tiles of 4 tokens x 16 rows); tiles are split over numba.get_num_threads() threads. No BLAS:
    NumPy's OpenBLAS threads and Numba's OpenMP threads spin against each other on a small machine
    (many times slower on 2 cores).

    Raises:
        ConfigError: wrong type, dtype or shape of out or X.
    """
    if not (isinstance(X, np.ndarray) and X.dtype == _F32 and X.ndim == 2 and X.shape[1] == pm.n_cols):
        raise ConfigError(f"matmul {pm.name}: X must be float32 (T, {pm.n_cols}), got "
                          f"{getattr(X, 'dtype', type(X).__name__)} {getattr(X, 'shape', '')}")
    T = X.shape[0]
    if not (isinstance(out, np.ndarray) and out.dtype == _F32 and out.shape == (T, pm.n_rows)
            and out.flags.writeable):
        raise ConfigError(f"matmul {pm.name}: out must be writeable float32 ({T}, {pm.n_rows}), got "
                          f"{getattr(out, 'dtype', type(out).__name__)} {getattr(out, 'shape', '')}")
    if T == 0:
        return
    if pm.q8 is not None:
        matmul_q8(out, pm, X)
        return
    tiled = T >= (MATMUL_MIN_T if few_rows else TILED_MIN_T)
    if not tiled and (T == 1 or pm.rows_kernel is None or not few_rows):
        for i in range(T):
            xi = np.ascontiguousarray(X[i])
            if out[i].flags.c_contiguous:
                pm.kernel(out[i], pm.buf, xi, pm.scratch)
            else:
                tmp = np.empty(pm.n_rows, np.float32)
                pm.kernel(tmp, pm.buf, xi, pm.scratch)
                out[i] = tmp
        return
    if not X.flags.c_contiguous or np.may_share_memory(out, X):
        X = np.array(X, dtype=np.float32, order="C")
    dst = out if out.flags.c_contiguous else np.empty((T, pm.n_rows), np.float32)
    if not tiled:
        if pm.rows_scratch.shape[0] < T:
            pm.rows_scratch = np.repeat(pm.scratch[None, :], T, axis=0)
        pm.rows_kernel(dst, pm.buf, X, pm.rows_scratch)
    else:
        n_chunks = min(numba.get_num_threads(), pm.n_tiles)
        wts = np.empty((n_chunks, pm.n_cols, decoded_rows(pm.tile_rows)), np.float32)
        MATMUL_TILES[pm.family](dst, pm.buf, X, pm.kind, pm.n_blocks, pm.tile_rows, wts)
    if dst is not out:
        out[...] = dst


def matmul_q8(out: np.ndarray, pm: PackedMatrix, X: np.ndarray) -> None:
    """out (T, n_rows) = W @ q8(X) for a matrix packed with precision="q8" (arguments as matmul's,
    not checked again): one q8 kernel call, which quantizes X into pm.q8_acts first; on the calling
    thread for a matrix below PAR_MIN_WEIGHTS weights or when one thread is set."""
    if not X.flags.c_contiguous:
        X = np.ascontiguousarray(X, dtype=np.float32)
    dst = out if out.flags.c_contiguous else np.empty(out.shape, np.float32)   # X is read before out is written
    kernel = pm.q8[1] if numba.get_num_threads() == 1 else pm.q8_kernel
    kernel(dst, pm.buf, X, *pm.q8_acts.for_rows(X.shape[0]), pm.n_blocks)
    if dst is not out:
        out[...] = dst
