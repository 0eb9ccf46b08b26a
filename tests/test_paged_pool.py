"""The paged KV pool (runtime/paged_pool.py), its attention kernel and the engine's paged store.

The eviction/compaction seed's numbers reproduced by the real pool, exactly. Convention: a "slot
copy" moves one token (its K and V in every layer and kv head) from one (block, offset) to another;
a token that stays where it is costs nothing. With that convention the seed's toy (blocks of 4
slots: history T0-T19 in blocks 0-4, round T20-T23 in block 5; evict T2, T9, T13, T21) gives:
    order-preserving repack: every survivor after the first hole (T2's slot) moves one or more
        slots down: T3..T23 are 21 tokens, minus T9, T13, T21 = 18 copies; block 5 is freed.
    hole-filling: the block with fewest survivors (ties: the last) is evacuated: T20, T22, T23 go
        into the holes of T2, T9, T13 = 3 copies; block 5 is freed.
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.runtime.attention import attend
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.paged_attention import gather_slots, paged_attend
from ringllm.runtime.paged_pool import PagedKVPool
from ringllm.runtime.rope import RopeTable


def _filled(n_blocks, block_size, n_tokens, n_layer=1, n_kv=1, hd=1):
    """A pool with one sequence holding tokens 0..n_tokens-1 (K = token index, V = -token index)."""
    pool = PagedKVPool(n_blocks, block_size, n_layer, n_kv, hd)
    sid = pool.new_sequence()
    for t in range(n_tokens):
        pool.append(sid, float(t), -float(t), t)
    return pool, sid


def _contents(pool, sid):
    """{token: (K, V) of every layer/head/dim} of a sequence, read through its block table."""
    out = {}
    for blk in pool.block_table(sid):
        for o in range(pool.block_size):
            s = int(pool.seq[0, blk, o])
            if s >= 0:
                out[s] = (pool.k[:, blk, :, o, :].copy(), pool.v[:, blk, :, o, :].copy())
    return out


# ---------------------------------------------------------------------------------------------
# The seed's numbers
# ---------------------------------------------------------------------------------------------


def _toy():
    pool, sid = _filled(6, 4, 24)                     # T0..T23 fill 6 blocks of 4 slots exactly
    assert pool.gauges()["free_blocks"] == 0
    assert pool.evict(sid, [2, 9, 13, 21]) == 0       # no block empties: eviction alone frees nothing
    return pool, sid


def test_seed_toy_repack_18_copies():
    pool, sid = _toy()
    g = pool.compact_repack(sid)
    assert (g["blocks_freed"], g["slot_copies"], g["survivors"], g["blocks_after"]) == (1, 18, 20, 5)
    assert pool.gauges()["free_blocks"] == 1
    # order preserved: the table read slot by slot is the survivors in token order
    order = [int(s) for blk in pool.block_table(sid) for s in pool.seq[0, blk]]
    assert order == [t for t in range(24) if t not in (2, 9, 13, 21)]


def test_seed_toy_fill_3_copies():
    pool, sid = _toy()
    g = pool.compact_fill(sid)
    assert (g["blocks_freed"], g["slot_copies"], g["survivors"], g["blocks_after"]) == (1, 3, 20, 5)
    # the last block's survivors moved into the holes, every other token stayed in its slot
    layout = np.concatenate([pool.seq[0, blk] for blk in pool.block_table(sid)]).tolist()
    want = list(range(20))
    want[2], want[9], want[13] = 20, 22, 23
    assert layout == want


def test_seed_16000_tokens_every_10th_kept():
    pool, sid = _filled(1000, 16, 16000)
    assert pool.evict(sid, [t for t in range(16000) if t % 10]) == 0     # 90% evicted, 0 blocks free
    g0 = pool.gauges()
    assert (g0["free_blocks"], g0["tokens_evicted"], g0["live_tokens"]) == (0, 14400, 1600)
    assert g0["occupancy"] == pytest.approx(0.1)
    g = pool.compact_repack(sid)
    assert (g["blocks_freed"], g["blocks_after"], g["slot_copies"]) == (900, 100, 1599)
    g1 = pool.gauges()
    assert (g1["free_blocks"], g1["occupancy"]) == (900, 1.0)
    assert sorted(_contents(pool, sid)) == list(range(0, 16000, 10))


def test_seed_16000_tokens_fill_frees_900_too():
    pool, sid = _filled(1000, 16, 16000)
    pool.evict(sid, [t for t in range(16000) if t % 10])
    g = pool.compact_fill(sid)
    # blocks hold 1 or 2 survivors; the 100 blocks holding 2 are kept, the other 1,400 survivors move
    assert (g["blocks_freed"], g["blocks_after"], g["slot_copies"]) == (900, 100, 1400)


def test_seed_one_survivor_per_block():
    pool, sid = _filled(1000, 16, 16000)
    assert pool.evict(sid, [t for t in range(16000) if t % 16]) == 0
    g = pool.gauges()
    assert g["tokens_evicted"] / 16000 == 0.9375 and g["free_blocks"] == 0
    assert g["occupancy"] == pytest.approx(1 / 16)


# ---------------------------------------------------------------------------------------------
# Passes: safety and minimality on random layouts
# ---------------------------------------------------------------------------------------------


def _random_layout(rng, block_size=4, n_blocks=12):
    n_tokens = int(rng.integers(block_size, n_blocks * block_size + 1))
    pool, sid = _filled(n_blocks, block_size, n_tokens, n_layer=2, n_kv=2, hd=3)
    victims = np.flatnonzero(rng.random(n_tokens) < rng.uniform(0.1, 0.9))
    pool.evict(sid, victims)
    return pool, sid


@pytest.mark.parametrize("seed", range(20))
def test_repack_reads_every_survivor_before_its_slot_is_written(seed):
    pool, sid = _random_layout(np.random.default_rng(seed))
    before = _contents(pool, sid)
    unread = {(int(b), o) for b in pool.block_table(sid) for o in range(pool.block_size) if pool.seq[0, b, o] >= 0}
    trace = np.zeros((4096, 3), np.int64)
    g = pool.compact_repack(sid, trace=trace)
    for op, blk, off in trace[:2 * g["slot_copies"]]:
        if op == 0:
            unread.discard((int(blk), int(off)))
        else:
            assert (int(blk), int(off)) not in unread, "a survivor was overwritten before it was read"
    after = _contents(pool, sid)
    assert sorted(after) == sorted(before)
    for s, (k, v) in before.items():
        np.testing.assert_array_equal(after[s][0], k)
        np.testing.assert_array_equal(after[s][1], v)
    order = [int(s) for blk in pool.block_table(sid) for s in pool.seq[0, blk] if s >= 0]
    assert order == sorted(before) and g["blocks_after"] == -(-len(before) // pool.block_size)


@pytest.mark.parametrize("seed", range(20))
def test_fill_makes_the_fewest_copies(seed):
    pool, sid = _random_layout(np.random.default_rng(100 + seed))
    B = pool.block_size
    counts = sorted(int((pool.seq[0, b] >= 0).sum()) for b in pool.block_table(sid))
    n = sum(counts)
    m = -(-n // B)
    before = _contents(pool, sid)
    g = pool.compact_fill(sid)
    # any pass ending with m blocks must empty len(counts) - m blocks, moving all their survivors:
    # the least it can move is the survivors of the emptiest ones
    assert g["slot_copies"] == sum(counts[:len(counts) - m])
    assert g["blocks_after"] == m and g["blocks_freed"] == len(counts) - m
    after = _contents(pool, sid)
    assert sorted(after) == sorted(before)
    for s, (k, v) in before.items():
        np.testing.assert_array_equal(after[s][0], k)
        np.testing.assert_array_equal(after[s][1], v)


def test_appends_continue_after_passes_and_empty_blocks_free_at_once():
    pool, sid = _filled(8, 4, 12)
    assert pool.evict(sid, [4, 5, 6, 7]) == 1            # block 1 empties: freed without a pass
    assert pool.gauges()["free_blocks"] == 6 and len(pool.block_table(sid)) == 2
    pool.evict(sid, [1, 9])
    pool.compact_fill(sid)
    for t in range(12, 20):
        pool.append(sid, float(t), -float(t), t)
    assert sorted(_contents(pool, sid)) == [0, 2, 3, 8, 10, 11] + list(range(12, 20))
    for s, (k, v) in _contents(pool, sid).items():
        assert (k == s).all() and (v == -s).all()


# ---------------------------------------------------------------------------------------------
# Refcounts, fork, copy-on-write, errors
# ---------------------------------------------------------------------------------------------


def test_fork_shares_blocks_and_copies_on_write():
    pool, a = _filled(16, 4, 10)                       # blocks 0, 1 full, block 2 half
    b = pool.fork(a)
    np.testing.assert_array_equal(pool.block_table(a), pool.block_table(b))
    assert pool.ref[pool.block_table(a)].tolist() == [2, 2, 2]
    assert pool.gauges()["blocks_in_use"] == 3
    pool.append(b, 100.0, -100.0, 10)                  # writes the shared half block: b gets a copy
    ta, tb = pool.block_table(a), pool.block_table(b)
    assert ta[:2].tolist() == tb[:2].tolist() and ta[2] != tb[2]
    assert pool.ref[ta].tolist() == [2, 2, 1] and pool.ref[tb[2]] == 1 and pool.cow_blocks == 1
    pool.append(a, 50.0, -50.0, 10)                    # a's block is private now: no copy
    assert pool.cow_blocks == 1
    assert _contents(pool, a)[10][0].item() == 50.0 and _contents(pool, b)[10][0].item() == 100.0
    pool.evict(b, [1])                                 # a hole in a shared block: b copies block 0
    assert pool.cow_blocks == 2 and 1 in _contents(pool, a) and 1 not in _contents(pool, b)
    pool.compact_repack(b)                             # b's pass never touches a's blocks
    assert sorted(_contents(pool, a)) == list(range(11))
    assert all((k == s).all() for s, (k, _) in _contents(pool, a).items() if s < 10)
    assert pool.ref[pool.block_table(a)].tolist() == [1, 1, 1]   # the pass un-shared block 1 for b
    assert pool.free_sequence(b) == 3
    assert pool.free_sequence(a) == 3 and pool.gauges()["free_blocks"] == 16


def test_fill_drops_a_shared_block_without_touching_it():
    pool, a = _filled(16, 4, 12)
    b = pool.fork(a)
    pool.evict(b, [0, 1, 2, 9, 10])                    # b: blocks 0 and 2 copied (holes), block 1 shared
    g = pool.compact_fill(b)
    assert g["blocks_after"] == 2 and sorted(_contents(pool, a)) == list(range(12))
    assert sorted(_contents(pool, b)) == [3, 4, 5, 6, 7, 8, 11]


def test_errors():
    with pytest.raises(ConfigError, match="block_size"):
        PagedKVPool(4, 0)
    with pytest.raises(ConfigError, match="n_blocks"):
        PagedKVPool(0, 16)
    pool, sid = _filled(2, 4, 8)
    with pytest.raises(ConfigError, match="exhausted"):
        pool.append(sid, 0.0, 0.0, 8)
    with pytest.raises(ConfigError, match="unknown sequence"):
        pool.compact_repack(7)
    with pytest.raises(ConfigError, match="not held"):
        pool.evict(sid, [99])


# ---------------------------------------------------------------------------------------------
# Paged attention vs the dense kernel
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["reindexed", "original"])
@pytest.mark.parametrize("rotary_dim", [8, 4])
def test_paged_attention_matches_attend(positions, rotary_dim):
    rng = np.random.default_rng(1)
    nh, nkv, hd, B = 4, 2, 8, 4
    reindexed = positions == "reindexed"
    pool = PagedKVPool(16, B, 1, nkv, hd)
    sid = pool.new_sequence()
    n_tok = 37
    ks = rng.standard_normal((n_tok, nkv, hd)).astype(np.float32)
    vs = rng.standard_normal((n_tok, nkv, hd)).astype(np.float32)
    for t in range(n_tok):
        pool.append(sid, ks[t][None], vs[t][None], t)
    gone = [1, 2, 3, 7, 12, 13, 20, 30]
    pool.evict(sid, gone)
    held = [t for t in range(n_tok) if t not in gone]
    table = RopeTable(rotary_dim, 10000.0, 1.0, n=64)
    scale = np.float32(hd ** -0.5)
    q = rng.standard_normal((nh, hd)).astype(np.float32)
    # dense: the same survivors in token order, positions by rank or by token index
    n = len(held)
    pos = np.arange(n) if reindexed else np.array(held)
    k_l, v_l = np.ascontiguousarray(ks[held].transpose(1, 0, 2)), np.ascontiguousarray(vs[held].transpose(1, 0, 2))
    want = np.zeros((nh, hd), np.float32)
    attend(want, q, k_l, np.zeros((nkv, hd), np.float32), np.zeros((nkv, n), np.int64), v_l, np.tile(pos, (nkv, 1)),
           np.full(nkv, n), np.full(nkv, pos[-1]), table.cos, table.sin,
           rotary_dim, scale, np.float32(0.0), np.zeros((nh, n), np.float32), np.zeros(hd, np.float32), np.zeros((nh, hd), np.float32),
           np.zeros((0, 0), np.float32))
    for step in ("holes", "fill", "repack"):
        if step == "fill":
            pool.compact_fill(sid)
        elif step == "repack":
            pool.compact_repack(sid)
        sq = pool._get(sid)
        slots, spos = np.zeros(64, np.int64), np.zeros(64, np.int64)
        got_n = gather_slots(slots, spos, pool.seq[0], sq.table, sq.n_table, sq.held[0], sq.n_held[0], reindexed)
        assert got_n == n
        got = np.zeros((nh, hd), np.float32)
        paged_attend(got, q, pool.k[0], pool.v[0], slots, spos, n, int(pos[-1]), table.cos, table.sin, rotary_dim,
                     scale, np.float32(0.0), np.zeros((nh, 64), np.float32), np.zeros(hd, np.float32),
                     np.zeros((nh, hd), np.float32), np.zeros(hd, np.float32))
        np.testing.assert_allclose(got, want, atol=1e-5, err_msg=step)


# ---------------------------------------------------------------------------------------------
# The engine: generation from compacted, uncompacted and dense stores
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smollm2_engine(smollm2_path):
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    loaded = load_model(smollm2_path)
    return loaded, CPUEngine(loaded.spec, loaded.tensors, n_batch=32)


def _greedy(eng, store, prompt, n):
    logits = eng.prefill(prompt, store)
    toks = []
    for _ in range(n):
        toks.append(int(np.argmax(logits)))
        logits = eng.step(toks[-1], store)
    return toks


def _passes_expected(n_prompt, n_batch, n_gen, every):
    """Passes a store compacting every `every` tokens runs: layers are in step at chunk starts and
    at every decode token."""
    last, n = 0, 0
    for s in list(range(0, n_prompt, n_batch)) + list(range(n_prompt, n_prompt + n_gen - 1)):
        if s - last >= every:
            last, n = s, n + 1
    return n


def _paged_runs(eng, loaded, prompt, n_gen, kv, variants):
    from ringllm.runtime.paged_store import PagedStore
    dense = eng.new_store(kv)
    want = _greedy(eng, dense, prompt, n_gen)
    dense_held = np.sort(dense.seq[5][0, :dense.count[5][0]])
    runs = {}
    for name, update, every, pas in variants:
        pool = PagedKVPool.for_model(loaded.spec, n_blocks=32, block_size=16)
        st = PagedStore(pool, loaded.spec, kv, update=update, compact_every=every, compaction=pas)
        assert _greedy(eng, st, prompt, n_gen) == want, name
        np.testing.assert_array_equal(pool.held(st.seq_id, 5), dense_held)     # the same survivors
        runs[name] = st.stats()
    return runs


def test_engine_generation_identical_compacted_uncompacted_dense(smollm2_engine):
    """Issue acceptance: 200 greedy tokens at capacity 64 (streaming, 4 sinks, reindexed) from the
    dense KVStore, a paged store never compacted and paged stores compacted every 16 tokens by
    either pass: the same tokens, the same survivors. The 80-token prompt runs in chunks of 32,
    evicting while the layers are out of step."""
    from conftest import novel_text
    from ringllm.runtime.kv_config import KVConfig
    loaded, eng = smollm2_engine
    prompt = loaded.tokenizer.encode(novel_text()[20000:21000])[:80]
    kv = KVConfig(capacity=64, policy="streaming", sinks=4)
    runs = _paged_runs(eng, loaded, prompt, 200, kv, (("uncompacted", "append", 0, "fill"),
                                                      ("repack/16", "append", 16, "repack"),
                                                      ("fill/16", "append", 16, "fill")))
    assert runs["uncompacted"]["passes"] == 0
    for name in ("repack/16", "fill/16"):
        s = runs[name]
        assert s["passes"] == _passes_expected(80, 32, 200, 16) == 15
        assert s["slot_copies"] > 0 and s["blocks_freed_by_passes"] > 0
        assert s["blocks"] <= runs["uncompacted"]["blocks"]
    assert runs["fill/16"]["slot_copies"] < runs["repack/16"]["slot_copies"]


def test_engine_inplace_and_original_positions(smollm2_engine):
    """Shorter: EQUIP in place and hole-filling every 8 tokens, original positions, vs the dense store."""
    from conftest import novel_text
    from ringllm.runtime.kv_config import KVConfig
    loaded, eng = smollm2_engine
    prompt = loaded.tokenizer.encode(novel_text()[30000:31000])[:70]
    kv = KVConfig(capacity=40, policy="streaming", sinks=4, positions="original")
    runs = _paged_runs(eng, loaded, prompt, 24, kv, (("inplace", "inplace", 0, "fill"),
                                                     ("fill/8", "append", 8, "fill")))
    assert runs["inplace"]["blocks"] == 3 and runs["inplace"]["pool"]["cow_blocks"] == 0
    assert runs["fill/8"]["passes"] == _passes_expected(70, 32, 24, 8)


def test_engine_fork_shares_the_prompt(smollm2_engine):
    """Two continuations of one prefilled prompt share its blocks; each equals a fresh store fed the
    prompt and its own continuation (copy-on-write keeps them apart)."""
    from ringllm.runtime.kv_config import KVConfig
    from ringllm.runtime.paged_store import PagedStore
    loaded, eng = smollm2_engine
    spec = loaded.spec
    kv = KVConfig(capacity=48, policy="streaming", sinks=4, positions="original")
    prompt = loaded.tokenizer.encode("The sea was calm and the ship sailed on toward the harbour at dawn.")
    pool = PagedKVPool.for_model(spec, n_blocks=16, block_size=8)
    a = PagedStore(pool, spec, kv)
    eng.prefill(prompt, a)
    b = a.fork()
    shared = pool.gauges()["blocks_in_use"]
    la = eng.logits([10, 11, 12], a).copy()
    lb = eng.logits([20, 21, 22], b).copy()
    # 15 prompt tokens = block 0 full + block 1 with one free slot, both shared. a's first token
    # writes block 1: a copies it (the only copy); b then owns block 1 alone and writes it in place;
    # each takes one new block for its last two tokens. Block 0 stays shared.
    assert len(prompt) == 15 and shared == 2
    assert pool.cow_blocks == 1 and pool.gauges()["blocks_in_use"] == 5
    assert pool.block_table(a.seq_id)[0] == pool.block_table(b.seq_id)[0] and pool.ref[pool.block_table(a.seq_id)[0]] == 2
    for tail, got in (([10, 11, 12], la), ([20, 21, 22], lb)):
        fresh = eng.new_store(kv)
        np.testing.assert_allclose(eng.logits(list(prompt) + tail, fresh)[-3:], got, atol=1e-3)
