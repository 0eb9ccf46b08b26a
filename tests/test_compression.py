"""Prompt compression after prefill (KVConfig.compress): every press on the CPU engine
(runtime/press.py, runtime/compress.py) against the reference engine's own version
(runtime/reference_press.py, written apart): the same kept tokens in every (layer, kv head) and
logits within 1e-4 over the prompt's last token and the decode steps after it, on tiny random
checkpoints (Llama with GQA; Gemma 3 with sliding-window layers, one kv head and q/k norms); the
presses' definitions (kvpress's) on hand-checkable cases; bad input; the chat-session path; the API,
CLI and the memory really released.
"""
from __future__ import annotations

import json

import numpy as np
import pytest

import ringllm
from ringllm.models.loader import load_model
from ringllm.runtime.compress import compress_prefill
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import PRESSES, KVConfig
from ringllm.runtime.press import adakv_keep, avg_pool, equal_counts, pyramid_budget, top_newest
from ringllm.runtime.reference import ReferenceEngine
from ringllm.runtime.reference_press import reference_compress_prefill

TOL = 1e-4
PROMPT_LEN = 96

# knobs that make each press choose a real subset on a tiny random model (its attention is nearly flat,
# so gvote's default nucleus would keep everything; pyramidkv's line needs budgets above beta x w)
PRESS_KV = {
    "snapkv": dict(compress_ratio=0.3),
    "pyramidkv": dict(compress_ratio=0.5, pyramid_beta=2.0),
    "adakv": dict(compress_ratio=0.3),
    "gvote": dict(gvote_p=0.3, gvote_samples=2),
    "tova": dict(compress_budget=20),
    "knorm": dict(compress_ratio=0.25),
    "streaming": dict(compress_budget=24),
    "random": dict(compress_ratio=0.4, seed=3),
}


# llama: two kv heads, no windows; gemma3: one kv head, sliding windows; gemma2: two kv heads, sliding
# windows and soft-capped attention (a ragged press next to window layers)
@pytest.fixture(scope="module", params=["llama", "gemma3", "gemma2"])
def tiny(request, tmp_path_factory):
    pytest.importorskip("transformers")
    from tiny_checkpoints import build_tiny

    d = str(tmp_path_factory.mktemp(request.param))
    build_tiny(request.param, d)
    loaded = load_model(d, tokenizer=False)
    return loaded, CPUEngine(loaded.spec, loaded.tensors, n_batch=16), ReferenceEngine(loaded.spec, loaded.tensors)


def kept_sets(store, cache):
    """Per (layer, head): the engine store's sequence indices (sorted) and the reference cache's."""
    spec = store.spec
    return [[(np.sort(store.seq[il][h, :store.count[il][h]]), np.asarray(cache.layers[il].seq[h]))
             for h in range(spec.n_head_kv)] for il in range(spec.n_layer)]


def assert_same_kept(store, cache):
    for il, row in enumerate(kept_sets(store, cache)):
        for h, (a, b) in enumerate(row):
            assert np.array_equal(a, b), f"layer {il} head {h}: engine keeps {a.tolist()}, reference {b.tolist()}"


def decode_both(eng, store, ref, cache, le, lr, n):
    """n greedy steps on both; logits within TOL at every step (the prompt's last one included)."""
    np.testing.assert_allclose(le, lr, rtol=0, atol=TOL, err_msg="prompt's last logits")
    for i in range(n):
        tok = int(np.argmax(lr))
        le, lr = eng.step(tok, store).copy(), ref.forward([tok], cache)[0]
        np.testing.assert_allclose(le, lr, rtol=0, atol=TOL, err_msg=f"decode step {i}")


def press_and_decode_both(eng, ref, kv, ids, equal=False):
    """Compress ids on the engine and on the reference, check they keep the same tokens (and, with
    equal, as many in every head of a pressed layer), then decode 14 tokens past the capacity on both
    (decode_both) with the policy evicting. Returns (store, cache, the pressed layers)."""
    store, le = compress_prefill(eng, ids, kv, room=0)
    cache, lr = reference_compress_prefill(ref, ids, kv, room=0)
    assert_same_kept(store, cache)
    spec = store.spec
    pressed = [il for il in range(spec.n_layer) if not spec.window[il]]
    if equal:
        assert all(len(set(store.count[il].tolist())) == 1 for il in pressed), [store.count[il] for il in pressed]
    before = store.stats()["evicted_total"]
    decode_both(eng, store, ref, cache, le, lr, 14)          # past the capacity: the policy evicts
    assert store.stats()["evicted_total"] > before, "the policy evicted while decoding"
    assert_same_kept(store, cache)
    return store, cache, pressed


def prompt_ids(seed=0, n=PROMPT_LEN):
    return np.random.default_rng(seed).integers(3, 250, n).tolist()


# ---------------------------------------------------------------------------------------------
# Engine against reference
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("press", PRESSES)
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_press_matches_reference(tiny, press, positions):
    loaded, eng, ref = tiny
    kv = KVConfig(compress=press, compress_window=12, compress_pool=5, positions=positions, **PRESS_KV[press])
    ids = prompt_ids()
    store, le = compress_prefill(eng, ids, kv, room=16)
    cache, lr = reference_compress_prefill(ref, ids, kv, room=16)
    assert_same_kept(store, cache)
    spec = loaded.spec
    pressed = [il for il in range(spec.n_layer) if not spec.window[il]]
    kept = [int(store.count[il][h]) for il in pressed for h in range(spec.n_head_kv)]
    assert max(kept) < PROMPT_LEN, "the press chose a real subset"
    assert store.released == PROMPT_LEN - max(int(c.max()) for c in store.count)
    decode_both(eng, store, ref, cache, le, lr, 6)


@pytest.mark.parametrize("press", ["snapkv", "adakv"])
def test_streaming_decode_after_compression_matches_reference(tiny, press):
    """The decode-time policy streaming runs on the kept tokens: capacity = kept + KVConfig.capacity per
    layer, its ring evicting the kept prompt's oldest non-sinks first (heads apart under adakv)."""
    _, eng, ref = tiny
    kv = KVConfig(policy="streaming", capacity=6, sinks=2, compress=press, compress_ratio=0.25, compress_window=8)
    ids = prompt_ids(1)
    store, le = compress_prefill(eng, ids, kv, room=0)
    cache, lr = reference_compress_prefill(ref, ids, kv, room=0)
    decode_both(eng, store, ref, cache, le, lr, 14)          # past the room: the ring evicts
    assert sum(int(e.sum()) for e in store.evicted) > 0
    assert_same_kept(store, cache)


# decode-time policies that evict by a score (not a ring), each with the knobs that make it evict in a
# short run; the press keeps the same number of tokens per head (snapkv), per-head budgets (adakv)
# under adakv, and one set for every head (tova) under the policies that score over all heads
DECODE_POLICIES = {
    "h2o": dict(), "scissorhands": dict(history=4), "tova": dict(), "knorm": dict(), "lsh": dict(lsh_bits=8, recent=2),
    "random": dict(seed=5), "snapkv": dict(window=4), "pyramidkv": dict(window=4, pyramid_beta=2.0),
    "rkv": dict(), "gvote": dict(window=4, gvote_p=0.5, gvote_samples=2), "h2o+staged": dict(lazy=2, slack=2),
    "streaming+staged": dict(lazy=2, slack=2),
}


@pytest.mark.parametrize("policy", list(DECODE_POLICIES) + ["adakv"])
def test_policy_decode_after_compression_matches_reference(tiny, policy):
    """An evicting decode-time policy after the press: the prompt is prefilled under that policy (its
    state built over every token), the press's choice kept with that state, the store resized to the
    kept tokens plus the policy's capacity; decoding past that evicts by the policy. Engine and
    reference keep the same tokens and their logits agree within TOL at every step."""
    _, eng, ref = tiny
    name = policy.split("+")[0]
    knobs = DECODE_POLICIES.get(policy, dict())
    press = {"adakv": "adakv", "tova": "tova", "gvote": "tova"}.get(name, "snapkv")
    positions = "original" if policy in ("tova", "lsh", "gvote") else "reindexed"
    budget = dict(compress_budget=24) if press == "tova" else dict(compress_ratio=0.25)
    kv = KVConfig(policy=name, capacity=8, sinks=2, positions=positions, compress=press, compress_window=8, **budget,
                  **knobs)
    store, cache, pressed = press_and_decode_both(eng, ref, kv, prompt_ids(7))
    assert max(int(store.count[il].max()) for il in pressed) < PROMPT_LEN // 2, "the press released tokens"


@pytest.mark.parametrize("policy, press", [("h2o", "adakv"), ("snapkv", "gvote"), ("knorm", "adakv"),
                                           ("streaming+staged", "gvote")])
def test_ragged_press_under_a_per_head_policy_matches_reference(tiny, policy, press):
    """A press that keeps different numbers of tokens per kv head (adakv, gvote) under a decode-time
    policy that evicts the same number from every head: each pressed layer's heads are topped up to
    its fullest by their newest unchosen tokens (press.equal_counts; the reference's own top-up), the
    press's choice kept whole. Engine and reference keep the same tokens, equally many per head, and
    agree while the policy evicts."""
    _, eng, ref = tiny
    name = policy.split("+")[0]
    knobs = DECODE_POLICIES.get(policy, dict())
    budget = dict(compress_ratio=0.25) if press == "adakv" else dict(gvote_p=0.5, gvote_samples=2)
    kv = KVConfig(policy=name, capacity=8, sinks=2, compress=press, compress_window=8, **budget, **knobs)
    ids = prompt_ids(7)
    store, cache, pressed = press_and_decode_both(eng, ref, kv, ids, equal=True)
    alone, _ = compress_prefill(eng, ids, KVConfig(policy="full", compress=press, compress_window=8, **budget), room=0)
    if store.spec.n_head_kv > 1:            # (one kv head, Gemma 3's: nothing to top up)
        assert any(len(set(alone.count[il].tolist())) > 1 for il in pressed), "the press alone leaves ragged heads"
        stats = store.press_stats
        assert stats["chosen_share"] == alone.press_stats["kept_share"] < stats["kept_share"], stats


@pytest.mark.parametrize("policy, press", [("tova", "snapkv"), ("tova", "adakv"), ("gvote", "knorm"),
                                           ("tova", "gvote"), ("gvote", "random")])
def test_per_head_press_under_a_head_aligned_policy_matches_reference(tiny, policy, press):
    """A press that chooses per kv head under a decode-time policy that scores each token over every
    head (tova, gvote): every head keeps one set (the heads' mean score, adakv's mean budget; gvote's
    union of the heads' votes). Engine and reference keep the same tokens, the same in every head of
    a pressed layer, and agree while the policy evicts."""
    _, eng, ref = tiny
    knobs = DECODE_POLICIES[policy]
    budget = dict(compress_ratio=0.25) if press != "gvote" else dict(gvote_p=0.5, gvote_samples=2)
    kv = KVConfig(policy=policy, capacity=8, sinks=2, positions="original", compress=press, compress_window=8,
                  **{**budget, **knobs})
    store, cache, pressed = press_and_decode_both(eng, ref, kv, prompt_ids(12))
    for il in pressed:
        held = [set(store.seq[il][h, :store.count[il][h]].tolist()) for h in range(store.spec.n_head_kv)]
        assert all(x == held[0] for x in held), il


def test_chat_turn_compresses_its_own_tokens(tiny):
    """A second prompt after a compressed store (a chat session's next turn): the earlier kept tokens
    stay, the new ones are pressed; engine and reference agree through both turns."""
    _, eng, ref = tiny
    kv = KVConfig(compress="adakv", compress_ratio=0.4, compress_window=8)
    first, second = prompt_ids(2, 64), prompt_ids(3, 40)
    store, le = compress_prefill(eng, first, kv, room=4)
    cache, lr = reference_compress_prefill(ref, first, kv, room=4)
    decode_both(eng, store, ref, cache, le, lr, 3)
    before = [[set(store.seq[il][h, :store.count[il][h]].tolist()) for h in range(store.spec.n_head_kv)]
              for il in range(store.spec.n_layer)]
    store2, le = compress_prefill(eng, second, kv, room=4, prior=store)
    cache2, lr = reference_compress_prefill(ref, second, kv, room=4, prior=cache)
    assert_same_kept(store2, cache2)
    for il in range(store.spec.n_layer):
        for h in range(store.spec.n_head_kv):
            now = set(store2.seq[il][h, :store2.count[il][h]].tolist())
            if not store.spec.window[il]:
                assert before[il][h] <= now, "earlier turns are kept as they were"
                assert 0 < len(now - before[il][h]) < len(second)
    decode_both(eng, store2, ref, cache2, le, lr, 3)


@pytest.mark.parametrize("policy, press", [("h2o", "snapkv"), ("adakv", "adakv"), ("h2o", "adakv")])
def test_chat_turn_under_an_evicting_policy(tiny, policy, press):
    """A chat session's second turn under an evicting decode-time policy: the store is resized up to
    hold the new turn, the turn's tokens are pressed, the store resized down; the policy's state of
    the first turn's tokens carries through. Engine and reference agree through both turns, the
    policy evicting in between."""
    _, eng, ref = tiny
    kv = KVConfig(policy=policy, capacity=6, sinks=2, compress=press, compress_ratio=0.3, compress_window=8)
    first, second = prompt_ids(8, 64), prompt_ids(9, 40)
    store, le = compress_prefill(eng, first, kv, room=0)
    cache, lr = reference_compress_prefill(ref, first, kv, room=0)
    decode_both(eng, store, ref, cache, le, lr, 9)            # past the capacity
    store2, le = compress_prefill(eng, second, kv, room=0, prior=store)
    cache2, lr = reference_compress_prefill(ref, second, kv, room=0, prior=cache)
    assert_same_kept(store2, cache2)
    decode_both(eng, store2, ref, cache2, le, lr, 9)
    assert_same_kept(store2, cache2)


def test_chat_turn_pressed_after_a_streamed_turn_keeps_the_window_layers(tiny):
    """A turn pressed after one that streamed (compress_overflow "stream") under staged streaming with
    a capacity below the sliding window: the streamed store's window layers are policy layers of that
    capacity, and the pressed turn keeps them so (compress.window_capacity) instead of making them
    rings of the window. Engine and reference agree through the turn and while the policy evicts."""
    _, eng, ref = tiny
    kv = KVConfig(policy="streaming", capacity=6, sinks=2, lazy=2, slack=2, compress="snapkv", compress_ratio=0.3,
                  compress_window=8, compress_overflow="stream")
    first, second = prompt_ids(10, 40), prompt_ids(11, 30)
    streamed = kv.decode_config(kv.capacity)          # what LLM streams a too-long turn through
    store, cache = eng.new_store(streamed), ref.new_cache(streamed)
    eng.prefill(first, store)
    ref.forward(first, cache)
    store2, le = compress_prefill(eng, second, kv, room=0, prior=store)
    cache2, lr = reference_compress_prefill(ref, second, kv, room=0, prior=cache)
    assert store2.layer_ring == store.layer_ring
    assert_same_kept(store2, cache2)
    decode_both(eng, store2, ref, cache2, le, lr, 9)
    assert_same_kept(store2, cache2)


def test_prompts_shorter_than_the_policy_capacity(tiny):
    """A prompt (and a chat turn) shorter than the decode-time policy's capacity and recent window:
    the transient and resized stores keep the config's capacity, so h2o's recent window (capacity/2)
    still fits; engine and reference agree."""
    _, eng, ref = tiny
    kv = KVConfig(policy="h2o", capacity=64, compress="snapkv", compress_ratio=0.5, compress_window=4)
    store, le = compress_prefill(eng, prompt_ids(10, 12), kv, room=0)
    cache, lr = reference_compress_prefill(ref, prompt_ids(10, 12), kv, room=0)
    decode_both(eng, store, ref, cache, le, lr, 3)
    store2, le = compress_prefill(eng, prompt_ids(11, 9), kv, room=0, prior=store)
    cache2, lr = reference_compress_prefill(ref, prompt_ids(11, 9), kv, room=0, prior=cache)
    assert_same_kept(store2, cache2)
    decode_both(eng, store2, ref, cache2, le, lr, 3)


# ---------------------------------------------------------------------------------------------
# The presses' definitions (kvpress) on cases checked by hand
# ---------------------------------------------------------------------------------------------


def test_equal_counts_tops_up_with_the_newest_unchosen():
    got = equal_counts([np.array([0, 5]), np.array([1, 2, 3, 9]), np.array([], np.int64)], 10)
    assert [g.tolist() for g in got] == [[0, 5, 8, 9], [1, 2, 3, 9], [6, 7, 8, 9]]


def test_avg_pool_is_torch_avg_pool1d():
    torch = pytest.importorskip("torch")
    x = np.random.default_rng(0).random((3, 40))
    for k in (1, 3, 5, 7):
        want = torch.nn.functional.avg_pool1d(torch.tensor(x)[:, None], kernel_size=k, padding=k // 2, stride=1)
        np.testing.assert_allclose(avg_pool(x, k), want[:, 0].numpy(), rtol=0, atol=1e-12)


def test_pyramid_budgets_fall_linearly_with_mean_the_budget():
    L, m, w = 30, 4000, 64
    b = [pyramid_budget(2000, m, w, 20.0, il, L) for il in range(L)]
    assert b[0] == 3900 and b[-1] == 100 and all(x > y for x, y in zip(b, b[1:]))
    assert abs(np.mean(b) - 2000) <= 1
    # below beta x w the line would go under the window: kvpress falls back to snapkv's budget
    assert {pyramid_budget(1000, m, w, 20.0, il, L) for il in range(L)} == {1000}


def test_selection_ties_go_to_the_newer_token_and_adakv_keeps_its_floor():
    assert top_newest(np.array([1.0, 2.0, 1.0, 1.0, 0.0]), 2).tolist() == [1, 3]
    scores = np.array([[9.0, 8, 7, 6, 5, 4], [0.1, 0.2, 0.3, 0.4, 0.5, 0.6]])
    keep = adakv_keep(scores, n_kept=3, alpha=0.34)          # floor(3 x 0.34) = 1 safe token per head
    assert keep[0].tolist() == [0, 1, 2, 3, 4] and keep[1].tolist() == [5]
    keep = adakv_keep(scores, n_kept=3, alpha=0.0)           # no floor: the layer's best 6 are all head 0's
    assert keep[0].tolist() == list(range(6)) and keep[1].tolist() == []


def test_snapkv_keeps_its_window_and_streaming_its_sinks(tiny):
    loaded, eng, _ = tiny
    spec = loaded.spec
    ids = prompt_ids(4)
    for kv in (KVConfig(compress="snapkv", compress_budget=20, compress_window=12),
               KVConfig(compress="streaming", compress_budget=20, sinks=4)):
        store, _ = compress_prefill(eng, ids, kv, room=1)
        for il in range(spec.n_layer):
            if spec.window[il]:
                continue
            for h in range(spec.n_head_kv):
                seq = set(store.seq[il][h, :store.count[il][h]].tolist())
                assert len(seq) == 20
                assert set(range(PROMPT_LEN - 12, PROMPT_LEN)) <= seq
                if kv.compress == "streaming":
                    assert seq == set(range(4)) | set(range(PROMPT_LEN - 16, PROMPT_LEN))


def test_budget_over_the_prompt_keeps_everything(tiny):
    _, eng, _ = tiny
    ids = prompt_ids(5, 30)
    for kv in (KVConfig(compress="snapkv", compress_budget=500), KVConfig(compress="knorm", compress_ratio=1.0)):
        store, _ = compress_prefill(eng, ids, kv, room=2)
        assert store.released == 0 and store.stats()["kept_share"] == 1.0


# ---------------------------------------------------------------------------------------------
# Bad input
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kw, match", [
    (dict(compress="h2o_press", compress_ratio=0.5), "compress 'h2o_press' unknown"),
    (dict(compress="snapkv"), "exactly one of compress_budget"),
    (dict(compress="snapkv", compress_budget=10, compress_ratio=0.5), "exactly one of compress_budget"),
    (dict(compress="gvote", compress_ratio=0.5), "gvote chooses its own budget"),
    (dict(compress="snapkv", compress_ratio=0.0), r"compress_ratio must be in \(0, 1\]"),
    (dict(compress="snapkv", compress_budget=0), "compress_budget must be >= 1"),
    (dict(compress="snapkv", compress_ratio=0.5, compress_pool=4), "compress_pool must be an odd"),
    (dict(compress="snapkv", compress_ratio=0.5, policy="h2o"), "needs a capacity"),
    (dict(max_prompt=100), "needs a press"),
    (dict(compress_ratio=0.5), "needs a press"),
    (dict(compress_overflow="stream", policy="streaming", capacity=64), "compress_overflow needs a press"),
    (dict(compress="snapkv", compress_ratio=0.5, compress_overflow="stream"), "which must evict: policy 'streaming'"),
    (dict(compress="snapkv", compress_ratio=0.5, compress_overflow="truncate"), "compress_overflow 'truncate' unknown"),
])
def test_bad_configs_are_refused(kw, match):
    with pytest.raises(ConfigError, match=match):
        KVConfig(**kw)


def test_prompt_over_max_prompt_is_an_error_at_the_call(tiny):
    _, eng, _ = tiny
    kv = KVConfig(compress="snapkv", compress_ratio=0.5, max_prompt=50)
    with pytest.raises(ConfigError, match="more than max_prompt 50"):
        compress_prefill(eng, prompt_ids(6, 51), kv, room=4)


# ---------------------------------------------------------------------------------------------
# API, chat session, CLI (the bundled SmolLM2)
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def smol(smollm2_path):
    return ringllm.LLM(smollm2_path, n_threads=1, progress=False,
                       kv=KVConfig(compress="snapkv", compress_ratio=0.3, compress_window=16, max_prompt=600))


def story(n_words=300):
    from conftest import novel_text
    return " ".join(novel_text()[5000:].split()[:n_words])


def test_generate_releases_the_pruned_prompt(smol):
    out = smol.complete(story() + "\nSummarize:", max_tokens=6, ignore_eos=True)
    st = smol.kv_stats()
    n = out.prompt_tokens
    assert st["tokens_seen"] == n + 5 and st["prompt_tokens"] == n
    assert abs(st["kept_share"] - 0.3) < 0.01
    kept = st["length"] - 5
    assert st["released"] == n - kept and kept < 0.4 * n
    assert st["capacity"] == kept + 6              # the kept tokens plus the room for the answer
    plain = ringllm.LLM(smol.model_path, n_threads=1, progress=False).engine.new_store(KVConfig(capacity=n + 6))
    assert st["bytes"] < 0.45 * plain.stats()["bytes"]
    with pytest.raises(ConfigError, match="more than max_prompt 600"):
        smol.complete(story(700), max_tokens=2)
    with pytest.raises(ConfigError, match="decode semantics"):
        smol.logits([1, 2, 3])


def test_chat_session_compresses_each_turn_and_saves(smol, tmp_path):
    s = smol.chat_session()
    s.send(story(150) + "\nWho is speaking?", max_tokens=4, stream=False)
    first = s.kv_stats()
    assert first["released"] > 0
    s.send("And what happens next? " + story(60), max_tokens=4, stream=False)
    second = s.kv_stats()
    assert second["released"] > first["released"] and second["tokens_seen"] == len(s.tokens)
    path = s.save(tmp_path / "c.session")
    loaded = type(s).load(smol, path)
    assert loaded.kv_stats()["released"] == second["released"]
    a = s.send("Thanks.", max_tokens=4, stream=False).tokens
    b = loaded.send("Thanks.", max_tokens=4, stream=False).tokens
    assert a == b


def test_chat_session_under_h2o_after_compression_saves_and_loads(smollm2_path, tmp_path):
    """SmolLM2, a chat session compressing each turn with snapkv and decoding under h2o (capacity 16):
    the policy evicts while answering; a session saved after the second turn loads with the same
    store (stats included) and answers the third turn exactly as the live one."""
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False,
                      kv=KVConfig(policy="h2o", capacity=16, compress="snapkv", compress_ratio=0.3,
                                  compress_window=16, max_prompt=600))
    s = llm.chat_session()
    s.send(story(120) + "\nWho is speaking?", max_tokens=24, stream=False, ignore_eos=True)
    first = s.kv_stats()
    assert first["policy"] == "h2o" and first["released"] > 0 and first["evicted_total"] > 0
    s.send("And then? " + story(40), max_tokens=24, stream=False, ignore_eos=True)
    second = s.kv_stats()
    assert second["tokens_seen"] == len(s.tokens) and second["evicted_total"] > first["evicted_total"]
    loaded = type(s).load(llm, s.save(tmp_path / "h2o.session"))
    assert loaded.kv_stats() == second
    a = s.send("Thanks.", max_tokens=24, stream=False, ignore_eos=True).tokens
    b = loaded.send("Thanks.", max_tokens=24, stream=False, ignore_eos=True).tokens
    assert a == b


OVERFLOW_KV = dict(policy="streaming", capacity=96, compress="snapkv", compress_ratio=0.3, compress_window=16,
                   max_prompt=200)


def test_over_long_prompt_streams_through_the_decode_policy_on_request(smollm2_path):
    """compress_overflow "stream": a prompt past max_prompt runs as it would with no press at all (the
    same store, the same tokens as plain streaming), a prompt within it is still pressed."""
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False,
                      kv=KVConfig(compress_overflow="stream", **OVERFLOW_KV))
    plain = ringllm.LLM(smollm2_path, n_threads=1, progress=False, kv=KVConfig(policy="streaming", capacity=96))
    long_prompt = story(400) + "\nAnswer:"
    out = llm.complete(long_prompt, max_tokens=6, ignore_eos=True)
    assert out.prompt_tokens > 200
    st = llm.kv_stats()
    assert "press" not in st and st["capacity"] == 96 and st["length"] == 96 and st["evicted_total"] > 0
    assert out.tokens == plain.complete(long_prompt, max_tokens=6, ignore_eos=True).tokens
    llm.complete(story(100) + "\nAnswer:", max_tokens=2)
    assert llm.kv_stats()["press"] == "snapkv"
    with pytest.raises(ConfigError, match="more than max_prompt 200"):
        ringllm.LLM(smollm2_path, n_threads=1, progress=False, kv=KVConfig(**OVERFLOW_KV)).complete(long_prompt)


def test_chat_turn_too_long_to_compress_streams_and_the_next_is_pressed(smollm2_path, tmp_path):
    llm = ringllm.LLM(smollm2_path, n_threads=1, progress=False,
                      kv=KVConfig(compress_overflow="stream", **OVERFLOW_KV))
    s = llm.chat_session()
    s.send(story(400) + "\nWho is speaking?", max_tokens=4, stream=False)
    first = s.kv_stats()
    assert "press" not in first and first["length"] <= 96
    s.send("And then? " + story(60), max_tokens=4, stream=False)
    second = s.kv_stats()
    assert second["press"] == "snapkv" and second["tokens_seen"] == len(s.tokens)
    s.send(story(300)[-1500:] + " Go on.", max_tokens=4, stream=False)      # long again: streams
    loaded = type(s).load(llm, s.save(tmp_path / "o.session"))
    assert s.send("Thanks.", max_tokens=4, stream=False).tokens == loaded.send("Thanks.", max_tokens=4,
                                                                              stream=False).tokens


def test_cli_generate_with_compression(smollm2_path):
    from test_cli import T1, run

    r = run("generate", "-p", story(200) + "\nAnswer:", "-n", "3", "--kv-compress", "tova", "--kv-compress-budget",
            "64", "--json", *T1)
    assert r.returncode == 0, r.stderr
    kv = json.loads(r.stdout)["kv"]
    assert kv["press"] == "tova" and kv["released"] > 0 and kv["length"] <= 64 + 3
    bad = run("generate", "-p", "hi", "--kv-compress", "gvote", "--kv-compress-ratio", "0.5", *T1)
    assert bad.returncode != 0 and "gvote chooses its own budget" in bad.stderr
    ppl = run("perplexity", "-f", __file__, "--kv-compress", "snapkv", "--kv-compress-ratio", "0.5", *T1)
    assert ppl.returncode != 0 and "decode semantics" in ppl.stderr


@pytest.mark.parametrize("rope", ["fused", "rk", "kshift"])
@pytest.mark.parametrize("positions", ["reindexed", "original"])
def test_every_engine_rope_strategy(tiny, rope, positions):
    """The transient store's keys come out of, and the decode store's go into, every ring layout."""
    loaded, _, ref = tiny
    eng = CPUEngine(loaded.spec, loaded.tensors, n_batch=16, rope=rope)
    kv = KVConfig(compress="adakv", compress_ratio=0.3, compress_window=8, positions=positions)
    ids = prompt_ids(7)
    store, le = compress_prefill(eng, ids, kv, room=6)
    cache, lr = reference_compress_prefill(ref, ids, kv, room=6)
    assert_same_kept(store, cache)
    decode_both(eng, store, ref, cache, le, lr, 4)
    store2, le = compress_prefill(eng, prompt_ids(8, 30), kv, room=4, prior=store)      # a chat turn after it
    cache2, lr = reference_compress_prefill(ref, prompt_ids(8, 30), kv, room=4, prior=cache)
    assert_same_kept(store2, cache2)
    decode_both(eng, store2, ref, cache2, le, lr, 3)
