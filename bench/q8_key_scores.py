"""Study: scoring q8_0 keys with an int16 query (exact integer dots) against today's decode-to-float path.

    python bench/q8_key_scores.py [--slots 4096] [--group 3] [--head-dim 64] [--repeats 15] [--name q8_key_scores]

The ring layers' attention (stored_attention._scores_span) decodes every q8_0 key row to float32
(eight at a time, kv_tile_math.rows8_at) and takes its dot product with each float32 query of the
group. The arithmetic, not the memory, bounds it (docs/kv_types.md). The variant measured here never
decodes a key: each query head, already rotated and scaled, is quantized once per span to int16 per
block of 32 (scale amax / 32767, round half away from zero), and a key block's score is the exact
integer dot of its 32 int8 values with the 32 int16 ones (vpmovsxbw, vpmaddwd, vpaddd), then
float(dot) x d_key x d_query added over the blocks: eight rows at a time, the eight partial-sum
vectors reduced by simd.vsum8x8, as the float path does. It is llama.cpp's q8_0 x q8_0 dot with the
query kept at 16 bits instead of 8, so the query's rounding (at most amax / 65534 per element) stays
far below the key's own.

Both run on one thread over one kv head's --slots slots (rows in L2/L3 after the first pass, as the
arithmetic's floor) for the --group query heads of that kv head: the float path through the kernels
the attention's span scoring runs (kv_tile_math.rows8_at decoding eight rows into a tile, dot8x2 for
two heads per pass over it, dot8 for a third; without the span's prefetch hints, the rows being in
cache), the integer path head by head. Reported: nanoseconds per slot for the whole group (the
fastest of --repeats passes of 50 calls), and each path's largest score error against float64 scores
of the decoded keys, beside the scores' spread. The integer kernels here are the study's, not the
runtime's. Writes bench/results/<name>.{json,md}.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
from llvmlite import ir
from numba import njit
from numba.extending import intrinsic

sys.path.insert(0, os.path.dirname(__file__))
from common import machine, write_results  # noqa: E402

from numba.core import cgutils, types  # noqa: E402

from ringllm.runtime.kv_codec import block_scale, decode, encode  # noqa: E402
from ringllm.runtime.kv_tile_math import dot8, dot8x2, head_rows, rows8_at  # noqa: E402
from ringllm.runtime.numba_flags import FASTMATH  # noqa: E402
from ringllm.runtime.simd import (i32x8, iadd, itof, ld_i32, vfma, vload, vmul, vsplat, vstore,  # noqa: E402
                                  vsum8x8, vzero)
from ringllm.runtime.stored_attention import stored_work  # noqa: E402

_VW = ir.VectorType(ir.IntType(16), 16)
_VI = ir.VectorType(ir.IntType(32), 8)


def _vector_at(context, builder, arrty, arr, off, offty, vty):
    """Pointer to a vty at byte offset off of array arr's data."""
    data = builder.bitcast(context.make_array(arrty)(context, builder, arr).data, ir.IntType(8).as_pointer())
    return builder.bitcast(builder.gep(data, [context.cast(builder, off, offty, types.intp)]), vty.as_pointer())


@intrinsic
def ld_i8w(typingctx, buf, off):
    """16 int8 at byte offset off sign-extended to 16 int16 lanes (vpmovsxbw), carried as an i32x8."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 16)
        b = builder.load(_vector_at(context, builder, sig.args[0], args[0], args[1], sig.args[1], vb), align=1)
        return builder.bitcast(builder.sext(b, _VW), _VI)
    return i32x8(buf, off), codegen


@intrinsic
def madd16(typingctx, a, b):
    """vpmaddwd: 8 int32 lanes, lane i = a[2i] b[2i] + a[2i+1] b[2i+1] of the two vectors' int16 lanes."""
    def codegen(context, builder, sig, args):
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(_VI, [_VW, _VW]), "llvm.x86.avx2.pmadd.wd")
        return builder.call(fn, [builder.bitcast(args[0], _VW), builder.bitcast(args[1], _VW)])
    return i32x8(a, b), codegen


@njit(cache=False, fastmath=False)
def quantize_queries(qw, h0, group, q16, dq):
    """q16[g] (hd,) int16 = round-half-away(qw[h0 + g] / d) per block of 32, dq[g, b] = d = amax / 32767."""
    hd = qw.shape[1]
    for g in range(group):
        for b in range(hd // 32):
            amax = np.float32(0.0)
            for i in range(32):
                amax = max(amax, abs(qw[h0 + g, 32 * b + i]))
            d = amax / np.float32(32767.0)
            inv = np.float32(1.0) / d if d != 0 else np.float32(0.0)
            dq[g, b] = d
            for i in range(32):
                x = qw[h0 + g, 32 * b + i] * inv
                a = np.floor(abs(x) + np.float32(0.5))
                q16[g, 32 * b + i] = np.int16(a if x >= 0 else -a)


@njit(cache=False, fastmath=FASTMATH, inline="always")
def _block_dot(qb, b, k_flat, r):
    """int32 lanes of the dot of the int16 query's block b (bytes qb) with the int8 block at byte r."""
    lo = madd16(ld_i32(qb, 64 * b), ld_i8w(k_flat, r + 2))
    hi = madd16(ld_i32(qb, 64 * b + 32), ld_i8w(k_flat, r + 18))
    return iadd(lo, hi)


@njit(cache=False, fastmath=FASTMATH, inline="always")
def _scaled_block(qb, b, k_flat, r, d, acc):
    """acc + float(the block-b integer dot at byte r) x (the key block's scale x d, the query's)."""
    return vfma(itof(_block_dot(qb, b, k_flat, r)), vsplat(block_scale(k_flat, r) * d), acc)


@njit(cache=False, fastmath=FASTMATH)
def scores_int16(scores, h0, group, q16, dq, k_l, h, ja, jb):
    """scores[h0 + g, ja:jb] (jb - ja a multiple of 8) of the q8_0 rows of head h against the int16
    queries q16[g] with block scales dq[g]."""
    width = k_l.shape[2]
    nb = width // 34
    k_flat = k_l[h].reshape(-1).view(np.uint8)
    for g in range(group):
        qb = q16[g].view(np.uint8)
        row = scores[h0 + g]
        for j in range(ja, jb, 8):
            a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = vzero()
            for b in range(nb):
                d = dq[g, b]
                r = j * width + b * 34
                a0 = _scaled_block(qb, b, k_flat, r, d, a0)
                a1 = _scaled_block(qb, b, k_flat, r + width, d, a1)
                a2 = _scaled_block(qb, b, k_flat, r + 2 * width, d, a2)
                a3 = _scaled_block(qb, b, k_flat, r + 3 * width, d, a3)
                a4 = _scaled_block(qb, b, k_flat, r + 4 * width, d, a4)
                a5 = _scaled_block(qb, b, k_flat, r + 5 * width, d, a5)
                a6 = _scaled_block(qb, b, k_flat, r + 6 * width, d, a6)
                a7 = _scaled_block(qb, b, k_flat, r + 7 * width, d, a7)
            vstore(row, j, vsum8x8(a0, a1, a2, a3, a4, a5, a6, a7))


@njit(cache=False, fastmath=FASTMATH)
def scores_int16_rowsum(scores, h0, group, q16, dq, k_l, h, ja, jb, dk):
    """scores_int16 with the scales applied after the reduction: per block, the eight rows' integer dots
    are reduced to one vector of eight sums (vsum8x8 of their float lanes), times the eight rows' key
    scales (one vector, read once per eight rows for the whole group: dk (8 nb,) f32 scratch) and the
    query's; one multiply-add per block instead of one per row and block."""
    width = k_l.shape[2]
    nb = width // 34
    k_flat = k_l[h].reshape(-1).view(np.uint8)
    for j in range(ja, jb, 8):
        for b in range(nb):
            for r in range(8):
                dk[8 * b + r] = block_scale(k_flat, (j + r) * width + b * 34)
        for g in range(group):
            qb = q16[g].view(np.uint8)
            acc = vzero()
            for b in range(nb):
                r = j * width + b * 34
                i0 = _block_dot(qb, b, k_flat, r)
                i1 = _block_dot(qb, b, k_flat, r + width)
                i2 = _block_dot(qb, b, k_flat, r + 2 * width)
                i3 = _block_dot(qb, b, k_flat, r + 3 * width)
                i4 = _block_dot(qb, b, k_flat, r + 4 * width)
                i5 = _block_dot(qb, b, k_flat, r + 5 * width)
                i6 = _block_dot(qb, b, k_flat, r + 6 * width)
                i7 = _block_dot(qb, b, k_flat, r + 7 * width)
                sums = vsum8x8(itof(i0), itof(i1), itof(i2), itof(i3), itof(i4), itof(i5), itof(i6), itof(i7))
                acc = vfma(sums, vmul(vload(dk, 8 * b), vsplat(dq[g, b])), acc)
            vstore(scores[h0 + g], j, acc)


@njit(cache=False, fastmath=FASTMATH)
def scores_float(scores, qw, group, k_l, h, ja, jb, tile):
    """scores[g, ja:jb] (jb - ja a multiple of 8) as the attention scores a span today: eight rows decoded
    into tile, two query heads per pass over it (dot8x2), the last one alone (dot8)."""
    hd = qw.shape[1]
    rows = head_rows(k_l, h, tile)
    for j in range(ja, jb, 8):
        base = rows8_at(k_l, h, j, tile)
        g = 0
        while g + 2 <= group:
            dot8x2(scores[g], scores[g + 1], j, qw[g], qw[g + 1], rows, base, hd)
            g += 2
        if g < group:
            dot8(scores[g], j, qw[g], rows, base, hd)


def _fastest(fn, repeats: int, calls: int = 50) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--slots", type=int, default=4096)
    ap.add_argument("--group", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=15)
    ap.add_argument("--name", default="q8_key_scores")
    args = ap.parse_args()
    slots, group, hd = args.slots - args.slots % 8, args.group, args.head_dim
    rng = np.random.default_rng(0)
    k_l = encode(rng.standard_normal((1, slots, hd)).astype(np.float32), "q8_0")
    qw = (rng.standard_normal((group, hd)) * hd ** -0.5).astype(np.float32)      # rotated queries, times scale
    tile = stored_work(1, group, hd, slots)[2, 0, :8].reshape(-1)      # the unit's tile rows of the attention's scratch
    s_float = np.zeros((group, slots), np.float32)
    s_int = np.zeros((group, slots), np.float32)
    s_rowsum = np.zeros((group, slots), np.float32)
    dk = np.zeros(8 * (hd // 32), np.float32)
    q16 = np.zeros((group, hd), np.int16)
    dq = np.zeros((group, hd // 32), np.float32)

    def float_path():
        scores_float(s_float, qw, group, k_l, 0, 0, slots, tile)

    def int_path():
        quantize_queries(qw, 0, group, q16, dq)
        scores_int16(s_int, 0, group, q16, dq, k_l, 0, 0, slots)

    def rowsum_path():
        quantize_queries(qw, 0, group, q16, dq)
        scores_int16_rowsum(s_rowsum, 0, group, q16, dq, k_l, 0, 0, slots, dk)

    t_float, t_int = _fastest(float_path, args.repeats), _fastest(int_path, args.repeats)
    t_rowsum = _fastest(rowsum_path, args.repeats)
    ref = qw.astype(np.float64) @ decode(k_l, hd)[0].astype(np.float64).T
    err_float, err_int = float(np.abs(s_float - ref).max()), float(np.abs(s_int - ref).max())
    err_rowsum = float(np.abs(s_rowsum - ref).max())
    spread = float(ref.std())
    result = {"slots": slots, "group": group, "head_dim": hd,
              "ns_per_slot": {"float (decode + dot8x2/dot8)": t_float * 1e9 / slots,
                              "int16 query (vpmaddwd)": t_int * 1e9 / slots,
                              "int16 query, scales after the reduction": t_rowsum * 1e9 / slots},
              "speedup": {"int16 query": t_float / t_int, "scales after the reduction": t_float / t_rowsum},
              "max_abs_score_error": {"float": err_float, "int16 query": err_int,
                                      "scales after the reduction": err_rowsum}, "score_std": spread}
    cmd = "python bench/q8_key_scores.py " + " ".join(sys.argv[1:])
    md = [f"# q8_0 key scores: int16 query vs decode to float\n",
          f"`{cmd.strip()}` on {machine()['cpu']}, one thread; {slots} slots of one kv head, {group} query heads, "
          f"head_dim {hd}; fastest of {args.repeats} passes of 50 calls.\n",
          "| path | ns per slot (whole group) | largest score error vs float64 |", "|---|---|---|",
          f"| float (today: decode 8 rows, dot8x2 + dot8) | {t_float * 1e9 / slots:.2f} | {err_float:.2e} |",
          f"| int16 query, int8 keys (vpmaddwd), scale per row and block | {t_int * 1e9 / slots:.2f} | {err_int:.2e} |",
          f"| the same, scales after the eight rows' reduction | {t_rowsum * 1e9 / slots:.2f} | {err_rowsum:.2e} |",
          f"\nSpeed-up over the float path: {t_float / t_int:.2f}x and {t_float / t_rowsum:.2f}x. "
          f"Scores' standard deviation: {spread:.3f}."]
    write_results(args.name, {"machine": machine(), "command": cmd, **result}, "\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
