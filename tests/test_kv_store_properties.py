"""Stateful property tests of the KV store against the reference cache (hypothesis).

A RuleBasedStateMachine drives the Numba engine's in-place store and the NumPy reference engine's
ordered shift-and-append cache (runtime/reference.py, written apart) through random sequences of:
chunks of tokens (prefill chunks and single steps: writes and evictions under the drawn policy,
staged eviction when lazy/slack/max_drop are drawn), fork, save/load (state() through an .npz
archive, restore(), adoption by the engine), truncate where the store allows it, and a rollback
journal (feed, roll back part, commit). After every step:
- logits of every fed token agree within TOL (1e-3 max abs, tests/test_engine.py);
- each (layer, kv head) holds the same tokens as the reference, at the same logical positions;
- per-slot policy state agrees where the two keep the same quantity (h2o's accumulated attention,
  knorm's key norms; 1e-3);
- no slot leaks: count equals the tokens held, every slot past count is empty, and the store's
  own slot invariants hold (KVStore.check_slots, the check a restored state passes).
The reference has no journal and no truncate: after either it is rebuilt by feeding the kept
tokens to a fresh cache, which is what "the store becomes the store fed only those" means.

CI runs 30 machines of up to 16 steps each, the same ones every run; RINGLLM_KV_PROPERTY_EXAMPLES=N
runs N fresh random ones (docs/reliability.md). Shrunk failures become regular tests below.
"""
from __future__ import annotations

import io
import os
from collections import Counter

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_store import KVStore
from ringllm.runtime.reference import ReferenceEngine

from test_engine import TOL
from test_policies_engine import _load_tiny

POLICIES = ["streaming", "full", "h2o", "tova", "scissorhands", "knorm", "lsh", "random", "snapkv", "pyramidkv",
            "adakv", "rkv", "gvote"]
STATE_AS_SCORE = {"h2o": "acc", "knorm": "norm"}     # policies whose store score is the reference's state entry
EXAMPLES = int(os.environ.get("RINGLLM_KV_PROPERTY_EXAMPLES", "30"))
# CI's form draws the same examples every run (derandomized); setting the count explores afresh
RANDOM = "RINGLLM_KV_PROPERTY_EXAMPLES" in os.environ
MAX_TOKENS = 120                                      # keeps the reference rebuilds cheap


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    m = _load_tiny("llama", tmp_path_factory)
    return CPUEngine(m.spec, m.tensors, n_batch=8), ReferenceEngine(m.spec, m.tensors)


def check_against_reference(store: KVStore, cache, policy: str) -> None:
    for il, lc in enumerate(cache.layers):
        for h in range(len(lc.seq)):
            n = int(store.count[il][h])
            assert n == lc.seq[h].size, f"layer {il} head {h}: {n} held, reference {lc.seq[h].size}"
            assert (store.seq[il][h, n:] == -1).all(), f"layer {il} head {h}: a slot past count is not empty"
            order = np.argsort(store.seq[il][h, :n])
            np.testing.assert_array_equal(store.seq[il][h, :n][order], lc.seq[h], err_msg=f"layer {il} head {h}")
            np.testing.assert_array_equal(store.pos[il][h, :n][order], cache.key_positions(il, h),
                                          err_msg=f"positions, layer {il} head {h}")
            name = STATE_AS_SCORE.get(policy)
            if name is not None and lc.policy:
                np.testing.assert_allclose(store.score[il][h, :n][order], lc.state[name][h], rtol=0, atol=1e-3,
                                           err_msg=f"{policy} state, layer {il} head {h}")
    store.check_slots()


class KVStoreMachine(RuleBasedStateMachine):
    engines: tuple = None           # set by the test (the tiny model's engine and reference engine)
    ran: Counter = Counter()        # rule -> times run, over all examples (the test checks each ran)

    # half the machines are rings (full, streaming): the only stores truncate() accepts
    @initialize(policy=st.one_of(st.sampled_from(["full", "streaming"]), st.sampled_from(POLICIES)), positions=st.sampled_from(["reindexed", "original"]),
                capacity=st.integers(8, 14), sinks=st.integers(0, 3),
                staging=st.sampled_from([(0, 0, 0), (3, 0, 0), (3, 2, 0), (4, 3, 2)]))
    def setup(self, policy, positions, capacity, sinks, staging):
        self.ran[policy] += 1
        lazy, slack, max_drop = staging if policy not in ("streaming", "full") else (0, 0, 0)
        self.kv = KVConfig(capacity=capacity if policy != "full" else None, policy=policy, sinks=sinks, recent=2,
                           positions=positions, lazy=lazy, slack=slack, max_drop=max_drop, window=4, pool=3,
                           history=4)
        self.policy = policy
        self.eng, self.ref = self.engines
        self.store, self.cache = self.eng.new_store(self.kv), self.ref.new_cache(self.kv)
        self.tokens: list[int] = []

    def _rebuild_reference(self) -> None:
        self.cache = self.ref.new_cache(self.kv)
        if self.tokens:
            self.ref.forward(self.tokens, self.cache)

    def _feed(self, ids, run) -> None:
        """run(ids) feeds the store and returns (len(ids), n_vocab) logits; the reference gets the same."""
        before = self.store.stats()["evicted_total"]
        got = run(ids)
        np.testing.assert_allclose(got, self.ref.forward(ids, self.cache), rtol=0, atol=TOL)
        self.tokens += ids
        self.ran["evictions"] += self.store.stats()["evicted_total"] - before

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS)
    @rule(ids=st.lists(st.integers(0, 255), min_size=1, max_size=24))
    def prefill(self, ids):
        """A chunk through the engine's batched prefill."""
        self.ran["prefill"] += 1
        self._feed(ids, lambda x: self.eng.logits(x, self.store))

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS)
    @rule(ids=st.lists(st.integers(0, 255), min_size=1, max_size=6))
    def decode(self, ids):
        """Tokens one decode step each."""
        self.ran["decode"] += 1
        self._feed(ids, lambda x: np.stack([self.eng.step(t, self.store).copy() for t in x]))

    @rule()
    def fork(self):
        self.ran["fork"] += 1
        copy = self.store.fork()
        self.store = copy

    @rule()
    def save_and_load(self):
        self.ran["save_and_load"] += 1
        state = self.store.state()
        buf = io.BytesIO()
        np.savez(buf, **state["arrays"])
        buf.seek(0)
        with np.load(buf, allow_pickle=False) as z:
            arrays = {n: z[n] for n in z.files}
        self.store = self.eng.adopt_store(KVStore.restore(self.eng.spec, {**state, "arrays": arrays}))

    @precondition(lambda self: self.store.truncatable() and self.tokens)
    @rule(data=st.data())
    def truncate(self, data):
        self.ran["truncate"] += 1
        n_keep = data.draw(st.integers(0, len(self.tokens)))
        self.store.truncate(n_keep)
        self.tokens = self.tokens[:n_keep]
        self._rebuild_reference()

    @precondition(lambda self: len(self.tokens) < MAX_TOKENS)
    @rule(ids=st.lists(st.integers(0, 255), min_size=1, max_size=6), data=st.data())
    def journal_and_rollback(self, ids, data):
        self.ran["journal_and_rollback"] += 1
        try:
            self.store.begin_journal(len(ids))
        except ConfigError:
            self.ran["journal_refused"] += 1
            return                       # a policy the journal does not cover: refused, store unchanged
        self.eng.logits(ids, self.store)
        keep = data.draw(st.integers(0, len(ids)))
        self.store.rollback(keep)
        self.store.commit()
        self.tokens += ids[:keep]
        self._rebuild_reference()
        self.ran["rolled_back"] += len(ids) - keep

    @invariant()
    def agrees_with_reference(self):
        if hasattr(self, "store"):
            check_against_reference(self.store, self.cache, self.policy)


def test_kv_store_state_machine(engines):
    KVStoreMachine.engines = engines
    run = settings(max_examples=EXAMPLES, stateful_step_count=16, deadline=None, database=None, derandomize=not RANDOM,
                   suppress_health_check=list(HealthCheck))(KVStoreMachine)
    KVStoreMachine.ran.clear()
    run.TestCase().runTest()
    ran = KVStoreMachine.ran
    assert all(ran[r] for r in ("prefill", "decode", "fork", "save_and_load", "truncate", "journal_and_rollback",
                                "evictions", "rolled_back")), ran
    print(dict(ran))
