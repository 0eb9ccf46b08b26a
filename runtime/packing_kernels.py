"""Packing in Numba: file blocks -> the per-tile records of quant_tiles.py, for the common weight types.

packing.py lays the records out with NumPy (the oracle: whole-array field extraction, lanes moved
by transposes), several passes over temporaries a few times the size of the rows, which made
repacking the bulk of loading a large model. The kernels here write each record byte once, straight
from the file's blocks, for Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q4_K, Q5_K and Q6_K (every type of the
Q4_K_M / Q5_K_M / Q8_0 / Q4_0 files people download) and for the q8 mode's own layouts
(packing_q8.py); the other types keep the NumPy packing. tests/test_packing_kernels.py checks every
byte against the NumPy packing.

Record layout (packing.to_lanes / build_records): a tile holds 8 G rows (G groups of 8 lanes); per
(tile, block column) a record concatenates parts, each a per-row field array of shape (A, B) (A
the dimensions moved before the groups, e.g. a K-quant's 8 sub-blocks) of e-byte little-endian
elements. Element (a, b) of the row in group g, lane l sits at byte

    part_offset + e * (((a * G + g) * B + b) * 8 + l).

Rows past the matrix's end (the last tile's padding) are zeros.

Entries: pack_records_fast(qtype, data, n_rows, n_cols) and pack_records_q8_fast, the same contracts
and bytes as packing.pack_records and packing_q8.pack_records_q8, chunked the same way
(packing.pack_in_chunks: file pages released as packed).
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.packing import pack_in_chunks, pack_records, records_buffer
from ringllm.runtime.packing_q8 import Q8_GROUPS, Q8_OWN_LAYOUT, Q8_TILE
from ringllm.runtime.quant_tiles import GROUP, tile_rows
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType
from ringllm.runtime.simd import ld_u64, st_u16, st_u32

__all__ = ["FAST_PACK_TYPES", "record_bytes", "pack_part_fast", "pack_records_fast", "pack_part_q8_fast",
           "pack_records_q8_fast"]


# ==================================================================================================
# Byte writers and the lane position formula
# ==================================================================================================
# The kernels walk each row of a tile once, its blocks in file order (the reads stream), and write
# that row's lane of every record; rec3 (nt, nb, record_bytes) and blocks (n_rows, nb, block_bytes)
# are indexed directly (rec3[t, b, o], blocks[r, b, k]): no per-record views in the inner loops.

@njit(cache=True, nogil=True, inline="always")
def _at(o, e, a, g, groups, width, b, lane):
    """Byte offset of element (a, b) of lane `lane` of group g in a part at o (module docstring)."""
    return o + e * (((a * groups + g) * width + b) * 8 + lane)


@njit(cache=True, nogil=True, inline="always")
def _copy2(rec3, t, b, o, blocks, r, src):
    """Two bytes of block (r, b) at src (an f16, as stored) to record (t, b) at o."""
    rec3[t, b, o] = blocks[r, b, src]
    rec3[t, b, o + 1] = blocks[r, b, src + 1]


@njit(cache=True, nogil=True, inline="always")
def _put32(rec3, t, b, o, v):
    """v (< 2^32) as four little-endian bytes at record (t, b), byte o."""
    rec3[t, b, o] = v & 255
    rec3[t, b, o + 1] = (v >> 8) & 255
    rec3[t, b, o + 2] = (v >> 16) & 255
    rec3[t, b, o + 3] = (v >> 24) & 255


@njit(cache=True, nogil=True, inline="always")
def _zero_padded_tile(rec3, t, rows_per_tile, n_rows):
    """Zero the records of tile t when it runs past the last row (its padding lanes stay 0)."""
    if (t + 1) * rows_per_tile > n_rows:
        for b in range(rec3.shape[1]):
            for i in range(rec3.shape[2]):
                rec3[t, b, i] = 0


@njit(cache=True, nogil=True, inline="always")
def _q5_value(blocks, r, b, qs_off, qh_bits, c, shift):
    """Column c of a 32-value 5-bit block: the low nibble from qs, bit 4 from bit c of qh_bits. shift < 0:
    legacy Q5_0 / Q5_1 (column c < 16 in the low nibble of qs[c], else the high one of qs[c - 16]);
    else a Q5_K sub-block (column c in nibble `shift` of qs[c])."""
    if shift < 0:
        lo = (blocks[r, b, qs_off + c] & 15) if c < 16 else (blocks[r, b, qs_off + c - 16] >> 4)
    else:
        lo = (blocks[r, b, qs_off + c] >> shift) & 15
    return np.int64(lo) | (((qh_bits >> c) & 1) << 4)


@njit(cache=True, nogil=True, inline="always")
def _fields5_put(rec3, t, b, o, blocks, r, qs_off, qh_bits, shift, groups, a, g, lane):
    """The six 5-bit field dwords of a 32-value block (packing._fields5: column 6m + i at bits 5i of
    dword m < 5, columns 30, 31 at bits 0 and 5 of dword 5), values by _q5_value, into the part at o,
    sub-block a."""
    for m in range(6):
        v = np.int64(0)
        for i in range(6 if m < 5 else 2):
            v |= _q5_value(blocks, r, b, qs_off, qh_bits, 6 * m + i, shift) << (5 * i)
        _put32(rec3, t, b, _at(o, 4, a, g, groups, 6, m, lane), v)


@njit(cache=True, nogil=True, inline="always")
def _kquant_scales(rec3, t, b, blocks, r, groups, g, lane):
    """Q4_K / Q5_K: d, dmin [G][8] f16 at 0 and 16 G; the 6-bit scales and mins [8][G][8] u8 at 32 G and
    96 G (packing._scale_min_k4 of the 12 bytes at blk[4:16])."""
    _copy2(rec3, t, b, _at(0, 2, 0, g, groups, 1, 0, lane), blocks, r, 0)
    _copy2(rec3, t, b, _at(16 * groups, 2, 0, g, groups, 1, 0, lane), blocks, r, 2)
    for j in range(8):
        if j < 4:
            d = blocks[r, b, 4 + j] & 63
            m = blocks[r, b, 8 + j] & 63
        else:
            d = (blocks[r, b, 8 + j] & 15) | ((blocks[r, b, j] >> 6) << 4)
            m = (blocks[r, b, 8 + j] >> 4) | ((blocks[r, b, 4 + j] >> 6) << 4)
        rec3[t, b, _at(32 * groups, 1, j, g, groups, 1, 0, lane)] = d
        rec3[t, b, _at(96 * groups, 1, j, g, groups, 1, 0, lane)] = m


@njit(cache=True, nogil=True, inline="always")
def _q6_values(vals, blocks, r, b):
    """vals (256,) i64 = Q6_K's unsigned 6-bit values of block (r, b) in column order (packing.q6k_values:
    ql at 0, qh at 128)."""
    for n in range(2):
        for l in range(32):
            ql0, ql1 = np.int64(blocks[r, b, 64 * n + l]), np.int64(blocks[r, b, 64 * n + 32 + l])
            qh = np.int64(blocks[r, b, 128 + 32 * n + l])
            vals[128 * n + l] = (ql0 & 15) | ((qh & 3) << 4)
            vals[128 * n + 32 + l] = (ql1 & 15) | (((qh >> 2) & 3) << 4)
            vals[128 * n + 64 + l] = (ql0 >> 4) | (((qh >> 4) & 3) << 4)
            vals[128 * n + 96 + l] = (ql1 >> 4) | (((qh >> 6) & 3) << 4)


@njit(cache=True, nogil=True, inline="always")
def _q6k_scales_and_values(rec3, t, b, blocks, r, groups, g, lane, vals):
    """Q6_K, both layouts: d [G][8] f16 (blk[208:210]) at 0, scales [16][G][8] i8 (blk[192:208]) at 16 G;
    vals (256,) = the block's 6-bit values (_q6_values)."""
    _copy2(rec3, t, b, _at(0, 2, 0, g, groups, 1, 0, lane), blocks, r, 208)
    for k in range(16):
        rec3[t, b, _at(16 * groups, 1, k, g, groups, 1, 0, lane)] = blocks[r, b, 192 + k]
    _q6_values(vals, blocks, r, b)


# ==================================================================================================
# One kernel per type: records (nt, nb, record_bytes) from blocks (n_rows, nb, block_bytes)
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def _pack_q8_0(rec3, blocks, n_rows):
    """Q8_0 (G = 2): values [G][32][8] i8, then d [G][8] f16."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 2
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                for i in range(32):
                    rec3[t, b, _at(0, 1, 0, g, groups, 32, i, lane)] = blocks[r, b, 2 + i]
                _copy2(rec3, t, b, _at(256 * groups, 2, 0, g, groups, 1, 0, lane), blocks, r, 0)


_LOW_NIBBLES = np.uint64(0x0F0F0F0F0F0F0F0F)
_HIGH_NIBBLES = np.uint64(0xF0F0F0F0F0F0F0F0)


@njit(cache=True, nogil=True, inline="always")
def _even_bytes(z):
    """Bytes 0, 2, 4 and 6 of uint64 z, as the four bytes of a uint64 below 2^32."""
    return ((z & np.uint64(0xFF)) | ((z >> np.uint64(8)) & np.uint64(0xFF00))
            | ((z >> np.uint64(16)) & np.uint64(0xFF0000)) | ((z >> np.uint64(24)) & np.uint64(0xFF000000)))


@njit(cache=True, nogil=True, inline="always")
def _low_nibble_pairs(x):
    """Of eight bytes q0..q7 (uint64 x): the four bytes (q_2p & 15) | (q_2p+1 & 15) << 4, p = 0..3."""
    lo = x & _LOW_NIBBLES
    return _even_bytes(lo | (lo >> np.uint64(4)))        # byte 2p gets q_2p+1's low nibble on top


@njit(cache=True, nogil=True, inline="always")
def _high_nibble_pairs(x):
    """Of eight bytes q0..q7 (uint64 x): the four bytes (q_2p >> 4) | (q_2p+1 & 0xF0), p = 0..3."""
    hi = x & _HIGH_NIBBLES
    return _even_bytes((hi >> np.uint64(4)) | (hi >> np.uint64(8)))


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q4_legacy(rec3, blocks, n_rows, qs_off, has_min):
    """Q4_0 (qs_off 2) / Q4_1 (qs_off 4, has_min) (G = 3): nibble dwords [G][4][8] u32 (byte p of the 16:
    columns 2p, 2p + 1 of the block, p < 8 from the low nibbles of qs[2p], qs[2p + 1], p >= 8 from their
    high nibbles; packing._nib_dwords_of_qs), d [G][8] f16, Q4_1's m [G][8] f16.

    Eight bytes of qs at a time: each block's 16 bytes of qs are two 64-bit loads, and the 16 record
    bytes of the row's lane four 32-bit stores (dwords 0 and 1 from the low nibbles, 2 and 3 from the
    high ones); d and m come from one 64-bit load of the block's head. rec3 and blocks are addressed
    by flat byte offsets (both C-contiguous: records_buffer, _read_only_blocks): a byte at a time, the
    three-index addressing of every byte bound the kernel, not the memory."""
    nt, nb, rb = rec3.shape[0], rec3.shape[1], rec3.shape[2]
    size = blocks.shape[2]
    groups = 3
    o_d = 128 * groups
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            o_q = _at(0, 4, 0, g, groups, 4, 0, lane)                # dword 0; dwords 1, 2, 3 at +32, +64, +96
            o_dl = _at(o_d, 2, 0, g, groups, 1, 0, lane)
            o_ml = _at(o_d + 16 * groups, 2, 0, g, groups, 1, 0, lane)
            for b in range(nb):
                src, dst = (r * nb + b) * size, (t * nb + b) * rb
                x0, x1 = ld_u64(blocks, src + qs_off), ld_u64(blocks, src + qs_off + 8)
                st_u32(rec3, dst + o_q, _low_nibble_pairs(x0))
                st_u32(rec3, dst + o_q + 32, _low_nibble_pairs(x1))
                st_u32(rec3, dst + o_q + 64, _high_nibble_pairs(x0))
                st_u32(rec3, dst + o_q + 96, _high_nibble_pairs(x1))
                head = ld_u64(blocks, src)                            # d (and Q4_1's m) in its low bytes
                st_u16(rec3, dst + o_dl, head)
                if has_min:
                    st_u16(rec3, dst + o_ml, head >> np.uint64(16))


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q5_legacy(rec3, blocks, n_rows, qh_off, has_min):
    """Q5_0 (qh at 2) / Q5_1 (qh at 4, has_min) (G = 3): 5-bit field dwords [G][6][8] u32
    (_fields5_put), d [G][8] f16, Q5_1's m [G][8] f16."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 3
    o_d = 192 * groups
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                qh = (np.int64(blocks[r, b, qh_off]) | (np.int64(blocks[r, b, qh_off + 1]) << 8)
                      | (np.int64(blocks[r, b, qh_off + 2]) << 16) | (np.int64(blocks[r, b, qh_off + 3]) << 24))
                _fields5_put(rec3, t, b, 0, blocks, r, qh_off + 4, qh, -1, groups, 0, g, lane)
                _copy2(rec3, t, b, _at(o_d, 2, 0, g, groups, 1, 0, lane), blocks, r, 0)
                if has_min:
                    _copy2(rec3, t, b, _at(o_d + 16 * groups, 2, 0, g, groups, 1, 0, lane), blocks, r, 2)


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q4_k(rec3, blocks, n_rows):
    """Q4_K (G = 3): scales (_kquant_scales), then nibble dwords [8 sub][G][4][8] u32 at 160 G: sub-block
    2c + h, column l is nibble h of qs[32 c + l] (qs at blk[16:144]); byte k of dword s holds columns
    8s + 2k and 8s + 2k + 1."""
    nt, nb, rb = rec3.shape[0], rec3.shape[1], rec3.shape[2]
    size = blocks.shape[2]
    groups = 3
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                _kquant_scales(rec3, t, b, blocks, r, groups, g, lane)
                src, dst = (r * nb + b) * size + 16, (t * nb + b) * rb      # qs; this record (flat, as Q4_0's)
                for c in range(4):
                    for s in range(4):
                        o = dst + _at(160 * groups, 4, 2 * c, g, groups, 4, s, lane)
                        x = ld_u64(blocks, src + 32 * c + 8 * s)
                        st_u32(rec3, o, _low_nibble_pairs(x))
                        st_u32(rec3, o + 4 * 4 * groups * 8, _high_nibble_pairs(x))    # sub-block 2c + 1


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q5_k(rec3, blocks, n_rows):
    """Q5_K (G = 3): scales (_kquant_scales), then 5-bit field dwords [8 sub][G][6][8] u32 at 160 G:
    sub-block 2c + h, column l is nibble h of qs[32 c + l] (qs at blk[48:176]) with bit 2c + h of
    qh[l] (qh at blk[16:48]) as bit 4."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 3
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                _kquant_scales(rec3, t, b, blocks, r, groups, g, lane)
                for sub in range(8):
                    bits = np.int64(0)        # bit l: bit `sub` of qh[l]
                    for col in range(32):
                        bits |= np.int64((blocks[r, b, 16 + col] >> sub) & 1) << col
                    _fields5_put(rec3, t, b, 160 * groups, blocks, r, 48 + 32 * (sub // 2), bits, 4 * (sub % 2),
                                 groups, sub, g, lane)


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q6_k(rec3, blocks, n_rows):
    """Q6_K (G = 2): d [G][8] f16 (blk[208:210]), scales [16][G][8] i8 (blk[192:208]) at 16 G, 6-bit
    field dwords [8 sub][G][6][8] u32 at 144 G (packing._fields6: dword 3h + m holds column
    16h + 5m + i at bits 6i and bits 2m, 2m + 1 of column 16h + 15 at bits 30, 31)."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 2
    vals = np.empty(256, np.int64)
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                _q6k_scales_and_values(rec3, t, b, blocks, r, groups, g, lane, vals)
                for sub in range(8):
                    for h in range(2):
                        c0 = 32 * sub + 16 * h
                        top = vals[c0 + 15]
                        for m in range(3):
                            c = c0 + 5 * m
                            v = (vals[c] | (vals[c + 1] << 6) | (vals[c + 2] << 12) | (vals[c + 3] << 18)
                                 | (vals[c + 4] << 24) | (((top >> (2 * m)) & 3) << 30))
                            _put32(rec3, t, b, _at(144 * groups, 4, sub, g, groups, 6, 3 * h + m, lane), v)


# ==================================================================================================
# The q8 mode's own layouts (packing_q8.py): 16-row tiles, weight bytes in act_quant's column order
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _nibble_dwords_put(rec3, t, b, o, vals, v0, groups, g, lane):
    """The 4 dwords of low nibbles of vals[v0:v0 + 32] (packing_q8._nibbles: byte k of dword s holds
    columns 8s + 2k, 8s + 2k + 1 in bits 0-3, 4-7) at part o, group g, lane."""
    for s in range(4):
        base = _at(o, 4, 0, g, groups, 4, s, lane)
        for k in range(4):
            c = v0 + 8 * s + 2 * k
            rec3[t, b, base + k] = (vals[c] & 15) | ((vals[c + 1] & 15) << 4)


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q8_q8_0(rec3, blocks, n_rows):
    """Q8_0, q8 layout (G = 2): quads [G][8][8] u32 (quad 2a: columns 8a + 0, 2, 4, 6; quad 2a + 1:
    8a + 1, 3, 5, 7), then d [G][8] f16."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 2
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                for qd in range(8):
                    o = _at(0, 4, 0, g, groups, 8, qd, lane)
                    for i in range(4):
                        rec3[t, b, o + i] = blocks[r, b, 2 + 8 * (qd // 2) + 2 * i + qd % 2]
                _copy2(rec3, t, b, _at(256 * groups, 2, 0, g, groups, 1, 0, lane), blocks, r, 0)


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q8_q5_0(rec3, blocks, n_rows):
    """Q5_0, q8 layout (G = 2): low-nibble dwords [G][4][8] u32, high-bit dwords [G][8] u32 at 128 G (byte
    k holds bit 4 of column 8s + 2k at bit 4 + s and of column 8s + 2k + 1 at bit s), d [G][8] f16 at
    160 G."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 2
    vals = np.empty(32, np.int64)
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                qh = (np.int64(blocks[r, b, 2]) | (np.int64(blocks[r, b, 3]) << 8)
                      | (np.int64(blocks[r, b, 4]) << 16) | (np.int64(blocks[r, b, 5]) << 24))
                for c in range(32):
                    vals[c] = _q5_value(blocks, r, b, 6, qh, c, -1)
                _nibble_dwords_put(rec3, t, b, 0, vals, 0, groups, g, lane)
                o = _at(128 * groups, 4, 0, g, groups, 1, 0, lane)
                for k in range(4):
                    byte = np.int64(0)
                    for s in range(4):
                        byte |= (((vals[8 * s + 2 * k] >> 4) & 1) << (4 + s)) | (((vals[8 * s + 2 * k + 1] >> 4) & 1) << s)
                    rec3[t, b, o + k] = byte
                _copy2(rec3, t, b, _at(160 * groups, 2, 0, g, groups, 1, 0, lane), blocks, r, 0)


@njit(cache=True, nogil=True, fastmath=False)
def _pack_q8_q6_k(rec3, blocks, n_rows):
    """Q6_K, q8 layout (G = 2): d [G][8] f16, scales [16][G][8] i8 at 16 G, then per sub-block j at
    144 G + 192 G j: low-nibble dwords [G][4][8] u32 and, 128 G on, high-bit dwords [G][2][8] u32 (dword
    h, byte k: bits 4-5 of columns 16h + 2k, 16h + 2k + 1 at bits 4-5, 6-7 and of columns 16h + 8 + 2k,
    16h + 8 + 2k + 1 at bits 0-1, 2-3)."""
    nt, nb = rec3.shape[0], rec3.shape[1]
    groups = 2
    vals = np.empty(256, np.int64)
    for t in range(nt):
        _zero_padded_tile(rec3, t, 8 * groups, n_rows)
        for slot in range(min(8 * groups, n_rows - t * 8 * groups)):
            r, g, lane = t * 8 * groups + slot, slot // 8, slot % 8
            for b in range(nb):
                _q6k_scales_and_values(rec3, t, b, blocks, r, groups, g, lane, vals)
                for j in range(8):
                    base = 144 * groups + 192 * groups * j
                    _nibble_dwords_put(rec3, t, b, base, vals, 32 * j, groups, g, lane)
                    for h in range(2):
                        o = _at(base + 128 * groups, 4, 0, g, groups, 2, h, lane)
                        for k in range(4):
                            c0, c1 = 32 * j + 16 * h + 2 * k, 32 * j + 16 * h + 8 + 2 * k
                            rec3[t, b, o + k] = ((((vals[c0] >> 4) & 3) << 4) | (((vals[c0 + 1] >> 4) & 3) << 6)
                                                 | ((vals[c1] >> 4) & 3) | (((vals[c1 + 1] >> 4) & 3) << 2))


# ==================================================================================================
# Entry
# ==================================================================================================

# bytes of one (tile, block) record per type, G = tile_rows // 8 (the sums of the parts above)
_RECORD_PER_GROUP = {GGMLType.Q8_0: 272, GGMLType.Q4_0: 144, GGMLType.Q4_1: 160, GGMLType.Q5_0: 208,
                     GGMLType.Q5_1: 224, GGMLType.Q4_K: 1184, GGMLType.Q5_K: 1696, GGMLType.Q6_K: 1680}
FAST_PACK_TYPES = frozenset(_RECORD_PER_GROUP)


def record_bytes(qtype: GGMLType) -> int:
    """Bytes of one (tile, block column) record of qtype's packed layout."""
    return _RECORD_PER_GROUP[qtype] * (tile_rows(qtype) // GROUP)


def _read_only_blocks(data, n_rows: int, nb: int, size: int) -> np.ndarray:
    """data as (n_rows, nb, size) uint8 blocks, read-only: one compiled signature per kernel (file rows are
    read-only; stacked copies and test arrays are not)."""
    blocks = np.ascontiguousarray(np.asarray(data).reshape(n_rows, nb, size))    # kernels address it flat
    if blocks.flags.writeable:
        blocks = blocks.view()
        blocks.flags.writeable = False
    return blocks


def pack_part_fast(qtype: GGMLType, data: np.ndarray, n_rows: int, n_cols: int, alloc) -> np.ndarray:
    """The records of one chunk of rows (packing._pack_part's contract), by the type's kernel."""
    block, size = BLOCK_LAYOUT[qtype]
    nb = n_cols // block
    nt = -(-n_rows // tile_rows(qtype))
    buf = records_buffer(nt * nb * record_bytes(qtype), alloc)
    rec3, blocks = buf.reshape(nt, nb, record_bytes(qtype)), _read_only_blocks(data, n_rows, nb, size)
    if qtype == GGMLType.Q8_0:
        _pack_q8_0(rec3, blocks, np.int64(n_rows))
    elif qtype in (GGMLType.Q4_0, GGMLType.Q4_1):
        q41 = qtype == GGMLType.Q4_1
        _pack_q4_legacy(rec3, blocks, np.int64(n_rows), np.int64(4 if q41 else 2), q41)
    elif qtype in (GGMLType.Q5_0, GGMLType.Q5_1):
        q51 = qtype == GGMLType.Q5_1
        _pack_q5_legacy(rec3, blocks, np.int64(n_rows), np.int64(4 if q51 else 2), q51)
    elif qtype == GGMLType.Q4_K:
        _pack_q4_k(rec3, blocks, np.int64(n_rows))
    elif qtype == GGMLType.Q5_K:
        _pack_q5_k(rec3, blocks, np.int64(n_rows))
    else:
        _pack_q6_k(rec3, blocks, np.int64(n_rows))
    return buf


# q8 mode: bytes of one record of the layouts of packing_q8 (G = 2), per type with a layout of its own
_Q8_RECORD_PER_GROUP = {GGMLType.Q8_0: 272, GGMLType.Q5_0: 176, GGMLType.Q6_K: 1680}


def pack_part_q8_fast(qtype: GGMLType, data: np.ndarray, n_rows: int, n_cols: int, alloc) -> np.ndarray:
    """The q8 layout's records of one chunk of rows (packing_q8's per-chunk contract), by the type's kernel."""
    block, size = BLOCK_LAYOUT[qtype]
    nb, nt = n_cols // block, -(-n_rows // Q8_TILE)
    per = _Q8_RECORD_PER_GROUP[qtype] * Q8_GROUPS
    buf = records_buffer(nt * nb * per, alloc)
    rec3, blocks = buf.reshape(nt, nb, per), _read_only_blocks(data, n_rows, nb, size)
    if qtype == GGMLType.Q8_0:
        _pack_q8_q8_0(rec3, blocks, np.int64(n_rows))
    elif qtype == GGMLType.Q5_0:
        _pack_q8_q5_0(rec3, blocks, np.int64(n_rows))
    else:
        _pack_q8_q6_k(rec3, blocks, np.int64(n_rows))
    return buf


def pack_records_q8_fast(qtype: GGMLType, data, n_rows: int, n_cols: int) -> np.ndarray:
    """packing_q8.pack_records_q8 (the same bytes): its own layouts by the kernels above, the 4-bit types'
    exact-mode layout by pack_records_fast."""
    if qtype not in Q8_OWN_LAYOUT:
        return pack_records_fast(qtype, data, n_rows, n_cols)
    return pack_in_chunks(pack_part_q8_fast, qtype, data, n_rows, n_cols, Q8_TILE)


def pack_records_fast(qtype: GGMLType, data, n_rows: int, n_cols: int) -> np.ndarray:
    """packing.pack_records, by the kernels above for FAST_PACK_TYPES (the same bytes), else by NumPy."""
    if qtype not in FAST_PACK_TYPES:
        return pack_records(qtype, data, n_rows, n_cols)
    return pack_in_chunks(pack_part_fast, qtype, data, n_rows, n_cols, tile_rows(qtype))
