"""RoPE: angle tables, and the strategies that decide where a layer's keys are rotated (kernels: rope_kernels.py).

RoPE is rotate-half over the first `rotary_dim` dims: halves (a, b) -> (a cos - b sin, b cos + a sin)
with angle pos/scale * base^(-2i/rotary_dim) (Su et al., RoFormer eq. 34, HF layout). Scores depend
only on the difference of the query's and the key's positions, which is what lets a key be stored
rotated at one position and read at another with the query rotated by the offset.

Strategies (one per layer, chosen by the engine; every one exact up to float32 rounding):

    stored   keys rotated once at write by their sequence index; the query is rotated by each
             slot's offset (sequence index - logical position) at read: attention.attend_stored
    fused    keys stored before RoPE, each rotated by its slot's logical position as it is read:
             attention.attend
    rk       EQUIP's cached rotate-half: rotate_half(k) stored beside each key (+50% KV memory),
             keys rotated at read by two multiply-adds per dim: attention.attend_rk
    kshift   keys stored rotated at their logical position and re-rotated by the change when an
             eviction re-indexes them (llama.cpp's K-shift, the staged-eviction seed's Eq. 4):
             kv_write_kshift, then attention.attend_stored with zero offsets
    rebased  (policy layers) keys rotated at a per-slot base position kbase kept within
             REBASE_LIMIT of the slot's position; the query rotated once per offset in use:
             attention.attend_rebased, written by kv_store.kv_write_policy

`RopeStrategy` and its subclasses put the first four behind one interface (`write`, `attend`) for
the layers where the store's ring chooses victims; policy layers are "rebased" (or "fused" when the
policy reads keys before RoPE) and run through the compiled policy step, which takes the layout as
its `rebase` argument (`rebase_limit`).

The rotation kernels, the K-shift write and REBASE_LIMIT are in runtime/rope_kernels.py (the
attention kernels use them; this file uses the attention kernels). Sections: tables; strategies.
"""
from __future__ import annotations

import time

import numpy as np

from ringllm.runtime import compile_share
from ringllm.runtime.attention import attend, attend_rk
from ringllm.runtime.stored_attention import (PARALLEL_MIN_SLOTS, attend_stored, attend_stored_parallel,
                                              attend_stored_tokens, same_unit_plan, stored_work)
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.rope_kernels import REBASE_LIMIT, kv_write_kshift, rk_write, rope_rows_at, rotate_keys_to
from ringllm.runtime.rope_scaling import base_freqs

# ---------------------------------------------------------------------------------------------
# Tables
# ---------------------------------------------------------------------------------------------


class RopeTable:
    """cos/sin of angle pos/scale * inv_freq[i] for pos in [0, n): cos, sin (n, rotary_dim/2) float32.

    inv_freq (rotary_dim/2,) float64: the layer's frequencies (ModelSpec.inv_freq: any per-frequency
    scaling already divided in), or a float base for the unscaled base^(-2i/rotary_dim). Grows
    (doubling) when a position past its end is asked for: in `original` mode positions are sequence
    indices and a stream is unbounded.
    """

    def __init__(self, rotary_dim: int, inv_freq, scale: float, n: int = 4096):
        if np.ndim(inv_freq) == 0:
            inv_freq = base_freqs(rotary_dim, float(inv_freq))
        self.rotary_dim, self.scale = rotary_dim, scale
        self.inv_freq = np.ascontiguousarray(inv_freq, dtype=np.float64)
        if self.inv_freq.shape != (rotary_dim // 2,):
            raise ValueError(f"inv_freq has shape {self.inv_freq.shape}, expected ({rotary_dim // 2},)")
        self.cos = self.sin = np.zeros((0, rotary_dim // 2), np.float32)
        self.ensure(n)

    def ensure(self, n: int) -> None:
        if n <= self.cos.shape[0]:
            return
        size = max(n, 2 * self.cos.shape[0])
        ang = (np.arange(size, dtype=np.float64) / self.scale)[:, None] * self.inv_freq[None, :]
        self.cos = np.ascontiguousarray(np.cos(ang), dtype=np.float32)
        self.sin = np.ascontiguousarray(np.sin(ang), dtype=np.float32)


class FullRopeTable:
    """cos, sin (n, rotary_dim) float32: a RopeTable's rows repeated over both halves (the RK cache's
    form: RoPE(k) at p = k * C[p] + rotate_half(k) * S[p])."""

    def __init__(self, table: RopeTable):
        self.table = table
        self.cos = self.sin = np.zeros((0, table.rotary_dim), np.float32)
        self.ensure(table.cos.shape[0])

    def ensure(self, n: int) -> None:
        if n <= self.cos.shape[0]:
            return
        self.table.ensure(n)
        self.cos = np.ascontiguousarray(np.concatenate([self.table.cos, self.table.cos], axis=1))
        self.sin = np.ascontiguousarray(np.concatenate([self.table.sin, self.table.sin], axis=1))


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------


class LayerRope:
    """One layer's RoPE constants: table (RopeTable, shared by layers of the same base and scale),
    full (its FullRopeTable), inv_freq (rotary_dim/2,) f64, inv_scale = 1/scale, rotary_dim, and
    back (2, rotary_dim/2) f32: cos, sin of a one-position step back (K-shift)."""

    def __init__(self, table: RopeTable, full: FullRopeTable):
        self.table, self.full = table, full
        self.inv_freq = table.inv_freq
        self.inv_scale = 1.0 / table.scale
        self.rotary_dim = table.rotary_dim
        self.back = np.stack([np.cos(-self.inv_freq / table.scale),
                              np.sin(-self.inv_freq / table.scale)]).astype(np.float32)


def layer_ropes(spec, n: int) -> list[LayerRope]:
    """LayerRope per layer of a ModelSpec (frequencies spec.inv_freq(il), linear scale spec.rope_scale[il]);
    layers with the same frequencies and scale share one table, created with n rows."""
    tables: dict[tuple[bytes, float], LayerRope] = {}
    out = []
    for il in range(spec.n_layer):
        inv_freq, scale = spec.inv_freq(il), spec.rope_scale[il]
        key = (inv_freq.tobytes(), scale)
        if key not in tables:
            table = RopeTable(spec.rotary_dim, inv_freq, scale, n=n)
            tables[key] = LayerRope(table, FullRopeTable(table))
        out.append(tables[key])
    return out


class AttendScratch:
    """The run buffers of one token's attention over a ring layer (engine-owned, reused every step):
    out (n_head, hd) f32 result, scores (n_head, P) f32 and work (stored_attention.stored_work for P
    slots) (both grown by grow()), krot (hd,) f32, qrot (n_head, hd) f32, angles (2, rotary_dim/2)
    f32, ktmp (hd + rotary_dim,) f32, qpos (n_kv,) i64. parallel: the stored layouts' attention
    spreads a layer's slots over the threads (when it holds at least PARALLEL_MIN_SLOTS)."""

    def __init__(self, n_head: int, n_kv: int, head_dim: int, rotary_dim: int, parallel: bool = True):
        self.n_kv, self.parallel = n_kv, parallel
        self.out = np.zeros((n_head, head_dim), np.float32)
        self.scores = np.zeros((n_head, 0), np.float32)
        self.work = stored_work(n_kv, n_head, head_dim, 0)
        self.krot = np.zeros(head_dim, np.float32)
        self.qrot = np.zeros((n_head, head_dim), np.float32)
        self.angles = np.zeros((2, rotary_dim // 2), np.float32)
        self.ktmp = np.zeros(head_dim + rotary_dim, np.float32)
        self.qpos = np.zeros(n_kv, np.int64)
        self.no_mass = np.zeros((0, 0), np.float32)
        self._run = None                    # run_buffers' arrays, made on a run's first use

    def grow(self, slots: int) -> bool:
        """Make scores hold `slots` columns; True when it had to grow."""
        if self.scores.shape[1] >= slots:
            return False
        self.scores = np.zeros((self.scores.shape[0], slots), np.float32)
        self.work = stored_work(self.n_kv, self.out.shape[0], self.out.shape[1], slots)
        return True

    def run_buffers(self, T: int, slots: int) -> tuple:
        """Buffers of a run of T <= RUN_TOKENS tokens' attention (StoredRope.write_attend_run) over
        layers of at most `slots` slots: (out (T, n_head, hd), scores (T, n_head, slots), work
        (T, stored_work), books (T, 4) i64, counts (T, n_kv) i64, q_pos (T,) i64), views of arrays
        allocated once for RUN_TOKENS tokens and grown with the slots."""
        run = self._run
        if run is None or run[1].shape[2] < slots:
            n_head, hd = self.out.shape
            run = (np.zeros((RUN_TOKENS, n_head, hd), np.float32), np.zeros((RUN_TOKENS, n_head, slots), np.float32),
                   np.zeros((RUN_TOKENS, *stored_work(self.n_kv, n_head, hd, slots).shape), np.float32),
                   np.zeros((RUN_TOKENS, 4), np.int64), np.zeros((RUN_TOKENS, self.n_kv), np.int64),
                   np.zeros(RUN_TOKENS, np.int64))
            self._run = run
        return tuple(a[:T] for a in run)


class RopeStrategy:
    """Where a ring layer's keys are rotated: `write` puts token `seq` into the store's layer il in
    the strategy's layout, `attend` computes the attention of its query q (n_head, hd) f32 (before
    RoPE) over the layer into sc.out (scores times scale, soft-capped when softcap > 0), writing the per-slot mass (n_kv, P) f32 when it has rows.
    Every strategy holds the same tokens and gives the same scores up to float32 rounding.

    table_rows: rows the RopeTables start with (strategies that read table rows at every position
    start large; the others compute angles directly and need none up front). rebase: the write
    kernels' `rebase` argument for a layer in this layout (kv_write.kv_write_policy): REBASE_LIMIT
    when keys are rotated at their base position as they are written, else 0 (keys stored as given).
    A policy layer ("fused" or "rebased") is written and attended by the policy's compiled step or
    policy_step.policy_write_attend, which take the layout through `rebase`; write/attend serve the
    ring layers."""

    name = ""
    table_rows = 1
    rebase = 0

    def write(self, store, il: int, rope: LayerRope, k: np.ndarray, v: np.ndarray, seq: int,
              sc: AttendScratch) -> None:
        store.write(il, k, v, seq)

    def attend(self, store, il: int, rope: LayerRope, q: np.ndarray, seq: int, scale: np.float32, softcap: np.float32,
               mass: np.ndarray, sc: AttendScratch) -> None:
        raise NotImplementedError

    @staticmethod
    def runs(store, il: int, T: int) -> bool:
        """Whether write_attend_run can take T tokens into layer il (StoredRope; no other strategy has it)."""
        return False


def _query_position_grown(store, il: int, rope: LayerRope, seq: int) -> int:
    """The query's position in a layer read through table rows (its newest token's, the largest
    count in reindexed mode), growing the tables to cover it."""
    qp = int(store.count[il].max()) - 1 if store.reindexed else seq
    if qp + REBASE_LIMIT >= rope.table.cos.shape[0]:
        rope.table.ensure(qp + REBASE_LIMIT + 1)
        rope.full.ensure(qp + 1)
    return qp


# Tokens a run's attention takes at once (StoredRope.write_attend_run): a speculative verification's
# gamma + 1; longer runs go in parts of this many.
RUN_TOKENS = 8


# The threaded attention in this process: "ready" once it has run, else the monotonic time at which a
# cold start's parent may next ask for it (_attend_stored).
_THREADED = {"ready": False, "ask_at": 0.0}
THREADED_ASK_S = 0.25


def _attend_stored(store, il: int, rope: LayerRope, seq_l: np.ndarray, q: np.ndarray, seq: int, scale: np.float32,
                   softcap: np.float32, mass: np.ndarray, sc: AttendScratch) -> None:
    """stored_attention.attend_stored over layer il, keys stored rotated at seq_l (n_kv, P); on the
    threads unless sc.parallel is off (stored_attention.PARALLEL_MIN_SLOTS; the same bits either way).

    A cold start (runtime/compile_share.py: stand-ins) does not wait for the threaded kernel, the
    longest compile before its first tokens: while the helper has yet to compile it, a prompt's rows
    and decode steps run the one-thread kernel, which the helper compiles first, and ask again after
    THREADED_ASK_S. The process's exit waits for the helper to save it, so the cache it leaves holds it."""
    count = store.count[il]
    args = (sc.out, q, store.k[il], store.v[il], store.pos[il], seq_l, count, store.query_position(il, seq),
            rope.inv_freq, rope.inv_scale, rope.rotary_dim, scale, softcap, sc.scores, sc.work, mass)
    if not sc.parallel or count.sum() < PARALLEL_MIN_SLOTS:
        attend_stored(*args)
    elif _THREADED["ready"]:
        attend_stored_parallel(*args)
    elif time.monotonic() < _THREADED["ask_at"]:
        attend_stored(*args)
    else:
        try:
            with compile_share.unless_compiling():
                attend_stored_parallel(*args)
            _THREADED["ready"] = True
        except compile_share.NotReady:
            _THREADED["ask_at"] = time.monotonic() + THREADED_ASK_S
            attend_stored(*args)


class StoredRope(RopeStrategy):
    """Keys rotated at their sequence index as they are written; the query rotated per offset."""

    name = "stored"

    def write(self, store, il, rope, k, v, seq, sc):
        rope_rows_at(k, seq, rope.inv_freq, rope.inv_scale, rope.rotary_dim, sc.ktmp)
        store.write(il, k, v, seq)

    def attend(self, store, il, rope, q, seq, scale, softcap, mass, sc):
        _attend_stored(store, il, rope, store.seq[il], q, seq, scale, softcap, mass, sc)

    @staticmethod
    def runs(store, il: int, T: int) -> bool:
        """Whether write_attend_run can take T tokens into ring layer il: written in place into free
        slots (every head holds count + T <= its slots), so no token evicts one an earlier token sees."""
        return (store.layer_ring[il] and store.update == "inplace"
                and int(store.count[il].max()) + T <= store.k[il].shape[1])

    def write_attend_run(self, store, il, rope, k, v, q, seq0, scale, softcap, sc, out):
        """Tokens seq0 .. seq0 + T - 1 into ring layer il (k, v (T, n_kv, hd) before RoPE: rotated
        in place) and out (T, n_head, hd) = each one's attention (q (T, n_head, hd) before RoPE), as T
        calls of write then attend give them (the same bits): every token is written, through the store's
        write (and its journal), then each one's attention over the slots it saw when written, all the
        run's tokens at once (stored_attention.attend_stored_tokens: the layer's rows read once, not T
        times). runs(store, il, T) must hold. Runs of more than RUN_TOKENS tokens go in parts."""
        T = q.shape[0]
        for a in range(0, T, RUN_TOKENS):
            n = min(RUN_TOKENS, T - a)
            o, scores, work, books, counts, q_pos = sc.run_buffers(n, store.k[il].shape[1])
            for t in range(n):
                self.write(store, il, rope, k[a + t], v[a + t], seq0 + a + t, sc)
                counts[t] = store.count[il]
                q_pos[t] = store.query_position(il, seq0 + a + t)
            args = (store.k[il], store.v[il], store.pos[il], store.seq[il])
            tail = (rope.inv_freq, rope.inv_scale, rope.rotary_dim, scale, softcap)
            if same_unit_plan(counts):
                attend_stored_tokens(o, q[a:a + n], *args, counts, q_pos, *tail, scores, work, books)
            else:                   # a token crossed a unit boundary: its own call (the same bits)
                for t in range(n):
                    attend_stored_parallel(o[t], q[a + t], *args, counts[t], q_pos[t], *tail, scores[t], work[t],
                                           sc.no_mass)
            out[a:a + n] = o


class KShiftRope(RopeStrategy):
    """Keys rotated at their logical position, re-rotated when an eviction re-indexes them; the
    offsets pos - pos are 0, so attend_stored rotates each group's query once."""

    name = "kshift"

    def write(self, store, il, rope, k, v, seq, sc):
        kv_write_kshift(store.k[il], store.v[il], store.seq[il], store.pos[il], store.count[il], store.evicted[il], k,
                        v, seq, store.layer_sinks[il], store.reindexed, rope.inv_freq, rope.inv_scale,
                        rope.rotary_dim, rope.back, sc.angles, sc.ktmp)

    def attend(self, store, il, rope, q, seq, scale, softcap, mass, sc):
        _attend_stored(store, il, rope, store.pos[il], q, seq, scale, softcap, mass, sc)


class FusedRope(RopeStrategy):
    """Keys stored before RoPE, each rotated by its slot's position as it is read."""

    name = "fused"
    table_rows = 4096

    def attend(self, store, il, rope, q, seq, scale, softcap, mass, sc):
        _query_position_grown(store, il, rope, seq)
        attend(sc.out, q, store.k[il], store.koff[il], store.seq[il], store.v[il], store.pos[il], store.count[il],
               store.query_positions(il, seq, sc.qpos), rope.table.cos, rope.table.sin, rope.rotary_dim, scale, softcap,
               sc.scores, sc.krot, sc.qrot, mass)


class RKCacheRope(RopeStrategy):
    """EQUIP's RK cache: rotate_half(k) kept beside each key (store.rk), two multiply-adds per dim at read."""

    name = "rk"
    table_rows = 4096

    def write(self, store, il, rope, k, v, seq, sc):
        store.write(il, k, v, seq)
        rk_write(store.rk[il], store.k[il], store.seq[il], store.count[il], seq, rope.rotary_dim)

    def attend(self, store, il, rope, q, seq, scale, softcap, mass, sc):
        qp = _query_position_grown(store, il, rope, seq)
        attend_rk(sc.out, q, store.k[il], store.rk[il], store.v[il], store.pos[il], store.count[il], qp,
                  rope.full.cos, rope.full.sin, rope.table.cos, rope.table.sin, rope.rotary_dim, scale, softcap, sc.scores,
                  sc.qrot, mass)


class RebasedRope(RopeStrategy):
    """Policy layers: keys rotated at a per-slot base position kbase as they are written, kept within
    REBASE_LIMIT of the slot's position (the attention pass re-rotates those the evictions pushed
    out); the query is rotated once per offset in use (attention.attend_rebased). A policy permutes
    and re-ranks slots freely, so the offsets of "stored" would vary from slot to slot; these stay
    few. Written and attended through the policy step (class docstring of RopeStrategy)."""

    name = "rebased"
    table_rows = 4096
    rebase = REBASE_LIMIT


# the strategies an engine may use for its ring layers, by name
STRATEGIES: dict[str, RopeStrategy] = {s.name: s for s in (StoredRope(), FusedRope(), RKCacheRope(), KShiftRope())}
# every layout a store's layer may be in: the ring strategies and the policy layers' "rebased"
LAYOUT_STRATEGIES: dict[str, RopeStrategy] = {**STRATEGIES, "rebased": RebasedRope()}
LAYOUTS = tuple(LAYOUT_STRATEGIES)


def rebase_limit(layout: str | None) -> int:
    """The write kernels' `rebase` argument for a layer laid out as `layout` (RopeStrategy.rebase; 0
    for a layer not laid out yet)."""
    return 0 if layout is None else LAYOUT_STRATEGIES[layout].rebase


def relayout_keys(store, il: int, old: str, new: str) -> None:
    """Re-lay the keys of policy layer il of `store` (a KVStore) from layout `old` to `new`, both in
    ("fused", "rebased"): keys before RoPE (a store saved before "rebased" existed, or one an engine
    built with rope "fused" laid out) or rotated at kbase. Exact up to float32 rounding of one
    rotation. ConfigError for any other pair: ring layouts are fixed for a store's life."""
    if old == new:
        return
    if {old, new} != {"fused", "rebased"}:
        raise ConfigError(f"cannot convert layer {il}'s keys from RoPE strategy {old!r} to {new!r}")
    store.forget_pending(il)
    kbase = store.kbase[il]
    if old == "fused":
        kbase[...] = 0
    target = store.pos[il] if new == "rebased" else np.zeros_like(kbase)
    rotate_keys_to(store.k[il], kbase, target, store.count[il], store.layer_inv_freq[il], store.layer_inv_scale[il],
                   store.spec.rotary_dim, *store.rotation_cache(il))
    if new == "fused":
        kbase[...] = 0
