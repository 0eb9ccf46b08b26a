"""PagedStore: one sequence's KV store living in a shared PagedKVPool, decodable by the CPU engine.

    pool = PagedKVPool.for_model(spec, n_blocks=64)
    st = PagedStore(pool, spec, KVConfig(capacity=64, policy="streaming", sinks=4),
                    update="append", compact_every=16, compaction="fill")
    engine.prefill(ids, st); engine.step(tok, st)         # CPUEngine._layer's paged branch

Policies: `streaming` (without staged eviction) and `full`, both position modes, exactly as
KVStore (DESIGN.md "KV store contract"): `capacity` counts the new token, the victim is the oldest
non-sink token and leaves before the new token's attention. A slot is one token in every layer and
kv head, so per-head policies (h2o and the other score-based ones) are not offered here.

Where the new token goes (`update`):
    "inplace" (EQUIP): into the victim's (block, offset); without a victim, at the tail.
    "append": always at the tail (a new block when the last is used up); the victim's slot stays a
        hole until its block empties (freed at once) or a compaction pass reclaims it.
`compact_every` N > 0 runs `compaction` ("repack" | "fill") on the sequence every N tokens, at the
first token boundary where every layer is in step (decode: every N tokens exactly; prefill chunks:
at the next chunk start).

Keys are stored before RoPE and rotated at read by each slot's logical position
(runtime/paged_attention.py), whatever RoPE strategy the engine uses for dense stores. The rows are
in the pool's KV types (KVConfig k_type / v_type must name them): a quantized key is rounded before
RoPE, as a dense store's keys are under CPUEngine(rope="fused") (the reference cache's
ring_keys="fused").
"""
from __future__ import annotations

import numpy as np

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.paged_attention import gather_slots, paged_attend
from ringllm.runtime.paged_pool import PagedKVPool
from ringllm.runtime.policies import make_policy

UPDATES = ("inplace", "append")
COMPACTIONS = ("repack", "fill")


class PagedStore:
    """One sequence of a PagedKVPool behind the verbs CPUEngine uses (module docstring).

    Args:
        pool: the shared pool (shaped for `spec`: PagedKVPool.for_model).
        spec: the model.
        kv: KVConfig (policy streaming without staging, or full; either position mode).
        update: "inplace" | "append".
        compact_every: tokens between compaction passes (0 = never).
        compaction: "repack" | "fill".
        seq_id: adopt an existing pool sequence (fork()) instead of starting a new one.
    """

    paged = True          # CPUEngine._layer's branch: this store writes and attends itself
    needs_mass = False
    mass = None

    def __init__(self, pool: PagedKVPool, spec, kv: KVConfig | None = None, update: str = "append",
                 compact_every: int = 0, compaction: str = "fill", seq_id: int | None = None):
        kv = kv or KVConfig()
        kv.validate()
        if (kv.k_type, kv.v_type) != (pool.k_type, pool.v_type):
            raise ConfigError(f"this paged KV pool holds k_type {pool.k_type!r} / v_type {pool.v_type!r} rows; the "
                              f"store asks for {kv.k_type!r} / {kv.v_type!r}: build the pool with "
                              "PagedKVPool.for_model(spec, n_blocks, k_type=..., v_type=...) of the store's types")
        if kv.policy not in ("streaming", "full") or kv.staged:
            raise ConfigError(f"the paged store offers policies 'streaming' (without staged eviction) and 'full'; "
                              f"got {kv.policy!r}{' with staging' if kv.staged else ''}")
        if (pool.n_layer, pool.n_kv_head, pool.head_dim) != (spec.n_layer, spec.n_head_kv, spec.head_dim):
            raise ConfigError(f"pool shaped (n_layer, n_kv_head, head_dim) = {(pool.n_layer, pool.n_kv_head, pool.head_dim)}"
                              f", the model needs {(spec.n_layer, spec.n_head_kv, spec.head_dim)}: "
                              "use PagedKVPool.for_model(spec, n_blocks)")
        if any(spec.window):
            raise ConfigError("the paged store does not serve sliding-window layers yet; use KVStore")
        if update not in UPDATES:
            raise ConfigError(f"update {update!r} unknown; valid: {', '.join(UPDATES)}")
        if compaction not in COMPACTIONS:
            raise ConfigError(f"compaction {compaction!r} unknown; valid: {', '.join(COMPACTIONS)}")
        if not isinstance(compact_every, int) or compact_every < 0:
            raise ConfigError(f"compact_every must be an integer >= 0, got {compact_every!r}")
        self.pool, self.spec, self.kv = pool, spec, kv
        self.policy = kv.policy
        self.capacity = int(kv.capacity or spec.n_ctx)
        self.sinks = int(kv.sinks) if kv.policy == "streaming" else 0
        self.reindexed = kv.positions == "reindexed"
        self.update, self.compact_every, self.compaction = update, compact_every, compaction
        self.seq_id = pool.new_sequence() if seq_id is None else seq_id
        self.sq = pool._get(self.seq_id)
        self.policy_impl = make_policy(kv, spec)
        self.layer_rope_mode = ["paged"] * spec.n_layer     # set: the engine's adopt_store is not needed
        self.n_seen = 0
        self.last_compaction = 0
        self.passes: list[dict] = []
        nh, hd = spec.n_head, spec.head_dim
        self.krot = np.zeros(hd, np.float32)
        self.row = np.zeros(hd, np.float32)          # a quantized row decoded (paged_attend)
        self.qrot = np.zeros((nh, hd), np.float32)
        self.out = np.zeros((nh, hd), np.float32)
        self._size_scratch(min(self.capacity, 1024))

    def _size_scratch(self, n: int) -> None:
        self.scores = np.zeros((self.spec.n_head, n), np.float32)
        self.slots = np.zeros(n, np.int64)
        self.spos = np.zeros(n, np.int64)

    # -----------------------------------------------------------------------------------------
    # Engine verbs
    # -----------------------------------------------------------------------------------------

    def check_room(self, n_new: int) -> None:
        """Raise before any work when policy full would overflow its context."""
        if self.policy == "full" and self.n_seen + n_new > self.capacity:
            raise ConfigError(f"{self.n_seen + n_new} tokens exceed the context {self.capacity} with policy 'full'")

    def uses_policy(self, il: int) -> bool:
        return False

    def fork(self) -> "PagedStore":
        """A second sequence sharing this one's blocks (prefix sharing, copy-on-write) and continuing
        from the same state."""
        child = PagedStore(self.pool, self.spec, self.kv, self.update, self.compact_every, self.compaction,
                           seq_id=self.pool.fork(self.seq_id))
        child.n_seen, child.last_compaction = self.n_seen, self.last_compaction
        return child

    def write(self, il: int, k_new: np.ndarray, v_new: np.ndarray, seq: int) -> None:
        """Token `seq` into layer il: k_new, v_new (n_kv_head, head_dim) f32, keys before RoPE."""
        pool, sq = self.pool, self.sq
        if (il == 0 and self.compact_every and seq - self.last_compaction >= self.compact_every
                and sq.in_step()):
            self.compact()
            self.last_compaction = seq
        if sq.n_held[il] >= self.capacity:
            victim = int(sq.held[il, self.sinks])
            tslot = pool.evict_layer(sq, il, victim, free_empty=self.update == "append")
            if self.update == "inplace":
                pool.write_layer(sq, il, tslot, k_new, v_new, seq)
                return
        pool.append_layer(sq, il, k_new, v_new, seq)

    def compact(self) -> dict:
        """One compaction pass now (layers must be in step); returns its gauges."""
        run = self.pool.compact_repack if self.compaction == "repack" else self.pool.compact_fill
        g = run(self.seq_id)
        self.passes.append(g)
        return g

    def attend(self, il: int, q: np.ndarray, out: np.ndarray, table, scale: np.float32,
               softcap: np.float32 = np.float32(0.0)) -> None:
        """out (n_head, hd) = attention of the token just written to layer il; q (n_head, hd) before
        RoPE; table: the layer's RopeTable (grown here when a position passes its end)."""
        pool, sq = self.pool, self.sq
        n = int(sq.n_held[il])
        if n > self.slots.shape[0]:
            self._size_scratch(max(n, 2 * self.slots.shape[0]))
        got = gather_slots(self.slots, self.spos, pool.seq[il], sq.table, sq.n_table, sq.held[il], n, self.reindexed)
        q_pos = n - 1 if self.reindexed else int(sq.held[il, n - 1])
        need = q_pos + 1 if self.reindexed else int(sq.held[il, n - 1]) + 1
        if need > table.cos.shape[0]:
            table.ensure(need)
        paged_attend(out, q, pool.k[il], pool.v[il], self.slots, self.spos, got, q_pos, table.cos, table.sin,
                     self.spec.rotary_dim, scale, softcap, self.scores, self.krot, self.qrot, self.row)

    def forward_layer(self, il: int, q: np.ndarray, k: np.ndarray, v: np.ndarray, seq0: int, att: np.ndarray,
                      table, scale: np.float32, softcap: np.float32) -> None:
        """The engine's per-layer KV step for a chunk of T tokens: q (T, n_head*hd), k, v (T, n_kv, hd)
        before RoPE; att (T, n_head*hd) receives the attention outputs. Token t is written, then attends."""
        nh, hd = self.spec.n_head, self.spec.head_dim
        for t in range(q.shape[0]):
            self.write(il, k[t], v[t], seq0 + t)
            self.attend(il, q[t].reshape(nh, hd), self.out, table, scale, softcap)
            att[t] = self.out.reshape(-1)

    # -----------------------------------------------------------------------------------------

    def stats(self) -> dict:
        sq = self.sq
        return {"capacity": self.capacity, "length": int(sq.n_held.max()),
                "evicted_total": int(sq.evicted.sum()) * self.spec.n_head_kv, "tokens_evicted": int(sq.evicted[0]),
                "policy": self.policy, "sinks": self.sinks, "positions": self.kv.positions, "update": self.update,
                "tokens_seen": self.n_seen, "paged": True, "blocks": int(sq.n_table),
                "block_size": self.pool.block_size, "compaction": self.compaction,
                "compact_every": self.compact_every, "passes": len(self.passes),
                "slot_copies": int(sum(p["slot_copies"] for p in self.passes)),
                "blocks_freed_by_passes": int(sum(p["blocks_freed"] for p in self.passes)), "pool": self.pool.gauges()}
