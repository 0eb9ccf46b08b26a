"""The fixed-capacity KV store of one sequence, written in place (EQUIP), with logical positions per slot.

Arrays per layer il (allocated once, never resized, never shifted; P = physical slots, see below):
    k[il], v[il]   (n_kv_head, P, width)              rows in the KVConfig's k_type / v_type
                                                       (runtime/kv_types.py; f32: width = head_dim);
                                                       keys laid out as the layer's RoPE strategy keeps
                                                       them (runtime/rope.py: rotated at the sequence
                                                       index for "stored", the default on ring layers;
                                                       at `kbase` on "rebased" policy layers; before
                                                       RoPE for "fused" and "rk")
    kbase[il]      (n_kv_head, P) int64   position a slot's key is rotated at ("rebased" layers only)
    seq[il]        (n_kv_head, P) int64   sequence index of the token a slot holds, -1 = empty
    rank[il]       (n_kv_head, P) int64   rank of that token by sequence index among the head's tokens
    pos[il]        (n_kv_head, P) int64   logical position: `rank` itself in reindexed mode, the
                                          sequence index in original mode
    count[il]      (n_kv_head,) int64     slots in use; slots [0, count) are occupied, always
    evicted[il]    (n_kv_head,) int64     tokens evicted so far
    score[il]      (n_kv_head, P) float64 policy score per slot (accumulated attention, key norm, ...)
    aux[il]        (n_kv_head, P) int64   policy bits per slot (LSH code, Scissorhands history)
    hist[il]       (n_kv_head, w, P) float32  last w attention masses per slot, window-major: column c of
                                              every slot contiguous (windowed policies only)
    ksum[il]       (n_kv_head, head_dim) int64  per head, the sum over held slots of the unit key
                                              k/|k| (before RoPE) in units of 2^-40, kept by the write
                                              kernel for policies with keeps_key_sum (rkv; score then
                                              holds 1/|k|); (0, head_dim) for the others
    koff[il]       (n_kv_head, head_dim) float32  the key offsets c of a q4_0 policy layer: the rows of
                                              tokens from kv_types.OFFSET_FROM on hold k - c, every
                                              reader adds c (kv_types: when c is chosen); zero on
                                              every other layer and type

Positions (DESIGN.md):
    reindexed: a token's position is its rank, by sequence index, among the tokens its head holds;
               after an eviction every held token newer than the victim moves down by one.
    original:  a token's position is its sequence index, fixed for life.

Slot choice, one kernel call per layer per token (which tokens leave is decided in
runtime/eviction.py; this file carries it out):
  * streaming without staging (and every sliding-window layer): a ring over slots [sinks, capacity):
    the victim is slot sinks + (evictions mod (capacity - sinks)) (eviction.ring_slot); no scan, no
    policy state.
  * every other policy: when the held length L (new token included) calls for pruning (staged
    eviction, eviction.keep_after), the policy fills `key` for the held slots and the L - L* lowest
    keys among unprotected slots (not among the `sinks` oldest or `recent` newest; ties -> oldest;
    eviction.pick_victims) are evicted; each hole is filled by moving the last occupied slot into it (one slot copy, safe
    because every slot carries its own position), ranks are updated, and the new token takes slot
    `count`. Nothing is shifted. A policy's compiled layer step (policy_step.bind_layer_step) chooses
    the victims of a layer's next write at the end of its current step, while the scores are in
    cache, and keeps them in pend/pend_drop tagged with the next sequence index (pend_tag); any
    other change to the layer clears the tag (forget_pending), so they are always the victims the
    state would give.
`capacity` counts the new token: victims are removed before the new token's attention.

Gemma 3's sliding-window layers get capacity = window and no sinks when the window fits the
configured capacity: their own window, exactly as the model defines it, whatever the policy.
"""
from __future__ import annotations

from dataclasses import replace

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.eviction import GRID_GIVEN, GRID_NONE, keep_after
from ringllm.runtime.key_sum import key_sums
from ringllm.runtime.kv_basis import rotate_back
from ringllm.runtime.kv_codec import decode, encode, round_trip
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_multi import KVJournal, check_replace_many, kv_replace_many
from ringllm.runtime.host_memory import lazy_zeros_group, small_pages
from ringllm.runtime.kv_types import (OFFSET_FROM, Q4_0_OUTLIERS, Q4_0_ROWS, QBLOCK, STORE_DTYPE, key_offset_of,
                                     q4_0_blocks_width, row_width)
from ringllm.runtime.kv_write import LAYER_FIELDS, evict_slots, kv_write_policy, kv_write_shift, kv_write_streaming
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.policies import make_policy
from ringllm.runtime.policies.base import Policy
from ringllm.runtime.rope import LAYOUTS, rebase_limit, relayout_keys
from ringllm.runtime.rope_kernels import rope_rows_at

# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------

# the slot axis of each per-layer array that has one (snapshots hold only the slots ever written)
SLOT_AXIS = {"k": 1, "v": 1, "rk": 1, "hist": 2, "seq": 1, "rank": 1, "pos": 1, "kbase": 1, "score": 1, "aux": 1}


def layer_layout(spec: ModelSpec, kv: KVConfig, policy: Policy, budgets: list[int],
                 sinks: int) -> tuple[list[int], list[int], list[bool], list[int]]:
    """Per layer: (capacity C_l, sinks, ring, physical slots P_l) of a store with these budgets (the
    policy's layer_budgets, or a compressed prompt's capacities). A sliding-window layer whose window
    fits its budget is a ring of the window with no sinks; ring layers (full/streaming without staging)
    have P_l = C_l; policy layers have the staging settings' physical capacity, and under a ragged
    policy (adakv) the most one head can hold (head_slots). The CPU and CUDA stores share it."""
    caps, sinks_l, rings, phys = [], [], [], []
    for il in range(spec.n_layer):
        cap, s, ring = budgets[il], sinks, kv.ring
        w = spec.window[il]
        if w and w <= cap:
            cap, s, ring = w, 0, True
        p = cap if ring else KVConfig(capacity=cap, policy="streaming", sinks=0, lazy=kv.lazy, slack=kv.slack,
                                      max_drop=kv.max_drop).physical_capacity
        if not ring and policy.ragged:   # adakv: one head may hold more
            p = policy.head_slots(cap, p)
        caps.append(cap)
        sinks_l.append(s)
        rings.append(ring)
        phys.append(p)
    return caps, sinks_l, rings, phys


def copy_slots(dst: np.ndarray, src: np.ndarray, axis: int | None) -> None:
    """dst's first slots = src's, along the slot axis `axis` (SLOT_AXIS; as many as both have: a
    snapshot's arrays hold the slots ever written, a resized store's more or fewer); None: the whole
    array (per-layer state without slots)."""
    if axis is None:
        dst[...] = src
        return
    cut = (slice(None),) * axis + (slice(0, min(src.shape[axis], dst.shape[axis])),)
    dst[cut] = src[cut]


class StoreSnapshot:
    """A KVStore's state cut to the slots it has written (KVStore.snapshot / from_snapshot): kv,
    n_seen, the layers' RoPE layouts, arrays {field: [per-layer array]} (slot fields cut to
    min(P, n_seen) slots), whether the store could be truncated, and meta (a compressed prompt's
    per-layer capacities, ring RoPE layout, released count and press stats). nbytes: what it holds."""

    __slots__ = ("kv", "n_seen", "layer_rope_mode", "arrays", "truncatable", "meta", "nbytes")

    def __init__(self, kv: KVConfig, n_seen: int, layer_rope_mode, arrays: dict, truncatable: bool, meta: dict):
        self.kv, self.n_seen, self.layer_rope_mode = kv, int(n_seen), layer_rope_mode
        self.arrays, self.truncatable, self.meta = arrays, truncatable, meta
        self.nbytes = int(sum(a.nbytes for per_layer in arrays.values() for a in per_layer))


class KVStore:
    """Preallocated, in-place KV storage of one sequence.

    Args:
        spec: the model.
        kv: the KVConfig (capacity, policy, sinks, positions, staging, policy knobs, update mode);
            keyword arguments instead build one (KVStore(spec, capacity=64, policy="streaming")).
            With policy full the capacity is the context size (default and maximum: the model's
            context); past it, an error.

    The eviction policy object (runtime/policies) is `self.policy_impl`; it owns no per-slot state:
    what it keeps per slot lives in score/aux/hist so that it moves with the slot.
    """

    def __init__(self, spec: ModelSpec, kv: KVConfig | None = None, *, layer_capacity: list[int] | None = None,
                 **kwargs):
        if kv is None:
            kv = KVConfig(**kwargs)
        elif kwargs:
            raise ConfigError(f"pass a KVConfig or keyword arguments, not both (got {sorted(kwargs)})")
        kv.validate()
        kv.check_types_fit(spec.head_dim)
        capacity, sinks = kv.capacity, kv.sinks
        if kv.policy == "full":
            if capacity is not None and not 1 <= capacity <= spec.n_ctx:
                raise ConfigError(f"with policy 'full' the capacity is the context size, 1..{spec.n_ctx}; got {capacity}")
            capacity, sinks = capacity or spec.n_ctx, 0
        self.kv = kv
        self.update = kv.update
        self.spec, self.policy, self.positions = spec, kv.policy, kv.positions
        self.capacity, self.sinks = int(capacity), int(sinks)
        self.recent = kv.resolved_recent if kv.policy != "full" else 0
        self.reindexed = kv.positions == "reindexed"
        self.n_seen = 0
        self.policy_impl = make_policy(kv, spec)
        nkv, hd = spec.n_head_kv, spec.head_dim
        budgets = self.policy_impl.layer_budgets(self.capacity, spec.n_layer)
        # layer_capacity: per-layer capacities in place of the policy's (a compressed prompt's transient
        # and decode stores, whose layers hold different numbers of tokens: runtime/compress.py); each
        # at most the capacity
        self.layer_capacity_override = None
        if layer_capacity is not None:
            caps = [int(c) for c in layer_capacity]
            if len(caps) != spec.n_layer or min(caps) < 1 or max(caps) > self.capacity:
                raise ConfigError(f"layer_capacity needs {spec.n_layer} values in 1..{self.capacity}; got "
                                  f"{layer_capacity!r}")
            budgets = self.layer_capacity_override = caps
            floor = self.sinks + self.recent
            for il, cap in enumerate(caps):
                w = spec.window[il]
                if not kv.ring and not (w and w <= cap) and cap <= floor:
                    raise ConfigError(f"layer_capacity[{il}] = {cap} must be above sinks + recent = {floor} on a "
                                      "policy layer: at least one slot must be evictable")
        # tokens kept after pruning (C_l), sinks, ring layers (the streaming ring kernel serves them), slots
        self.layer_capacity, self.layer_sinks, self.layer_ring, phys = layer_layout(spec, kv, self.policy_impl,
                                                                                    budgets, self.sinks)
        self.layer_physical = phys
        hw = self.policy_impl.history_width
        kw, vw = row_width(kv.k_type, hd, key=True), row_width(kv.v_type, hd)
        per_slot = {"k": ((kw,), STORE_DTYPE[kv.k_type]), "v": ((vw,), STORE_DTYPE[kv.v_type]),
                    "rank": ((), np.int64), "kbase": ((), np.int64), "score": ((), np.float64),
                    "aux": ((), np.int64), "pend": ((), np.float64)}
        if not self.reindexed:
            per_slot["pos"] = ((), np.int64)
        groups = {name: [((nkv, p) + tail, dt) for p in phys] for name, (tail, dt) in per_slot.items()}
        groups["hist"] = [((nkv, hw, p), np.float32) for p in phys]
        with small_pages():           # a new store's first token would fault in huge pages (host_memory.py)
            lazy = lazy_zeros_group(groups)        # one mapping for all of them (paid for as written)
        self.k, self.v, self.hist = lazy["k"], lazy["v"], lazy["hist"]
        self.seq = [np.full((nkv, p), -1, np.int64) for p in phys]
        self.rank = lazy["rank"]
        self.pos = self.rank if self.reindexed else lazy["pos"]
        self.kbase = lazy["kbase"]
        self.count = [np.zeros(nkv, np.int64) for _ in phys]
        self.evicted = [np.zeros(nkv, np.int64) for _ in phys]
        self.score = lazy["score"]
        self.aux = lazy["aux"]
        # per-layer policy state that is not per slot (GVote's recent queries), shape from the policy
        self.extra = [np.zeros(self.policy_impl.extra_shape(), np.float32) for _ in phys]
        ks_rows = nkv if self.policy_impl.keeps_key_sum else 0
        self.ksum = [np.zeros((ks_rows, hd), np.int64) for _ in phys]     # rkv: sum of unit keys per head
        self.koff = [np.zeros((nkv, hd), np.float32) for _ in phys]       # key offsets (q4_0 policy layers)
        # each layer's arrays as the kernels take them (LAYER_FIELDS)
        self.layers = [tuple(getattr(self, name)[il] for name in LAYER_FIELDS) for il in range(spec.n_layer)]
        self.key = np.zeros((nkv, max(phys)), np.float64)      # victim keys, filled by the policy
        # victims of the next write into each layer, chosen by the compiled step at the end of the one
        # before (policy_step.choose_next): per layer (n_kv, P) f64 slots, (n_kv,) counts, and the
        # sequence index of the write they are for (-1: none; any other change to the layer clears it)
        self.pend = lazy["pend"]
        self.pend_drop = [np.zeros(nkv, np.int64) for _ in phys]
        self.pend_tag = [np.full(1, -1, np.int64) for _ in phys]
        # write-kernel scratch per kv head (the compiled policy step runs the heads on separate threads;
        # single-threaded paths use row 0): victims' slots, and the new key's rotated row
        self.victims = np.zeros((nkv, max(phys) + 1), np.int64)
        self.drop_h = np.zeros(nkv, np.int64)                   # victims per head of the next policy write
        self.needs_mass = self.policy_impl.needs_mass
        # (n_kv, P) float32: the attention kernels' per-slot mass of the latest token (summed over each
        # GQA group), read by observe and mass_hook; every layer writes it in turn
        self.mass = np.zeros((nkv, max(phys)), np.float32)
        self._layer_rope_mode = None      # per layer "stored" | "fused" | "rk" | "kshift" | "rebased", set by the engine
        self.adopter = None               # the token of the engine that adopted this store last (CPUEngine.adopt_store)
        self.layer_rebase = [0] * spec.n_layer    # REBASE_LIMIT on "rebased" layers, else 0 (follows layer_rope_mode)
        self.layer_inv_scale = [1.0 / spec.rope_scale[il] for il in range(spec.n_layer)]
        # RoPE of "rebased" policy layers, rotated as keys are written (kv_write_policy): per layer
        # inv_freq (rotary_dim/2,) f64 and 1/scale; cos/sin and row scratch
        half = spec.rotary_dim // 2
        self.layer_inv_freq = [spec.inv_freq(il) for il in range(spec.n_layer)]
        # kv_write_policy's rotation cache per kv head: cos/sin (n_kv, 2, rotary_dim/2) and the rotation
        # they are for (n_kv,); a pure cache (keyed by the rotation), so any row serves a serial path
        self.layer_angles = [np.zeros((nkv, 2, half), np.float32) for _ in phys]
        self.layer_angle_tag = [np.full(nkv, np.int64(-1) << 62, np.int64) for _ in phys]
        self.ktmp = np.zeros((nkv, hd), np.float32)
        self.rk = None                    # RK cache, per layer (n_kv, P, rotary_dim) f32, rope "rk" only
        # optional callable(il, mass (n_kv, P) f32, store) run after each attention step with the per-slot
        # attention mass (group-summed); for measurements such as the attention loss of eviction
        self.mass_hook = None
        # optional callable(il, h (T, n_embd) f32, q (T, n_head * hd) f32, seq0) run by the CPU engine per
        # layer and prompt chunk with the attention input and the queries before RoPE (a compressing
        # prefill captures its observation window with it: runtime/compress.py)
        self.query_hook = None
        # prompt compression (runtime/compress.py): tokens seen but released by a press (the room
        # check counts held tokens: n_seen - released), and the RoPE layout of the ring layers when
        # it is not the engine's (a compressed store in reindexed mode reads its keys "fused")
        self.released = 0
        self.ring_rope: str | None = None
        self.press_stats: dict = {}
        # --- speculative rollback journal (runtime/kv_multi.py): None unless begin_journal() ran ---
        self.journal = None

    # -----------------------------------------------------------------------------------------
    # Writes
    # -----------------------------------------------------------------------------------------

    def check_room(self, n_new: int) -> None:
        """Raise before any work when policy full would overflow the model's context."""
        if self.policy == "full" and self.n_seen - self.released + n_new > self.capacity:
            raise ConfigError(f"{self.n_seen - self.released + n_new} tokens exceed the model's context "
                              f"{self.capacity} with policy 'full'; choose an eviction policy (e.g. streaming) or a "
                              "shorter input")

    def drops(self, il: int) -> int:
        """Tokens the next write into layer il evicts per head (staged eviction, Algorithm 1; adakv
        decides per layer in its select)."""
        if self.layer_ring[il]:
            return int(self.count[il][0] >= self.layer_capacity[il])
        held = int(self.count[il][0]) + 1
        kv = self.kv
        if not kv.staged:                 # plain per-step eviction: Algorithm 1 with R = sigma = delta = 0
            return max(0, held - self.layer_capacity[il])
        return held - keep_after(held, self.layer_capacity[il], kv.lazy, kv.slack, kv.max_drop)

    def write(self, il: int, k_new: np.ndarray, v_new: np.ndarray, seq: int, q: np.ndarray | None = None) -> None:
        """Put token `seq` into layer il: k_new, v_new (n_kv_head, head_dim) float32 (keys before RoPE,
        or rotated by `seq` with the engine's stored strategy). q (n_head, head_dim): the token's
        query before RoPE, for policies whose victim depends on it (lsh); k_pre: see Policy.on_insert."""
        if self.layer_ring[il]:
            write = kv_write_streaming if self.update == "inplace" else kv_write_shift
            if self.journal is not None:      # journal hook (kv_multi.py): save the rows this write overwrites
                self.journal.before_ring(self, il)
            write(self.k[il], self.v[il], self.seq[il], self.pos[il], self.count[il], self.evicted[il],
                  k_new, v_new, seq, self.layer_sinks[il], self.reindexed)
            return
        k_new = self.relative_keys(il, np.asarray(k_new, np.float32)[None], seq)[0]
        grid = self.prepare_policy_write(il, q, seq)
        if self.journal is not None:          # journal hook (kv_multi.py): victims chosen, rows saved
            self.journal.before_policy(self, il, grid)
        kv_write_policy(self.layers[il], k_new, v_new, seq, self.write_args(il, grid), self.victims[0],
                        self.rotation_args(il))

    def offsets_keys(self, il: int) -> bool:
        """Whether layer il holds its keys relative to key offsets (kv_types: q4_0 keys of a policy layer)."""
        return self.kv.k_type == "q4_0" and not self.layer_ring[il]

    def relative_keys(self, il: int, k_rows: np.ndarray, seq0: int) -> np.ndarray:
        """k_rows (T, n_kv, hd) f32, keys before RoPE about to be written into layer il as tokens seq0..:
        what the layer's rows encode. On a layer that holds keys relative to offsets (kv_types), k_rows
        - c for the tokens from OFFSET_FROM on, c chosen first when these bring the layer its first
        such token (from every key it has seen but token 0's); else k_rows."""
        if not self.offsets_keys(il):
            return k_rows
        seqs = seq0 + np.arange(k_rows.shape[0])
        if seqs[-1] >= OFFSET_FROM and self._offsets_open(il):
            for h in range(self.spec.n_head_kv):
                n = int(self.count[il][h])
                held = np.flatnonzero(self.seq[il][h, :n] > 0)
                seen = np.concatenate([self.key_values(il, h, held), k_rows[seqs > 0, h]])
                self.koff[il][h] = key_offset_of(seen)
        return k_rows - self.key_offset_rows(il, seqs)

    def _offsets_open(self, il: int) -> bool:
        """Whether layer il's key offsets may still be chosen: it holds no row relative to them (no token
        from OFFSET_FROM on; a policy layer always holds its newest token)."""
        return int(self.seq[il].max(initial=-1)) < OFFSET_FROM

    def key_offset_rows(self, il: int, seqs: np.ndarray) -> np.ndarray:
        """(..., n_kv, hd) f32: the offsets the rows of tokens `seqs` (any shape) hold their keys relative
        to, per kv head. Zero where the layer holds no offsets, and for the first OFFSET_FROM tokens."""
        seqs = np.asarray(seqs)
        on = (seqs >= OFFSET_FROM) & self.offsets_keys(il)
        return np.where(on[..., None, None], self.koff[il], np.float32(0))

    def key_values(self, il: int, h: int, slots: np.ndarray) -> np.ndarray:
        """(len(slots), hd) f32: head h's keys in those slots of layer il, decoded from the KV type with
        the layer's key offsets added (in the layer's layout: before RoPE on a policy layer)."""
        k = decode(self.k[il][h, slots], self.spec.head_dim)
        return k + self.key_offset_rows(il, self.seq[il][h, slots])[:, h]

    def prepare_policy_write(self, il: int, q: np.ndarray | None, seq: int) -> int:
        """Before a write into policy layer il: how many tokens each head drops (self.drop_h) and, when
        any, the policy's keys (self.key). Returns the grid the write kernel compares the keys on:
        the policy's own when the keys were left raw (eviction.choose_one grids only the few it
        needs), GRID_NONE when the keys were gridded (the journal chooses from the keys themselves),
        GRID_GIVEN when the policy chose the victims (adakv's layer-wide select: their slots in key)."""
        policy = self.policy_impl
        self.forget_pending(il)           # this write changes the layer: victims chosen before it are stale
        if policy.ragged:                 # adakv: one selection over all heads, the victims given
            policy.select(self, il)
            return GRID_GIVEN
        n_drop = self.drops(il)
        grid = policy.key_grid if self.journal is None else GRID_NONE
        if n_drop <= 0:
            self.drop_h.fill(0)
            return grid
        wanted = (policy.fill_raw_keys if grid != GRID_NONE else policy.fill_keys)(self, il, q, seq)
        if wanted is not None:            # adaptive budgets (gvote) may drop more than the capacity asks
            n_drop = max(n_drop, int(wanted))
        self.drop_h.fill(n_drop)
        return grid

    @property
    def layer_rope_mode(self) -> list[str] | None:
        """Per layer RoPE strategy, set by the engine (adopt_store) or a restore; None before."""
        return self._layer_rope_mode

    @layer_rope_mode.setter
    def layer_rope_mode(self, modes) -> None:
        """Lay the layers out for `modes` (rope.LAYOUTS, one per layer): sets the write kernels' rebase
        argument per layer and allocates the RK cache (self.rk) when a layer uses "rk"."""
        self._layer_rope_mode = modes
        modes_or_none = modes if modes is not None else [None] * self.spec.n_layer
        self.layer_rebase = [rebase_limit(m) for m in modes_or_none]
        if "rk" in modes_or_none and self.rk is None:
            self.rk = [np.zeros(k.shape[:2] + (self.spec.rotary_dim,), np.float32) for k in self.k]

    def rope_mode(self, il: int) -> str | None:
        """Layer il's RoPE strategy as set by the engine ("stored", "fused", "rk", "kshift", "rebased"), or
        None before an engine adopted the store."""
        return None if self.layer_rope_mode is None else self.layer_rope_mode[il]

    def stats_policy(self) -> dict:
        return self.policy_impl.stats()

    def query_position(self, il: int, seq: int) -> int:
        """Logical position of the newest token (just written) in layer il, kv head 0 (every head when
        the heads hold equally many tokens: all policies but adakv)."""
        return int(self.count[il][0]) - 1 if self.reindexed else seq

    def query_positions(self, il: int, seq: int, out: np.ndarray) -> np.ndarray:
        """out (n_kv,) i64 = the newest token's logical position per kv head of layer il."""
        if self.reindexed:
            np.subtract(self.count[il], 1, out=out)
        else:
            out[:] = seq
        return out

    def convert_rope_layout(self, il: int, old: str, new: str) -> None:
        """Re-lay the keys of policy layer il from layout `old` to `new` (rope.relayout_keys)."""
        relayout_keys(self, il, old, new)

    def pending(self, il: int) -> tuple:
        """(pend, pend_drop, pend_tag) of layer il: the victims its next write drops, chosen ahead by
        the compiled step (policy_step's `pend`)."""
        return self.pend[il], self.pend_drop[il], self.pend_tag[il]

    def step_args(self, il: int, key_grid: int) -> tuple:
        """A policy layer step's `st` for layer il (policy_step's argument groups): (key, key_grid,
        drop_h, capacity, lazy, slack, max_drop, sinks, recent, reindexed, victims, shift)."""
        kv = self.kv
        return (self.key, key_grid, self.drop_h, self.layer_capacity[il], kv.lazy, kv.slack, kv.max_drop,
                self.layer_sinks[il], self.recent, self.reindexed, self.victims, self.update == "shift")

    def write_args(self, il: int, grid: int) -> tuple:
        """kv_write_policy's `wr` for layer il: (key, grid, drop_h, sinks, recent, reindexed, shift)."""
        return (self.key, grid, self.drop_h, self.layer_sinks[il], self.recent, self.reindexed, self.update == "shift")

    def rotation_args(self, il: int, rows: bool = False) -> tuple:
        """The write kernels' `rw` for layer il: (rebase, inv_freq, inv_scale, rotary_dim, angles,
        angle_tag, tmp); rows: the per-kv-head rotation caches and key scratch (n_kv, ...) for the
        compiled step, else head 0's (rotation_cache) for a write on one thread."""
        cache = (self.layer_angles[il], self.layer_angle_tag[il], self.ktmp) if rows else self.rotation_cache(il)
        return (self.layer_rebase[il], self.layer_inv_freq[il], self.layer_inv_scale[il], self.spec.rotary_dim,
                *cache)

    def rotation_cache(self, il: int) -> tuple:
        """(angles (2, rotary_dim/2) f32, angle_tag (1,) i64, tmp (hd,) f32): head 0's rotation cache and
        key-row scratch of layer il, for the write kernels called for the whole layer on one thread."""
        return self.layer_angles[il][0], self.layer_angle_tag[il][:1], self.ktmp[0]

    def forget_pending(self, il: int | None = None) -> None:
        """Drop the victims the compiled step chose ahead for layer il (every layer when None): a change
        to the layer other than a compiled step (a write by the Python path, rollback, replace_many, a
        RoPE re-layout) makes them stale."""
        for tag in (self.pend_tag if il is None else [self.pend_tag[il]]):
            tag[0] = -1

    def uses_policy(self, il: int) -> bool:
        """Whether layer il runs the policy (False: the plain ring of streaming/full or a sliding window)."""
        return not self.layer_ring[il]

    def evict(self, il: int, slots) -> None:
        """Remove chosen tokens from policy layer il: slots[h] (a sequence of ints per kv head, n_kv of
        them) are the occupied slots head h drops, chosen by the caller (a press that compresses a
        prefilled prompt; the store itself never decides). Ranks (and positions in reindexed mode)
        follow, each hole takes the last occupied slot (kv_write.evict_slots), the policy's per-slot
        state moves with its slot, rkv's key sums are rebuilt. ConfigError, with nothing changed, on a
        ring layer, during a rollback journal, or for a slot that is empty, out of range or named twice."""
        if not 0 <= il < self.spec.n_layer:
            raise ConfigError(f"layer {il} out of range 0..{self.spec.n_layer - 1}")
        if not self.uses_policy(il):
            raise ConfigError(f"layer {il} is a ring (streaming, full or a sliding window): its slots are not evicted "
                              "by choice")
        if self.journal is not None:
            raise ConfigError("evict during a rollback journal: commit() or rollback() first")
        nkv = self.spec.n_head_kv
        if len(slots) != nkv:
            raise ConfigError(f"evict needs one list of slots per kv head ({nkv}); got {len(slots)}")
        rows = []
        for h in range(nkv):
            row = np.asarray(slots[h], dtype=np.int64).reshape(-1)
            n = int(self.count[il][h])
            if row.size and (row.min() < 0 or row.max() >= n):
                raise ConfigError(f"evict: head {h}'s slots must be occupied, in 0..{n - 1}; got {row.tolist()}")
            if np.unique(row).size != row.size:
                raise ConfigError(f"evict: head {h} names a slot twice: {row.tolist()}")
            rows.append(row)
        self.forget_pending(il)
        for h, row in enumerate(rows):
            if row.size:
                self.victims[h, :row.size] = row
                evict_slots(self.layers[il], h, self.victims[h], row.size, self.reindexed)
        if self.ksum[il].shape[0] > 0:
            key_sums(self.ksum[il], self.k[il], self.koff[il], self.seq[il], self.score[il], self.count[il])

    def resized(self, layer_capacity: list[int], capacity: int | None = None) -> "KVStore":
        """A copy of this store whose layer il keeps layer_capacity[il] tokens (KVStore(layer_capacity=)),
        holding the same tokens in the same slots with their positions and policy state: the per-slot
        arrays cut or extended at the slot axis, the per-layer ones (counts, evictions, gvote's
        queries, rkv's key sums) as they are. A prompt compressed under an evicting decode-time policy
        is prefilled into a store sized to hold it whole, pressed (evict), then resized to the kept
        tokens plus the policy's capacity (runtime/compress.py); a chat turn resizes the other way.
        A ring layer (a sliding window) keeps its capacity and a policy layer stays a policy layer
        with slots for what each head holds; ConfigError otherwise, or during a rollback journal. The copy
        belongs to no engine yet. capacity: the copy's KVConfig.capacity (default: the larger of this
        store's and the largest layer's); the policy's recent window stays this store's whatever it is
        (a default derived from the capacity, h2o's capacity/2, is pinned), so the copy protects the
        tokens this store protects."""
        if self.journal is not None:
            raise ConfigError("resized during a rollback journal: commit() or rollback() first")
        try:
            caps = [int(c) for c in layer_capacity]
        except (TypeError, ValueError):
            raise ConfigError(f"resized: layer_capacity must be integers, got {layer_capacity!r}") from None
        capacity = max(caps + [self.kv.capacity or 1]) if capacity is None else int(capacity)
        kv = replace(self.kv, capacity=capacity)
        if self.kv.policy != "full":
            kv = replace(kv, recent=self.kv.resolved_recent)
        dst = KVStore(self.spec, kv, layer_capacity=caps)
        for il in range(self.spec.n_layer):
            if dst.layer_ring[il] != self.layer_ring[il] or (
                    self.layer_ring[il] and dst.layer_capacity[il] != self.layer_capacity[il]):
                raise ConfigError(f"resized: layer {il} would change kind or ring capacity "
                                  f"({self.layer_capacity[il]} -> {dst.layer_capacity[il]} slots)")
            held = int(self.count[il].max())
            # the limit is a head's slots: a staged layer, or one adakv head, may hold more than the capacity
            if held > dst.layer_physical[il]:
                raise ConfigError(f"resized: layer {il} holds {held} tokens, more than its "
                                  f"{dst.layer_physical[il]} slots at capacity {dst.layer_capacity[il]}")
        dst.layer_rope_mode = list(self.layer_rope_mode) if self.layer_rope_mode is not None else None
        for name in self.array_fields:
            for src, out in zip(getattr(self, name), getattr(dst, name)):
                copy_slots(out, src, SLOT_AXIS.get(name))
        dst.n_seen, dst.released, dst.ring_rope = self.n_seen, self.released, self.ring_rope
        dst.press_stats = dict(self.press_stats)
        return dst

    def fork(self) -> "KVStore":
        """An independent copy of this store (its tokens, positions and policy state): the copy and this
        store can each be fed on from here, and each decodes exactly as this store would have (a chat
        branch, a prompt prefix shared by several requests). The copy belongs to no engine yet: the
        engine adopts it on its first use. ConfigError during a rollback journal."""
        return KVStore.from_snapshot(self.spec, self.snapshot())

    def convert_types(self, k_type: str, v_type: str) -> "KVStore":
        """A copy of this store holding its keys and values in k_type / v_type (KVConfig): each row
        decoded and encoded again (a quantized row keeps its rounding; f32 -> q8_0 rounds as a write
        would). Keys are converted in their layout; a policy layer laid out "rebased" is first re-laid
        "fused" when the keys become quantized (the layout a quantized store's policy layers use,
        engine.adopt_store). The copy belongs to no engine yet. ConfigError for an unknown type or
        during a rollback journal."""
        kv = replace(self.kv, k_type=k_type, v_type=v_type)      # validates the names
        kv.check_types_fit(self.spec.head_dim)
        src = self.fork()
        modes = list(self.layer_rope_mode) if self.layer_rope_mode is not None else None
        if modes is not None and kv.quantized_keys:
            for il, mode in enumerate(modes):
                if mode == "rebased":
                    src.convert_rope_layout(il, "rebased", "fused")
                    modes[il] = "fused"
        state = src.state()
        hd = self.spec.head_dim
        arrays = dict(state["arrays"])
        for il in range(self.spec.n_layer):
            rows = arrays[f"v.{il}"]
            if rows.dtype != STORE_DTYPE[v_type]:
                arrays[f"v.{il}"] = encode(decode(rows, hd), v_type)
            if arrays[f"k.{il}"].dtype != STORE_DTYPE[k_type]:
                rel = (self.seq[il] >= OFFSET_FROM)[..., None]   # the rows relative to the offsets
                keys = decode(arrays[f"k.{il}"], hd)
                if self.offsets_keys(il):
                    keys += np.where(rel, self.koff[il][:, None, :], np.float32(0))
                now = k_type == "q4_0" and not self.layer_ring[il]
                off = self._held_key_offsets(il, keys) if now else np.zeros_like(self.koff[il])
                arrays[f"k.{il}"] = encode(keys - np.where(rel, off[:, None, :], np.float32(0)), k_type, key=True)
                arrays[f"koff.{il}"] = off
        return KVStore.restore(self.spec, {**state, "kv": kv.to_dict(), "arrays": arrays, "layer_rope_mode": modes})

    def _held_key_offsets(self, il: int, keys: np.ndarray) -> np.ndarray:
        """Key offsets (n_kv, hd) for layer il's held keys `keys` (n_kv, P, hd), before RoPE: per head,
        kv_types.key_offset_of over the keys it holds but token 0's (zero for a head that holds none)."""
        off = np.zeros((keys.shape[0], keys.shape[2]), np.float32)
        for h in range(keys.shape[0]):
            held = np.flatnonzero(self.seq[il][h, :int(self.count[il][h])] > 0)
            if held.size:
                off[h] = key_offset_of(keys[h, held])
        return off

    def snapshot(self) -> "StoreSnapshot":
        """This store's state in as many bytes as it has written (StoreSnapshot): what a prompt cache
        keeps instead of the store itself, whose arrays are sized for its whole capacity.
        ConfigError during a rollback journal."""
        if self.journal is not None:
            raise ConfigError("snapshot during a rollback journal: commit() or rollback() first")
        arrays = {}
        for name in self.array_fields:
            axis = SLOT_AXIS.get(name)
            per_layer = []
            for a in getattr(self, name):
                if axis is None:
                    per_layer.append(a.copy())
                else:       # slots past min(P, n_seen) were never written: a fresh store's zeros/-1 are theirs
                    used = (slice(None),) * axis + (slice(0, min(a.shape[axis], self.n_seen)),)
                    per_layer.append(np.ascontiguousarray(a[used]))
            arrays[name] = per_layer
        meta = {"layer_capacity": self.layer_capacity_override, "ring_rope": self.ring_rope,
                "released": int(self.released), "press_stats": dict(self.press_stats)}
        return StoreSnapshot(self.kv, self.n_seen, list(self._layer_rope_mode) if self._layer_rope_mode else None,
                             arrays, self.truncatable(), meta)

    @classmethod
    def from_snapshot(cls, spec: ModelSpec, snap: "StoreSnapshot") -> "KVStore":
        """A store equal to the one the snapshot was taken of (a fresh allocation; the snapshot is
        left as it is and may be restored again)."""
        store = cls(spec, snap.kv, layer_capacity=snap.meta["layer_capacity"])
        store.layer_rope_mode = list(snap.layer_rope_mode) if snap.layer_rope_mode is not None else None
        store.ring_rope, store.released = snap.meta["ring_rope"], snap.meta["released"]
        store.press_stats = dict(snap.meta["press_stats"])
        for name, per_layer in snap.arrays.items():
            for src, dst in zip(per_layer, getattr(store, name)):
                copy_slots(dst, src, SLOT_AXIS.get(name))
        store.n_seen = snap.n_seen
        return store

    def truncatable(self) -> bool:
        """Whether truncate() can cut this store: every layer is a ring that has evicted (or, after a
        compressing prefill, released) nothing, so slot i holds token i and no slot carries state that
        later tokens changed (policy full, and streaming / sliding-window layers before their first
        eviction)."""
        return (self.journal is None and self.released == 0 and all(self.layer_ring)
                and all(int(e.sum()) == 0 for e in self.evicted))

    def truncate(self, n_keep: int) -> None:
        """Keep the first n_keep tokens fed (0 <= n_keep <= n_seen); the store then decodes exactly
        as one fed only those. Only where truncatable() (a store that evicted or keeps policy scores
        cannot forget its later tokens' influence): ConfigError otherwise, with nothing changed."""
        if not self.truncatable():
            raise ConfigError("truncate needs a store that has evicted nothing, under policy full or streaming "
                              f"(this one: policy {self.policy!r}, {self.stats()['evicted_total']} evicted)")
        if isinstance(n_keep, bool) or not isinstance(n_keep, (int, np.integer)) or not 0 <= n_keep <= self.n_seen:
            raise ConfigError(f"truncate: n_keep must be an integer in 0..{self.n_seen}, got {n_keep!r}")
        for il in range(self.spec.n_layer):
            held = int(self.count[il][0])
            if n_keep < held:
                self.seq[il][:, n_keep:held] = -1
                self.count[il][:] = n_keep
        self.forget_pending()
        self.n_seen = int(n_keep)

    def stats(self) -> dict:
        return {"capacity": self.capacity, "length": int(max(int(c.max()) for c in self.count)),
                "evicted_total": int(sum(int(e.sum()) for e in self.evicted)), "policy": self.policy,
                "sinks": self.sinks, "recent": self.recent, "positions": self.positions, "update": self.update,
                "tokens_seen": self.n_seen, "layer_capacity": list(self.layer_capacity),
                **({"released": int(self.released), **self.press_stats} if self.released or self.press_stats else {}),
                **self.policy_impl.stats(),
                "bytes": int(sum(a.nbytes for a in self.k + self.v + self.seq + self.rank + self.kbase + self.score
                                 + self.aux + self.hist) + (0 if self.reindexed else sum(a.nbytes for a in self.pos)))}

    # -----------------------------------------------------------------------------------------
    # Multi-token update and rollback journal (speculative decoding; kernels in runtime/kv_multi.py)
    # -----------------------------------------------------------------------------------------

    def replace_many(self, il: int, slots, k_rows: np.ndarray, v_rows: np.ndarray, seqs) -> None:
        """m new tokens take m slots of every kv head of layer il in one in-place pass (EQUIP D.7):
        slots (n_kv, m) ints (an occupied slot: its token leaves; a free one: count, count + 1, ...),
        k_rows, v_rows (m, n_kv, head_dim) float32, seqs (m,) increasing and newer than every held
        token (keys laid out as the layer's RoPE strategy stores them: on a "rebased" layer, rotated at
        their logical position). Ranks/positions updated; the new slots' score/aux/hist zeroed, then
        what the policy computes from a key at insert (Policy.on_replace: knorm's norm, lsh's code;
        under rkv, score = 1/|k| and ksum rebuilt)."""
        slots = np.ascontiguousarray(slots, dtype=np.int64)
        seqs = np.ascontiguousarray(seqs, dtype=np.int64).reshape(-1)
        nkv, hd = self.spec.n_head_kv, self.spec.head_dim
        k_rows = np.ascontiguousarray(k_rows, dtype=np.float32)
        v_rows = np.ascontiguousarray(v_rows, dtype=np.float32)
        if k_rows.shape != (seqs.size, nkv, hd) or v_rows.shape != k_rows.shape:
            raise ConfigError(f"replace_many: k_rows and v_rows must be ({seqs.size}, {nkv}, {hd}); got "
                              f"{k_rows.shape}, {v_rows.shape}")
        check_replace_many(self, il, slots, seqs)
        self.forget_pending(il)
        k_keys = k_rows
        k_rows = np.ascontiguousarray(self.relative_keys(il, k_rows, int(seqs[0])), dtype=np.float32)
        kv_replace_many(self.k[il], self.v[il], self.seq[il], self.rank[il], self.pos[il], self.kbase[il],
                        self.score[il], self.aux[il], self.hist[il], self.count[il], self.evicted[il], slots, k_rows,
                        v_rows, seqs, self.reindexed, self.rope_mode(il) == "rebased", np.empty(seqs.size, np.int64))
        if self.ksum[il].shape[0] > 0:     # rkv's sum of unit keys: rebuilt (m new keys, m leaving)
            key_sums(self.ksum[il], self.k[il], self.koff[il], self.seq[il], self.score[il], self.count[il])
        if type(self.policy_impl).on_replace is not Policy.on_replace and self.uses_policy(il):
            self.policy_impl.on_replace(self, il, slots, self._keys_before_rope(il, slots, k_keys, seqs))

    def _keys_before_rope(self, il: int, slots: np.ndarray, k_rows: np.ndarray, seqs: np.ndarray) -> np.ndarray:
        """k_rows (m, n_kv, hd) as replace_many took them, brought back to before RoPE and as the store
        holds them: a "rebased" layer's rows were rotated at their slots' kbase (rope_kernels.rope_rows_at,
        angles in f64); quantized keys (always before RoPE on policy layers) rounded through their type,
        as the write path hands the policy the key as stored."""
        if self.kv.quantized_keys:
            off = self.key_offset_rows(il, seqs)                   # (m, n_kv, hd)
            return round_trip(k_rows - off, self.kv.k_type, key=True) + off
        if self.rope_mode(il) != "rebased":
            return k_rows
        out = k_rows.copy()
        tmp = np.zeros(self.spec.head_dim + self.spec.rotary_dim, np.float32)
        for h in range(slots.shape[0]):
            for i, slot in enumerate(slots[h]):
                rope_rows_at(out[i, h:h + 1], -int(self.kbase[il][h, slot]), self.layer_inv_freq[il],
                             self.layer_inv_scale[il], self.spec.rotary_dim, tmp)
        return out

    def begin_journal(self, max_tokens: int):
        """Journal the next (up to) max_tokens tokens fed, so that rollback(n_keep) can take the last
        ones back out exactly (kv_multi.KVJournal). Reuses the journal's buffers when they fit."""
        j = self.journal or getattr(self, "_journal_spare", None)
        if j is None or j.max_tokens < max_tokens:
            j = KVJournal(self, max_tokens)
        j.reset()
        self.journal = j
        return j

    def rollback(self, n_keep: int) -> None:
        """Keep the first n_keep tokens fed since begin_journal; the store becomes bitwise the store fed
        only those. The journal stays open (more tokens may be fed and rolled back)."""
        if self.journal is None:
            raise ConfigError("rollback without begin_journal")
        self.journal.rollback(n_keep)

    def commit(self) -> None:
        """Stop journaling (the buffers are kept for the next begin_journal)."""
        self._journal_spare, self.journal = self.journal, None

    # -----------------------------------------------------------------------------------------
    # Save / restore (sessions)
    # -----------------------------------------------------------------------------------------

    @property
    def array_fields(self) -> tuple[str, ...]:
        base = ("k", "v", "seq", "rank", "kbase", "count", "evicted", "score", "aux", "hist", "extra", "ksum", "koff")
        return base + (() if self.reindexed else ("pos",)) + (("rk",) if self.rk is not None else ())

    def state(self) -> dict:
        """Everything that defines this store, as plain values: {"kv": KVConfig dict, "n_seen": int,
        "arrays": {"k.0": ndarray, ...}} (per-layer arrays named field.layer). Restored by restore()."""
        arrays = {f"{name}.{il}": a for name in self.array_fields for il, a in enumerate(getattr(self, name))}
        return {"kv": self.kv.to_dict(), "n_seen": int(self.n_seen), "arrays": arrays,
                "layer_rope_mode": list(self.layer_rope_mode) if self.layer_rope_mode else None,
                "hist_layout": "window_major", "released": int(self.released), "ring_rope": self.ring_rope,
                "layer_capacity": self.layer_capacity_override, "press_stats": dict(self.press_stats),
                "q4_0_rows": Q4_0_ROWS}

    @classmethod
    def restore(cls, spec: ModelSpec, state: dict) -> "KVStore":
        """A store equal to the one state() was taken from; every array is checked for name, shape and
        dtype against a freshly built store (ConfigError naming the first mismatch), so a damaged
        state never half-loads."""
        try:
            store = cls(spec, KVConfig.from_dict(dict(state["kv"])), layer_capacity=state.get("layer_capacity"))
            n_seen, arrays = int(state["n_seen"]), state["arrays"]
            rope_mode = state.get("layer_rope_mode")
            if rope_mode is not None and (len(rope_mode) != spec.n_layer or not set(rope_mode) <= set(LAYOUTS)):
                raise ValueError(f"layer_rope_mode {rope_mode!r}")
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"KV store state is malformed: {e!r}") from None
        store.layer_rope_mode = list(rope_mode) if rope_mode is not None else None    # allocates rk if used
        ring_rope = state.get("ring_rope")
        if ring_rope is not None and ring_rope not in LAYOUTS:
            raise ConfigError(f"KV store state is malformed: ring_rope {ring_rope!r}")
        store.ring_rope, store.released = ring_rope, int(state.get("released", 0))
        press_stats = state.get("press_stats") or {}
        if not isinstance(press_stats, dict) or not all(isinstance(k, str) and isinstance(v, (str, int, float))
                                                       and not isinstance(v, bool) for k, v in press_stats.items()):
            raise ConfigError(f"KV store state is malformed: press_stats {press_stats!r}")
        store.press_stats = dict(press_stats)
        fresh = store.state()["arrays"]
        if not any(name.startswith("kbase.") for name in arrays):    # saved before "rebased" existed: no
            arrays = {**arrays, **{n: a for n, a in fresh.items() if n.startswith("kbase.")}}   # rebased layers
        if not any(name.startswith("ksum.") for name in arrays):     # saved before ksum: rkv rebuilds it
            arrays = {**arrays, **{n: a for n, a in fresh.items() if n.startswith("ksum.")}}    # (after_restore)
        if not any(name.startswith("koff.") for name in arrays):     # saved before key offsets: its rows
            arrays = {**arrays, **{n: a for n, a in fresh.items() if n.startswith("koff.")}}    # hold the keys
        if state.get("hist_layout") != "window_major":     # saved when hist was (n_kv, P, w): slot-major
            arrays = {n: (np.swapaxes(np.asarray(a), 1, 2) if n.startswith("hist.") else a) for n, a in arrays.items()}
        if set(arrays) != set(fresh):
            raise ConfigError(f"KV store state has arrays {sorted(set(arrays) ^ set(fresh))[:4]} that do not match "
                              "this model/config")
        form = state.get("q4_0_rows")
        if form != Q4_0_ROWS:           # saved when q4_0 keys held no outliers (or no row the rotation)
            if form not in (None, "hadamard"):
                raise ConfigError(f"KV store state: q4_0 rows of the form {form!r}; this version reads "
                                  f"{Q4_0_ROWS!r}, 'hadamard' and the unrotated rows before them")
            old_width = q4_0_blocks_width(spec.head_dim)

            def converted(n, a):
                field, a = n.split(".")[0], np.asarray(a)
                if field not in ("k", "v") or a.dtype != STORE_DTYPE["q4_0"] or \
                        a.shape != fresh[n].shape[:-1] + (old_width,) or (field == "v" and form == "hadamard"):
                    return a            # not q4_0 rows of the old form (a "hadamard" value row is today's)
                return _legacy_q4_0(a, spec.head_dim, form, key=field == "k")
            arrays = {n: converted(n, a) for n, a in arrays.items()}
        for name, ref in fresh.items():
            a = np.asarray(arrays[name])
            if a.shape != ref.shape or a.dtype != ref.dtype:
                raise ConfigError(f"KV store state array {name}: shape {a.shape} {a.dtype}, expected {ref.shape} {ref.dtype}")
        if n_seen < 0:
            raise ConfigError(f"KV store state: n_seen {n_seen} is negative")
        for name, ref in fresh.items():
            ref[...] = arrays[name]
        store.n_seen = n_seen
        store.check_slots()
        store.check_key_rows()
        store.policy_impl.after_restore(store)
        return store

    def check_key_rows(self) -> None:
        """ConfigError unless every q4_0 key row names its outliers' channels inside head_dim (kv_types:
        a restored state is untrusted, and a decoder adds each outlier at its channel, in a Numba kernel
        that does not check bounds)."""
        if self.kv.k_type != "q4_0":
            return
        hd = self.spec.head_dim
        at = q4_0_blocks_width(hd) + 2 * Q4_0_OUTLIERS
        for il, k in enumerate(self.k):
            if k.shape[-1] > at and k.size and int(k[..., at:].max()) >= hd:
                raise ConfigError(f"KV store state: layer {il} has q4_0 key rows naming a channel past "
                                  f"head_dim {hd}")

    def check_slots(self) -> None:
        """ConfigError unless the slot metadata is what the write kernels keep (a restored state is
        untrusted: a count past the slots, or a position past the RoPE table, would index out of
        bounds inside a Numba kernel, a segfault rather than an error). Per layer and kv head:
        0 <= count <= slots; the occupied slots hold distinct sequence indices in [0, n_seen), the
        others -1; reindexed mode: rank is each token's rank by sequence index (the position);
        original mode: pos is the sequence index (rank is not kept there); kbase in [0, n_seen]; evicted >= 0."""
        for il in range(self.spec.n_layer):
            seq, rank, count = self.seq[il], self.rank[il], self.count[il]
            n_slots = seq.shape[1]
            if (count < 0).any() or (count > n_slots).any() or (self.evicted[il] < 0).any():
                raise ConfigError(f"KV store state: layer {il} counts {count.tolist()} outside 0..{n_slots} "
                                  "(or negative evictions)")
            if self.kbase[il].size and ((self.kbase[il] < 0).any() or (self.kbase[il] > self.n_seen).any()):
                raise ConfigError(f"KV store state: layer {il} key base positions outside 0..{self.n_seen}")
            for h in range(seq.shape[0]):
                n = int(count[h])
                held = seq[h, :n]
                if (held < 0).any() or (held >= self.n_seen).any() or np.unique(held).size != n \
                        or (seq[h, n:] != -1).any():
                    raise ConfigError(f"KV store state: layer {il} head {h} holds invalid sequence indices")
                want = np.empty(n, np.int64)
                want[np.argsort(held, kind="stable")] = np.arange(n)
                if self.reindexed and not np.array_equal(rank[h, :n], want):
                    raise ConfigError(f"KV store state: layer {il} head {h} ranks do not follow the sequence order")
                if not self.reindexed and not np.array_equal(self.pos[il][h, :n], held):
                    raise ConfigError(f"KV store state: layer {il} head {h} positions are not the sequence indices")


def _legacy_q4_0(rows: np.ndarray, head_dim: int, form: str | None, key: bool) -> np.ndarray:
    """q4_0 store rows (..., width) of an earlier form -> the same values in today's (kv_types; key:
    as key rows): `form` None, llama.cpp's block_q4_0 of the values themselves; "hadamard", of each
    block's rotation, with no outliers apart. The values are decoded (gguf's dequantizer, then the
    rotation back) and encoded once more, so they round a second time."""
    from gguf import GGMLQuantizationType, quants

    rows = np.ascontiguousarray(rows)
    blocks = np.asarray(quants.dequantize(rows.reshape(-1, rows.shape[-1]), GGMLQuantizationType.Q4_0), np.float32)
    values = blocks if form is None else rotate_back(blocks / np.float32(QBLOCK))
    return encode(values.reshape(rows.shape[:-1] + (head_dim,)), "q4_0", key)
