"""The KV store's verbs beyond write: fork (an independent copy that decodes exactly as the original),
evict (tokens chosen by the caller leave a policy layer), resized (a copy with other per-layer
capacities, its tokens and policy state carried), and adoption by an engine (a store fed to
an engine that did not lay it out is adopted first, or refused when its layout cannot be)."""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.key_sum import key_sums
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_store import KVStore

from tiny_checkpoints import build_tiny

IDS = np.random.default_rng(11).permutation(256)[:60].tolist()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_verbs_llama"))
    build_tiny("llama", d)
    return load_model(d, tokenizer=False)


def _held(st, il):
    return [sorted(st.seq[il][h, :st.count[il][h]].tolist()) for h in range(st.seq[il].shape[0])]


@pytest.mark.parametrize("policy", ["streaming", "h2o", "snapkv", "rkv", "adakv"])
def test_fork_decodes_like_the_original(tiny, policy):
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    kv = KVConfig(capacity=16, policy=policy, sinks=2, window=4, pool=3)
    a, ref = eng.new_store(kv), eng.new_store(kv)
    eng.prefill(IDS[:30], a)
    eng.prefill(IDS[:30], ref)
    b = a.fork()
    assert b.adopter is None                        # the copy is laid out by the engine on first use
    for t in IDS[30:45]:
        la, lb = eng.step(t, a).copy(), eng.step(t, b).copy()
        np.testing.assert_array_equal(la, lb)
        np.testing.assert_array_equal(la, eng.step(t, ref))
    for name in a.array_fields:                     # the copy shares no array with the original
        for x, y in zip(getattr(a, name), getattr(b, name)):
            assert not np.shares_memory(x, y)
            np.testing.assert_array_equal(x, y)


@pytest.mark.parametrize("policy, recent", [("h2o", 2), ("h2o", None), ("rkv", 2), ("gvote", 2), ("adakv", 2)])
def test_resized_carries_every_token_and_its_state(tiny, policy, recent):
    """A store resized up and back down is the store it was, array for array, and decodes as it; the
    larger copy holds more before the policy evicts. Under rkv the key sums, under gvote the recent
    queries (per-layer state) come along; a recent window the capacity set (h2o's capacity/2) stays
    the one it was."""
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    L = tiny.spec.n_layer
    kv = KVConfig(capacity=16, policy=policy, sinks=2, recent=recent, window=4, gvote_samples=2)
    a = eng.new_store(kv)
    eng.prefill(IDS[:24], a)                        # evicted down to 16
    big = a.resized([24] * L)
    assert big.layer_capacity == [24] * L and big.adopter is None and big.recent == a.recent
    back = big.resized([16] * L, capacity=16)
    assert back.kv.capacity == 16 and back.recent == a.recent
    for name in a.array_fields:
        for x, y in zip(getattr(a, name), getattr(back, name)):
            np.testing.assert_array_equal(x, y, err_msg=name)
    for t in IDS[24:34]:
        np.testing.assert_array_equal(eng.step(t, a).copy(), eng.step(t, back))
    evicted, held = big.stats()["evicted_total"], sum(int(c.sum()) for c in big.count)
    eng.prefill(IDS[24:30], big)                    # 16 + 6 held: the larger copy has room for them all
    assert big.stats()["evicted_total"] == evicted
    assert sum(int(c.sum()) for c in big.count) == held + 6 * L * tiny.spec.n_head_kv


def test_resized_refuses_what_it_cannot_carry(tiny):
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    L = tiny.spec.n_layer
    st = eng.new_store(KVConfig(capacity=16, policy="h2o", sinks=2))
    eng.prefill(IDS[:20], st)
    with pytest.raises(ConfigError, match="holds 16 tokens, more than its 12 slots"):
        st.resized([12] * L)
    with pytest.raises(ConfigError, match=f"needs {L} values"):
        st.resized([16] * (L + 1))
    with pytest.raises(ConfigError, match="must be integers"):
        st.resized(["x"] * L)
    with pytest.raises(ConfigError, match=r"must be above sinks \+ recent = 10"):
        KVStore(tiny.spec, KVConfig(capacity=64, policy="h2o", sinks=2, recent=8), layer_capacity=[10] * L)
    st.begin_journal(2)
    with pytest.raises(ConfigError, match="journal"):
        st.resized([32] * L)
    st.commit()


@pytest.mark.parametrize("policy", ["knorm", "lsh"])
def test_replace_many_gives_new_tokens_their_key_state(tiny, policy):
    """A token replace_many puts in a slot gets the per-slot state its policy computes from the key at
    insert (knorm's norm grid, lsh's SimHash code of the key before RoPE), not zero: the rows go in
    rotated at their positions on these "rebased" layers and are brought back before the policy sees
    them. The same key written through the engine's path gets the same state."""
    from ringllm.runtime.policies.lsh import simhash_rows
    from ringllm.runtime.reference_rope import layer_freqs, rope

    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    spec = tiny.spec
    st = eng.new_store(KVConfig(capacity=16, policy=policy, sinks=0, recent=2, lsh_bits=16))
    eng.prefill(IDS[:10], st)
    il, nkv, hd = 1, spec.n_head_kv, spec.head_dim
    assert st.rope_mode(il) == "rebased"
    k_pre = np.random.default_rng(3).standard_normal((1, nkv, hd)).astype(np.float32) * 3
    pos = np.array([int(st.count[il][0]) - 1 if st.reindexed else 10])     # one token leaves, one enters
    rows = np.stack([rope(k_pre[:, h], pos, spec.rotary_dim, layer_freqs(spec, il), spec.rope_scale[il])
                     for h in range(nkv)], axis=1).astype(np.float32)
    slots = np.array([[2], [5]])
    st.replace_many(il, slots, rows, np.zeros_like(rows), [10])
    for h in range(nkv):
        slot = slots[h, 0]
        if policy == "knorm":
            want = np.floor(256.0 * np.log2(np.sqrt((k_pre[0, h].astype(np.float64) ** 2).sum())) + 0.5)
            assert st.score[il][h, slot] == want
        else:
            code = np.zeros(1, np.int64)
            simhash_rows(code, k_pre[0, h:h + 1], st.policy_impl.proj[il])
            assert st.aux[il][h, slot] == code[0] != 0


def test_fork_during_a_journal_is_refused(tiny):
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    st = eng.new_store(KVConfig(capacity=16, policy="h2o", sinks=2))
    eng.prefill(IDS[:20], st)
    st.begin_journal(4)
    with pytest.raises(ConfigError, match="journal"):
        st.fork()
    with pytest.raises(ConfigError, match="journal"):
        st.evict(0, [[0], [0]])
    st.commit()
    st.fork()


@pytest.mark.parametrize("policy", ["h2o", "rkv"])
def test_evict_removes_the_chosen_tokens(tiny, policy):
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    st = eng.new_store(KVConfig(capacity=32, policy=policy, sinks=2, window=4))
    eng.prefill(IDS[:24], st)                        # nothing evicted yet: 24 held per head
    before = _held(st, 1)
    gone = [[5, 9, 17], [0, 23]]                     # sequence indices per kv head
    slots = [[int(np.flatnonzero(st.seq[1][h] == s)[0]) for s in gone[h]] for h in range(2)]
    kept_score = {(h, int(st.seq[1][h, j])): st.score[1][h, j] for h in range(2) for j in range(24)}
    st.evict(1, slots)
    for h in range(2):
        n = int(st.count[1][h])
        assert _held(st, 1)[h] == [s for s in before[h] if s not in gone[h]]
        assert int(st.evicted[1][h]) == len(gone[h])
        seq = st.seq[1][h, :n]
        np.testing.assert_array_equal(st.rank[1][h, :n], np.argsort(np.argsort(seq)))   # ranks follow
        assert (st.seq[1][h, n:] == -1).all()
        for j in range(n):                           # per-slot policy state moved with its token
            assert st.score[1][h, j] == kept_score[(h, int(seq[j]))]
    if st.ksum[1].shape[0]:                           # rkv: the key sums equal a rebuild
        ks, sc = st.ksum[1].copy(), st.score[1].copy()
        key_sums(ks, st.k[1], st.koff[1], st.seq[1], sc, st.count[1])
        np.testing.assert_array_equal(ks, st.ksum[1])
    assert all(len(x) == 24 for x in _held(st, 0))   # other layers untouched
    logits = eng.step(IDS[24], st)                   # and decoding goes on
    assert np.isfinite(logits).all()


def test_evict_bad_input_changes_nothing(tiny):
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    ring = eng.new_store(KVConfig(capacity=16, policy="streaming", sinks=2))
    eng.prefill(IDS[:10], ring)
    with pytest.raises(ConfigError, match="ring"):
        ring.evict(0, [[1], [1]])
    st = eng.new_store(KVConfig(capacity=16, policy="h2o", sinks=2))
    eng.prefill(IDS[:10], st)
    snapshot = {k: v.copy() for k, v in st.state()["arrays"].items()}
    for il, slots, msg in [(0, [[1]], "one list of slots per kv head"), (0, [[10], []], "occupied"),
                           (0, [[-1], []], "occupied"), (0, [[2, 2], []], "twice"), (7, [[1], [1]], "out of range")]:
        with pytest.raises(ConfigError, match=msg):
            st.evict(il, slots)
    for k, v in st.state()["arrays"].items():
        np.testing.assert_array_equal(v, snapshot[k])


def test_a_store_fed_to_another_engine_is_adopted_or_refused(tiny):
    a = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    st = a.new_store(KVConfig(capacity=12, policy="streaming", sinks=2))
    a.prefill(IDS[:20], st)
    restored = KVStore.restore(tiny.spec, st.state())
    b = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)           # a fresh engine: scratch not sized yet
    np.testing.assert_array_equal(b.step(IDS[20], restored), a.step(IDS[20], st))
    fused = CPUEngine(tiny.spec, tiny.tensors, n_batch=8, rope="fused")
    with pytest.raises(ConfigError, match="laid out"):       # keys rotated for "stored": not silently misread
        fused.step(IDS[21], st)


def test_rollback_refuses_to_undo_a_token_whose_write_bypassed_the_journal(tiny):
    """A slot changed behind the journal's back during a token the rollback undoes is caught
    (RuntimeError naming the layer, head and slot); one changed during a token it keeps is not its
    concern: that token is never restored from the journal."""
    eng = CPUEngine(tiny.spec, tiny.tensors, n_batch=8)
    kv = KVConfig(capacity=16, policy="streaming", sinks=2)
    st = eng.new_store(kv)
    eng.prefill(IDS[:20], st)
    st.begin_journal(3)
    eng.step(IDS[20], st)
    st.seq[0][0, 5] = 10 ** 6          # a write no journal hook saw, during the first journaled token
    eng.step(IDS[21], st)
    eng.step(IDS[22], st)
    st.rollback(1)                     # undoes the second and third tokens: their writes were all saved
    with pytest.raises(RuntimeError, match=r"layer 0 head 0 slot 5 was written without being journaled"):
        st.rollback(0)
    st.commit()
