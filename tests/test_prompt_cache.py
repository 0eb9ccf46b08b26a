"""The server's prompt cache (ringllm.prompt_cache) and the store verbs it stands on (KVStore.fork,
snapshot, truncate): a request continued from a cached store decodes what a fresh store gives,
under every policy; which entries are reusable; the byte budget."""
from __future__ import annotations

import numpy as np
import pytest

import ringllm
from conftest import novel_text
from ringllm import KVConfig
from ringllm.prompt_cache import PromptCache
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import POLICIES

# logits of a continued store against a fresh one: the cached store computed its generated tokens
# one at a time (matrix-vector kernels), the fresh one in a prefill chunk (matrix-matrix kernels),
# so they agree to float32 rounding, not bitwise
LOGIT_ATOL = 2e-3


@pytest.fixture(scope="module")
def llm(smollm2_path):
    return ringllm.LLM(smollm2_path, seed=0)


@pytest.fixture(scope="module")
def text_ids(llm):
    return llm.tokenize(novel_text()[:4000])


def _kv(policy: str) -> KVConfig:
    return KVConfig() if policy == "full" else KVConfig(capacity=48, policy=policy, sinks=4)


def _greedy(llm, ids, kv, store=None, n=10):
    dec = llm.decoder(ids, max_tokens=n, temperature=0.0, ignore_eos=True, kv=kv, store=store)
    dec.prefill()
    eng = llm.engine
    while not dec.done:
        tok = dec.feed()
        dec.advance(None if tok is None else eng.step(tok, dec.store))
    return dec


@pytest.mark.parametrize("policy", POLICIES)
def test_a_continued_store_decodes_as_a_fresh_one(llm, text_ids, policy):
    """Turn 1 (prompt, 10 greedy tokens) is cached; turn 2 (turn 1's tokens plus new ones) continues
    its store: same greedy tokens as from a fresh store, first logits within rounding, and only the
    new tokens prefilled."""
    kv = _kv(policy)
    cache = PromptCache(1 << 30)
    first = _greedy(llm, text_ids[:90], kv)
    history = text_ids[:90] + first.record.fed[90:]
    cache.put(history, first.store)
    turn2 = history + first.record.tokens[-1:] + text_ids[200:240]
    store, n = cache.take(turn2, kv)
    assert n == len(history) and store is not first.store
    cached = _greedy(llm, turn2, kv, store=store)
    fresh = _greedy(llm, turn2, kv)
    assert cached.record.tokens == fresh.record.tokens
    assert cached.record.timings.prompt_tokens == len(turn2) - n
    assert cached.store.stats()["evicted_total"] == fresh.store.stats()["evicted_total"]
    # the cached entry itself is untouched by the request that forked it
    again, m = cache.take(turn2, kv)
    assert m == n and again.n_seen == n
    e1, e2 = _first_logits(llm, turn2, kv, again), _first_logits(llm, turn2, kv, None)
    np.testing.assert_allclose(e1, e2, atol=LOGIT_ATOL, rtol=0)


def _first_logits(llm, ids, kv, store):
    if store is None:
        store = llm.engine.new_store(kv)
    return llm.engine.prefill(ids[store.n_seen:], store).copy()


def test_fork_copies_only_what_was_written_and_is_independent(llm, text_ids):
    eng = llm.engine
    st = eng.new_store(KVConfig(capacity=64, policy="h2o", sinks=4))
    eng.prefill(text_ids[:100], st)
    full = eng.new_store(KVConfig())
    eng.prefill(text_ids[:100], full)
    snap = full.snapshot()                       # 100 of 8192 slots: the snapshot holds those only
    assert snap.nbytes < full.stats()["bytes"] / 40 and snap.truncatable
    fk = st.fork()
    for name in st.array_fields:
        for a, b in zip(getattr(st, name), getattr(fk, name)):
            np.testing.assert_array_equal(a, b, err_msg=name)
    la = eng.prefill(text_ids[100:110], st).copy()
    assert fk.n_seen == 100                      # feeding the original leaves the fork as it was
    lb = eng.prefill(text_ids[100:110], fk).copy()
    np.testing.assert_array_equal(la, lb)


def test_truncate_under_full_and_streaming_only(llm, text_ids):
    eng = llm.engine
    full = eng.new_store(KVConfig())
    eng.prefill(text_ids[:120], full)
    full.truncate(80)
    assert full.n_seen == 80 and full.stats()["length"] == 80
    ref = eng.new_store(KVConfig())
    eng.prefill(text_ids[:80], ref)
    np.testing.assert_allclose(eng.prefill(text_ids[80:100], full), eng.prefill(text_ids[80:100], ref),
                               atol=LOGIT_ATOL, rtol=0)
    ring = eng.new_store(KVConfig(capacity=64, policy="streaming"))
    eng.prefill(text_ids[:40], ring)
    assert ring.truncatable()
    eng.prefill(text_ids[40:80], ring)            # now it has evicted: its ring forgot tokens
    assert not ring.truncatable()
    with pytest.raises(ConfigError, match="evicted"):
        ring.truncate(10)
    scored = eng.new_store(KVConfig(capacity=64, policy="h2o"))
    eng.prefill(text_ids[:20], scored)
    assert not scored.truncatable()              # scores hold the later tokens' attention
    with pytest.raises(ConfigError, match="n_keep"):
        full.truncate(101)


def test_which_entry_is_reused(llm, text_ids):
    """A store serves a request that extends all of its history; a divergent one only when it can be
    cut (policy full), at the common prefix; never a store of another KVConfig."""
    eng = llm.engine
    a = text_ids[:60]
    branch = a[:40] + text_ids[300:330]
    for kv, reused in ((KVConfig(), 40), (KVConfig(capacity=48, policy="h2o"), 0)):
        cache = PromptCache(1 << 30)
        st = eng.new_store(kv)
        eng.prefill(a, st)
        cache.put(a, st)
        assert cache.take(a + text_ids[400:405], kv)[1] == 60          # extends it all: every policy
        assert cache.take(a, kv)[1] == (59 if kv.policy == "full" else 0)   # same prompt: the last is re-fed
        store, n = cache.take(branch, kv)
        assert n == reused and (store is None) == (reused == 0)
        if store is not None:
            assert store.n_seen == 40
        assert cache.take(a + [1], KVConfig(capacity=32, policy="streaming"))[1] == 0
    assert cache.stats()["hits"] >= 1 and cache.stats()["misses"] >= 1


def test_budget_evicts_least_recently_used(llm, text_ids):
    eng = llm.engine
    kv = KVConfig(capacity=64, policy="streaming")
    stores = []
    for i in range(3):
        st = eng.new_store(kv)
        eng.prefill(text_ids[i * 50:i * 50 + 50], st)
        stores.append(st)
    size = stores[0].snapshot().nbytes + 50 * 8           # an entry: the snapshot and its 50 token ids
    cache = PromptCache(2 * size + size // 2)          # room for two
    cache.put(text_ids[0:50], stores[0])
    cache.put(text_ids[50:100], stores[1])
    assert cache.take(text_ids[0:50] + [7], kv)[1] == 50       # touches the first: the second is now oldest
    cache.put(text_ids[100:150], stores[2])
    assert len(cache) == 2 and cache.bytes <= cache.max_bytes and cache.evictions == 1
    assert cache.take(text_ids[50:100] + [7], kv)[1] == 0
    assert cache.take(text_ids[0:50] + [7], kv)[1] == 50
    tiny = PromptCache(size // 2)                       # a store over the whole budget is not kept
    tiny.put(text_ids[0:50], stores[0])
    assert len(tiny) == 0
    off = PromptCache(0)
    off.put(text_ids[0:50], stores[0])
    assert off.take(text_ids[0:50] + [7], kv) == (None, 0)


def test_decoder_refuses_a_store_that_holds_the_whole_prompt(llm, text_ids):
    st = llm.engine.new_store(KVConfig())
    llm.engine.prefill(text_ids[:30], st)
    with pytest.raises(ConfigError, match="fewer tokens than the prompt"):
        llm.decoder(text_ids[:30], store=st)
