"""The fixed-capacity KV store of one sequence, written in place (EQUIP), with logical positions per slot.

Arrays (allocated once, never resized, never shifted):
    k[il], v[il]   (n_kv_head, capacity_l, head_dim) float32   keys are stored before RoPE
    seq[il]        (n_kv_head, capacity_l) int64   sequence index of the token a slot holds, -1 = empty
    pos[il]        (n_kv_head, capacity_l) int64   logical position of that token (see below)
    count[il]      (n_kv_head,) int64              slots in use; slots [0, count) are occupied

Positions (DESIGN.md):
    reindexed: a token's position is its rank, by sequence index, among the tokens its head holds;
               after an eviction every held token newer than the victim moves down by one.
    original:  a token's position is its sequence index, fixed for life.

Slot choice (kernels below, one call per layer per token): a free slot while there is one; when
the store is full the policy's victim slot is overwritten by the new token. For `streaming` the
victim is the oldest non-sink token, which in this layout walks a ring over slots
[sinks, capacity): slot sinks + (evictions mod (capacity - sinks)). `capacity` counts the new
token: the victim is replaced before the new token's attention.

Gemma 3's sliding-window layers get capacity = window and no sinks when the window fits the
configured capacity: their own window, exactly as the model defines it.
"""
from __future__ import annotations

import numpy as np
from numba import njit

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.model_spec import ModelSpec

STORE_POLICIES = ("full", "streaming")


# ---------------------------------------------------------------------------------------------
# Kernels
# ---------------------------------------------------------------------------------------------


@njit(cache=True, nogil=True, inline="always")
def _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, pos_new):
    """Slot `slot` of head h takes token seq_new at logical position pos_new: k_new[h], v_new[h] (hd,)."""
    seq_l[h, slot] = seq_new
    pos_l[h, slot] = pos_new
    for d in range(k_l.shape[2]):
        k_l[h, slot, d] = k_new[h, d]
        v_l[h, slot, d] = v_new[h, d]


@njit(cache=True, nogil=True)
def kv_write_streaming(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new, v_new, seq_new, sinks, reindexed):
    """Write one token into layer storage, evicting the oldest non-sink token when full.

    k_l, v_l (n_kv, cap, hd) f32; seq_l, pos_l (n_kv, cap) i64; count_l, evicted_l (n_kv,) i64;
    k_new, v_new (n_kv, hd) f32; seq_new: sequence index of the token. Returns None; the slot
    written is the one holding `seq_new` afterwards.
    """
    n_kv, cap = seq_l.shape
    for h in range(n_kv):
        n = count_l[h]
        if n < cap:
            slot = n
            count_l[h] = n + 1
            pos_new = n if reindexed else seq_new
        else:
            slot = sinks + evicted_l[h] % (cap - sinks)
            evicted_l[h] += 1
            if reindexed:
                victim_seq = seq_l[h, slot]
                for j in range(cap):
                    if seq_l[h, j] > victim_seq:
                        pos_l[h, j] -= 1
                pos_new = cap - 1
            else:
                pos_new = seq_new
        _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, pos_new)


@njit(cache=True, nogil=True)
def kv_write_shift(k_l, v_l, seq_l, pos_l, count_l, evicted_l, k_new, v_new, seq_new, sinks, reindexed):
    """The shift-and-append baseline (HF-style StreamingLLM): same arguments as kv_write_streaming,
    but the store is kept ordered: on eviction every slot after the victim (slot `sinks`, the oldest
    non-sink) is copied one slot down and the new token is appended at the end. Kept only as the
    honest baseline of the in-place update in benchmarks."""
    n_kv, cap = seq_l.shape
    hd = k_l.shape[2]
    for h in range(n_kv):
        n = count_l[h]
        if n < cap:
            slot = n
            count_l[h] = n + 1
        else:
            evicted_l[h] += 1
            for j in range(sinks, cap - 1):
                seq_l[h, j] = seq_l[h, j + 1]
                pos_l[h, j] = j if reindexed else pos_l[h, j + 1]
                for d in range(hd):
                    k_l[h, j, d] = k_l[h, j + 1, d]
                    v_l[h, j, d] = v_l[h, j + 1, d]
            slot = cap - 1
        _put(k_l, v_l, seq_l, pos_l, h, slot, k_new, v_new, seq_new, slot if reindexed else seq_new)


# ---------------------------------------------------------------------------------------------
# Store
# ---------------------------------------------------------------------------------------------


class KVStore:
    """Preallocated, in-place KV storage of one sequence.

    Args:
        spec: the model.
        kv: the KVConfig (capacity, policy, sinks, positions, staging, policy knobs, update mode);
            keyword arguments instead build one (KVStore(spec, capacity=64, policy="streaming")).
            With policy full the capacity is the context size (default and maximum: the model's
            context); past it, an error.
    """

    def __init__(self, spec: ModelSpec, kv: KVConfig | None = None, **kwargs):
        if kv is None:
            kv = KVConfig(**kwargs)
        elif kwargs:
            raise ConfigError(f"pass a KVConfig or keyword arguments, not both (got {sorted(kwargs)})")
        kv.validate()
        if kv.policy not in STORE_POLICIES:
            raise ConfigError(f"policy {kv.policy!r} is not available in this store yet; valid: {STORE_POLICIES}")
        capacity, sinks = kv.capacity, kv.sinks
        if kv.policy == "full":
            if capacity is not None and not 1 <= capacity <= spec.n_ctx:
                raise ConfigError(f"with policy 'full' the capacity is the context size, 1..{spec.n_ctx}; got {capacity}")
            capacity, sinks = capacity or spec.n_ctx, 0
        self.kv = kv
        self.update = kv.update
        self._write = kv_write_streaming if kv.update == "inplace" else kv_write_shift
        self.spec, self.policy, self.positions = spec, kv.policy, kv.positions
        self.capacity, self.sinks = int(capacity), int(sinks)
        self.reindexed = kv.positions == "reindexed"
        self.n_seen = 0
        nkv, hd = spec.n_head_kv, spec.head_dim
        self.layer_capacity: list[int] = []
        self.layer_sinks: list[int] = []
        for il in range(spec.n_layer):
            cap, s = self.capacity, self.sinks
            w = spec.window[il]
            if w and w <= cap:
                cap, s = w, 0
            self.layer_capacity.append(cap)
            self.layer_sinks.append(s)
        self.k = [np.zeros((nkv, c, hd), np.float32) for c in self.layer_capacity]
        self.v = [np.zeros((nkv, c, hd), np.float32) for c in self.layer_capacity]
        self.seq = [np.full((nkv, c), -1, np.int64) for c in self.layer_capacity]
        self.pos = [np.zeros((nkv, c), np.int64) for c in self.layer_capacity]
        self.count = [np.zeros(nkv, np.int64) for _ in self.layer_capacity]
        self.evicted = [np.zeros(nkv, np.int64) for _ in self.layer_capacity]

    # -----------------------------------------------------------------------------------------
    # Save / restore (sessions)
    # -----------------------------------------------------------------------------------------

    ARRAY_FIELDS = ("k", "v", "seq", "pos", "count", "evicted")

    def state(self) -> dict:
        """Everything that defines this store, as plain values: {"kv": KVConfig dict, "n_seen": int,
        "arrays": {"k.0": ndarray, ...}} (per-layer arrays named field.layer). Restored by restore()."""
        arrays = {f"{name}.{il}": a for name in self.ARRAY_FIELDS for il, a in enumerate(getattr(self, name))}
        return {"kv": self.kv.to_dict(), "n_seen": int(self.n_seen), "arrays": arrays}

    @classmethod
    def restore(cls, spec: ModelSpec, state: dict) -> "KVStore":
        """A store equal to the one state() was taken from; every array is checked for name, shape and
        dtype against a freshly built store (ConfigError naming the first mismatch), so a damaged
        state never half-loads."""
        try:
            store = cls(spec, KVConfig.from_dict(dict(state["kv"])))
            n_seen, arrays = int(state["n_seen"]), state["arrays"]
        except (KeyError, TypeError, ValueError) as e:
            raise ConfigError(f"KV store state is malformed: {e!r}") from None
        fresh = store.state()["arrays"]
        if set(arrays) != set(fresh):
            raise ConfigError(f"KV store state has arrays {sorted(set(arrays) ^ set(fresh))[:4]} that do not match "
                              "this model/config")
        for name, ref in fresh.items():
            a = np.asarray(arrays[name])
            if a.shape != ref.shape or a.dtype != ref.dtype:
                raise ConfigError(f"KV store state array {name}: shape {a.shape} {a.dtype}, expected {ref.shape} {ref.dtype}")
        for name, ref in fresh.items():
            ref[...] = arrays[name]
        store.n_seen = n_seen
        return store

    def check_room(self, n_new: int) -> None:
        """Raise before any work when policy full would overflow the model's context."""
        if self.policy == "full" and self.n_seen + n_new > self.capacity:
            raise ConfigError(f"{self.n_seen + n_new} tokens exceed the model's context {self.capacity} with "
                              "policy 'full'; choose an eviction policy (e.g. streaming) or a shorter input")

    def write(self, il: int, k_new: np.ndarray, v_new: np.ndarray, seq: int) -> None:
        """Put token `seq` into layer il: k_new, v_new (n_kv_head, head_dim) float32 before RoPE."""
        self._write(self.k[il], self.v[il], self.seq[il], self.pos[il], self.count[il], self.evicted[il],
                           k_new, v_new, seq, self.layer_sinks[il], self.reindexed)

    def query_position(self, il: int, seq: int) -> int:
        """Logical position of the newest token (just written) in layer il."""
        return int(self.count[il][0]) - 1 if self.reindexed else seq

    def stats(self) -> dict:
        return {"capacity": self.capacity, "length": int(max(int(c.max()) for c in self.count)),
                "evicted_total": int(sum(int(e.sum()) for e in self.evicted)), "policy": self.policy,
                "sinks": self.sinks, "positions": self.positions, "update": self.update, "tokens_seen": self.n_seen,
                "bytes": int(sum(a.nbytes for a in self.k + self.v + self.seq + self.pos))}
