"""Multi-token KV updates in one in-place pass (EQUIP section 5.4 / D.7), and the rollback journal that
speculative decoding uses to take rejected tokens back out of a store.

k tokens enter, k tokens leave, one call per layer:
  * kv_put_rows: m rows (head, slot) of K and V (and the RK cache) written in one pass; the row
    mover of both verbs below.
  * kv_replace_many (KVStore.replace_many): m new tokens take m given slots of every head: the
    tokens held there leave (counted in `evicted`), free slots are taken in order; ranks and
    positions are updated in one pass per head (a survivor drops by the number of leaving tokens
    older than it: O(n log m) instead of m passes of O(n)).
  * KVJournal (KVStore.begin_journal / rollback / commit): before every write of a journaled
    token, the store's small per-slot arrays of that layer (seq, rank, kbase, pos, count, evicted,
    score, aux, hist, extra, ksum: a few KB; for a ring write only seq, count, evicted and positions,
    into a free slot only its slot's position) are snapshot and the K/V/RK rows the write will overwrite (the
    ring's slot, or the policy's victims, the new token's slot and the keys a "rebased" layer will
    re-rotate) are saved. rollback(n_keep)
    puts the saved rows back in reverse order (one kv_put_rows call per layer: the rejected tokens
    leave, the tokens they evicted come back) and restores the snapshot taken before token n_keep,
    so the store is bitwise the store that was fed only the first n_keep tokens, stale bytes of
    empty slots included.

A write the journal did not predict is caught: before a rollback undoes a token, every slot whose
sequence index that token's write changed to a held token must be among the rows saved for it, else
RuntimeError (a new write path that bypasses the journal, e.g. a changed victim rule, cannot silently
corrupt a rollback). The check runs at rollback, on the tokens it undoes (the state after token t is
the snapshot taken before token t + 1, or the store itself for the newest), not at every write: a
token kept is never restored from the journal, and most of a verify's tokens are kept.
Not journaled (ConfigError at begin_journal or rollback): update "shift", RoPE strategy "kshift"
(it re-rotates every newer key in place), paged stores.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.eviction import GRID_GIVEN, choose_victims, count_below, sort_i64
from ringllm.runtime.kv_codec import encode_row
from ringllm.runtime.rope_kernels import REBASE_LIMIT

# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=False)
def kv_put_rows(k_l, v_l, heads, slots, k_rows, v_rows):
    """k_l[heads[i], slots[i]] = k_rows[i], v_l[...] = v_rows[i] for i = 0..m-1 in order (a later row
    wins where a (head, slot) repeats).

    k_l, v_l (n_kv, P, d) in the store's KV types (v_l may be k_l's RK twin (n_kv, P, rotary_dim) with
    v_rows the same width); heads, slots (m,) i64; k_rows, v_rows (m, d) rows of the same types (saved
    from the store: copied as they are). Returns None."""
    d = k_l.shape[2]
    dv = v_l.shape[2]
    for i in range(heads.shape[0]):
        h, s = heads[i], slots[i]
        for j in range(d):
            k_l[h, s, j] = k_rows[i, j]
        for j in range(dv):
            v_l[h, s, j] = v_rows[i, j]


@njit(cache=True, nogil=True, fastmath=False)
def kv_replace_many(k_l, v_l, seq_l, rank_l, pos_l, kbase_l, score_l, aux_l, hist_l, count_l, evicted_l, slots, k_new,
                    v_new, seq_new, reindexed, rebased, vseq):
    """m new tokens enter and the m tokens in their slots leave, per head, in one pass.

    k_l, v_l (n_kv, P, width) in the store's KV types; seq_l, rank_l, pos_l, kbase_l, aux_l (n_kv, P) i64; score_l (n_kv, P) f64;
    hist_l (n_kv, w, P) f32; count_l, evicted_l (n_kv,) i64 (the store's arrays of one layer).
    slots (n_kv, m) i64: slot of head h that new token i takes: an occupied slot (its token leaves)
    or a free one (slots count, count + 1, ... in order of use; checked by the caller).
    k_new, v_new (m, n_kv, hd) f32 (encoded as written); seq_new (m,) i64 increasing and newer than every held token
    (checked by the caller). vseq (m,) i64 scratch.

    A survivor's rank drops by the number of leaving tokens older than it (binary search over their
    sorted sequence indices); new token i gets rank n_after - m + i; score/aux/hist of the new slots
    are zeroed; rebased (a "rebased" RoPE layer, which takes keys rotated at their logical position):
    kbase of the new slots = their position, else 0 (keys before RoPE). Returns None.
    """
    n_kv = seq_l.shape[0]
    m = seq_new.shape[0]
    w = hist_l.shape[1]
    for h in range(n_kv):
        n = count_l[h]
        n_leave = 0
        for i in range(m):
            s = slots[h, i]
            if s < n:
                vseq[n_leave] = seq_l[h, s]
                n_leave += 1
        vs = vseq[:n_leave]
        sort_i64(vs, n_leave, np.empty(n_leave, np.int64), np.empty(0, np.float64), np.empty(0, np.int64))
        # survivors' ranks first, while the leaving tokens are still in place
        for j in range(n):
            sq = seq_l[h, j]
            lo = count_below(vs, n_leave, sq)
            if lo < n_leave and vs[lo] == sq:
                continue                       # leaving: rewritten below
            rank_l[h, j] -= lo
            if reindexed:
                pos_l[h, j] = rank_l[h, j]
        n_after = n + (m - n_leave)
        for i in range(m):
            s = slots[h, i]
            r = n_after - m + i
            seq_l[h, s] = seq_new[i]
            rank_l[h, s] = r
            pos_l[h, s] = r if reindexed else seq_new[i]
            kbase_l[h, s] = pos_l[h, s] if rebased else 0
            score_l[h, s] = 0.0
            aux_l[h, s] = 0
            for c in range(w):
                hist_l[h, c, s] = 0.0
            encode_row(k_l[h, s], k_new[i, h])
            encode_row(v_l[h, s], v_new[i, h])
        count_l[h] = n_after
        evicted_l[h] += n_leave


def check_replace_many(store, il: int, slots: np.ndarray, seqs: np.ndarray) -> None:
    """The argument checks of KVStore.replace_many (an out-of-range slot in Numba is a segfault).
    slots (n_kv, m) i64, seqs (m,) i64."""
    n_kv, P = store.seq[il].shape
    m = seqs.shape[0]
    if slots.shape != (n_kv, m):
        raise ConfigError(f"replace_many: slots must be ({n_kv}, {m}) (one slot per kv head and new token), "
                          f"got {slots.shape}")
    if m and (np.any(np.diff(seqs) <= 0) or seqs[0] < 0):
        raise ConfigError("replace_many: new sequence indices must be >= 0 and strictly increasing")
    for h in range(n_kv):
        n = int(store.count[il][h])
        held = store.seq[il][h, :n]
        if m and n and seqs[0] <= held.max():
            raise ConfigError(f"replace_many: new tokens must be newer than every held token (head {h} holds "
                              f"{int(held.max())}, first new {int(seqs[0])})")
        s = slots[h]
        if np.any(s < 0) or np.any(s >= P) or np.unique(s).size != m:
            raise ConfigError(f"replace_many: head {h} slots must be distinct, in 0..{P - 1}; got {s.tolist()}")
        free = s[s >= n]
        if not np.array_equal(free, np.arange(n, n + free.size)):
            raise ConfigError(f"replace_many: head {h} free slots must be taken in order from count {n}; got "
                              f"{free.tolist()}")


# ---------------------------------------------------------------------------------------------
# Journal
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, fastmath=False)
def ring_save(t, k_l, v_l, seq_l, pos_l, count_l, evicted_l, sinks, snap_seq, snap_count, snap_evicted, snap_pos,
              slots, k_rows, v_rows, pos_rows):
    """KVJournal's record of journaled token t about to be written into a ring layer by the streaming
    kernel (kv_write.kv_write_streaming): per head the slot it takes (eviction.ring_slot's choice,
    without advancing anything) into slots[t], that slot's K/V row and position into k_rows[t],
    v_rows[t], pos_rows[t]; seq, count and evicted into their snapshots of token t, and the whole
    position array into snap_pos[t] when some head is full (that write evicts, and in reindexed mode
    moves every newer token's position). Returns whether every head had a free slot."""
    n_kv, cap = seq_l.shape
    free = True
    for h in range(n_kv):
        n = count_l[h]
        slot = n if n < cap else sinks + evicted_l[h] % max(cap - sinks, 1)
        free = free and n < cap
        slots[t, h] = slot
        k_rows[t, h] = k_l[h, slot]
        v_rows[t, h] = v_l[h, slot]
        pos_rows[t, h] = pos_l[h, slot]
    snap_seq[t] = seq_l
    snap_count[t] = count_l
    snap_evicted[t] = evicted_l
    if not free:
        snap_pos[t] = pos_l
    return free


class KVJournal:
    """Undo log of up to `max_tokens` tokens fed into `store` (see the module docstring).

    Per layer and journaled token t: snapshot[field][t] = a small array of the layer before token t's
    write, for the fields that write may change; rows[t] = (heads (r,) i64, slots (r,) i64, k (r, hd),
    v (r, hd), rk (r, rotary_dim) or None, pos (r,) i64 or None, fields): the rows that write
    overwrites, as they were, the slots' positions when only theirs change, and the fields snapshot.
    A policy write may change any small array: all of them (SNAP_FIELDS). A ring write (the streaming
    kernel) changes the sequence index and position of its slot, the head's count and evicted, and in
    reindexed mode, when it evicts, the position of every newer token: LIGHT_FIELDS and the position
    array (`rank` in reindexed mode, else `pos`); into a free slot, LIGHT_FIELDS and its slot's
    position alone. A layer of 4096 slots holds ~0.6 MB of small arrays; a verify snapshots them for
    every token of every layer.
    """

    SNAP_FIELDS = ("seq", "rank", "kbase", "count", "evicted", "score", "aux", "hist", "extra", "ksum")
    LIGHT_FIELDS = ("seq", "count", "evicted")

    def __init__(self, store, max_tokens: int):
        if max_tokens < 1:
            raise ConfigError(f"a journal needs max_tokens >= 1, got {max_tokens}")
        if getattr(store, "paged", False):
            raise ConfigError("the rollback journal works on dense KVStores, not paged ones")
        if store.update != "inplace":
            raise ConfigError("the rollback journal needs update 'inplace' (the shift baseline moves every slot)")
        if store.layer_rope_mode is not None and "kshift" in store.layer_rope_mode:
            raise ConfigError("the rollback journal does not cover RoPE strategy 'kshift' (it re-rotates every "
                              "newer key in place); use rope 'stored', 'fused' or 'rk'")
        self.store, self.max_tokens = store, int(max_tokens)
        self.fields = self.SNAP_FIELDS + (() if store.reindexed else ("pos",))
        self.snap = [{f: np.empty((self.max_tokens,) + getattr(store, f)[il].shape, getattr(store, f)[il].dtype)
                      for f in self.fields} for il in range(store.spec.n_layer)]
        self.victims = np.zeros(max(store.layer_physical) + 1, np.int64)
        self.heads = np.arange(store.spec.n_head_kv, dtype=np.int64)     # a ring write: one row per head
        self.pos_field = "rank" if store.reindexed else "pos"             # the array a ring write's positions go to
        self.ring_fields = self.LIGHT_FIELDS + (self.pos_field,)          # what a ring write may change
        self.ring_rows = [None] * store.spec.n_layer     # per ring layer: slots, k, v, positions per token
        self.reset()

    def reset(self) -> None:
        """Start journaling from the store's current state."""
        n_layer = self.store.spec.n_layer
        self.base_n_seen = self.store.n_seen
        self.n = [0] * n_layer
        self.rows: list[list[tuple]] = [[] for _ in range(n_layer)]

    # -- recording (KVStore.write calls these just before its kernel) --------------------------

    def before_ring(self, store, il: int) -> None:
        """The ring kernel is about to write: each head's slot is `count` while free, else the oldest
        non-sink slot sinks + evicted mod (P - sinks) (eviction.ring_slot)."""
        t = self.n[il]
        if t >= self.max_tokens:
            self._full()
        if self.ring_rows[il] is None:
            k, v = store.k[il], store.v[il]
            n_kv = k.shape[0]
            m = self.max_tokens
            self.ring_rows[il] = (np.empty((m, n_kv), np.int64), np.empty((m,) + k[:, 0].shape, k.dtype),
                                  np.empty((m,) + v[:, 0].shape, v.dtype), np.empty((m, n_kv), np.int64))
        slots, k_rows, v_rows, pos_rows = self.ring_rows[il]
        snap = self.snap[il]
        free = ring_save(t, store.k[il], store.v[il], store.seq[il], getattr(store, self.pos_field)[il],
                         store.count[il], store.evicted[il], store.layer_sinks[il], snap["seq"], snap["count"],
                         snap["evicted"], snap[self.pos_field], slots, k_rows, v_rows, pos_rows)
        heads = self.heads[:slots.shape[1]]
        rk = store.rk[il][heads, slots[t]] if store.rk is not None else None       # the RK cache's rows (rope "rk")
        self.rows[il].append((heads, slots[t], k_rows[t], v_rows[t], rk, pos_rows[t] if free else None,
                              self.LIGHT_FIELDS if free else self.ring_fields))
        self.n[il] = t + 1

    def before_policy(self, store, il: int, grid: int) -> None:
        """kv_write_policy is about to evict drop_h[h] tokens of each head (store.key filled, `grid` as
        KVStore.prepare_policy_write returned it) and write the new token into slot count - dropped:
        the victims are chosen here by the same function, or read from store.key under GRID_GIVEN."""
        heads, slots = [], []
        for h in range(store.seq[il].shape[0]):
            n, d = int(store.count[il][h]), int(store.drop_h[h])
            got = 0
            if d > 0 and grid == GRID_GIVEN:           # the victims' slots, chosen by the policy (adakv)
                got = d
                slots.extend(store.key[h, :d].astype(np.int64).tolist())
            elif d > 0:
                got = int(choose_victims(store.key[h], store.seq[il][h], store.rank[il][h], n, d,
                                         store.layer_sinks[il], store.recent, self.victims))
                slots.extend(self.victims[:got].tolist())
            slots.append(n - got)
            heads.extend([h] * (got + 1))
            if store.rope_mode(il) == "rebased":
                # survivors the attention after this write re-rotates (attention.attend_rebased): an offset
                # kbase - pos grows by at most `got`; saving a superset is harmless (an unchanged row restores as is)
                off = store.kbase[il][h, :n] - store.pos[il][h, :n]
                again = np.flatnonzero((off < 0) | (off + got >= REBASE_LIMIT))
                slots.extend(again.tolist())
                heads.extend([h] * again.size)
        self._record(store, il, np.asarray(heads, np.int64), np.asarray(slots, np.int64))

    def _record(self, store, il: int, heads: np.ndarray, slots: np.ndarray) -> None:
        """Save what token t's policy write may change: the rows at (heads, slots) and every small
        array (class docstring)."""
        t = self.n[il]
        if t >= self.max_tokens:
            self._full()
        snap = self.snap[il]
        for f in self.fields:
            src = getattr(store, f)[il]
            if src.size:
                snap[f][t] = src
        rk = store.rk[il][heads, slots] if store.rk is not None else None
        k, v = store.k[il][heads, slots], store.v[il][heads, slots]
        self.rows[il].append((heads, slots, k, v, rk, None, self.fields))
        self.n[il] = t + 1

    def _full(self):
        raise ConfigError(f"journal full: it was begun for {self.max_tokens} tokens; begin_journal(n) with "
                          "the number of tokens the verify feeds")

    def _check(self, il: int, t: int, seq_after: np.ndarray) -> None:
        """Every slot whose token changed during journaled token t (seq_after: layer il's sequence indices
        after that token's write; changed to a held token) was saved."""
        seq_then = self.snap[il]["seq"][t]
        changed = (seq_after != seq_then) & (seq_after >= 0)
        heads, slots = self.rows[il][t][:2]
        changed[heads, slots] = False
        if changed.any():
            h, j = np.argwhere(changed)[0]
            raise RuntimeError(f"KV journal: layer {il} head {h} slot {j} was written without being journaled "
                               "(a write path the journal does not predict); rollback would be wrong")

    # -- rollback -----------------------------------------------------------------------------

    def _restore_small(self, il: int, n_keep: int, fed: int) -> None:
        """Layer il's small arrays back to their state before token n_keep. Each field from the oldest
        snapshot of it among tokens n_keep .. fed - 1: a token before that one left the field as it was
        (else it would have snapshot it), except the positions of the slots a ring write into a free
        slot took, put back newest first. A field no undone token snapshot is as it was."""
        store, snap, entries = self.store, self.snap[il], self.rows[il]
        for f in self.fields:
            first = next((t for t in range(n_keep, fed) if f in entries[t][6]), fed)
            dst = getattr(store, f)[il]
            if first < fed and dst.size:
                dst[...] = snap[f][first]
            if f == self.pos_field:
                for t in range(first - 1, n_keep - 1, -1):
                    heads, slots, pos = entries[t][0], entries[t][1], entries[t][5]
                    if pos is not None:
                        dst[heads, slots] = pos

    def rollback(self, n_keep: int) -> None:
        """Undo every journaled token after the first n_keep: the store becomes bitwise the store
        that was fed only those n_keep tokens."""
        store = self.store
        fed = store.n_seen - self.base_n_seen
        if not 0 <= n_keep <= fed:
            raise ConfigError(f"rollback: n_keep must be in 0..{fed} (tokens fed since begin_journal), got {n_keep}")
        if any(n != fed for n in self.n):
            raise ConfigError(f"rollback: the journal saw {self.n} writes per layer for {fed} tokens fed; a write "
                              "path bypassed it (RoPE strategy 'kshift'?)")
        for il in range(store.spec.n_layer):
            if n_keep == fed:
                continue
            for t in range(n_keep, fed):                  # the tokens undone: each wrote only saved rows
                self._check(il, t, store.seq[il] if t == fed - 1 else self.snap[il]["seq"][t + 1])
            undo = self.rows[il][n_keep:fed][::-1]         # newest first: the oldest image of a row wins
            heads = np.concatenate([u[0][::-1] for u in undo])
            slots = np.concatenate([u[1][::-1] for u in undo])
            kv_put_rows(store.k[il], store.v[il], heads, slots, np.concatenate([u[2][::-1] for u in undo]),
                        np.concatenate([u[3][::-1] for u in undo]))
            if store.rk is not None and undo[0][4] is not None:
                rows = np.concatenate([u[4][::-1] for u in undo])
                kv_put_rows(store.rk[il], store.rk[il], heads, slots, rows, rows)
            self._restore_small(il, n_keep, fed)
            del self.rows[il][n_keep:]
            self.n[il] = n_keep
        store.forget_pending()
        store.n_seen = self.base_n_seen + n_keep
