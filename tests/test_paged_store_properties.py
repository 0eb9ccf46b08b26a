"""Stateful property tests of the paged store and its pool's compaction passes against the reference
cache (hypothesis).

A RuleBasedStateMachine drives a PagedStore (runtime/paged_store.py) in a small shared PagedKVPool
(blocks of 4 slots) and the NumPy reference engine's ordered cache through random sequences of
prefill chunks, decode steps, compaction passes ("repack" or "fill", on demand and every N tokens),
and fork (the child continues; the parent is freed or kept aside, its blocks shared copy-on-write).
Policy (streaming or full: what the paged store offers), positions, capacity, sinks and the update
mode (in place, or append with holes) are drawn per machine. After every step:
- logits of every fed token agree with the reference within TOL (1e-3);
- every layer holds the reference's tokens (the pool's held list, and the sequence indices in its
  blocks' slots: each held once, nothing else);
- a sequence kept aside after a fork still holds exactly what it held (copy-on-write held);
- no block leaks: free + in use = the pool's blocks, and the blocks in use are exactly those some
  live sequence's table names.

CI runs 30 machines of up to 16 steps (derandomized); RINGLLM_KV_PROPERTY_EXAMPLES=N runs N fresh ones.
"""
from __future__ import annotations

from collections import Counter

import numpy as np
import pytest
from hypothesis import strategies as st
from hypothesis.stateful import initialize, invariant, precondition, rule

from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.paged_pool import PagedKVPool
from ringllm.runtime.paged_store import PagedStore
from ringllm.runtime.reference import ReferenceEngine

from store_machines import FeedingMachine, run_machine
from test_policies_engine import _load_tiny

MAX_TOKENS = 100
N_BLOCKS, BLOCK = 96, 4


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    m = _load_tiny("llama", tmp_path_factory)
    return CPUEngine(m.spec, m.tensors, n_batch=8), ReferenceEngine(m.spec, m.tensors)


def slot_tokens(pool: PagedKVPool, store: PagedStore, il: int) -> np.ndarray:
    """Sorted sequence indices in the slots of store's blocks, layer il (-1 holes left out)."""
    table = store.sq.table[:store.sq.n_table]
    seq = pool.seq[il][table].reshape(-1)
    return np.sort(seq[seq >= 0])


class PagedStoreMachine(FeedingMachine):
    max_tokens = MAX_TOKENS
    ran = Counter()                 # this machine's own tally

    @initialize(policy=st.sampled_from(["streaming", "full"]), positions=st.sampled_from(["reindexed", "original"]),
                capacity=st.integers(5, 14), sinks=st.integers(0, 3), update=st.sampled_from(["inplace", "append"]),
                every=st.sampled_from([0, 3, 8]), compaction=st.sampled_from(["repack", "fill"]))
    def setup(self, policy, positions, capacity, sinks, update, every, compaction):
        self.eng, self.ref = self.engines
        spec = self.eng.spec
        self.kv = KVConfig(policy=policy, capacity=capacity if policy == "streaming" else None,
                           sinks=sinks, positions=positions)
        self.pool = PagedKVPool.for_model(spec, N_BLOCKS, block_size=BLOCK)
        self.store = PagedStore(self.pool, spec, self.kv, update=update, compact_every=every, compaction=compaction)
        self.cache = self.ref.new_cache(self.kv)
        self.tokens: list[int] = []
        self.aside: list[tuple[PagedStore, list]] = []     # forked-from sequences kept alive, with what they held
        self.ran[f"{policy}-{update}-{compaction}"] += 1

    def _feed(self, ids, run) -> None:
        super()._feed(ids, run)
        self.ran["passes"] = max(self.ran["passes"], self.pool.passes)

    @precondition(lambda self: self.tokens)
    @rule()
    def compact(self):
        """A pass now (the layers are in step between engine calls)."""
        self.store.compact()
        self.ran["compact"] += 1

    @precondition(lambda self: self.tokens)
    @rule(keep_parent=st.booleans())
    def fork(self, keep_parent):
        """The child continues; the parent is kept aside (its blocks shared until one side writes)
        or freed."""
        child = self.store.fork()
        if keep_parent:
            held = [self.pool.held(self.store.seq_id, il) for il in range(self.eng.spec.n_layer)]
            self.aside.append((self.store, held))
            self.ran["fork_kept"] += 1
        else:
            self.pool.free_sequence(self.store.seq_id)
            self.ran["fork_freed"] += 1
        self.store = child

    @invariant()
    def agrees_with_reference(self):
        if not hasattr(self, "store"):
            return
        pool, store = self.pool, self.store
        for il, lc in enumerate(self.cache.layers):
            want = np.sort(np.asarray(lc.seq[0]))
            for h in range(1, len(lc.seq)):
                assert np.array_equal(np.sort(np.asarray(lc.seq[h])), want)
            np.testing.assert_array_equal(pool.held(store.seq_id, il), want, err_msg=f"held, layer {il}")
            np.testing.assert_array_equal(slot_tokens(pool, store, il), want, err_msg=f"slots, layer {il}")
        for other, held in self.aside:
            for il, was in enumerate(held):
                np.testing.assert_array_equal(pool.held(other.seq_id, il), was, err_msg="a forked-from sequence")
                np.testing.assert_array_equal(slot_tokens(pool, other, il), was, err_msg="its blocks")
        g = pool.gauges()
        assert g["free_blocks"] + g["blocks_in_use"] == N_BLOCKS
        named = set()
        for s in [store] + [o for o, _ in self.aside]:
            named |= set(s.sq.table[:s.sq.n_table].tolist())
        assert len(named) == g["blocks_in_use"], "a block in use that no live sequence names, or the reverse"


def test_paged_store_state_machine(engines):
    run_machine(PagedStoreMachine, engines, ("prefill", "decode", "compact", "fork_kept", "fork_freed", "passes"))
