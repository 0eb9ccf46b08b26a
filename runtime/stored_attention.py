"""Attention of one token over a ring layer whose keys are stored rotated ("stored" / "kshift"
layouts, runtime/rope.py), split into units of slots so that both cores work on one token.

Keys are stored rotated at their sequence index s_j. RoPE scores depend only on the position
difference, so with the query rotated at q_pos + (s_j - p_j) the score equals that of query and key
rotated at their logical positions q_pos and p_j. The offset s_j - p_j is 0 in `original` mode and,
for streaming in `reindexed` mode, 0 for the sinks and the head's eviction count for every other
slot; the kshift layout passes pos as seq (offsets 0). Any other slot layout stays exact: the
query is re-rotated whenever the offset changes.

Split softmax (flash-decoding). The occupied slots of each kv head are cut into units of
unit_slots(count) consecutive slots (UNIT_SLOTS, or more for a long head, which gets at most
MAX_UNITS units). A unit computes, for each query head g of its group, the scores of
its slots, their maximum m, the exponentials e_j = exp(s_j - m) (fast_exp.exp_f32: never subnormal,
which would slow every operation that reads them), l = sum e_j and the weighted value sum
o = sum e_j v_j. The merge takes M = max m_u over the head's units and gives

    out = (sum_u o_u exp(m_u - M)) / (sum_u l_u exp(m_u - M)),

and the per-slot mass e_j exp(m_u - M) / Z summed over the group when a caller asks for it. The
units depend only on the slot counts, never on the thread count: attend_stored (units in turn) and
attend_stored_parallel (units over the threads) give the same bits, and so does a batched step that
runs attend_stored per sequence (stream_attention.py).

Work scratch (stored_work): (3, n_units, max(n_head, 12), hd) f32, three row blocks per unit u:

    work[0, u, h0 + g]    query head h0 + g rotated at the unit's current offset, times scale (then
                          taken into the keys' basis, kv_basis.py)
    work[1, u, h0 + g]    the unit's weighted value sum o for query head h0 + g
    work[2, u, 0:8]       eight rows of a quantized store, decoded into their basis (kv_tile_math.rows8_at)
    work[2, u, 8]         cos (first rotary_dim/2) and sin (next rotary_dim/2) of the offset of its
                          first slot, when no earlier unit of the call computed them (the book, below)
    work[2, u, 9]         m (first group entries) and l (next group entries)
    work[2, u, 10]        the eight scores or weights of a span's last 1-7 slots (head_dim a multiple
                          of 8), or one decoded row (the one-by-one kernels otherwise); also the
                          angles of an offset a unit of the parallel kernel meets that the book lacks
                          (used at once, before the row serves anything else)
    work[2, u, 11]        the angles of an offset met later inside the unit

The book: the angles of an offset are computed once per call, not once per unit and span. A ring
layer holds two offsets (its sinks' and the other slots'), met by every kv head and unit, and each
computation is rotary_dim/2 cosines and sines in float64, which cost about as much as the attention
over a few dozen slots. The book is a tuple of int64 scalars (nothing allocated) naming the two
offsets computed most recently in this call and the work rows that hold their angles,
(off_a, row_a, off_b, row_b) with row = u * _MISC_ROWS + (_ANG or _ANG_IN), -1 when empty. A row
in the book is never written again in the call: attend_stored (units in turn) adds what each unit
computes; attend_stored_parallel fills it while planning (each unit's first offset, and that of its
last slot into the unit's _ANG_IN row), and its units only read it, computing anything else into
their own _ROW row. The angles are the same values whichever row they come from, so the bits do
not depend on the book.

Only the unit's group rows of blocks 0 and 1 are used: the query and sum rows keep the query head's
index, so the row kernels (kv_row_math, kv_tile_math) address scores, queries and sums alike and
every row they read is a contiguous C row.
"""
from __future__ import annotations

import numpy as np
from numba import njit, prange

from ringllm.runtime.attention import cap_scores, exp_shifted, scale_group
from ringllm.runtime.fast_exp import exp_f32
from ringllm.runtime.kv_basis import from_value_basis, group_scores_row_basis, to_key_basis
from ringllm.runtime.kv_row_math import accumulate_row
from ringllm.runtime.kv_tile_math import (PREFETCH_AHEAD, axpy8, axpy8x2, dot8, dot8x2, head_rows, prefetch_rows,
                                          rows8_at, rows_tail_at)
from ringllm.runtime.numba_flags import FASTMATH
from ringllm.runtime.rope_kernels import angles_at, rotate_with

__all__ = ["UNIT_SLOTS", "MAX_UNITS", "unit_slots", "PARALLEL_MIN_SLOTS", "stored_work", "attend_stored",
           "attend_stored_ahead", "attend_stored_parallel", "same_unit_plan", "attend_stored_tokens"]

UNIT_SLOTS = 256                 # slots per unit at least: a unit's scores (group x 256 f32) and rows stay in L1/L2
# A head's slots are cut into at most this many units (unit_slots): each unit's start costs the
# queries' rotation, a cold start of its key and value reads and its share of the merge, which at
# thousands of slots in units of 256 is measurable (bench/read_bandwidth.py part 2); eight a head
# still spread a long layer over eight threads, even for a model with one kv head.
MAX_UNITS = 8
# A decode step's attention runs on the threads from this many occupied slots (all kv heads) on: from
# the first. A short layer's attention is only a few microseconds of work per thread, but run on the
# calling thread alone it leaves the other threads idle for longer than the OpenMP spin count
# (runtime/omp_spin.py: SPIN_SECONDS), they fall asleep, and the next product (the
# attention's output projection) pays for waking them, every layer of every token.
PARALLEL_MIN_SLOTS = 0
_F32_TINY = np.float32(1.1754944e-38)      # smallest normal float32
_ANG, _ML, _ROW, _ANG_IN, _MISC_ROWS = 8, 9, 10, 11, 12     # rows of a unit's misc block (module docstring)


@njit(cache=True, nogil=True, inline="always")
def unit_slots(count):
    """Slots per unit of a head holding `count` slots: UNIT_SLOTS, or the multiple of it that cuts the
    head into at most MAX_UNITS units. A function of the slot count alone (never of the thread
    count), so every entry (serial, parallel, batched) cuts a head alike and gives the same bits."""
    per = -(-count // MAX_UNITS)
    return max(UNIT_SLOTS, -(-per // UNIT_SLOTS) * UNIT_SLOTS)


def stored_work(n_kv: int, n_head: int, head_dim: int, slots: int) -> np.ndarray:
    """Work scratch for attend_stored over layers of at most `slots` slots per kv head (module docstring)."""
    if 2 * (n_head // n_kv) > head_dim:
        raise ValueError(f"attend_stored keeps 2 x {n_head // n_kv} per-head sums in a row of {head_dim}")
    n_units = n_kv * max(1, min(-(-slots // UNIT_SLOTS), MAX_UNITS))
    return np.zeros((3, n_units, max(n_head, _MISC_ROWS), head_dim), np.float32)


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _rotate_group(qw, ang, q, h0, group, rotary_dim, scale):
    """qw[h0:h0 + group] = the group's queries rotated by the angles ang (cos | sin), times scale."""
    half = rotary_dim // 2
    for g in range(group):
        rotate_with(qw[h0 + g], q[h0 + g], ang[:half], ang[half:rotary_dim], rotary_dim)
    scale_group(qw, h0, group, scale)


_NO_BOOK = (np.int64(-1), np.int64(-1), np.int64(-1), np.int64(-1))


@njit(cache=True, nogil=True, inline="always")
def _book_find(book, off):
    """The work[2] row (u * _MISC_ROWS + r) of the book holding offset off's angles, or -1."""
    if book[1] >= 0 and book[0] == off:
        return book[1]
    if book[3] >= 0 and book[2] == off:
        return book[3]
    return np.int64(-1)


@njit(cache=True, nogil=True, inline="always")
def _book_add(book, off, row):
    """The book with (off, row) first and the entry it held first second."""
    return (off, row, book[0], book[1])


@njit(cache=True, nogil=True, inline="always")
def _book_drop(book, row):
    """The book without the entry at work[2] row `row` (about to be rewritten)."""
    if book[3] == row:
        book = (book[0], book[1], np.int64(-1), np.int64(-1))
    if book[1] == row:
        book = (book[2], book[3], np.int64(-1), np.int64(-1))
    return book


@njit(cache=True, nogil=True, inline="always")
def _angles_row(work, row):
    """work[2] row `row` (u * _MISC_ROWS + r) as a view."""
    return work[2, row // _MISC_ROWS, row % _MISC_ROWS]


@njit(cache=True, nogil=True, inline="always")
def _offset_angles(work, book, u, r, off, q_pos, inv_freq, inv_scale, rotary_dim, learn):
    """(angles row of offset off, book): the book's row when it has off, else computed into work[2, u, r]
    and, when learn, entered in the book in place of whatever that row held before."""
    row = _book_find(book, off)
    if row >= 0:
        return _angles_row(work, row), book
    half = rotary_dim // 2
    ang = work[2, u, r]
    angles_at(ang[:half], ang[half:rotary_dim], q_pos + off, inv_freq, inv_scale)
    if learn:
        book = _book_add(_book_drop(book, u * _MISC_ROWS + r), off, u * _MISC_ROWS + r)
    return ang, book


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _scores_span(scores, qw, k_l, h, ja, jb, h0, group, misc, k_next, n_next, pf_end):
    """scores[h0 + g, ja:jb] = qw[h0 + g] . key j (any KV type): eight keys at a time (kv_tile_math), two
    query heads per pass over them, the last 1-7 as eight zero-padded rows (kv_tile_math.rows_tail_at:
    the same vector code for every slot, so every caller gets the same bits); one by one (kv_row_math)
    when head_dim is not a multiple of 8. The queries are first taken into the keys' basis (kv_basis:
    in place, for q4_0 rows; a span always starts from freshly rotated queries) and the keys read in
    it. The keys PREFETCH_AHEAD slots on are hinted (up to pf_end: past the span and unit, since the
    head's next rows are read next), and so are the same eight rows of k_next's head h below n_next
    (the next work's keys)."""
    hd = qw.shape[1]
    to_key_basis(qw, h0, group, k_l)
    tile = misc[:8].reshape(-1)
    j = ja
    if hd % 8 == 0:
        rows, flat, width = head_rows(k_l, h, tile), k_l[h].reshape(-1), k_l.shape[2]
        flat_next = k_next[h].reshape(-1)
        while j + 8 <= jb:
            if n_next == 0 and j + PREFETCH_AHEAD + 8 <= pf_end:
                prefetch_rows(flat, width, j + PREFETCH_AHEAD, 8)
            if j < n_next:
                prefetch_rows(flat_next, width, j, min(8, n_next - j))
            base = rows8_at(k_l, h, j, tile)
            g = 0
            while g + 2 <= group:
                dot8x2(scores[h0 + g], scores[h0 + g + 1], j, qw[h0 + g], qw[h0 + g + 1], rows, base, hd)
                g += 2
            if g < group:
                dot8(scores[h0 + g], j, qw[h0 + g], rows, base, hd)
            j += 8
        if j < jb:                      # the last 1-7 keys: eight rows, zero-padded, eight scores
            rows_tail_at(k_l, h, j, jb - j, tile)
            eight = misc[_ROW]
            for g in range(group):
                dot8(eight, 0, qw[h0 + g], tile, 0, hd)
                for r in range(jb - j):
                    scores[h0 + g, j + r] = eight[r]
            j = jb
    while j < jb:
        group_scores_row_basis(scores, qw, k_l, h, j, h0, group, misc[_ROW])
        j += 1


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _weighted_values(ow, scores, v_l, h, j0, j1, h0, group, misc, v_next, n_next, pf_end):
    """ow[h0 + g] = sum over j in [j0, j1) of scores[h0 + g, j] * value j (any KV type), eight rows at
    a time (kv_tile_math; in the values' basis, kv_basis, the sums taken back at the end), two query
    heads per pass over them, the last 1-7 as eight zero-padded rows with zero weights (as
    _scores_span); one by one (kv_row_math, values) when head_dim is not a multiple of 8, which no
    q4_0 store has. The values PREFETCH_AHEAD slots on are hinted up to pf_end (as _scores_span), and
    so are the same eight rows of v_next's head h below n_next (the next work's values)."""
    hd = ow.shape[1]
    for g in range(group):
        o = ow[h0 + g]
        for d in range(hd):
            o[d] = 0.0
    tile = misc[:8].reshape(-1)
    j = j0
    if hd % 8 == 0:
        rows, flat, width = head_rows(v_l, h, tile), v_l[h].reshape(-1), v_l.shape[2]
        flat_next = v_next[h].reshape(-1)
        while j + 8 <= j1:
            if n_next == 0 and j + PREFETCH_AHEAD + 8 <= pf_end:
                prefetch_rows(flat, width, j + PREFETCH_AHEAD, 8)
            if j < n_next:
                prefetch_rows(flat_next, width, j, min(8, n_next - j))
            base = rows8_at(v_l, h, j, tile)
            g = 0
            while g + 2 <= group:
                axpy8x2(ow[h0 + g], ow[h0 + g + 1], scores[h0 + g], scores[h0 + g + 1], j, rows, base, hd)
                g += 2
            if g < group:
                axpy8(ow[h0 + g], scores[h0 + g], j, rows, base, hd)
            j += 8
        if j < j1:                      # the last 1-7 values: eight rows, zero-padded, zero weights
            rows_tail_at(v_l, h, j, j1 - j, tile)
            eight = misc[_ROW]
            for g in range(group):
                for r in range(8):
                    eight[r] = scores[h0 + g, j + r] if j + r < j1 else np.float32(0.0)
                axpy8(ow[h0 + g], eight, 0, tile, 0, hd)
            j = j1
    from_value_basis(ow, h0, group, v_l)
    while j < j1:
        accumulate_row(ow, scores, v_l, h, j, h0, group, misc[_ROW:_ROW + 1])
        j += 1


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _exp_span(sc, n, softcap, ml, g, group):
    """sc[:n] (scores) -> exp(score - m), soft-capped first when softcap > 0; ml[g] = m, ml[group + g] = sum.
    (Loops from 0: an index that may be negative costs Numba's wraparound select and the vector code.)"""
    cap_scores(sc, n, softcap)
    m, total = exp_shifted(sc, n)
    ml[g] = m
    ml[group + g] = total


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _unit(u, h, j0, q, k_l, v_l, pos_l, seq_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, softcap, scores,
          work, count_l, group, off0, k_next, v_next, n_next, book, learn):
    """Unit u (kv head h, slots from j0): scores, per-head maximum and exponential sum, and weighted
    value sums into work[:, u] (module docstring). off0: the offset work[0, u]'s queries are rotated
    at on entry. The slots are scored in spans of one offset; the queries are re-rotated between spans,
    with the book's angles where it has them (module docstring); learn: the angles computed here go
    into the unit's _ANG_IN row and the book (attend_stored), else into its _ROW row (the parallel
    kernel's units, which only read the book). Returns the book.
    Rows j of head h of k_next / v_next below n_next are hinted into L2 as rows j are read (0: none)."""
    j1 = min(j0 + unit_slots(count_l[h]), count_l[h])
    h0 = h * group
    qw, misc = work[0, u], work[2, u]
    own = np.int64(_ANG_IN) if learn else np.int64(_ROW)
    cur = off0
    ja = j0
    while ja < j1:
        jb = ja
        while jb < j1 and seq_l[h, jb] - pos_l[h, jb] == cur:
            jb += 1
        _scores_span(scores, qw, k_l, h, ja, jb, h0, group, misc, k_next, n_next, count_l[h])
        if jb < j1:
            cur = seq_l[h, jb] - pos_l[h, jb]
            ang, book = _offset_angles(work, book, u, own, cur, q_pos, inv_freq, inv_scale, rotary_dim, learn)
            _rotate_group(qw, ang, q, h0, group, rotary_dim, scale)
        ja = jb
    for g in range(group):
        _exp_span(scores[h0 + g, j0:j1], j1 - j0, softcap, misc[_ML], g, group)
    _weighted_values(work[1, u], scores, v_l, h, j0, j1, h0, group, misc, v_next, n_next, count_l[h])
    return book


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _unit_query(u, h, j0, book, q, pos_l, seq_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, work, group):
    """Rotate unit u's queries at the offset of its first slot j0, with the book's angles when it has
    that offset, else computed into the unit's _ANG row and added to the book; returns (that offset,
    the book)."""
    off = seq_l[h, j0] - pos_l[h, j0]
    ang, book = _offset_angles(work, book, u, np.int64(_ANG), off, q_pos, inv_freq, inv_scale, rotary_dim, True)
    _rotate_group(work[0, u], ang, q, h * group, group, rotary_dim, scale)
    return off, book


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _merge(out, scores, work, count_l, group, mass):
    """out[h0 + g] = the merged attention of each head's units; mass[h, :count] when it has rows."""
    n_kv = count_l.shape[0]
    hd = out.shape[1]
    u1 = 0
    for h in range(n_kv):
        h0 = h * group
        size = unit_slots(count_l[h])
        u0, u1 = u1, u1 + (count_l[h] + size - 1) // size
        for g in range(group):
            o = out[h0 + g]
            for d in range(hd):
                o[d] = 0.0
            if u1 == u0:
                continue
            big = work[2, u0, _ML, g]
            for u in range(u0 + 1, u1):
                big = max(big, work[2, u, _ML, g])
            z = np.float32(0.0)
            for u in range(u0, u1):
                w = exp_f32(work[2, u, _ML, g] - big)
                z += work[2, u, _ML, group + g] * w
                work[2, u, _ML, g] = w        # the unit's factor exp(m_u - M), for the mass below
                ou = work[1, u, h0 + g]
                for d in range(hd):
                    o[d] += w * ou[d]
            inv = np.float32(1.0) / z
            for d in range(hd):
                o[d] *= inv
            if mass.shape[0] > 0:
                for u in range(u0, u1):
                    f = work[2, u, _ML, g] * inv
                    ja = (u - u0) * size
                    for j in range(ja, min(ja + size, count_l[h])):
                        w = scores[h0 + g, j] * f
                        w = w if w >= _F32_TINY else np.float32(0.0)
                        if g == 0:
                            mass[h, j] = w
                        else:
                            mass[h, j] += w


@njit(cache=True, nogil=True, inline="always", fastmath=FASTMATH)
def _attend_units(out, q, k_l, v_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, softcap,
                  scores, work, mass, k_next, v_next, count_next, hint_next):
    """attend_stored's units in turn, then their merge; with hint_next, the rows of the next work
    (k_next, v_next, count_next: a layer of the same shape and KV types) are hinted as they go."""
    group = q.shape[0] // k_l.shape[0]
    # int64 from the start: a counter starting as a literal 0 makes Numba compile _unit twice
    u, book = np.int64(0), _NO_BOOK
    for h in range(k_l.shape[0]):                  # nothing allocated: a batched step calls this per sequence
        n_next = count_next[h] if hint_next else np.int64(0)
        for j0 in range(0, count_l[h], unit_slots(count_l[h])):
            off, book = _unit_query(u, h, j0, book, q, pos_l, seq_l, q_pos, inv_freq, inv_scale, rotary_dim, scale,
                                    work, group)
            book = _unit(u, h, j0, q, k_l, v_l, pos_l, seq_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, softcap,
                         scores, work, count_l, group, off, k_next, v_next, n_next, book, True)
            u += 1
    _merge(out, scores, work, count_l, group, mass)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend_stored(out, q, k_l, v_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale,
                  softcap, scores, work, mass):
    """Attention of one token over the occupied slots of one layer, keys stored rotated (module docstring).

    out (n_head, hd) f32: result.         q (n_head, hd) f32: queries before RoPE.
    k_l, v_l (n_kv, cap, width) in the store's KV types (kv_types.py); pos_l, seq_l (n_kv, cap) i64:
        logical position and sequence index of each slot; count_l (n_kv,) i64: occupied slots.
    q_pos: the query's logical position; inv_freq (rotary_dim/2,) f64, inv_scale = 1 / rope_scale.
    scale: score multiplier; softcap: attention soft-cap (0 = none, softcap * tanh(s / softcap)).
    scores (n_head, >= cap) f32 scratch; work: stored_work(...) for at least cap slots.
    mass (n_kv, cap) f32: per-slot attention mass summed over the group's query heads, written
        when mass.shape[0] > 0, else untouched.
    """
    _attend_units(out, q, k_l, v_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, softcap,
                  scores, work, mass, k_l, v_l, count_l, False)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def attend_stored_ahead(out, q, k_l, v_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale,
                        softcap, scores, work, mass, k_next, v_next, count_next, hint_next):
    """attend_stored (same bits) that, when hint_next, hints into L2 the rows of the work that follows
    on this thread: layer arrays k_next, v_next (same shape and KV types as k_l, v_l) with count_next
    (n_kv,) occupied slots. Row j of the next layer is hinted as row j of this one is read, so the next
    work's reads from memory overlap this work's arithmetic (a batched step whose stores do not fit in
    the cache, stream_attention.py); this layer's own rows are then not hinted ahead, since the work
    before it hinted them. Without hint_next it is attend_stored."""
    _attend_units(out, q, k_l, v_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, softcap,
                  scores, work, mass, k_next, v_next, count_next, hint_next)


@njit(cache=True, nogil=True, fastmath=FASTMATH)
def _plan_units(q, k_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, work, group):
    """attend_stored_parallel's units before they run: (3, n_units) i64 of each unit's kv head, first
    slot and query offset, its queries rotated (_unit_query), and the book the units read (module
    docstring): it learns each unit's first offset and, into the unit's _ANG_IN row, the offset of its
    last slot (a ring layer's other offset, where a unit starts at the sinks). A function of its own,
    not inlined: the parallel kernel's compile then holds the loop alone. Returns (plan, book)."""
    n_units = 0
    for h in range(k_l.shape[0]):
        size = unit_slots(count_l[h])
        n_units += (count_l[h] + size - 1) // size
    plan = np.empty((3, n_units), np.int64)
    u, book = np.int64(0), _NO_BOOK
    for h in range(k_l.shape[0]):
        size = unit_slots(count_l[h])
        for j0 in range(0, count_l[h], size):
            plan[0, u], plan[1, u] = h, j0
            off, book = _unit_query(u, h, j0, book, q, pos_l, seq_l, q_pos, inv_freq, inv_scale, rotary_dim, scale,
                                    work, group)
            plan[2, u] = off
            j_last = min(j0 + size, count_l[h]) - 1
            last = seq_l[h, j_last] - pos_l[h, j_last]
            if last != off:
                _, book = _offset_angles(work, book, u, np.int64(_ANG_IN), last, q_pos, inv_freq, inv_scale,
                                         rotary_dim, True)
            u += 1
    return plan, book


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def attend_stored_parallel(out, q, k_l, v_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale,
                           softcap, scores, work, mass):
    """attend_stored with the units spread over the threads: the same bits for any thread count."""
    group = q.shape[0] // k_l.shape[0]
    plan, book = _plan_units(q, k_l, pos_l, seq_l, count_l, q_pos, inv_freq, inv_scale, rotary_dim, scale, work,
                             group)
    for i in prange(plan.shape[1]):
        u = np.int64(i)
        _unit(u, plan[0, u], plan[1, u], q, k_l, v_l, pos_l, seq_l, q_pos, inv_freq, inv_scale, rotary_dim, scale,
              softcap, scores, work, count_l, group, plan[2, u], k_l, v_l, np.int64(0), book, False)
    _merge(out, scores, work, count_l, group, mass)


@njit(cache=True, nogil=True, fastmath=False)
def same_unit_plan(counts):
    """Whether every row of counts (T, n_kv) i64 (each token's occupied slots per kv head) cuts each
    head into the same units (unit_slots and the number of units): attend_stored_tokens' condition."""
    for h in range(counts.shape[1]):
        size = unit_slots(counts[0, h])
        n_units = (counts[0, h] + size - 1) // size
        for t in range(1, counts.shape[0]):
            if unit_slots(counts[t, h]) != size or (counts[t, h] + size - 1) // size != n_units:
                return False
    return True


@njit(cache=True, nogil=True, parallel=True, fastmath=FASTMATH)
def attend_stored_tokens(out, q, k_l, v_l, pos_l, seq_l, counts, q_pos, inv_freq, inv_scale, rotary_dim, scale,
                         softcap, scores, work, books):
    """attend_stored_parallel for T tokens at once over one layer, each token t seeing the first
    counts[t, h] slots of each kv head h at query position q_pos[t]: the attention of a run of tokens
    written one after another without evicting, each attending right after its write (a speculative
    verification, a short chunk), after all of them were written. Each token's units and merge are
    attend_stored_parallel's (the same bits as calling it per token with that token's count); a unit's
    tokens run in turn on one thread, so its key and value rows come from memory once for all of them
    (from L2 after the first), where a call per token reads the layer T times.

    out, q (T, n_head, hd) f32; counts (T, n_kv) i64, q_pos (T,) i64; scores (T, n_head, >= cap) f32,
    work (T, *stored_work(...).shape) f32, books (T, 4) i64 scratch. same_unit_plan(counts) must hold.
    Nothing is written to a mass array (no policy reads it on a ring layer)."""
    T = q.shape[0]
    group = q.shape[1] // k_l.shape[0]
    plan = np.empty((3, 0), np.int64)
    for t in range(T):
        plan, book = _plan_units(q[t], k_l, pos_l, seq_l, counts[t], q_pos[t], inv_freq, inv_scale, rotary_dim,
                                 scale, work[t], group)
        books[t, 0], books[t, 1], books[t, 2], books[t, 3] = book
    for i in prange(plan.shape[1]):
        u = np.int64(i)
        for t in range(T):
            book = (books[t, 0], books[t, 1], books[t, 2], books[t, 3])
            _unit(u, plan[0, u], plan[1, u], q[t], k_l, v_l, pos_l, seq_l, q_pos[t], inv_freq, inv_scale, rotary_dim,
                  scale, softcap, scores[t], work[t], counts[t], group, plan[2, u], k_l, v_l, np.int64(0), book, False)
    no_mass = np.zeros((0, 0), np.float32)
    for t in range(T):
        _merge(out[t], scores[t], work[t], counts[t], group, no_mass)
