"""Packing for the q8 mode (NumPy, once at load; the oracle of packing_kernels.pack_records_q8_fast, which
loading uses): the record layouts of quant_tiles_q8.py.

The 4-bit types (Q4_0, Q4_1, Q4_K) keep the layout of the exact mode (packing.pack_records): their
nibble dwords already split into bytes with one mask (low nibbles: columns 8s + 0, 2, 4, 6; high:
8s + 1, 3, 5, 7). The types below get a layout made for byte products instead, in 16-row tiles
(two groups of 8 lanes), every weight byte in the column order of act_quant's xq:

  Q5_0 record per 32 columns: nibbles [2 groups][4 slots][8 lanes] u32 (low 4 bits, as Q4_0's),
      high bits [2][8] u32, d [2][8] f16. In a lane's high-bit dword, byte k holds bit 4 of column
      8s + 2k at bit 4 + s and bit 4 of column 8s + 2k + 1 at bit s (s = 0..3 the slot).
  Q6_K record per 256 columns: d [2][8] f16, scales [16][2][8] i8, then per 32 columns j:
      nibbles [2][4][8] u32 (low 4 bits) and high bits [2][2][8] u32: dword h serves slots 2h and
      2h + 1; byte k holds bits 4-5 of column 8s + 2k at bits 4-5 (s = 2h) or 0-1 (s = 2h + 1),
      those of column 8s + 2k + 1 at bits 6-7 or 2-3.
  Q8_0 record per 32 columns: values [2][8 quads][8 lanes][4] i8 (quad 2s: columns 8s + 0, 2, 4,
      6; quad 2s + 1: 8s + 1, 3, 5, 7), d [2][8] f16.

Bytes per weight equal the file's (Q5_0 22 / 32, Q6_K 210 / 256, Q8_0 34 / 32).
"""
from __future__ import annotations

import numpy as np

from ringllm.runtime.packing import build_records, pack_in_chunks, pack_records, q6k_values, to_lanes
from ringllm.runtime.quant_tiles import tile_rows
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

__all__ = ["Q8_TILE", "Q8_GROUPS", "Q8_OWN_LAYOUT", "q8_tile_rows", "pack_records_q8"]

Q8_GROUPS = 2                     # groups of 8 rows per tile in the q8-only layouts
Q8_TILE = 8 * Q8_GROUPS
Q8_OWN_LAYOUT = (GGMLType.Q5_0, GGMLType.Q6_K, GGMLType.Q8_0)
_EVEN_ODD = np.array([0, 2, 4, 6, 1, 3, 5, 7])


def q8_tile_rows(qtype: GGMLType) -> int:
    """Rows per tile of qtype's q8 layout."""
    return Q8_TILE if qtype in Q8_OWN_LAYOUT else tile_rows(qtype)


def _f16_bits(blocks: np.ndarray, off: int) -> np.ndarray:
    return blocks[..., off:off + 2].copy().view(np.uint16)[..., 0]


def _nibbles(q: np.ndarray) -> np.ndarray:
    """q (..., 32) values -> (..., 4) u32 of their low nibbles: byte k of dword s = column 8s + 2k
    (bits 0-3) and 8s + 2k + 1 (bits 4-7)."""
    p = (q.astype(np.uint8) & 15).reshape(q.shape[:-1] + (16, 2))
    return np.ascontiguousarray(p[..., 0] | (p[..., 1] << 4)).view("<u4").reshape(q.shape[:-1] + (4,))


def _high1(q: np.ndarray) -> np.ndarray:
    """Bit 4 of q (..., 32) -> (..., 1) u32 in the Q5_0 high-bit layout (module docstring)."""
    h = ((q.astype(np.uint32) >> 4) & 1).reshape(q.shape[:-1] + (4, 4, 2))          # slot s, byte k, even/odd
    s = np.arange(4, dtype=np.uint32)[:, None]
    byte = ((h[..., 0] << (4 + s)) | (h[..., 1] << s)).sum(axis=-2, dtype=np.uint32)   # (..., 4 k)
    return (byte << (8 * np.arange(4, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)[..., None]


def _high2(q: np.ndarray) -> np.ndarray:
    """Bits 4-5 of q (..., 32) -> (..., 2) u32 in the Q6_K high-bit layout (module docstring)."""
    h = ((q.astype(np.uint32) >> 4) & 3).reshape(q.shape[:-1] + (2, 2, 4, 2))       # h, s', byte k, even/odd
    shift_even = np.array([4, 0], np.uint32)[:, None]
    shift_odd = np.array([6, 2], np.uint32)[:, None]
    byte = ((h[..., 0] << shift_even) | (h[..., 1] << shift_odd)).sum(axis=-2, dtype=np.uint32)   # (..., 2, 4)
    return (byte << (8 * np.arange(4, dtype=np.uint32))).sum(axis=-1, dtype=np.uint32)


def _quads(q: np.ndarray) -> np.ndarray:
    """q (..., 32) int8 -> (..., 8 quads, 4) in the Q8_0 quad order (module docstring)."""
    perm = (np.arange(4)[:, None] * 8 + _EVEN_ODD[None, :]).reshape(-1)            # xq's column order
    return q[..., perm].reshape(q.shape[:-1] + (8, 4))


def pack_records_q8(qtype: GGMLType, data, n_rows: int, n_cols: int) -> np.ndarray:
    """Packed uint8 buffer of qtype's q8 layout for a (n_rows, row_bytes) uint8 block matrix, or a list of
    row blocks stacked in order; packed in chunks of whole tiles (packing.pack_in_chunks)."""
    if qtype not in Q8_OWN_LAYOUT:
        return pack_records(qtype, data, n_rows, n_cols)
    return pack_in_chunks(_pack_part_q8, qtype, data, n_rows, n_cols, Q8_TILE)


def _pack_part_q8(qtype: GGMLType, data: np.ndarray, n_rows: int, n_cols: int, alloc) -> np.ndarray:
    """pack_records_q8 of one chunk of rows, its buffer from alloc (packing.build_records)."""
    block, size = BLOCK_LAYOUT[qtype]
    nb = n_cols // block
    blocks = data.reshape(n_rows, nb, size)
    nt = -(-n_rows // Q8_TILE)

    def lanes(a, inner_first=0):
        return to_lanes(a, nt, Q8_GROUPS, inner_first)

    if qtype == GGMLType.Q8_0:
        quads = np.ascontiguousarray(_quads(blocks[..., 2:34].view(np.int8))).view("<u4")[..., 0]   # (R, nb, 8)
        return build_records(nt, nb, lanes(quads), lanes(_f16_bits(blocks, 0)), alloc=alloc)
    if qtype == GGMLType.Q5_0:
        qs = blocks[..., 6:22]
        qh = blocks[..., 2:6].copy().view("<u4")[..., 0]
        q = np.concatenate([qs & 15, qs >> 4], axis=-1).astype(np.uint32)
        q |= ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1) << 4
        return build_records(nt, nb, lanes(_nibbles(q)), lanes(_high1(q)), lanes(_f16_bits(blocks, 0)),
                             alloc=alloc)
    q = q6k_values(blocks).reshape(n_rows, nb, 8, 32)
    sc = blocks[..., 192:208].view(np.int8)
    nib = lanes(_nibbles(q), 1).view(np.uint8).reshape(nt, nb, 8, Q8_GROUPS * 128)
    high = lanes(_high2(q), 1).view(np.uint8).reshape(nt, nb, 8, Q8_GROUPS * 64)
    return build_records(nt, nb, lanes(_f16_bits(blocks, 208)), lanes(sc, 1), np.concatenate([nib, high], axis=-1),
                         alloc=alloc)
