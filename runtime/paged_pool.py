"""The paged KV pool: fixed-size blocks shared by many sequences, block tables, in-place writes at
(block, offset), shared prefixes with copy-on-write, and two compaction passes (DESIGN.md "Paged mode").

Layout (allocated once; B = block_size slots per block, default 16):
    k, v    (n_layer, n_blocks, n_kv_head, B, width)   keys before RoPE, values, each row in the pool's
            KV type (k_type, v_type: runtime/kv_types.py; f32 rows are head_dim float32, a quantized
            row is encoded once as its token is written, a q4_0 key row with its outliers)
    seq     (n_layer, n_blocks, B) int64     token index (sequence index) a slot holds, -1 = hole / empty
    ref     (n_blocks,) int64                 sequences whose block table holds the block (0 = free)

One pool holds every layer: a slot is one token in all layers and all kv heads (vLLM's convention),
so one block table per sequence serves every layer and a compaction pass moves a token once for the
whole model. The slot metadata is kept per layer nevertheless: the engine writes a prefill chunk of
T tokens layer by layer, so while a chunk is in flight layer 0 already holds token t + 5 (and has
evicted its victim) when layer 1 attends for token t; per-layer `seq` keeps every layer's view
exactly that of a one-token-at-a-time pass. Between chunks every layer holds the same tokens in the
same slots ("in step"); the compaction passes, fork and the gauges require that.

Per sequence (`_Sequence`): its block table (table slot i = block table[i // B], offset i % B), the
`tail` per layer (next table slot an append writes), `held` per layer (the held token indices,
sorted: the rank of a token among them is its `reindexed` logical position, so a slot moved by a
compaction pass keeps its position; in `original` mode the position is the token index itself)
and evictions per layer.

Holes: evicting a token marks its slot -1 (EQUIP: nothing is shifted). A block whose slots are
holes in every layer, and that every layer has written past, is returned to the free list at once.
Otherwise holes stay until a compaction pass:
  * compact_repack: order-preserving. The k-th survivor (table order) moves to table slot k. Since
    k <= its source slot, one forward sweep reads every survivor before any write lands on its slot
    (the property "read all survivors before writing any" protects); the blocks past
    ceil(n / B) are freed. Copies: every survivor after the first hole.
  * compact_fill: hole-filling. Keep the ceil(n / B) blocks holding the most survivors (ties: the
    earlier block), move the survivors of the other blocks into the kept blocks' holes. Copies: the
    survivors of the evacuated blocks, the fewest any pass ending with ceil(n / B) blocks can make.
    Safe because every slot carries its token index, hence its logical position.
A slot copy moves one token's K and V of every layer and kv head (and its per-layer metadata).

Shared prefixes: fork(seq_id) gives a new sequence the same block table, each block's refcount + 1.
Any write into a shared block (a token written, a hole marked, a compaction move) first copies the
block for the writer (copy-on-write); evacuating a shared block only drops the reference.
"""
from __future__ import annotations

import time

import numpy as np
from numba import njit

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.host_memory import zeros_small_pages
from ringllm.runtime.eviction import count_below
from ringllm.runtime.kv_codec import encode_row
from ringllm.runtime.kv_types import STORE_DTYPE, check_kv_type, row_width

# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=False)
def write_slot(k, v, il, blk, o, k_l, v_l):
    """Slot (blk, o) of layer il = k_l, v_l (n_kv, hd) f32, each row encoded in its array's KV type."""
    for h in range(k_l.shape[0]):
        encode_row(k[il, blk, h, o], k_l[h])
        encode_row(v[il, blk, h, o], v_l[h])


@njit(cache=True, nogil=True, fastmath=False)
def copy_slot(k, v, seq, sb, so, db, do):
    """Slot (sb, so) -> slot (db, do) in every layer: the K and V rows as stored (n_kv rows each, any
    KV type: their bytes) and the token index."""
    n_layer, _, n_kv, _, kw = k.shape
    vw = v.shape[4]
    for il in range(n_layer):
        seq[il, db, do] = seq[il, sb, so]
        for h in range(n_kv):
            for d in range(kw):
                k[il, db, h, do, d] = k[il, sb, h, so, d]
            for d in range(vw):
                v[il, db, h, do, d] = v[il, sb, h, so, d]


@njit(cache=True, nogil=True, fastmath=False)
def copy_block(k, v, seq, sb, db):
    """Block sb -> block db, every layer (copy-on-write)."""
    for il in range(k.shape[0]):
        k[il, db] = k[il, sb]
        v[il, db] = v[il, sb]
        seq[il, db] = seq[il, sb]


@njit(cache=True, nogil=True, fastmath=False)
def repack_kernel(k, v, seq, table, n_table, trace):
    """Order-preserving repack of one sequence, in place: the k-th survivor (table order, judged by
    layer 0; the layers are in step) moves to table slot k; its old slot becomes a hole.

    k, v (n_layer, n_blocks, n_kv, B, width) the pool's rows; seq (n_layer, n_blocks, B) i64; table (>= n_table,)
    i64 block of each table entry. trace (E, 3) i64: when E > 0, the first E slot events in order,
    (0 = read | 1 = write, block, offset). Returns (survivors, slot copies, events recorded).
    The destination k <= the source slot, so a forward sweep never writes a slot whose survivor is
    still unread: every survivor at table slot k has rank <= k, i.e. it was read (or stayed) already.
    """
    n_layer = seq.shape[0]
    B = seq.shape[2]
    dst = 0
    copies = 0
    ne = 0
    for i in range(n_table * B):
        sb = table[i // B]
        so = i % B
        if seq[0, sb, so] < 0:
            continue
        if i != dst:
            db = table[dst // B]
            do = dst % B
            if ne + 2 <= trace.shape[0]:
                trace[ne, 0], trace[ne, 1], trace[ne, 2] = 0, sb, so
                trace[ne + 1, 0], trace[ne + 1, 1], trace[ne + 1, 2] = 1, db, do
                ne += 2
            copy_slot(k, v, seq, sb, so, db, do)
            for il in range(n_layer):
                seq[il, sb, so] = -1
            copies += 1
        dst += 1
    return dst, copies, ne


@njit(cache=True, nogil=True, fastmath=False)
def fill_kernel(k, v, seq, table, n_table, keep):
    """Hole-filling: the survivors of the blocks with keep[i] == False (table order) are copied into
    the holes of the kept blocks (table order). The evacuated blocks are only read (the caller drops
    them: a shared one stays intact for its other owners); reads and writes touch disjoint blocks.

    keep (n_table,) bool. The caller guarantees enough holes. Returns the number of slot copies.
    """
    B = seq.shape[2]
    hole = 0
    copies = 0
    for i in range(n_table * B):
        ti = i // B
        if keep[ti]:
            continue
        sb = table[ti]
        so = i % B
        if seq[0, sb, so] < 0:
            continue
        while not (keep[hole // B] and seq[0, table[hole // B], hole % B] < 0):
            hole += 1
        copy_slot(k, v, seq, sb, so, table[hole // B], hole % B)
        hole += 1
        copies += 1
    return copies


@njit(cache=True, nogil=True, fastmath=False)
def find_token(seq_l, table, n_table, s):
    """Table slot holding token s in one layer (seq_l (n_blocks, B) i64), or -1."""
    B = seq_l.shape[1]
    for ti in range(n_table):
        blk = table[ti]
        for o in range(B):
            if seq_l[blk, o] == s:
                return ti * B + o
    return -1


@njit(cache=True, nogil=True, fastmath=False)
def held_insert(held_l, n, s):
    """Insert token s into the sorted held_l[:n] (capacity > n). Returns its rank."""
    j = n
    while j > 0 and held_l[j - 1] > s:
        held_l[j] = held_l[j - 1]
        j -= 1
    held_l[j] = s
    return j


@njit(cache=True, nogil=True, fastmath=False)
def held_remove(held_l, n, s):
    """Remove token s from the sorted held_l[:n]. Returns its rank, -1 when absent."""
    lo = count_below(held_l, n, s)
    if lo >= n or held_l[lo] != s:
        return -1
    for j in range(lo, n - 1):
        held_l[j] = held_l[j + 1]
    return lo


@njit(cache=True, nogil=True, fastmath=False)
def block_counts(seq0, table, n_table, out):
    """out[i] = survivors (layer-0 slots >= 0) of table entry i. seq0 (n_blocks, B) i64."""
    for ti in range(n_table):
        c = 0
        for o in range(seq0.shape[1]):
            if seq0[table[ti], o] >= 0:
                c += 1
        out[ti] = c


# ---------------------------------------------------------------------------------------------
# Pool
# ---------------------------------------------------------------------------------------------


class _Sequence:
    """One sequence's view: block table, per-layer tail, sorted held tokens, evictions."""

    def __init__(self, n_layer: int):
        self.table = np.zeros(8, np.int64)       # (cap,) block of each table entry; [:n_table] used
        self.n_table = 0
        self.tail = np.zeros(n_layer, np.int64)  # next table slot an append writes, per layer
        self.held = np.zeros((n_layer, 16), np.int64)   # sorted token indices held, per layer
        self.n_held = np.zeros(n_layer, np.int64)
        self.evicted = np.zeros(n_layer, np.int64)

    def copy(self) -> "_Sequence":
        c = _Sequence.__new__(_Sequence)
        c.table, c.n_table = self.table.copy(), self.n_table
        c.tail, c.held, c.n_held, c.evicted = self.tail.copy(), self.held.copy(), self.n_held.copy(), self.evicted.copy()
        return c

    def in_step(self) -> bool:
        return bool((self.tail == self.tail[0]).all() and (self.n_held == self.n_held[0]).all())


class PagedKVPool:
    """A pool of `n_blocks` blocks of `block_size` slots shared by every sequence (module docstring).

    Args:
        n_blocks: blocks in the pool (>= 1).
        block_size: slots per block (>= 1, default 16).
        n_layer, n_kv_head, head_dim: the model's KV shape (PagedKVPool.for_model(spec, ...)).

    Sequences are integer ids from new_sequence() / fork(); an unknown id, an exhausted pool or an
    absent token raise ConfigError. Token K, V arguments are (n_layer, n_kv_head, head_dim) for
    whole-token verbs (append, write, evict) and (n_kv_head, head_dim) for the per-layer verbs the
    PagedStore uses while the engine runs a chunk layer by layer.
    """

    def __init__(self, n_blocks: int, block_size: int = 16, n_layer: int = 1, n_kv_head: int = 1, head_dim: int = 1,
                 k_type: str = "f32", v_type: str = "f32"):
        for name, val in (("n_blocks", n_blocks), ("block_size", block_size), ("n_layer", n_layer),
                          ("n_kv_head", n_kv_head), ("head_dim", head_dim)):
            if not isinstance(val, (int, np.integer)) or isinstance(val, bool) or val < 1:
                raise ConfigError(f"paged KV pool: {name} must be an integer >= 1, got {val!r}")
        check_kv_type(k_type, "paged KV pool: k_type", int(head_dim))
        check_kv_type(v_type, "paged KV pool: v_type", int(head_dim))
        self.n_blocks, self.block_size = int(n_blocks), int(block_size)
        self.n_layer, self.n_kv_head, self.head_dim = int(n_layer), int(n_kv_head), int(head_dim)
        self.k_type, self.v_type = k_type, v_type
        shape = (self.n_layer, self.n_blocks, self.n_kv_head, self.block_size)
        # blocks fill as sequences grow (host_memory.py)
        self.k = zeros_small_pages(shape + (row_width(k_type, self.head_dim, key=True),), STORE_DTYPE[k_type])
        self.v = zeros_small_pages(shape + (row_width(v_type, self.head_dim),), STORE_DTYPE[v_type])
        self.seq = np.full((self.n_layer, self.n_blocks, self.block_size), -1, np.int64)
        self.ref = np.zeros(self.n_blocks, np.int64)
        self._free = list(range(self.n_blocks - 1, -1, -1))    # stack: the lowest free block comes first
        self._seqs: dict[int, _Sequence] = {}
        self._next_id = 0
        self.tokens_evicted = 0
        self.passes = 0
        self.slot_copies_total = 0
        self.blocks_freed_by_passes = 0
        self.blocks_freed_by_eviction = 0
        self.cow_blocks = 0
        self.last_pass: dict | None = None

    @classmethod
    def for_model(cls, spec, n_blocks: int, block_size: int = 16, k_type: str = "f32",
                  v_type: str = "f32") -> "PagedKVPool":
        """A pool shaped for a ModelSpec (every layer, every kv head), its rows in the KV types given."""
        return cls(n_blocks, block_size, spec.n_layer, spec.n_head_kv, spec.head_dim, k_type, v_type)

    # -----------------------------------------------------------------------------------------
    # Blocks and sequences
    # -----------------------------------------------------------------------------------------

    def _get(self, seq_id: int) -> _Sequence:
        sq = self._seqs.get(seq_id)
        if sq is None:
            raise ConfigError(f"paged KV pool: unknown sequence {seq_id!r}; live: {sorted(self._seqs)}")
        return sq

    def _alloc(self) -> int:
        if not self._free:
            raise ConfigError(f"paged KV pool exhausted: all {self.n_blocks} blocks of {self.block_size} slots are "
                              f"in use; free or compact sequences, or build a larger pool")
        blk = self._free.pop()
        self.ref[blk] = 1
        self.seq[:, blk, :] = -1
        return blk

    def _release(self, blk: int) -> bool:
        """Drop one reference; True when the block went back to the free list."""
        self.ref[blk] -= 1
        if self.ref[blk] == 0:
            self.seq[:, blk, :] = -1
            self._free.append(blk)
            return True
        return False

    def _push_block(self, sq: _Sequence) -> None:
        if sq.n_table == sq.table.shape[0]:
            sq.table = np.concatenate([sq.table, np.zeros_like(sq.table)])
        sq.table[sq.n_table] = self._alloc()
        sq.n_table += 1

    def _unshare(self, sq: _Sequence, ti: int) -> int:
        """Copy-on-write: give table entry ti a private copy when its block is shared. Returns the block."""
        blk = int(sq.table[ti])
        if self.ref[blk] > 1:
            new = self._alloc()
            copy_block(self.k, self.v, self.seq, blk, new)
            self.ref[blk] -= 1
            sq.table[ti] = new
            self.cow_blocks += 1
            return new
        return blk

    def new_sequence(self) -> int:
        """A new, empty sequence; returns its id."""
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = _Sequence(self.n_layer)
        return sid

    def fork(self, seq_id: int) -> int:
        """A new sequence sharing every block of seq_id (refcount + 1 each; copy-on-write later)."""
        sq = self._get(seq_id)
        sid = self._next_id
        self._next_id += 1
        self._seqs[sid] = sq.copy()
        self.ref[sq.table[:sq.n_table]] += 1
        return sid

    def free_sequence(self, seq_id: int) -> int:
        """Drop a sequence; returns the blocks that went back to the free list."""
        sq = self._get(seq_id)
        freed = sum(self._release(int(b)) for b in sq.table[:sq.n_table])
        del self._seqs[seq_id]
        return freed

    def block_table(self, seq_id: int) -> np.ndarray:
        """(n_table,) int64 blocks of the sequence, in table order (a copy)."""
        sq = self._get(seq_id)
        return sq.table[:sq.n_table].copy()

    def held(self, seq_id: int, il: int = 0) -> np.ndarray:
        """(n,) int64 sorted token indices the sequence holds in layer il (a copy)."""
        sq = self._get(seq_id)
        return sq.held[il, :sq.n_held[il]].copy()

    # -----------------------------------------------------------------------------------------
    # Per-layer verbs (the PagedStore's hot path; the whole-token verbs below loop over them)
    # -----------------------------------------------------------------------------------------

    def _held_add(self, sq: _Sequence, il: int, s: int) -> None:
        n = int(sq.n_held[il])
        if n == sq.held.shape[1]:
            sq.held = np.concatenate([sq.held, np.zeros_like(sq.held)], axis=1)
        held_insert(sq.held[il], n, s)
        sq.n_held[il] = n + 1

    def write_layer(self, sq: _Sequence, il: int, tslot: int, k_l: np.ndarray, v_l: np.ndarray, s: int) -> None:
        """In place (EQUIP): table slot tslot of layer il takes token s; k_l, v_l (n_kv, hd) f32, encoded
        in the pool's KV types. The slot must be a hole (evict its token first)."""
        B = self.block_size
        ti, o = divmod(tslot, B)
        blk = self._unshare(sq, ti)
        if self.seq[il, blk, o] >= 0:
            raise ConfigError(f"paged KV pool: slot ({blk}, {o}) of layer {il} holds token {self.seq[il, blk, o]}; "
                              "evict it before writing")
        write_slot(self.k, self.v, il, blk, o, np.ascontiguousarray(k_l, np.float32),
                   np.ascontiguousarray(v_l, np.float32))
        self.seq[il, blk, o] = s
        self._held_add(sq, il, s)

    def append_layer(self, sq: _Sequence, il: int, k_l: np.ndarray, v_l: np.ndarray, s: int) -> int:
        """Token s into layer il at the sequence's tail (a new block when the last one is used up);
        returns the table slot."""
        tslot = int(sq.tail[il])
        if tslot == sq.n_table * self.block_size:
            self._push_block(sq)
        self.write_layer(sq, il, tslot, k_l, v_l, s)
        sq.tail[il] = tslot + 1
        return tslot

    def evict_layer(self, sq: _Sequence, il: int, s: int, free_empty: bool = True) -> int:
        """Mark token s's slot in layer il a hole; returns its table slot. With free_empty, a block
        left empty in every layer (and written past by every layer) goes back to the free list."""
        tslot = int(find_token(self.seq[il], sq.table, sq.n_table, s))
        if tslot < 0:
            raise ConfigError(f"paged KV pool: token {s} is not held in layer {il}")
        ti, o = divmod(tslot, self.block_size)
        blk = self._unshare(sq, ti)
        self.seq[il, blk, o] = -1
        held_remove(sq.held[il], int(sq.n_held[il]), s)
        sq.n_held[il] -= 1
        sq.evicted[il] += 1
        if il == 0:
            self.tokens_evicted += 1
        if free_empty:
            self._free_if_empty(sq, ti)
        return tslot

    def _free_if_empty(self, sq: _Sequence, ti: int) -> None:
        B = self.block_size
        blk = int(sq.table[ti])
        if (self.seq[:, blk, :] >= 0).any() or (sq.tail < (ti + 1) * B).any():
            return
        sq.table[ti:sq.n_table - 1] = sq.table[ti + 1:sq.n_table].copy()
        sq.n_table -= 1
        sq.tail -= B
        if self._release(blk):
            self.blocks_freed_by_eviction += 1

    # -----------------------------------------------------------------------------------------
    # Whole-token verbs (every layer at once)
    # -----------------------------------------------------------------------------------------

    def _token_kv(self, k, v):
        shape = (self.n_layer, self.n_kv_head, self.head_dim)
        k = np.ascontiguousarray(np.broadcast_to(np.asarray(k, np.float32), shape))
        v = np.ascontiguousarray(np.broadcast_to(np.asarray(v, np.float32), shape))
        return k, v

    def append(self, seq_id: int, k, v, s: int) -> tuple[int, int]:
        """Token s (k, v broadcastable to (n_layer, n_kv_head, head_dim)) at the tail, every layer;
        returns its (block, offset)."""
        sq = self._get(seq_id)
        k, v = self._token_kv(k, v)
        for il in range(self.n_layer):
            tslot = self.append_layer(sq, il, k[il], v[il], int(s))
        ti, o = divmod(tslot, self.block_size)
        return int(sq.table[ti]), o

    def write(self, seq_id: int, tslot: int, k, v, s: int) -> tuple[int, int]:
        """In place at table slot tslot (block table[tslot // B], offset tslot % B), every layer; the
        slot must be a hole. Returns (block, offset)."""
        sq = self._get(seq_id)
        if not 0 <= tslot < sq.n_table * self.block_size:
            raise ConfigError(f"paged KV pool: table slot {tslot} outside sequence {seq_id}'s "
                              f"{sq.n_table * self.block_size} slots")
        k, v = self._token_kv(k, v)
        for il in range(self.n_layer):
            self.write_layer(sq, il, tslot, k[il], v[il], int(s))
        ti, o = divmod(tslot, self.block_size)
        return int(sq.table[ti]), o

    def evict(self, seq_id: int, tokens) -> int:
        """Mark the slots of `tokens` (token indices) holes in every layer; blocks left empty are
        freed at once. Returns the blocks freed."""
        sq = self._get(seq_id)
        before = self.blocks_freed_by_eviction
        for s in np.asarray(tokens, np.int64).reshape(-1):
            for il in range(self.n_layer):
                self.evict_layer(sq, il, int(s))
        return self.blocks_freed_by_eviction - before

    # -----------------------------------------------------------------------------------------
    # Compaction
    # -----------------------------------------------------------------------------------------

    def _pass_start(self, seq_id: int) -> _Sequence:
        sq = self._get(seq_id)
        if not sq.in_step():
            raise ConfigError("paged KV pool: compaction needs every layer in step (between engine chunks)")
        return sq

    def _pass_end(self, kind, sq, t0, n, before, freed, copies, cow0) -> dict:
        gauges = {"kind": kind, "survivors": int(n), "blocks_before": int(before), "blocks_after": int(sq.n_table),
                  "blocks_freed": int(freed), "slot_copies": int(copies), "cow_blocks": int(self.cow_blocks - cow0),
                  "seconds": time.perf_counter() - t0}
        self.passes += 1
        self.slot_copies_total += int(copies)
        self.blocks_freed_by_passes += int(freed)
        self.last_pass = gauges
        return gauges

    def compact_repack(self, seq_id: int, trace: np.ndarray | None = None) -> dict:
        """Order-preserving repack of one sequence (module docstring). trace: optional (E, 3) int64
        event log (repack_kernel). Returns the pass gauges: survivors, blocks_before/after,
        blocks_freed (back to the free list), slot_copies, cow_blocks, seconds."""
        t0, cow0 = time.perf_counter(), self.cow_blocks
        sq = self._pass_start(seq_id)
        B, before = self.block_size, sq.n_table
        counts = np.zeros(before, np.int64)
        block_counts(self.seq[0], sq.table, before, counts)
        full = np.flatnonzero(counts < B)
        first = int(full[0]) if full.size else before       # first table entry with a hole
        for ti in range(first, before):                      # entries the sweep may write
            self._unshare(sq, ti)
        tr = np.zeros((0, 3), np.int64) if trace is None else trace
        n, copies, _ = repack_kernel(self.k, self.v, self.seq, sq.table, before, tr)
        keep = -(-n // B)
        freed = sum(self._release(int(b)) for b in sq.table[keep:before])
        sq.n_table = keep
        sq.tail[:] = n
        return self._pass_end("repack", sq, t0, n, before, freed, copies, cow0)

    def compact_fill(self, seq_id: int) -> dict:
        """Hole-filling pass of one sequence (module docstring): fewest slot copies to leave
        ceil(n / B) blocks. Returns the pass gauges (as compact_repack)."""
        t0, cow0 = time.perf_counter(), self.cow_blocks
        sq = self._pass_start(seq_id)
        B, before = self.block_size, sq.n_table
        counts = np.zeros(before, np.int64)
        block_counts(self.seq[0], sq.table, before, counts)
        n = int(counts.sum())
        m = -(-n // B)
        # keep the m fullest blocks; ties keep the earlier entry (stable sort on -count)
        keep = np.zeros(before, np.bool_)
        keep[np.argsort(-counts, kind="stable")[:m]] = True
        copies = 0
        if m < before:
            for ti in np.flatnonzero(keep & (counts < B)):   # kept blocks that receive copies
                self._unshare(sq, int(ti))
            copies = fill_kernel(self.k, self.v, self.seq, sq.table, before, keep)
        dropped = sq.table[:before][~keep].copy()
        sq.table[:m] = sq.table[:before][keep]
        sq.n_table = m
        freed = sum(self._release(int(b)) for b in dropped)
        occupied = np.flatnonzero((self.seq[0][sq.table[:m]] >= 0).reshape(-1))
        sq.tail[:] = int(occupied[-1]) + 1 if occupied.size else 0
        return self._pass_end("fill", sq, t0, n, before, freed, copies, cow0)

    # -----------------------------------------------------------------------------------------
    # Gauges
    # -----------------------------------------------------------------------------------------

    def gauges(self) -> dict:
        """free_blocks, blocks_in_use, live_tokens (layer-0 slots held, a shared slot once),
        occupancy (live_tokens / slots of blocks in use), tokens_evicted, passes, slot copies and
        blocks freed (by passes, by eviction), cow_blocks, and the last pass's gauges."""
        in_use = self.ref > 0
        live = int((self.seq[0][in_use] >= 0).sum())
        n_use = int(in_use.sum())
        return {"n_blocks": self.n_blocks, "block_size": self.block_size, "free_blocks": len(self._free),
                "blocks_in_use": n_use, "live_tokens": live,
                "occupancy": live / (n_use * self.block_size) if n_use else 0.0,
                "sequences": len(self._seqs), "tokens_evicted": self.tokens_evicted, "passes": self.passes,
                "slot_copies_total": self.slot_copies_total, "blocks_freed_by_passes": self.blocks_freed_by_passes,
                "blocks_freed_by_eviction": self.blocks_freed_by_eviction, "cow_blocks": self.cow_blocks,
                "last_pass": self.last_pass}
