"""Known answers per eviction policy on small hand-built stores: which slot goes given these scores,
keys, codes or histories (ties included), and the staged-eviction rule (Algorithm 1) step by step.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.eviction import keep_after
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.kv_store import KVStore
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.reference_policies import staged_keep

HD = 4


def _spec(n_head=2, n_kv=1, n_layer=1):
    return ModelSpec(arch="llama", n_vocab=16, n_embd=n_head * HD, n_layer=n_layer, n_head=n_head, n_head_kv=n_kv,
                     head_dim=HD, n_ff=8, n_ctx=512)


def _fill(store, n, keys=None):
    """Write tokens 0..n-1 into layer 0 (no eviction yet); key of token t = keys[t] (HD,) or t."""
    nkv = store.spec.n_head_kv
    for t in range(n):
        k = np.zeros((nkv, HD), np.float32) + (t if keys is None else np.asarray(keys[t], np.float32))
        store.write(0, k, np.zeros((nkv, HD), np.float32), t, np.zeros((store.spec.n_head, HD), np.float32))
        store.policy_impl.on_insert(store, 0, k, None)
        store.n_seen += 1


def _evicted_by_next_write(store, q=None):
    """Sequence indices that leave layer 0 when the next token arrives."""
    before = set(store.seq[0][0, : store.count[0][0]].tolist())
    nkv, nh = store.spec.n_head_kv, store.spec.n_head
    q = np.zeros((nh, HD), np.float32) if q is None else q
    k = np.zeros((nkv, HD), np.float32)
    store.write(0, k, k, store.n_seen, q)
    store.n_seen += 1
    after = set(store.seq[0][0, : store.count[0][0]].tolist())
    return sorted(before - after)


def _scored(policy, scores, **kw):
    st = KVStore(_spec(), KVConfig(capacity=len(scores), policy=policy, **kw))
    _fill(st, len(scores))
    st.score[0][0, : len(scores)] = scores
    return st


def test_h2o_lowest_accumulated_mass_ties_to_older():
    st = _scored("h2o", [9.0, 1.0, 0.5, 0.5, 7.0, 3.0], sinks=1, recent=1)
    assert _evicted_by_next_write(st) == [2]                     # tie 0.5/0.5 -> older token 2
    # the hole took the last slot's token; nothing shifted
    assert st.seq[0][0, :6].tolist() == [0, 1, 5, 3, 4, 6]
    assert st.rank[0][0, :6].tolist() == [0, 1, 4, 2, 3, 5]


def test_h2o_protects_sinks_and_recent():
    st = _scored("h2o", [0.0, 5.0, 6.0, 7.0, 0.1, 0.0], sinks=1, recent=2)
    assert _evicted_by_next_write(st) == [1]                     # 0 is a sink, 4 and 5 are recent


def test_h2o_accumulates_mass_from_attention():
    st = KVStore(_spec(), KVConfig(capacity=4, policy="h2o", sinks=0, recent=0))
    _fill(st, 3)
    mass = np.array([[0.5, 1.0, 0.5, 0.0]], np.float32)
    st.policy_impl.observe(st, 0, mass, 2)
    st.policy_impl.observe(st, 0, mass, 2)
    assert st.score[0][0, :3].tolist() == [1.0, 2.0, 1.0]


def test_tova_one_victim_for_all_heads():
    st = KVStore(_spec(n_head=4, n_kv=2), KVConfig(capacity=4, policy="tova", sinks=0))
    _fill(st, 4)
    mass = np.array([[0.9, 0.1, 0.5, 0.5], [0.9, 0.3, 0.1, 0.7]], np.float32)   # per kv head, group-summed
    st.policy_impl.observe(st, 0, mass, 3)
    np.testing.assert_allclose(st.score[0][:, :4], [[0.45, 0.1, 0.15, 0.3]] * 2, rtol=1e-6)
    assert _evicted_by_next_write(st) == [1]
    assert st.seq[0][0].tolist() == st.seq[0][1].tolist()          # the heads stay aligned


def test_scissorhands_most_unimportant_steps_goes():
    st = KVStore(_spec(), KVConfig(capacity=5, policy="scissorhands", sinks=0, recent=1, history=4))
    _fill(st, 5)
    # group of 2 query heads; 1/n = 0.2: a token is unimportant when its mass / 2 < 0.2
    for mass in ([0.1, 0.9, 0.2, 0.6, 0.2], [0.1, 0.9, 0.9, 0.1, 0.0], [0.5, 0.1, 0.1, 0.1, 0.2]):
        st.policy_impl.observe(st, 0, np.array([mass], np.float32), 4)
    # bits, oldest step first: t0 110 -> 2 set, t1 001 -> 1, t2 101 -> 2, t3 011 -> 2, t4 (recent)
    assert [bin(int(a)).count("1") for a in st.aux[0][0, :5]] == [2, 1, 2, 2, 3]
    assert _evicted_by_next_write(st) == [0]                       # ties among 2s -> oldest
    st2 = KVStore(_spec(), KVConfig(capacity=3, policy="scissorhands", sinks=0, recent=0, history=2))
    _fill(st2, 3)
    for _ in range(5):                                             # history window of 2 steps caps the count
        st2.policy_impl.observe(st2, 0, np.array([[0.0, 1.0, 0.0]], np.float32), 2)
    assert st2.aux[0][0, :3].tolist() == [3, 0, 3]


def test_knorm_largest_key_norm_goes():
    keys = [[1, 0, 0, 0], [3, 4, 0, 0], [0, 0, 0, 2], [0, -5, 0, 0], [1, 1, 1, 1]]   # norms 1 5 2 5 2
    st = KVStore(_spec(), KVConfig(capacity=5, policy="knorm", sinks=0))
    _fill(st, 5, keys)
    assert st.score[0][0, :5].tolist() == [0.0, 594.0, 256.0, 594.0, 256.0]   # 256 log2(norm), rounded
    assert _evicted_by_next_write(st) == [1]                       # tie 5/5 -> older


def test_lsh_farthest_code_goes():
    st = KVStore(_spec(), KVConfig(capacity=4, policy="lsh", sinks=0, recent=0, lsh_bits=4))
    st.policy_impl.proj[0] = np.eye(4, dtype=np.float32)          # code bit i = sign of dim i
    keys = [[1, 1, 1, 1], [-1, -1, -1, -1], [1, -1, 1, 1], [-1, -1, 1, 1]]
    _fill(st, 4, keys)
    assert st.aux[0][0, :4].tolist() == [0b1111, 0, 0b1101, 0b1100]
    q = np.array([[1, 1, 1, 1], [1, 1, -1, 1]], np.float32)      # codes 1111, 1011 (group of 2)
    # Hamming sums: t0 0+1=1, t1 4+3=7, t2 1+2=3, t3 2+3=5
    assert _evicted_by_next_write(st, q) == [1]
    assert np.all(st.aux[0][0, :4] >= 0)


def test_random_is_seeded_and_uniform():
    def victims(seed):
        out = []
        for trial in range(300):
            st = KVStore(_spec(), KVConfig(capacity=6, policy="random", sinks=1, seed=seed))
            _fill(st, 6)
            st.n_seen = 6 + trial                                  # a different draw per trial
            out += _evicted_by_next_write(st)
        return out

    a = victims(0)
    assert a == victims(0) and a != victims(1)
    counts = np.bincount(a, minlength=6)
    assert counts[0] == 0                                          # the sink
    assert counts[1:].min() > 30 and counts[1:].max() < 90         # ~60 each


def test_snapkv_pooled_window_scores():
    st = KVStore(_spec(), KVConfig(capacity=7, policy="snapkv", sinks=1, recent=1, window=2, pool=3))
    _fill(st, 7)
    st.policy_impl.observe(st, 0, np.array([[0, 0.1, 0, 0, 0.4, 0, 0]], np.float32), 5)
    st.policy_impl.observe(st, 0, np.array([[0, 0.1, 0, 0, 0.1, 0, 0]], np.float32), 6)
    # window sums [0 .2 0 0 .5 0 0]; pooled over 3: [.2 .2 .2 .5 .5 .5 0]; unprotected 1..5 -> lowest .2, oldest 1
    assert _evicted_by_next_write(st) == [1]
    st.policy_impl.observe(st, 0, np.zeros((1, 7), np.float32), 7)   # column 7 % 2 = 1 replaced: only step 6 left
    sums = dict(zip(st.seq[0][0, :7].tolist(), st.hist[0][0, :, :7].sum(axis=0).tolist()))
    assert sums[4] == pytest.approx(0.1) and sum(sums.values()) == pytest.approx(0.1)


@pytest.mark.parametrize("policy", ["snapkv", "rkv", "adakv"])
def test_window_totals_stay_exact_over_a_long_stream(policy):
    """The fixed-point window totals that observe moves by (new entry - replaced entry) equal the
    whole window re-summed (snapkv.window_totals) and the reference engine's definition, after 3,000
    steps of evictions and masses spanning zeros, tiny values and ones: no drift, no residue."""
    from ringllm.runtime.policies.snapkv import window_totals
    from ringllm.runtime.reference_policies import RefSnapKV
    st = KVStore(_spec(n_head=4, n_kv=2), KVConfig(capacity=24, policy=policy, sinks=2, window=5))
    rng = np.random.default_rng(3)
    z = np.zeros((2, HD), np.float32)
    for t in range(3000):
        st.write(0, z + rng.standard_normal((2, HD)).astype(np.float32), z, t, np.zeros((4, HD), np.float32))
        st.policy_impl.on_insert(st, 0, z, None)
        st.n_seen += 1
        mass = rng.choice([0.0, 1e-30, 1e-16, 3e-15, 0.25, 1.0, 2.0], size=(2, st.aux[0].shape[1]))
        st.policy_impl.observe(st, 0, (mass * rng.random(mass.shape)).astype(np.float32), t)
    again = np.zeros_like(st.aux[0])
    window_totals(again, st.hist[0], st.count[0])
    for h in range(2):
        n = st.count[0][h]
        assert st.aux[0][h, :n].tolist() == again[h, :n].tolist()
        want = RefSnapKV.window_total(st.hist[0][h, :, :n].T)
        assert (st.aux[0][h, :n].astype(np.float64) / 2.0 ** 48).tolist() == want.tolist()
    held = np.concatenate([st.aux[0][h, :st.count[0][h]] for h in range(2)])
    assert (held == 0).any() and (held > 0).any()        # totals of only tiny masses are exactly 0


@pytest.mark.parametrize("update", ["inplace", "shift"])
def test_rkv_key_sum_stays_exact_over_a_long_stream(update):
    """R-KV's sum of unit keys, moved by the write kernel as keys leave and enter (runtime/key_sum.py),
    equals the sum rebuilt from the held keys bit for bit after 2,000 staged steps (several victims
    at once, zero keys, huge and tiny ones), is within n 2^-41 per component of the float sum of
    the unit keys, and survives a journal rollback, replace_many and a state saved without it."""
    from ringllm.runtime.key_sum import KEY_SUM_FIXED, key_sums
    kv = KVConfig(capacity=24, policy="rkv", sinks=2, window=4, lazy=3, slack=2, max_drop=3, update=update)
    st = KVStore(_spec(n_head=4, n_kv=2), kv)
    rng = np.random.default_rng(5)
    z = np.zeros((2, HD), np.float32)

    def feed(t):
        k = (rng.standard_normal((2, HD)) * rng.choice([0.0, 1e-20, 1.0, 3e4])).astype(np.float32)
        st.write(0, k, z, t, np.zeros((4, HD), np.float32))
        st.n_seen += 1
        st.policy_impl.observe(st, 0, rng.random((2, st.aux[0].shape[1])).astype(np.float32), t)

    def check():
        again, inv = np.zeros_like(st.ksum[0]), st.score[0].copy()
        key_sums(again, st.k[0], st.koff[0], st.seq[0], inv, st.count[0])
        assert st.ksum[0].tolist() == again.tolist()
        for h in range(2):
            n = st.count[0][h]
            assert st.score[0][h, :n].tolist() == inv[h, :n].tolist()
            k = st.k[0][h, :n].astype(np.float64)
            unit = k / np.maximum(np.linalg.norm(k, axis=1, keepdims=True), 1e-30)
            assert np.abs(st.ksum[0][h] / KEY_SUM_FIXED - unit.sum(0)).max() <= n * 2.0 ** -41

    for t in range(2000):
        feed(t)
    assert st.evicted[0].min() > 1900
    check()
    if update == "inplace":
        before = st.ksum[0].copy()
        st.begin_journal(5)
        for t in range(2000, 2005):
            feed(t)
        assert st.ksum[0].tolist() != before.tolist()
        st.rollback(0)
        assert st.ksum[0].tolist() == before.tolist()
        st.commit()
        slots = np.array([[5], [7]], np.int64)
        st.replace_many(0, slots, rng.standard_normal((1, 2, HD)), np.zeros((1, 2, HD)), [st.n_seen])
        st.n_seen += 1
        check()
    state = st.state()
    old = {**state, "arrays": {n: a for n, a in state["arrays"].items() if not n.startswith("ksum.")}}
    for saved in (state, old):
        back = KVStore.restore(_spec(n_head=4, n_kv=2), saved)
        assert back.ksum[0].tolist() == st.ksum[0].tolist() and back.score[0].tolist() == st.score[0].tolist()


def _tie_prone_keys(rng, mode, n):
    """Raw keys built to tie on grid `mode`: many equal, one float step or one grid cell apart, zeros."""
    cell = 2.0 ** (1 / 4096) if mode == "log" else 1 / 4096
    steps = rng.integers(0, 4, n)
    if mode == "log":
        base = rng.choice([0.0, 1e-31, 1e-6, 0.3, 1.0])
        return base * cell ** (steps * rng.choice([0.5, 1.0])) * (1 + rng.integers(0, 3, n) * 1e-16)
    return rng.choice([-0.5, 0.0, 0.25]) + steps * cell * rng.choice([0.5, 1.0]) + rng.integers(0, 3, n) * 1e-17


@pytest.mark.parametrize("mode", ["log", "abs"])
def test_grid_aware_choice_equals_gridding_every_key(mode):
    """eviction.choose_one (one victim, grid computed near the minimum only) picks what
    choose_victims picks on fully gridded keys, on keys built to tie."""
    from ringllm.runtime.eviction import GRID_ABS, GRID_LOG, choose_one, choose_victims, grid_keys
    grid = GRID_LOG if mode == "log" else GRID_ABS
    rng = np.random.default_rng(7)
    for trial in range(300):
        n = int(rng.integers(3, 40))
        raw = _tie_prone_keys(rng, mode, n).reshape(1, n)
        seq = rng.permutation(1000)[:n].reshape(1, n).astype(np.int64)
        rank = np.argsort(np.argsort(seq[0])).reshape(1, n).astype(np.int64)
        count = np.array([n], np.int64)
        sinks, recent = int(rng.integers(0, 2)), int(rng.integers(0, 2))
        gridded = raw.copy()
        grid_keys(gridded, count, grid)
        want = np.zeros(n + 1, np.int64)
        got_n = choose_victims(gridded[0], seq[0], rank[0], n, 1, sinks, recent, want)
        assert choose_one(raw[0], seq[0], rank[0], n, sinks, recent, grid) == (want[0] if got_n else -1), trial


def test_choose_victims_equals_sorting_by_key_then_seq():
    """eviction.choose_victims (one insertion pass up to 8 victims, a sort beyond) takes the n_drop
    lowest (key, seq) among unprotected slots, in that order, on keys with many ties."""
    from ringllm.runtime.eviction import choose_victims
    rng = np.random.default_rng(13)
    for trial in range(400):
        n = int(rng.integers(1, 40))
        key = rng.integers(0, 4, n).astype(np.float64) * rng.choice([1.0, 0.5])
        seq = rng.permutation(1000)[:n].astype(np.int64)
        rank = np.argsort(np.argsort(seq)).astype(np.int64)
        sinks, recent, k = int(rng.integers(0, 3)), int(rng.integers(0, 3)), int(rng.integers(1, 12))
        want = sorted((key[j], seq[j], j) for j in range(n) if sinks <= rank[j] < n - recent)[:k]
        out = np.full(k, -1, np.int64)
        got = choose_victims(key, seq, rank, n, k, sinks, recent, out)
        assert got == len(want) and out[:got].tolist() == [j for _, _, j in want], trial


def test_choose_victims_many_equals_numpy_stable_sorts():
    """choose_victims beyond 8 victims (staged eviction: its own merge sort) gives NumPy's order: a
    stable argsort by key after one by seq, so NaN keys after every number, -0.0 tied with 0.0 and
    ties to the older token; up to 300 slots (several merge passes), as many victims as slots."""
    from ringllm.runtime.eviction import choose_victims
    rng = np.random.default_rng(17)
    for trial in range(300):
        n = int(rng.integers(9, 300))
        key = rng.integers(-3, 4, n).astype(np.float64) * rng.choice([1.0, 0.25])
        key[rng.random(n) < 0.1] = np.nan
        key[rng.random(n) < 0.1] = -0.0
        key[rng.random(n) < 0.05] = rng.choice([np.inf, -np.inf])
        seq = rng.permutation(5000)[:n].astype(np.int64)
        rank = np.argsort(np.argsort(seq)).astype(np.int64)
        sinks, recent, k = int(rng.integers(0, 4)), int(rng.integers(0, 4)), int(rng.integers(9, n + 2))
        cand = np.array([j for j in range(n) if sinks <= rank[j] < n - recent], np.int64)
        cand = cand[np.argsort(seq[cand], kind="mergesort")]
        want = cand[np.argsort(key[cand], kind="mergesort")][:k]
        out = np.full(k, -1, np.int64)
        got = choose_victims(key, seq, rank, n, k, sinks, recent, out)
        assert got == len(want) and out[:got].tolist() == want.tolist(), trial


def test_adakv_select_equals_sorting_every_gridded_key():
    """adakv.select_drops (pooled keys in rank order, grid near each head's minimum, per-head
    insertion lists, merge) against a brute force: snapkv.pooled_keys per slot, every key gridded,
    the layer's candidates sorted by (grid key, seq, head), taken in order while the head stays
    above its floor; the victims' slots it leaves in key, per head in that order. Keys built to tie,
    heads of different lengths, pool 1 and 3, none to 14 victims (as staged eviction drops)."""
    from ringllm.runtime.policies.adakv import select_drops
    from ringllm.runtime.eviction import GRID_LOG, grid_value
    from ringllm.runtime.policies.snapkv import pooled_keys
    rng = np.random.default_rng(11)
    P, n_kv = 48, 3
    for trial in range(300):
        count = rng.integers(5, P, n_kv).astype(np.int64)
        tot = np.zeros((n_kv, P), np.int64)           # window totals in fixed point (snapkv.record_window)
        for h in range(n_kv):
            tot[h, :count[h]] = np.floor(_tie_prone_keys(rng, "log", int(count[h])) * 2.0 ** 48 + 0.5)
        seq = np.stack([rng.permutation(1000)[:P] for _ in range(n_kv)]).astype(np.int64)
        rank = np.zeros((n_kv, P), np.int64)
        for h in range(n_kv):
            rank[h, :count[h]] = np.argsort(np.argsort(seq[h, :count[h]]))
        pool, sinks, recent = int(rng.choice([1, 3])), int(rng.integers(0, 3)), int(rng.integers(0, 3))
        floor = int(rng.integers(0, 12))
        held = int(count.sum()) + n_kv              # the new token of each head included
        cap = (held - int(rng.integers(-2, 13))) // n_kv
        n_total = max(0, held - cap * n_kv)          # plain per-step eviction on the layer total
        by_rank = np.zeros(2 * P)
        pooled = np.zeros((n_kv, P))
        pooled_keys(pooled, tot, rank, count, pool, by_rank)
        cands = sorted((grid_value(pooled[h, j], GRID_LOG), seq[h, j], h, j) for h in range(n_kv)
                       for j in range(count[h]) if sinks <= rank[h, j] < count[h] - recent)
        want = [[] for _ in range(n_kv)]
        for g, s, h, j in cands:
            if sum(map(len, want)) == n_total:
                break
            if count[h] + 1 - len(want[h]) > floor:
                want[h].append(j)
        key = np.zeros((n_kv, P))
        drop_h = np.zeros(n_kv, np.int64)
        got = select_drops(key, tot, seq, rank, count, pool, by_rank, cap, 0, 0, 0, sinks, recent, floor, GRID_LOG,
                           np.zeros(P), np.zeros((n_kv, P), np.int64), np.zeros(n_kv, np.int64), drop_h)
        assert got == sum(map(len, want)) and drop_h.tolist() == [len(w) for w in want], trial
        for h in range(n_kv):            # the victims' slots, lowest key first (GRID_GIVEN)
            assert key[h, :drop_h[h]].astype(np.int64).tolist() == want[h], (trial, h)


def _adakv_evicts(masses, ada_floor=0.0):
    """Ada-KV on a hand-built layer of len(masses) kv heads, 6 tokens each, capacity 6 per head
    (sinks 1, recent 1, window 1, pool 1: a slot's key is the mass it got): the sequence indices
    each head loses when the next token enters, and the heads' counts after."""
    n_kv = len(masses)
    st = KVStore(_spec(n_head=n_kv, n_kv=n_kv), KVConfig(capacity=6, policy="adakv", sinks=1, recent=1, window=1,
                                                         pool=1, ada_floor=ada_floor))
    _fill(st, 6)
    st.policy_impl.observe(st, 0, np.array(masses, np.float32), 5)
    before = [set(st.seq[0][h, :6].tolist()) for h in range(n_kv)]
    k = np.zeros((n_kv, HD), np.float32)
    st.write(0, k, k, 6, np.zeros((n_kv, HD), np.float32))
    after = [set(st.seq[0][h, : st.count[0][h]].tolist()) for h in range(n_kv)]
    return [sorted(b - a) for b, a in zip(before, after)], st.count[0].tolist()


def test_adakv_one_selection_over_all_heads():
    # unprotected ranks 1..4; the two lowest masses of the layer are both in head 1: it gives two, head 0 none
    gone, counts = _adakv_evicts([[.9, .8, .7, .6, .5, .4], [.9, .1, .2, .3, .05, .4]])
    assert gone == [[], [1, 4]] and counts == [7, 5]
    # ada_floor 1.0: every head keeps >= 6 (its even share), so head 1 gives one and head 0 its lowest
    gone, counts = _adakv_evicts([[.9, .8, .7, .6, .5, .4], [.9, .1, .2, .3, .05, .4]], ada_floor=1.0)
    assert gone == [[4], [4]] and counts == [6, 6]


def test_adakv_ties_go_to_the_older_token_then_the_lower_head():
    # three heads, three victims: .1 (head 0, token 3) first; then four .3s: token 1 before token 2,
    # and among the token-1s head 0 before head 1 before head 2 -> head 2 keeps its token 1
    m = [[.9, .3, .3, .1, .8, .9], [.9, .3, .3, .8, .8, .9], [.9, .3, .3, .8, .8, .9]]
    gone, counts = _adakv_evicts(m)
    assert gone == [[1, 3], [1], []] and counts == [5, 6, 7]


def test_rkv_redundant_unimportant_key_goes():
    keys = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 1, 0.01, 0], [0, 0, 0, 1]]
    st = KVStore(_spec(), KVConfig(capacity=6, policy="rkv", sinks=1, recent=1, window=2, rkv_lambda=0.5))
    _fill(st, 6, keys)
    st.policy_impl.observe(st, 0, np.array([[0.2, 0.2, 0.2, 0.2, 0.0, 0.2]], np.float32), 5)
    # importance 1 for all but token 4; tokens 1, 2, 4 repeat one direction (redundancy ~2/5), 3 is unique (0):
    # Z = .5 I - .5 R -> token 4 (unimportant and redundant) lowest, then the twins 1, 2
    assert _evicted_by_next_write(st) == [4]
    st2 = KVStore(_spec(), KVConfig(capacity=6, policy="rkv", sinks=1, recent=1, window=2, rkv_lambda=0.5))
    keys[4] = [0, 1, 0, 0]                                 # three exact twins
    _fill(st2, 6, keys)
    st2.policy_impl.observe(st2, 0, np.array([[0.2] * 6], np.float32), 5)
    assert _evicted_by_next_write(st2) == [1]              # equal importance: the oldest of the redundant ones


def test_gvote_budget_from_nucleus_and_votes_from_history():
    spec = _spec()
    st = KVStore(spec, KVConfig(capacity=6, policy="gvote", sinks=0, recent=0, window=4, gvote_p=0.9,
                                gvote_samples=4))
    keys = np.eye(HD, dtype=np.float32)[[0, 1, 2, 3, 0, 1]]              # token 3 alone points along e3
    q_hist = np.zeros((spec.n_head, HD), np.float32)
    q_hist[:, 3] = 40.0                                                   # every past query looked at e3
    for t in range(6):
        k = keys[t][None]
        st.write(0, k, k, t, q_hist)
        st.policy_impl.on_insert(st, 0, k, q_hist)
        st.n_seen += 1
    q_now = np.zeros((spec.n_head, HD), np.float32)
    q_now[:, 2] = 40.0                                                    # the current query: token 2 only
    assert _evicted_by_next_write(st, q_now) == [0, 1, 2, 4, 5]          # budget 1: the voted token 3 stays
    assert sorted(st.seq[0][0, : st.count[0][0]].tolist()) == [3, 6]
    assert st.stats()["gvote_budget_last"] == [1]


def test_gaussian_draws_are_standard_normal_and_shared():
    from ringllm.runtime.policies.gvote import gaussian_draws
    from ringllm.runtime.reference_policies import gaussian_draws as ref_draws

    z = np.zeros((4000, 64))
    gaussian_draws(z, 3, 1, 2, 77)
    assert abs(z.mean()) < 0.01 and abs(z.std() - 1) < 0.01
    np.testing.assert_allclose(z[:8], ref_draws(3, 1, 2, 77, 8, 64), rtol=1e-12)


def test_pyramidkv_budgets_fall_with_depth_and_average_capacity():
    st = KVStore(_spec(n_layer=5), KVConfig(capacity=100, policy="pyramidkv", sinks=4, window=8, pyramid_beta=4))
    assert st.layer_capacity == [175, 138, 100, 62, 25]
    assert sum(st.layer_capacity) == 500


# ---------------------------------------------------------------------------------------------
# Staged eviction (Algorithm 1)
# ---------------------------------------------------------------------------------------------


def test_seed_worked_example():
    # (S, W, R, sigma, delta) = (4, 2044, 32, 16, 32): C = S + W = 2048, H = 2064
    assert keep_after(2090, 2048, 32, 16, 32) == 2058 == staged_keep(2090, 2048, 32, 16, 32)
    assert keep_after(2079, 2048, 32, 16, 32) == 2079              # L - C = 31 < R: lazy, nothing dropped
    assert keep_after(2080, 2048, 32, 16, 32) == 2048              # max(2048, 2048) capped by H
    assert keep_after(2200, 2048, 32, 16, 32) == 2064              # slack caps what is kept at H
    assert keep_after(2090, 2048, 32, 16, 0) == 2048               # delta = 0: back to C
    assert keep_after(2049, 2048, 0, 0, 0) == 2048                 # all zero: plain per-step eviction


@pytest.mark.parametrize("policy", ["streaming", "h2o", "knorm"])
def test_staged_trace_step_by_step(policy):
    # C = 8, R = 3, sigma = 2, delta = 2: hold until L = 11, keep min(max(11 - 2, 8), 10) = 9, ...
    kv = KVConfig(capacity=8, policy=policy, sinks=1, recent=1, lazy=3, slack=2, max_drop=2)
    st = KVStore(_spec(), kv)
    lengths, dropped = [], []
    for t in range(16):
        before = int(st.evicted[0][0])
        _fill_one(st, t)
        lengths.append(int(st.count[0][0]))
        dropped.append(int(st.evicted[0][0]) - before)
    assert lengths == [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 9, 10, 9, 10, 9, 10]
    assert dropped == [0] * 10 + [2, 0, 2, 0, 2, 0]
    assert max(lengths) <= st.layer_physical[0]
    if policy == "streaming":                                      # oldest non-sinks went, sink 0 stayed
        assert sorted(st.seq[0][0, :10].tolist()) == [0, 7, 8, 9, 10, 11, 12, 13, 14, 15]


def _fill_one(st, t):
    k = np.full((1, HD), float(t % 5), np.float32)
    st.write(0, k, k, t, np.zeros((2, HD), np.float32))
    st.policy_impl.on_insert(st, 0, k, None)
    st.n_seen += 1


def test_staged_held_length_bound():
    kv = KVConfig(capacity=16, policy="h2o", sinks=2, recent=2, lazy=5, slack=3, max_drop=4)
    st = KVStore(_spec(), kv)
    top = 0
    for t in range(200):
        _fill_one(st, t)
        top = max(top, int(st.count[0][0]))
    assert top == 16 + 5 - 1 <= kv.physical_capacity               # C + R - 1: pruning at L = C + R


# ---------------------------------------------------------------------------------------------
# KVConfig validation
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw,match", [
    (dict(capacity=64, policy="h3o"), "valid: full, streaming, h2o"),
    (dict(capacity=64, policy="h2o", sinks=4, recent=60), "sinks \\+ recent"),
    (dict(capacity=4, policy="streaming", sinks=4), "at least sinks \\+ 1"),
    (dict(capacity=64, policy="gvote", gvote_p=0.0), "gvote_p must be in \\(0, 1\\]"),
    (dict(capacity=64, policy="gvote", gvote_p=1.5), "gvote_p"),
    (dict(capacity=64, policy="lsh", lsh_bits=0), "lsh_bits must be in 1..64"),
    (dict(capacity=64, policy="lsh", lsh_bits=65), "lsh_bits"),
    (dict(capacity=64, policy="streaming", positions="absolute"), "valid: reindexed, original"),
    (dict(policy="streaming"), "needs a capacity"),
    (dict(capacity=64, policy="full", lazy=8), "needs an eviction policy"),
    (dict(capacity=64, policy="full", update="shift"), "needs an eviction policy"),
    (dict(capacity=64, policy="snapkv", pool=4), "odd"),
    (dict(capacity=64.5, policy="streaming"), "integer"),
])
def test_kvconfig_errors_name_the_problem(kw, match):
    with pytest.raises(ConfigError, match=match):
        KVConfig(**kw)
