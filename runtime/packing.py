"""Packing (NumPy, once at load): GGML block rows -> the per-tile records the matvec kernels stream.

pack_records(qtype, data, n_rows, n_cols) takes a block matrix as stored in the file, data uint8
(n_rows, row_bytes), and returns a new uint8 buffer of records in the layout of quant_tiles.py: rows
in tiles of tile_rows(qtype) (24 or 16), each tile's 8-row groups moved into the 8 lanes of a vector,
values repacked into fixed-width fields of 32-bit words, scales kept as f16 or bytes; one record per
(tile, block column), a tile's records in column order. mv.pack validates its arguments and wraps the
buffer in a PackedMatrix.

Memory. Packed buffers come from a SlabAllocator: anonymous mappings aligned to 2 MiB and advised
for transparent huge pages (fewer TLB misses while the kernels stream the weights), with small
matrices cut one after another from shared 32 MiB slabs, so matrices packed in the order of a forward
pass also follow each other in memory (the hardware prefetcher and the kernels' software prefetch
run on from one into the next). The allocator is an object with its own lock, used from Python only;
no kernel reads it.

A large matrix is packed in chunks of whole tiles (pack_in_chunks), each written straight into its
place in the one destination buffer: a tile's records depend on its own rows only, so the bytes are
those of packing it at once, while the NumPy temporaries (several times the bytes of the rows being
packed) stay bounded by the chunk instead of growing with the matrix; and the chunk's pages of the
model file are dropped from the RSS as soon as it is packed. Both set the load's peak memory.
"""
from __future__ import annotations

import mmap
import threading

import numpy as np

from ringllm.runtime.errors import UnsupportedModelError
from ringllm.runtime.host_memory import release_array_pages
from ringllm.runtime.quant_tiles import GROUP, tile_rows
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType

__all__ = ["SlabAllocator", "pack_records", "pack_in_chunks", "to_lanes", "build_records", "records_buffer",
           "q6k_values", "PACK_CHUNK_BYTES"]


# ==================================================================================================
# Huge-page memory
# ==================================================================================================

_HUGE = 2 << 20       # transparent huge page size
_SLAB = 32 << 20      # packed matrices below _SLAB // 4 bytes share slabs of this size


def _map(nbytes: int) -> np.ndarray:
    """Zeroed anonymous mapping of nbytes, 2 MiB aligned, backed by transparent huge pages where the
    kernel allows it (fewer TLB misses while streaming)."""
    mm = mmap.mmap(-1, nbytes + _HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mm, "madvise") and hasattr(mmap, "MADV_HUGEPAGE"):
        try:
            mm.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    raw = np.frombuffer(mm, np.uint8)
    start = (-raw.ctypes.data) % _HUGE
    return raw[start:start + nbytes]


class SlabAllocator:
    """Zeroed uint8 buffers, 64-byte aligned, in huge-page memory.

    Buffers of _SLAB // 4 bytes or more get a mapping of their own; smaller ones are cut one after
    the other from the current shared slab (a new slab when it is full). A slab the allocator has
    moved on from is freed with the last buffer cut from it (each buffer is a view that keeps its
    slab alive). Thread-safe.
    """

    def __init__(self):
        self._lock = threading.Lock()
        self._slab = None       # uint8 (_SLAB,) or None before the first small buffer
        self._used = 0          # bytes of _slab handed out

    def alloc(self, nbytes: int) -> np.ndarray:
        """A zeroed uint8 buffer of nbytes."""
        if nbytes >= _SLAB // 4:
            return _map(nbytes)
        size = -(-max(nbytes, 1) // 64) * 64
        with self._lock:
            buf, used = self._slab, self._used
            if buf is None or used + size > buf.shape[0]:
                buf, used = _map(_SLAB), 0
                self._slab = buf
            self._used = used + size
        return buf[used:used + nbytes]


_slabs = SlabAllocator()      # every packed matrix of the process


# ==================================================================================================
# Field packing: file blocks -> per-tile records
# ==================================================================================================

def _f16_at(blocks: np.ndarray, off: int) -> np.ndarray:
    """uint16 bits of the f16 at byte off of each block: blocks (..., size) -> (...)."""
    return blocks[..., off].astype(np.uint16) | (blocks[..., off + 1].astype(np.uint16) << np.uint16(8))


def _u32_at(blocks: np.ndarray, off: int) -> np.ndarray:
    b = blocks[..., off:off + 4].astype(np.uint32)
    return b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)


def _nib_dwords(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) values -> (R, nb, 4) uint32: dword s holds columns 8s + i at bits 4i (low 4 bits)."""
    pairs = q.astype(np.uint8, copy=False).reshape(q.shape[:-1] + (16, 2)) & 15
    b = np.ascontiguousarray(pairs[..., 0] | (pairs[..., 1] << 4))          # byte k of dword s: columns 8s + 2k, +1
    return b.view("<u4").reshape(q.shape[:-1] + (4,))


def _nib_dwords_of_qs(qs: np.ndarray) -> np.ndarray:
    """_nib_dwords of the 32 values a Q4_0 / Q4_1 block stores in qs (R, nb, 16) uint8 (column j in the
    low nibble of byte j, column j + 16 in its high nibble), without unpacking them first."""
    even, odd = qs[..., 0::2], qs[..., 1::2]
    b = np.concatenate([(even & 15) | (odd << 4), (even >> 4) | (odd & 0xF0)], axis=-1)
    return b.view("<u4").reshape(qs.shape[:-1] + (4,))


def _fields5(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) 5-bit values -> (R, nb, 6) uint32: column 6m + i at bits 5i of dword m (m < 5),
    columns 30, 31 at bits 0 and 5 of dword 5."""
    q = q.astype(np.uint32)
    f = np.zeros(q.shape[:-1] + (6,), np.uint32)
    for c in range(32):
        m, i = (c // 6, c % 6) if c < 30 else (5, c - 30)
        f[..., m] |= q[..., c] << np.uint32(5 * i)
    return f


def _fields6(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) 6-bit values -> (R, nb, 6) uint32, 6 bits per value as in the file: dword 3h + m
    (half h: columns 16h..16h+15, one Q6_K sub-block) holds column 16h + 5m + i at bits 6i (i < 5)
    and bits 2m, 2m + 1 of column 16h + 15 at bits 30, 31."""
    q = q.astype(np.uint32)
    f = np.zeros(q.shape[:-1] + (6,), np.uint32)
    for h in range(2):
        top = q[..., 16 * h + 15]
        for m in range(3):
            for i in range(5):
                f[..., 3 * h + m] |= q[..., 16 * h + 5 * m + i] << np.uint32(6 * i)
            f[..., 3 * h + m] |= ((top >> np.uint32(2 * m)) & np.uint32(3)) << np.uint32(30)
    return f


def _pad(a: np.ndarray, rows: int) -> np.ndarray:
    """a with its first axis zero-padded to `rows`."""
    if a.shape[0] == rows:
        return a
    out = np.zeros((rows,) + a.shape[1:], a.dtype)
    out[:a.shape[0]] = a
    return out


def to_lanes(a: np.ndarray, n_tiles: int, groups: int, inner_first: int = 0) -> np.ndarray:
    """a (rows, nb, *rest) -> (n_tiles, nb, *rest[:inner_first], groups, *rest[inner_first:], 8): rows
    zero-padded to n_tiles * groups * 8, and the groups and 8 lanes of a tile moved inside each block."""
    a = _pad(a, n_tiles * groups * GROUP)
    rest = a.shape[2:]
    a = a.reshape((n_tiles, groups, GROUP) + a.shape[1:])   # t, g, lane, nb, *rest
    nr = len(rest)
    order = ([0, 3] + [4 + k for k in range(inner_first)] + [1]
             + [4 + k for k in range(inner_first, nr)] + [2])
    return np.ascontiguousarray(a.transpose(order))


def records_buffer(nbytes: int, alloc=None) -> np.ndarray:
    """A uint8 (nbytes,) buffer for packed records: alloc(nbytes), or (alloc None) from the process's slab
    allocator (zeroed)."""
    return (alloc or _slabs.alloc)(nbytes)


def build_records(n_tiles: int, nb: int, *parts: np.ndarray, alloc=None) -> np.ndarray:
    """Concatenate per-(tile, block) parts, each (n_tiles, nb, ...), as bytes into one aligned buffer
    (records_buffer(nbytes, alloc))."""
    views = [np.ascontiguousarray(p).view(np.uint8).reshape(n_tiles, nb, -1) for p in parts]
    size = sum(v.shape[-1] for v in views)
    buf = records_buffer(n_tiles * nb * size, alloc)
    dst = buf.reshape(n_tiles, nb, size)
    o = 0
    for v in views:
        dst[:, :, o:o + v.shape[-1]] = v
        o += v.shape[-1]
    return buf


def _scale_min_k4(sc: np.ndarray):
    """Q4_K / Q5_K 12 packed bytes (..., 12) -> 6-bit scales, mins (..., 8) uint8."""
    sc = sc.astype(np.uint8)
    d = np.empty(sc.shape[:-1] + (8,), np.uint8)
    m = np.empty_like(d)
    d[..., :4] = sc[..., 0:4] & 63
    m[..., :4] = sc[..., 4:8] & 63
    d[..., 4:] = (sc[..., 8:12] & 0x0F) | ((sc[..., 0:4] >> 6) << 4)
    m[..., 4:] = (sc[..., 8:12] >> 4) | ((sc[..., 4:8] >> 6) << 4)
    return d, m


def _q_kquant(blocks: np.ndarray, qoff: int, qhoff: int | None) -> np.ndarray:
    """Q4_K / Q5_K values (R, nsb, 256) in column order from super-blocks (R, nsb, size)."""
    qs = blocks[..., qoff:qoff + 128].reshape(blocks.shape[:-1] + (4, 32))     # chunk c, l
    q = np.empty(blocks.shape[:-1] + (4, 2, 32), np.uint8)
    q[..., 0, :] = qs & 15
    q[..., 1, :] = qs >> 4
    if qhoff is not None:
        qh = blocks[..., qhoff:qhoff + 32]
        for c in range(4):
            q[..., c, 0, :] |= ((qh >> (2 * c)) & 1) << 4
            q[..., c, 1, :] |= ((qh >> (2 * c + 1)) & 1) << 4
    return q.reshape(blocks.shape[:-1] + (256,))


def q6k_values(blocks: np.ndarray) -> np.ndarray:
    """Q6_K unsigned 6-bit values (R, nsb, 256) in column order (ggml's dequantize_row_q6_K order)."""
    q = np.empty(blocks.shape[:-1] + (2, 4, 32), np.uint8)
    for n in range(2):
        ql = blocks[..., 64 * n:64 * n + 64]
        qh = blocks[..., 128 + 32 * n:128 + 32 * n + 32]
        q[..., n, 0, :] = (ql[..., :32] & 15) | ((qh & 3) << 4)
        q[..., n, 1, :] = (ql[..., 32:] & 15) | (((qh >> 2) & 3) << 4)
        q[..., n, 2, :] = (ql[..., :32] >> 4) | (((qh >> 4) & 3) << 4)
        q[..., n, 3, :] = (ql[..., 32:] >> 4) | (((qh >> 6) & 3) << 4)
    return q.reshape(blocks.shape[:-1] + (256,))


def _fields2(q: np.ndarray) -> np.ndarray:
    """q (R, nb, 32) 2-bit values -> (R, nb, 2) uint32: column 16h + i at bits 2i of dword h."""
    q = (q.reshape(q.shape[:-1] + (2, 16)) & 3).astype(np.uint32)
    return np.bitwise_or.reduce(q << (2 * np.arange(16, dtype=np.uint32)), axis=-1)


def _iq4_dwords(idx: np.ndarray) -> np.ndarray:
    """idx (R, nb, 32) 4-bit indices -> (R, nb, 4) uint32: byte k of dword s holds column 8s + k in its
    low nibble and column 8s + 4 + k in its high nibble (the order lut16 unpacks them in)."""
    i = idx.reshape(idx.shape[:-1] + (4, 2, 4)).astype(np.uint8)
    b = np.ascontiguousarray((i[..., 0, :] & 15) | ((i[..., 1, :] & 15) << 4))     # (R, nb, 4 s, 4 k)
    return b.view("<u4").reshape(idx.shape[:-1] + (4,))


def _low2_kquant(qs: np.ndarray) -> np.ndarray:
    """Q2_K / Q3_K 2-bit values (R, nsb, 256) in column order from their 64 qs bytes (R, nsb, 64):
    value 128 n + 32 s + l is bits 2s of qs[32 n + l]."""
    q = qs.reshape(qs.shape[:-1] + (2, 1, 32)) >> (2 * np.arange(4, dtype=np.uint8)).reshape(4, 1)
    return (q & 3).reshape(qs.shape[:-1] + (256,))


def _q3k_scales(sc: np.ndarray) -> np.ndarray:
    """Q3_K 12 packed bytes (..., 12) -> the 16 signed scales (..., 16) int8 (6 bits, minus 32)."""
    lo = np.concatenate([sc[..., 0:8] & 15, sc[..., 0:8] >> 4], axis=-1)
    hi = np.concatenate([(sc[..., 8:12] >> (2 * k)) & 3 for k in range(4)], axis=-1)
    return ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)


def _iq4xs_scales(blocks: np.ndarray) -> np.ndarray:
    """IQ4_XS super-blocks (..., 136) -> the 8 sub-block scales ls - 32 (..., 8) int8."""
    sh = _f16_at(blocks, 2).astype(np.uint32)
    sl = blocks[..., 4:8]
    lo = np.stack([sl & 15, sl >> 4], axis=-1).reshape(blocks.shape[:-1] + (8,))
    hi = (sh[..., None] >> (2 * np.arange(8, dtype=np.uint32))) & 3
    return ((lo | (hi << 4)).astype(np.int16) - 32).astype(np.int8)


def _iq4_idx(qs: np.ndarray) -> np.ndarray:
    """IQ4 indices (..., 32) in column order from the 16 bytes of each 32 values (..., 16)."""
    return np.concatenate([qs & 15, qs >> 4], axis=-1)


# ==================================================================================================
# Whole matrices, chunk by chunk
# ==================================================================================================

PACK_CHUNK_BYTES = 4 << 20    # file bytes of rows packed at a time (rounded to whole tiles)


def _row_slices(blocks: list, r0: int, r1: int) -> list:
    """The slices of the row blocks (stacked in order) that hold rows r0..r1-1."""
    out, base = [], 0
    for b in blocks:
        lo, hi = max(r0, base), min(r1, base + b.shape[0])
        if lo < hi:
            out.append(b[lo - base:hi - base])
        base += b.shape[0]
    return out


def _stacked_rows(blocks: list, r0: int, r1: int) -> np.ndarray:
    """Rows r0..r1-1 of the row blocks stacked in order (a view when one block holds them all)."""
    out = _row_slices(blocks, r0, r1)
    return out[0] if len(out) == 1 else np.concatenate(out, axis=0)


def _packed_rows_done(blocks: list, r0: int, r1: int) -> None:
    """Rows r0..r1-1 are packed: their file pages leave the RSS (host_memory.release_array_pages; a no-op
    for rows that are not a read-only file mapping). They stay readable: read again (the embedding rows
    an engine looks up, a press's W_q), they fault back in from the page cache."""
    release_array_pages(_row_slices(blocks, r0, r1))


def pack_in_chunks(part, qtype: GGMLType, data, n_rows: int, n_cols: int, tile: int) -> np.ndarray:
    """part(qtype, rows, n, n_cols, alloc) -> packed records of n rows (a multiple of `tile`, or the last
    rows), run over chunks of about PACK_CHUNK_BYTES of file rows; returns the records of all n_rows in
    one slab buffer, each chunk's written in place. data: uint8 (n_rows, row_bytes), or a list of such
    row blocks stacked in order (q|k|v), never concatenated whole. Each chunk's rows, when they are a view
    of the model file, leave the RSS once packed (_packed_rows_done): the file and its packed copy are
    never resident together, not even for one large matrix (a 262k-token embedding)."""
    blocks = list(data) if isinstance(data, (list, tuple)) else [data.reshape(n_rows, -1)]
    row_bytes = max(1, blocks[0].shape[1])
    step = max(1, PACK_CHUNK_BYTES // (row_bytes * tile)) * tile
    if n_rows <= step:
        out = part(qtype, _stacked_rows(blocks, 0, n_rows), n_rows, n_cols, None)
        _packed_rows_done(blocks, 0, n_rows)
        return out
    # the first chunk, in a temporary, gives the bytes per tile; then one buffer for the whole matrix
    first = part(qtype, _stacked_rows(blocks, 0, step), step, n_cols, lambda n: np.empty(n, np.uint8))
    per_tile = first.nbytes // (step // tile)
    buf = _slabs.alloc(-(-n_rows // tile) * per_tile)
    buf[:first.nbytes] = first
    del first
    _packed_rows_done(blocks, 0, step)
    for r0 in range(step, n_rows, step):
        r1 = min(n_rows, r0 + step)
        lo, hi = r0 // tile * per_tile, -(-r1 // tile) * per_tile

        def into(n, lo=lo, hi=hi):
            assert n == hi - lo, "records of a chunk do not match its tiles"
            return buf[lo:hi]
        part(qtype, _stacked_rows(blocks, r0, r1), r1 - r0, n_cols, into)
        _packed_rows_done(blocks, r0, r1)
    return buf


def pack_records(qtype: GGMLType, data, n_rows: int, n_cols: int) -> np.ndarray:
    """Packed uint8 buffer of a (n_rows, row_bytes) uint8 block matrix of qtype (record layouts in
    quant_tiles.py), or of a list of row blocks stacked in order; packed in chunks of whole tiles
    (pack_in_chunks). Raises UnsupportedModelError for a type without a layout."""
    return pack_in_chunks(_pack_part, qtype, data, n_rows, n_cols, tile_rows(qtype))


def _pack_part(qtype: GGMLType, data: np.ndarray, n_rows: int, n_cols: int, alloc) -> np.ndarray:
    """pack_records of one chunk of rows, its buffer from alloc (build_records)."""
    groups = tile_rows(qtype) // GROUP
    nt = -(-n_rows // (groups * GROUP))

    def lanes(a, inner_first=0):
        return to_lanes(a, nt, groups, inner_first)

    def records(width, *parts):       # width: block columns (elements for the float types)
        return build_records(nt, width, *parts, alloc=alloc)

    if qtype in (GGMLType.F32, GGMLType.F16, GGMLType.BF16):
        if qtype in (GGMLType.F16, GGMLType.BF16):
            vals = data.view(np.uint16).reshape(n_rows, n_cols)
        else:
            vals = data.view(np.float32).reshape(n_rows, n_cols)
        return records(n_cols, lanes(vals))
    block, size = BLOCK_LAYOUT[qtype]
    nb = n_cols // block
    blocks = data.reshape(n_rows, nb, size)
    if qtype == GGMLType.Q8_0:
        return records(nb, lanes(blocks[..., 2:34]), lanes(_f16_at(blocks, 0)))
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q5_0, GGMLType.Q5_1):
        off = {GGMLType.Q4_0: 2, GGMLType.Q4_1: 4, GGMLType.Q5_0: 6, GGMLType.Q5_1: 8}[qtype]
        qs = blocks[..., off:off + 16]
        if qtype in (GGMLType.Q5_0, GGMLType.Q5_1):
            q = np.concatenate([qs & 15, qs >> 4], axis=-1)
            qh = _u32_at(blocks, off - 4)
            hb = ((qh[..., None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)
            parts = [lanes(_fields5(q | (hb << 4)))]
        else:
            parts = [lanes(_nib_dwords_of_qs(qs))]
        parts.append(lanes(_f16_at(blocks, 0)))
        if qtype in (GGMLType.Q4_1, GGMLType.Q5_1):
            parts.append(lanes(_f16_at(blocks, 2)))
        return records(nb, *parts)
    if qtype in (GGMLType.Q4_K, GGMLType.Q5_K):
        sc, mn = _scale_min_k4(blocks[..., 4:16])
        if qtype == GGMLType.Q4_K:
            q = _q_kquant(blocks, 16, None).reshape(n_rows, nb, 8, 32)
            per_sub = [lanes(_nib_dwords(q), 1)]                       # t, nb, sub, g, s, lane
        else:
            q = _q_kquant(blocks, 48, 16).reshape(n_rows, nb, 8, 32)
            per_sub = [lanes(_fields5(q), 1)]                          # t, nb, sub, g, m, lane
        return records(nb, lanes(_f16_at(blocks, 0)), lanes(_f16_at(blocks, 2)),
                       lanes(sc, 1), lanes(mn, 1), *per_sub)
    if qtype == GGMLType.Q6_K:
        q = q6k_values(blocks).reshape(n_rows, nb, 8, 32)
        sc = blocks[..., 192:208].view(np.int8)
        return records(nb, lanes(_f16_at(blocks, 208)), lanes(sc, 1), lanes(_fields6(q), 1))
    if qtype == GGMLType.Q2_K:
        q = _low2_kquant(blocks[..., 16:80]).reshape(n_rows, nb, 8, 32)
        return records(nb, lanes(_f16_at(blocks, 80)), lanes(_f16_at(blocks, 82)),
                       lanes(blocks[..., 0:16], 1), lanes(_fields2(q), 1))
    if qtype == GGMLType.Q3_K:
        low = _low2_kquant(blocks[..., 32:96])
        hm = blocks[..., 0:32].reshape(n_rows, nb, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(8, 1)
        u3 = (low | ((hm & 1).reshape(n_rows, nb, 256) << 2)).reshape(n_rows, nb, 8, 32)
        return records(nb, lanes(_f16_at(blocks, 108)), lanes(_q3k_scales(blocks[..., 96:108]), 1),
                       lanes(_nib_dwords(u3), 1))
    if qtype == GGMLType.IQ4_NL:
        return records(nb, lanes(_iq4_dwords(_iq4_idx(blocks[..., 2:18]))), lanes(_f16_at(blocks, 0)))
    if qtype == GGMLType.IQ4_XS:
        idx = _iq4_idx(blocks[..., 8:136].reshape(n_rows, nb, 8, 16))
        return records(nb, lanes(_f16_at(blocks, 0)), lanes(_iq4xs_scales(blocks), 1),
                       lanes(_iq4_dwords(idx), 1))
    raise UnsupportedModelError(str(qtype), f"no matvec layout for GGML type {qtype!r}")
