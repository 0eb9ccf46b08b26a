"""Multi-token KV updates, the rollback journal and greedy speculative decoding (runtime/kv_multi.py,
runtime/speculative.py).

- Rollback exactness: journal, feed gamma tokens, roll back to n_keep in 0..gamma; the store equals,
  bitwise (k, v, seq, rank, pos, count, evicted, score, aux, hist, extra, rk), a store fed only the
  kept tokens, and continuing both gives bitwise identical logits. Every write path of the engine:
  the streaming ring (RoPE stored/fused/rk), sliding-window layers, score-based policies (h2o, tova,
  snapkv, knorm) and staged eviction (several tokens dropped in one write), both position modes.
- replace_many: a known-answer table (k tokens enter k slots, the leaving tokens are gone, ranks,
  positions and counters right).
- Speculative output == plain greedy output, both drafts (layer-truncated self-draft, small
  streaming store), on a tiny random model (100 tokens) and SmolLM2 (500 tokens, slow).
"""
from __future__ import annotations

import numpy as np
import pytest

from ringllm.models.common import f32_tensor
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.speculative import greedy_generate, make_layer_draft, speculative_generate


def tiny_model(seed: int = 0, window: tuple = (), n_layer: int = 3):
    """A random llama-style model (F32 weights, 256 tokens), built without transformers."""
    spec = ModelSpec(arch="llama", n_vocab=256, n_embd=64, n_layer=n_layer, n_head=4, n_head_kv=2, head_dim=16,
                     n_ff=128, n_ctx=4096, window=window)
    rng = np.random.default_rng(seed)
    tensors = {}
    for name, shape in spec.expected_shapes().items():
        v = 1.0 + 0.1 * rng.standard_normal(shape) if len(shape) == 1 else rng.standard_normal(shape) / np.sqrt(shape[1])
        tensors[name] = f32_tensor(name, v)
    return spec, tensors


def store_arrays(st) -> dict:
    return {f"{f}.{il}": a.copy() for f in st.array_fields for il, a in enumerate(getattr(st, f))}


def assert_same_store(a, b):
    assert a.n_seen == b.n_seen
    fa, fb = store_arrays(a), store_arrays(b)
    assert fa.keys() == fb.keys()
    for name in fa:
        np.testing.assert_array_equal(fa[name], fb[name], err_msg=name)


def feed(eng, st, ids, chunk: bool):
    if not ids:
        return
    if chunk:
        eng.logits(ids, st)
    else:
        for t in ids:
            eng.step(t, st)


def check_rollbacks(eng, kv, ids, n_prompt, gamma, chunk, positions_evict=True):
    """For every n_keep in 0..gamma: journaled feed of gamma tokens then rollback(n_keep) == a store fed
    the n_keep tokens; continuing gives the same logits."""
    prompt, spec_ids, after = ids[:n_prompt], ids[n_prompt:n_prompt + gamma], ids[n_prompt + gamma:n_prompt + gamma + 3]
    evicted_inside = False
    for n_keep in range(gamma + 1):
        a, b = eng.new_store(kv), eng.new_store(kv)
        eng.prefill(prompt, a)
        eng.prefill(prompt, b)
        ev0 = a.stats()["evicted_total"]
        a.begin_journal(gamma)
        feed(eng, a, spec_ids, chunk)
        evicted_inside |= a.stats()["evicted_total"] > ev0
        a.rollback(n_keep)
        a.commit()
        feed(eng, b, spec_ids[:n_keep], chunk)
        assert_same_store(a, b)
        np.testing.assert_array_equal(eng.logits(after, a), eng.logits(after, b))
        assert_same_store(a, b)
    if positions_evict:
        assert evicted_inside, "the journaled tokens evicted nothing: the test does not exercise restoring victims"


CONFIGS = {
    "streaming": dict(policy="streaming", sinks=2),
    "h2o": dict(policy="h2o", sinks=2, recent=4),
    "tova": dict(policy="tova", sinks=2),
    "snapkv": dict(policy="snapkv", sinks=2, window=4, pool=3),
    "knorm": dict(policy="knorm", sinks=2),
    "staged_h2o": dict(policy="h2o", sinks=2, recent=4, lazy=3, slack=2, max_drop=2),
    "staged_streaming": dict(policy="streaming", sinks=2, lazy=4),
}


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@pytest.mark.parametrize("positions", ["reindexed", "original"])
@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_rollback_exact_tiny(tiny, name, positions):
    eng = CPUEngine(*tiny, n_batch=16)
    ids = np.random.default_rng(1).permutation(256)[:60].tolist()
    kv = KVConfig(capacity=16, positions=positions, **CONFIGS[name])
    check_rollbacks(eng, kv, ids, 30, 4, chunk=True)      # one verify forward of 4 rows
    check_rollbacks(eng, kv, ids, 33, 6, chunk=False)     # 6 journaled decode steps


@pytest.mark.parametrize("rope", ["fused", "rk"])
def test_rollback_exact_rope_modes(tiny, rope):
    eng = CPUEngine(*tiny, n_batch=16, rope=rope)
    ids = np.random.default_rng(2).permutation(256)[:60].tolist()
    for positions in ("reindexed", "original"):
        check_rollbacks(eng, KVConfig(capacity=16, policy="streaming", sinks=2, positions=positions), ids, 30, 4, True)


@pytest.mark.parametrize("rope", ["stored", "fused", "rk"])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_rollback_exact_into_free_ring_slots(tiny, rope, positions):
    """Journaled tokens written into a ring's free slots keep a light record (KVJournal.LIGHT_FIELDS and
    the slots' positions): undone exactly, alone and when the journal's later tokens evict (the ring
    fills up inside the journal), for every n_keep, through one verify forward and through steps."""
    eng = CPUEngine(*tiny, n_batch=16, rope=rope)
    ids = np.random.default_rng(5).permutation(256)[:60].tolist()
    kv = KVConfig(capacity=16, policy="streaming", sinks=2, positions=positions)
    check_rollbacks(eng, kv, ids, 5, 4, chunk=True, positions_evict=False)      # every token into a free slot
    check_rollbacks(eng, kv, ids, 14, 4, chunk=True)                            # two free slots, then evictions
    check_rollbacks(eng, kv, ids, 13, 6, chunk=False)


def test_rollback_exact_sliding_window():
    """Gemma 3 style: two sliding-window layers (their own ring) beside a policy layer."""
    eng = CPUEngine(*tiny_model(seed=3, window=(8, 8, 0)), n_batch=16)
    ids = np.random.default_rng(3).permutation(256)[:60].tolist()
    check_rollbacks(eng, KVConfig(capacity=16, policy="h2o", sinks=2, recent=4), ids, 30, 4, True)


def test_rollback_zero_after_matmul_verify(tiny):
    """A verify long enough for the matrix-matrix kernels (>= MATMUL_MIN_T rows) is undone exactly."""
    eng = CPUEngine(*tiny, n_batch=16)
    ids = np.random.default_rng(4).permutation(256)[:60].tolist()
    for kv in (KVConfig(capacity=16, policy="streaming", sinks=2), KVConfig(capacity=16, policy="h2o", sinks=2)):
        a, b = eng.new_store(kv), eng.new_store(kv)
        eng.prefill(ids[:30], a)
        eng.prefill(ids[:30], b)
        a.begin_journal(9)
        eng.logits(ids[30:39], a)
        a.rollback(0)
        assert_same_store(a, b)


def test_journal_refuses_what_it_cannot_undo(tiny):
    eng = CPUEngine(*tiny, n_batch=16, rope="kshift")
    st = eng.new_store(KVConfig(capacity=16, policy="streaming", sinks=2))
    eng.prefill(list(range(20)), st)
    with pytest.raises(ConfigError, match="kshift"):
        st.begin_journal(4)
    eng2 = CPUEngine(*tiny, n_batch=16)
    st2 = eng2.new_store(KVConfig(capacity=16, policy="streaming", sinks=2, update="shift"))
    with pytest.raises(ConfigError, match="inplace"):
        st2.begin_journal(4)
    st3 = eng2.new_store(KVConfig(capacity=16, policy="streaming", sinks=2))
    eng2.prefill(list(range(20)), st3)
    st3.begin_journal(2)
    with pytest.raises(ConfigError, match="journal full"):
        eng2.logits([1, 2, 3], st3)
    with pytest.raises(ConfigError, match="rollback without"):
        eng2.new_store(KVConfig(capacity=16, policy="streaming")).rollback(0)


# ---------------------------------------------------------------------------------------------
# replace_many
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_replace_many_known_answer(tiny, positions):
    spec = tiny[0]
    eng = CPUEngine(*tiny, n_batch=16)
    st = eng.new_store(KVConfig(capacity=8, policy="h2o", sinks=0, recent=0, positions=positions))
    eng.prefill([5, 6, 7, 8, 9, 10], st)      # 6 of 8 slots: seq 0..5 in slots 0..5
    il, nkv, hd = 1, spec.n_head_kv, spec.head_dim
    st.score[il][:, :6] = 1.0
    # head 0: tokens 1 and 4 leave (slots 1, 4), free slot 6 is taken; head 1: tokens 0, 2 leave, slot 6
    slots = np.array([[4, 1, 6], [0, 6, 2]])
    k_rows = np.arange(3 * nkv * hd, dtype=np.float32).reshape(3, nkv, hd)
    v_rows = -k_rows
    ev = st.evicted[il].copy()
    st.replace_many(il, slots, k_rows, v_rows, [6, 7, 8])
    want_seq = {0: [0, 7, 2, 3, 6, 5, 8, -1], 1: [6, 1, 8, 3, 4, 5, 7, -1]}
    for h in range(nkv):
        seq = st.seq[il][h].tolist()
        assert seq == want_seq[h]
        n = int(st.count[il][h])
        assert n == 7
        held = np.array(seq[:n])
        ranks = st.rank[il][h, :n]
        np.testing.assert_array_equal(ranks, np.argsort(np.argsort(held)))     # rank by sequence index
        np.testing.assert_array_equal(st.pos[il][h, :n], ranks if positions == "reindexed" else held)
        assert st.evicted[il][h] == ev[h] + 2
        for i, s in enumerate(slots[h]):
            np.testing.assert_array_equal(st.k[il][h, s], k_rows[i, h])
            np.testing.assert_array_equal(st.v[il][h, s], v_rows[i, h])
            assert st.score[il][h, s] == 0.0
    assert 1 not in st.seq[il][0] and 4 not in st.seq[il][0] and 0 not in st.seq[il][1] and 2 not in st.seq[il][1]


def test_replace_many_checks(tiny):
    eng = CPUEngine(*tiny, n_batch=16)
    st = eng.new_store(KVConfig(capacity=8, policy="h2o", sinks=0, recent=0))
    eng.prefill([5, 6, 7, 8], st)
    k = np.zeros((1, 2, 16), np.float32)
    with pytest.raises(ConfigError, match="newer"):
        st.replace_many(0, [[0], [0]], k, k, [2])
    with pytest.raises(ConfigError, match="free slots"):
        st.replace_many(0, [[6], [4]], k, k, [9])
    with pytest.raises(ConfigError, match="distinct"):
        st.replace_many(0, [[9], [4]], k, k, [9])


def test_replace_many_equals_single_writes(tiny):
    """m tokens in one call == m calls of one token each (ranks, positions, rows), keys stored before
    RoPE ("fused" layers: a stored key does not depend on when it was written)."""
    eng = CPUEngine(*tiny, n_batch=16, rope="fused")
    kv = KVConfig(capacity=12, policy="h2o", sinks=0, recent=0)
    a, b = eng.new_store(kv), eng.new_store(kv)
    eng.prefill(list(range(10)), a)
    eng.prefill(list(range(10)), b)
    rng = np.random.default_rng(0)
    slots = np.stack([rng.permutation(10)[:4] for _ in range(2)])
    kr = rng.standard_normal((4, 2, 16)).astype(np.float32)
    a.replace_many(2, slots, kr, kr + 1, [10, 11, 12, 13])
    for i in range(4):
        b.replace_many(2, slots[:, i:i + 1], kr[i:i + 1], kr[i:i + 1] + 1, [10 + i])
    assert a.rope_mode(2) == "fused" and not a.kbase[2].any()
    assert_same_store(a, b)


def test_replace_many_rebased_layer_records_key_base(tiny):
    """On a "rebased" policy layer, new keys come rotated at their logical position: kbase = pos there,
    survivors keep the base their key was rotated at."""
    eng = CPUEngine(*tiny, n_batch=16)
    st = eng.new_store(KVConfig(capacity=12, policy="h2o", sinks=0, recent=0))
    eng.prefill(list(range(10)), st)
    assert st.rope_mode(2) == "rebased"
    before = st.kbase[2].copy()
    slots = np.array([[3, 10], [7, 10]])
    kr = np.zeros((2, 2, 16), np.float32)
    st.replace_many(2, slots, kr, kr, [10, 11])
    for h in range(2):
        new = slots[h]
        np.testing.assert_array_equal(st.kbase[2][h, new], st.pos[2][h, new])
        keep = np.setdiff1d(np.arange(10), new)
        np.testing.assert_array_equal(st.kbase[2][h, keep], before[h, keep])


# ---------------------------------------------------------------------------------------------
# Speculative decoding == plain greedy
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("gamma", [3, 5])
@pytest.mark.parametrize("policy", ["streaming", "h2o"])
def test_speculative_equals_greedy_tiny(gamma, policy):
    spec, tensors = tiny_model(seed=5, n_layer=4)
    target = CPUEngine(spec, tensors, n_batch=16)
    kv = KVConfig(capacity=24, policy=policy, sinks=2)
    prompt = np.random.default_rng(5).permutation(256)[:20].tolist()
    want, _ = greedy_generate(target, target.new_store(kv), prompt, 100)
    layer_draft = make_layer_draft(spec, tensors, 2, n_batch=16)
    drafts = [(layer_draft, layer_draft.new_store(kv)),
              (target, target.new_store(KVConfig(capacity=10, policy="streaming", sinks=2)))]
    for draft, dstore in drafts:
        st = target.new_store(kv)
        got, stats = speculative_generate(target, st, draft, dstore, prompt, 100, gamma)
        assert got == want
        assert 0.0 <= stats["acceptance"] <= 1.0 and stats["rounds"] > 0
        # the target store holds what plain decoding of the emitted tokens holds (all but the newest)
        ref = target.new_store(kv)
        target.prefill(prompt, ref)
        feed(target, ref, got[:st.n_seen - len(prompt)], chunk=False)
        if gamma + 1 < 5:
            assert_same_store(st, ref)


@pytest.fixture(scope="module")
def smollm2(smollm2_path):
    from ringllm.models.loader import load_model
    return load_model(smollm2_path)


@pytest.mark.parametrize("kv", [dict(capacity=48, policy="streaming", sinks=4),
                                dict(capacity=48, policy="h2o", sinks=4),
                                dict(capacity=48, policy="snapkv", sinks=4, lazy=4, slack=2, max_drop=3)])
def test_rollback_exact_smollm2(smollm2, kv):
    eng = CPUEngine(smollm2.spec, smollm2.tensors, n_batch=32)
    ids = smollm2.tokenizer.encode("It is a truth universally acknowledged, that a single man in possession of a "
                                   "good fortune, must be in want of a wife. However little known the feelings")
    ids = (ids * 3)[:70]
    check_rollbacks(eng, KVConfig(**kv), ids, 60, 4, chunk=True)


def verify_equals_decoding(eng, a, b, rows):
    """Journaled, the rows' logits from one verify forward into store a equal those of decoding them one
    by one into store b (the same state), bit for bit; both stores are rolled back after."""
    a.begin_journal(len(rows))
    got = eng.logits(rows, a, few_rows=True)
    b.begin_journal(len(rows))
    want = np.stack([eng.step(t, b).copy() for t in rows])
    np.testing.assert_array_equal(got, want)
    for st in (a, b):
        st.rollback(0)
        st.commit()


@pytest.mark.parametrize("kv_type", ["f32", "q8_0"])
def test_few_row_verify_gives_the_bits_of_decoding(smollm2, kv_type):
    """forward(few_rows=True), as speculative decoding drafts and verifies: 2 to 8 rows through the few-row
    products (Q4_1 / Q8_0 pairs kernels) give each row's logits bit for bit as decoding the tokens one
    by one does, over a journaled store that evicts (T >= 5) or has room for the rows (T <= 4: their
    attention as one run, rope.StoredRope.write_attend_run)."""
    eng = CPUEngine(smollm2.spec, smollm2.tensors)
    kv = KVConfig(capacity=40, policy="streaming", sinks=4, k_type=kv_type, v_type=kv_type)
    ids = smollm2.tokenizer.encode("It was the best of times, it was the worst of times, it was the age of wisdom,")
    ids = (ids * 3)[:36]
    a, b = eng.new_store(kv), eng.new_store(kv)
    eng.prefill(ids[:36], a)
    eng.prefill(ids[:36], b)
    for T in range(2, 9):
        verify_equals_decoding(eng, a, b, ids[36 - T:36])


@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_verify_run_gives_the_bits_of_decoding(tiny, monkeypatch, positions):
    """A journaled verify of T tokens into free slots writes them in turn and attends them as one run
    (stored_attention.attend_stored_tokens: each layer's rows read once for all T): every row's logits
    are bit for bit those of decoding the tokens one by one, whether all the run's tokens cut the heads
    into the same units or one crosses a unit boundary (2048 slots: that run attends token by token),
    runs longer than rope.RUN_TOKENS included; rollback gives back the store that was prefilled."""
    from ringllm.runtime import rope as rope_module

    spec, tensors = tiny
    eng = CPUEngine(spec, tensors)
    kv = KVConfig(capacity=2100, policy="streaming", sinks=4, positions=positions)
    ids = np.random.default_rng(1).integers(0, spec.n_vocab, 2070).tolist()
    runs, split = [], []
    real_run, real_plan = rope_module.attend_stored_tokens, rope_module.same_unit_plan
    monkeypatch.setattr(rope_module, "attend_stored_tokens", lambda *a: (runs.append(a[1].shape[0]), real_run(*a)))
    monkeypatch.setattr(rope_module, "same_unit_plan", lambda c: real_plan(c) or split.append(len(c)) or False)
    for n_prompt in (100, 2044):            # from 2044, a run of 5+ tokens crosses 2048 slots
        a, b, fresh = eng.new_store(kv), eng.new_store(kv), eng.new_store(kv)
        for st in (a, b, fresh):
            eng.prefill(ids[:n_prompt], st)
        for T in (2, 5, 8, 11):
            verify_equals_decoding(eng, a, b, ids[n_prompt:n_prompt + T])
        assert_same_store(a, fresh)
    assert runs and max(runs) == rope_module.RUN_TOKENS and split, "both kinds of run were exercised"


@pytest.mark.slow
@pytest.mark.parametrize("draft_kind", ["layers", "small_store"])
def test_speculative_equals_greedy_smollm2(smollm2, draft_kind):
    """500 greedy tokens (CI's short form: 320, past the 256-slot store's first eviction), speculative
    with gamma 3 against plain decoding: the same tokens."""
    from conftest import full_or_short

    n = full_or_short(500, 320)
    spec, tensors = smollm2.spec, smollm2.tensors
    target = CPUEngine(spec, tensors)
    kv = KVConfig(capacity=256, policy="h2o", sinks=4)
    prompt = smollm2.tokenizer.encode("Once upon a time, in a small village by the sea, there lived")
    want, _ = greedy_generate(target, target.new_store(kv), prompt, n)
    if draft_kind == "layers":
        draft = make_layer_draft(spec, tensors, 8)
        dstore = draft.new_store(kv)
    else:
        draft, dstore = target, target.new_store(KVConfig(capacity=64, policy="streaming", sinks=4))
    got, stats = speculative_generate(target, target.new_store(kv), draft, dstore, prompt, n, 3)
    assert got == want, f"first difference at {next(i for i, (x, y) in enumerate(zip(got, want)) if x != y)}"


# ---------------------------------------------------------------------------------------------- LLM.speculate

@pytest.fixture(scope="module")
def llm(smollm2_path):
    from ringllm.llm import LLM

    return LLM(smollm2_path, kv=KVConfig(capacity=64, policy="h2o", sinks=4), progress=False)


@pytest.mark.parametrize("draft", ["store:32", "layers:10"])
def test_llm_speculate_equals_greedy_generate(llm, draft):
    """LLM.speculate gives generate(temperature=0)'s tokens and text, through evictions at capacity 64,
    and up to the first EOS when EOS comes (the chat prompt answers and stops)."""
    prompt = "It is a truth universally acknowledged, that a single man in possession of a good fortune"
    want = llm.complete(prompt, max_tokens=120, ignore_eos=True)
    got = llm.speculate(prompt, max_tokens=120, draft=draft, gamma=3, ignore_eos=True)
    assert got.tokens == want.tokens and got.text == want.text and got.finish_reason == "length"
    sp = got.speculation
    assert sp["drafted"] == 3 * sp["rounds"] and 0 <= sp["accepted"] <= sp["drafted"]
    assert got.timings.gen_tokens == 120 and llm.kv_stats()["evicted_total"] > 0
    chat = llm.chat_ids(llm.render_chat([{"role": "user", "content": "Say hello."}], add_generation_prompt=True))
    want = llm.complete(chat, max_tokens=60)
    got = llm.speculate(chat, max_tokens=60, draft=draft)
    assert want.finish_reason == "stop" and (got.tokens, got.text, got.finish_reason) == (want.tokens, want.text, "stop")


@pytest.mark.parametrize("kwargs, match", [(dict(draft="store"), "draft must be"), (dict(draft="layers:0"), "draft must be"),
                                           (dict(draft="layers:99"), "draft layers"), (dict(draft="store:1"), "2 slots"),
                                           (dict(gamma=0), "gamma"), (dict(max_tokens=0), "max_tokens")])
def test_llm_speculate_bad_arguments(llm, kwargs, match):
    with pytest.raises(ConfigError, match=match):
        llm.speculate("Hi", **kwargs)
