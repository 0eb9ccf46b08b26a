"""Victim selection: which tokens leave a layer of the KV store, and how many (the store never decides).

    keep_after      how many held tokens survive a write (staged eviction, Algorithm 1 of the seed
                    "Lazy Pruning, Slack, Max_Drop"; plain per-step eviction when lazy = slack =
                    max_drop = 0)
    ring_slot       the slot a ring layer (streaming, full, a sliding window) writes next: a free
                    slot, else the oldest non-sink token's
    choose_victims  the n lowest policy keys among a head's unprotected slots (ties -> older)
    choose_one      the same for one victim, gridding only the keys near the minimum
    pick_victims    either of those for head h of a layer, as the write kernels call it

Keys computed from attention are compared on a grid (KEY_GRID steps per octave for non-negative
masses, 2^-KEY_GRID absolute for signed scores): values that differ only by float rounding (two
implementations, or a chunked vs a one-token pass, summing in different orders) tie, and the tie
goes to the older token everywhere alike, instead of to whichever rounding came out larger. The
grid (1/4096 of an octave, 0.017%) is far below any difference a policy means to act on.

A slot is protected when its token is among the `sinks` oldest or the `recent` newest the head holds
(by rank). Every function here is a Numba kernel (keep_after also runs from Python on ints).
"""
from __future__ import annotations

import numpy as np
from numba import njit

KEY_GRID = 4096
GRID_NONE, GRID_LOG, GRID_ABS = 0, 1, 2      # Policy.key_grid: how raw keys map onto the grid
GRID_GIVEN = 3    # not a grid: key[h, :drop_h[h]] already hold head h's victim slots (adakv.select_drops)


@njit(cache=True, nogil=True, inline="always")
def grid_value(x, mode):
    """The grid key of raw key x: GRID_LOG round(KEY_GRID * log2(x + 1e-30)) for masses (x >= 0),
    GRID_ABS round(x * KEY_GRID) for signed O(1) scores, GRID_NONE x itself. Non-decreasing in x."""
    if mode == GRID_LOG:
        return np.floor(KEY_GRID * np.log2(x + 1e-30) + 0.5)
    if mode == GRID_ABS:
        return np.floor(x * KEY_GRID + 0.5)
    return x


@njit(cache=True, nogil=True, inline="always")
def grid_cell_bound(x, mode):
    """An upper bound on the raw keys that can share x's grid key (a superset: a little over one cell)."""
    if mode == GRID_LOG:
        return (x + 1e-30) * 1.001 - 1e-30      # a cell spans a factor 2^(1/4096) = 1.00017
    if mode == GRID_ABS:
        return x + 2.0 / KEY_GRID
    return x


@njit(cache=True, nogil=True, fastmath=False)
def grid_keys(key, count_l, mode):
    """key[h, j] -> grid_value(key[h, j], mode) for the occupied slots."""
    if mode == GRID_NONE:
        return
    for h in range(count_l.shape[0]):
        for j in range(count_l[h]):
            key[h, j] = grid_value(key[h, j], mode)


@njit(cache=True, nogil=True, fastmath=False)
def keep_after(length, capacity, lazy, slack, max_drop):
    """Algorithm 1 of the staged-eviction seed: how many of `length` held tokens survive this step.

    C = capacity, H = C + slack. Returns `length` (no pruning) while length <= C or length - C < lazy,
    else C when max_drop == 0, else min(max(length - max_drop, C), H).
    (4, 2044, 32, 16, 32) i.e. C = 2048: keep_after(2090, 2048, 32, 16, 32) == 2058. Compiled (Numba):
    adakv's selection kernel runs it on the layer totals; from Python it takes and returns ints.
    """
    if length <= capacity or length - capacity < lazy:
        return length
    if max_drop == 0:
        return capacity
    return min(max(length - max_drop, capacity), capacity + slack)


@njit(cache=True, nogil=True, inline="always")
def ring_slot(seq_l, count_l, evicted_l, h, sinks, reindexed, seq_new):
    """The ring's next slot of head h: (slot, logical position of the new token, sequence index of
    the victim or -1). A free slot while the head is not full, else the oldest non-sink token's
    slot (sinks + evicted mod (cap - sinks)); count/evicted are advanced."""
    cap = seq_l.shape[1]
    n = count_l[h]
    if n < cap:
        count_l[h] = n + 1
        return n, (n if reindexed else seq_new), np.int64(-1)
    slot = sinks + evicted_l[h] % (cap - sinks)
    evicted_l[h] += 1
    return slot, (cap - 1 if reindexed else seq_new), seq_l[h, slot]


@njit(cache=True, nogil=True, inline="always")
def _before(a, b, key_h, seq_h):
    """Whether value a sorts before value b (sort_i64): by value when key_h is empty; else a and b are
    slots and leave in the order of the lower key (NaN after every number), ties (equal keys, or both
    NaN) to the older token: NumPy's stable argsort by key after one by seq."""
    if key_h.shape[0] == 0:
        return a < b
    x, y = key_h[a], key_h[b]
    if x < y:
        return True
    if x == y or (x != x and y != y):
        return seq_h[a] < seq_h[b]
    return y != y and x == x


@njit(cache=True, nogil=True, fastmath=False)
def sort_i64(vals, m, buf, key_h, seq_h):
    """vals[:m] (int64) sorted in place, ascending, or when key_h (P,) f64 has entries as slots in
    eviction order by (key_h, seq_h) (_before): a bottom-up merge sort through buf (>= m). Written out,
    not NumPy's sorts, whose compile (argsort's merge sort, sort's quicksort, the fancy indexing
    around them) was most of the eviction kernels' and went into every policy's layer step."""
    src, dst = vals, buf
    in_buf = False
    width = 1
    while width < m:
        for lo in range(0, m, 2 * width):
            mid, hi = min(lo + width, m), min(lo + 2 * width, m)
            i, j, k = lo, mid, lo
            while i < mid and j < hi:
                if _before(src[j], src[i], key_h, seq_h):
                    dst[k] = src[j]
                    j += 1
                else:
                    dst[k] = src[i]
                    i += 1
                k += 1
            while i < mid:
                dst[k] = src[i]
                i += 1
                k += 1
            while j < hi:
                dst[k] = src[j]
                j += 1
                k += 1
        src, dst = dst, src
        in_buf = not in_buf
        width *= 2
    if in_buf:
        for i in range(m):
            vals[i] = buf[i]


@njit(cache=True, nogil=True, fastmath=False)
def choose_victims(key_h, seq_h, rank_h, n, n_drop, sinks, recent, out):
    """The n_drop lowest keys among unprotected slots of one head; ties -> the older token.

    key_h (P,) f64, seq_h, rank_h (P,) i64: slot arrays of the head; n: occupied slots. A slot is
    protected when rank < sinks or rank >= n - recent. out (>= n_drop,) i64 receives the victims'
    slots in the order chosen (lowest key first). Returns how many were chosen (fewer than n_drop
    only when too few slots are unprotected).
    """
    if n_drop <= 0:
        return 0
    if n_drop > 8:           # many at once (staged eviction): sort the candidates, O(n log n)
        cand = np.empty(2 * n, np.int64)         # the candidates, then the sort's buffer
        m = np.int64(0)                          # not a literal 0: sort_i64 would compile twice
        for j in range(n):
            if rank_h[j] >= sinks and rank_h[j] < n - recent:
                cand[m] = j
                m += 1
        sort_i64(cand, m, cand[n:], key_h, seq_h)
        got = min(n_drop, m)
        for i in range(got):
            out[i] = cand[i]
        return got
    got = 0                  # one pass, the n_drop lowest kept sorted by (key, seq) in out (insertion)
    for j in range(n):
        r = rank_h[j]
        if r < sinks or r >= n - recent:
            continue
        x, s = key_h[j], seq_h[j]
        if got == n_drop:
            p = out[got - 1]
            if not (x < key_h[p] or (x == key_h[p] and s < seq_h[p])):
                continue
        else:
            got += 1
        i = got - 1
        while i > 0:
            p = out[i - 1]
            if not (x < key_h[p] or (x == key_h[p] and s < seq_h[p])):
                break
            out[i] = p
            i -= 1
        out[i] = j
    return got


@njit(cache=True, nogil=True, fastmath=False)
def choose_one(key_h, seq_h, rank_h, n, sinks, recent, grid):
    """choose_victims(n_drop=1) on raw keys that are compared on grid `grid` (eviction.grid_value):
    the same victim as mapping every key onto the grid first, but the grid (a log2 per slot for
    masses) is computed only for the slots within a cell of the lowest raw key. Returns the slot,
    or -1 when every slot is protected."""
    lo, hi = sinks, n - recent
    xmin = np.inf
    for j in range(n):
        r = rank_h[j]
        x = key_h[j]
        if r >= lo and r < hi and x < xmin:
            xmin = x
    if xmin == np.inf:
        return -1
    gmin = grid_value(xmin, grid)
    bound = grid_cell_bound(xmin, grid)
    best = -1
    for j in range(n):
        r = rank_h[j]
        if r >= lo and r < hi and key_h[j] <= bound:
            if grid_value(key_h[j], grid) == gmin and (best < 0 or seq_h[j] < seq_h[best]):
                best = j
    return best


@njit(cache=True, nogil=True, fastmath=False)
def pick_victims(key_l, grid, h, n_drop, seq_l, rank_l, count_l, sinks, recent, victims):
    """The n_drop victims of head h by the keys key_l[h] (raw, compared on `grid`; GRID_NONE: as
    they are) into victims[:got]; returns got (fewer only when too few slots are unprotected). One
    victim on a grid: choose_one; else, or when no key is below inf (NaN keys), the keys are
    gridded in place and choose_victims picks them."""
    victims[0] = -1
    got = 0
    if n_drop == 1 and grid != GRID_NONE:
        victims[0] = choose_one(key_l[h], seq_l[h], rank_l[h], count_l[h], sinks, recent, grid)
        got = 1
    if victims[0] < 0:
        if grid != GRID_NONE:
            for j in range(count_l[h]):
                key_l[h, j] = grid_value(key_l[h, j], grid)
        got = choose_victims(key_l[h], seq_l[h], rank_l[h], count_l[h], n_drop, sinks, recent, victims)
    return got


@njit(cache=True, nogil=True, inline="always")
def count_below(sorted_a, n, x):
    """Number of the first n entries of the ascending array sorted_a below x (binary search)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi) // 2
        if sorted_a[mid] < x:
            lo = mid + 1
        else:
            hi = mid
    return lo
