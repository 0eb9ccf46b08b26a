"""The in-place KV store and the fused-RoPE attention kernel vs the reference engine's ordered cache.

Both consume the same random stream of (q, k, v); the store never shifts, the reference shifts
and recomputes RoPE for every key at every step. Tolerance: max abs 1e-5 on attention outputs.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.runtime.attention import attend
from ringllm.runtime.stored_attention import attend_stored, stored_work
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_store import KVStore
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.reference import ReferenceCache, rope, softmax
from ringllm.runtime.rope import RopeTable
from ringllm.runtime.rope_kernels import rope_rows_at


def _spec(window=(0, 0), n_head=4, n_kv=2, hd=8, rotary_dim=0):
    return ModelSpec(arch="llama", n_vocab=16, n_embd=n_head * hd, n_layer=len(window), n_head=n_head,
                     n_head_kv=n_kv, head_dim=hd, n_ff=16, n_ctx=512, window=window, rotary_dim=rotary_dim)


def _ref_attention(cache: ReferenceCache, il: int, q: np.ndarray, spec: ModelSpec) -> np.ndarray:
    lc = cache.layers[il]
    pos = cache.key_positions(il)
    keys = rope(lc.k, pos, spec.rotary_dim, spec.rope_base[il], 1.0)
    qr = rope(q[:, None, :], pos[-1:], spec.rotary_dim, spec.rope_base[il], 1.0)[:, 0]
    group = spec.n_head // spec.n_head_kv
    return np.stack([softmax(keys[h // group] @ qr[h] * spec.attn_scale) @ lc.v[h // group]
                     for h in range(spec.n_head)])


@pytest.mark.parametrize("rope", ["fused", "stored"])
@pytest.mark.parametrize("update", ["inplace", "shift"])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
@pytest.mark.parametrize("capacity,sinks,rotary_dim", [(6, 2, 0), (5, 0, 0), (7, 4, 4), (40, 4, 0)])
def test_store_and_attention_match_reference(positions, capacity, sinks, rotary_dim, update, rope):
    spec = _spec(rotary_dim=rotary_dim)
    store = KVStore(spec, capacity=capacity, policy="streaming", sinks=sinks, positions=positions, update=update)
    ref = ReferenceCache(spec, capacity=capacity, policy="streaming", sinks=sinks, positions=positions)
    rng = np.random.default_rng(0)
    table = RopeTable(spec.rotary_dim, spec.rope_base[0], 1.0, n=4)   # small: forces growth
    nh, nkv, hd = spec.n_head, spec.n_head_kv, spec.head_dim
    scores, krot, qrot = np.zeros((nh, capacity), np.float32), np.zeros(hd, np.float32), np.zeros((nh, hd), np.float32)
    mass = np.zeros((nkv, capacity), np.float32)
    out = np.zeros((nh, hd), np.float32)
    inv_freq, ktmp = table.inv_freq, np.zeros(hd + spec.rotary_dim, np.float32)
    for t in range(30):
        q = rng.standard_normal((nh, hd)).astype(np.float32)
        k = rng.standard_normal((nkv, hd)).astype(np.float32)
        v = rng.standard_normal((nkv, hd)).astype(np.float32)
        ref.insert(0, k, v, t)
        if rope == "stored":           # keys rotated once, at write, by sequence index
            k = k.copy()
            rope_rows_at(k, t, inv_freq, 1.0, spec.rotary_dim, ktmp)
        store.write(0, k, v, t)
        qp = store.query_position(0, t)
        if rope == "stored":
            attend_stored(out, q, store.k[0], store.v[0], store.pos[0], store.seq[0], store.count[0], qp, inv_freq,
                          1.0, spec.rotary_dim, np.float32(spec.attn_scale), np.float32(0.0), scores,
                          stored_work(nkv, nh, hd, capacity), mass)
        else:
            table.ensure(max(qp, int(store.pos[0].max())) + 1)
            attend(out, q, store.k[0], store.koff[0], store.seq[0], store.v[0], store.pos[0], store.count[0],
                   np.full(nkv, qp), table.cos, table.sin,
                   spec.rotary_dim, np.float32(spec.attn_scale), np.float32(0.0), scores, krot, qrot, mass)
        np.testing.assert_allclose(out, _ref_attention(ref, 0, q, spec), atol=1e-5, err_msg=f"step {t}")
        # the same token set, slot by slot, with the same logical positions
        for h in range(nkv):
            n = store.count[0][h]
            order = np.argsort(store.seq[0][h, :n])
            np.testing.assert_array_equal(store.seq[0][h, :n][order], ref.layers[0].seq[h])
            np.testing.assert_array_equal(store.pos[0][h, :n][order], ref.key_positions(0))
        # attention mass per slot = sum over the group's heads of their softmax weights
        assert np.allclose(mass[:, : store.count[0][0]].sum(axis=1), nh // nkv, atol=1e-5)


def test_ring_walks_non_sink_slots_in_place():
    spec = _spec()
    store = KVStore(spec, capacity=5, policy="streaming", sinks=2)
    kv = np.zeros((2, 8), np.float32)
    seen_slots = []
    for t in range(12):
        before = store.seq[0][0].copy()
        store.write(0, kv + t, kv, t)
        changed = np.flatnonzero(store.seq[0][0] != before)
        assert changed.size == 1                    # exactly one slot written, nothing shifted
        seen_slots.append(int(changed[0]))
    assert seen_slots == [0, 1, 2, 3, 4, 2, 3, 4, 2, 3, 4, 2]
    assert store.seq[0][0].tolist() == [0, 1, 11, 9, 10]
    assert store.pos[0][0].tolist() == [0, 1, 4, 2, 3]
    assert store.k[0][0, :, 0].tolist() == [0, 1, 11, 9, 10]
    assert store.stats()["evicted_total"] == 2 * 7


def test_sliding_window_layers_get_their_window():
    store = KVStore(_spec(window=(3, 0)), capacity=6, policy="streaming", sinks=2)
    assert store.layer_capacity == [3, 6] and store.layer_sinks == [0, 2]


def test_bad_configs():
    spec = _spec()
    with pytest.raises(ConfigError, match="at least sinks \\+ 1"):
        KVStore(spec, capacity=4, policy="streaming", sinks=4)
    with pytest.raises(ConfigError, match="valid"):
        KVStore(spec, capacity=8, policy="h3o")
    with pytest.raises(ConfigError, match="context size"):
        KVStore(spec, capacity=10_000, policy="full")
    store = KVStore(spec, capacity=8, policy="full")
    with pytest.raises(ConfigError, match="exceed the model's context 8"):
        store.check_room(9)


def test_shift_mode_keeps_slots_ordered():
    store = KVStore(_spec(), capacity=5, policy="streaming", sinks=2, update="shift")
    kv = np.zeros((2, 8), np.float32)
    for t in range(12):
        store.write(0, kv + t, kv, t)
    assert store.seq[0][0].tolist() == [0, 1, 9, 10, 11]
    assert store.k[0][0, :, 0].tolist() == [0, 1, 9, 10, 11]
    assert store.pos[0][0].tolist() == [0, 1, 2, 3, 4]


def test_state_round_trip_and_slot_major_window_of_earlier_saves():
    """state() -> restore() gives the same arrays; a state saved before the window ring became
    window-major (hist (n_kv, P, w), no "hist_layout", window totals not in aux) restores to the
    same store: hist transposed, the fixed-point totals recomputed from it."""
    from ringllm.runtime.kv_config import KVConfig
    spec = _spec(window=(0, 0))
    st = KVStore(spec, KVConfig(capacity=12, policy="snapkv", sinks=1, window=3))
    rng = np.random.default_rng(5)
    z = np.zeros((2, 8), np.float32)
    for t in range(40):
        for il in range(2):
            st.write(il, z + rng.standard_normal((2, 8)).astype(np.float32), z, t, np.zeros((4, 8), np.float32))
            st.policy_impl.observe(st, il, rng.random((2, 12)).astype(np.float32), t)
        st.n_seen += 1
    state = st.state()
    again = KVStore.restore(spec, state)
    old = {"kv": state["kv"], "n_seen": state["n_seen"], "layer_rope_mode": None,
           "arrays": {n: (np.ascontiguousarray(np.swapaxes(a, 1, 2)) if n.startswith("hist.")
                          else np.zeros_like(a) if n.startswith("aux.") else a) for n, a in state["arrays"].items()}}
    earlier = KVStore.restore(spec, old)
    for name, a in state["arrays"].items():
        assert np.array_equal(again.state()["arrays"][name], a), name
        assert np.array_equal(earlier.state()["arrays"][name], a), name
    assert st.hist[0].shape == (2, 3, 12) and (st.aux[0][:, :st.count[0][0]] > 0).all()
