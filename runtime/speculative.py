"""Greedy speculative decoding over the in-place KV store (Leviathan et al. 2023, greedy acceptance).

One round, with `cur` the newest token (known, fed to neither model yet):

    draft:  feeds cur (and any token still owed to it), then its own argmax, gamma times in all
            -> d_1..d_gamma                                      gamma one-token steps, journaled
    target: one forward of [cur, d_1..d_gamma] (gamma + 1 rows) -> t_0..t_gamma, t_i = argmax after d_i
    accept: a = the longest prefix with d_{i+1} == t_i; emit d_1..d_a and t_a (the target's token at
            the first mismatch, or the bonus token when all gamma were accepted)
    rollback: the target keeps [cur, d_1..d_a] (a + 1 of its gamma + 1 rows), the draft the same
            (it fed cur, d_1..d_{gamma-1}; when a == gamma it still owes d_gamma, fed next round)
    cur = t_a

Each store's journal (runtime/kv_multi.py) takes the rejected tokens back out exactly, evicted tokens
restored, so both stores always hold what plain decoding of the emitted tokens would hold, whatever
the eviction policy. Every emitted token is the target's argmax given exactly the emitted prefix, so
the output is plain greedy decoding's. Bitwise so when gamma + 1 < matvec.MATMUL_MIN_T: the draft's
and the verify's rows go through the few-row products (CPUEngine.forward(few_rows=True): each
weight decoded once per pair of rows, the same bits as one matvec per row, which is what decoding
runs); from there on the verify's projections use the tiled matrix-matrix kernels, which round
differently (~1e-6): equal greedy output then holds unless two logits tie to that precision.

Drafts (see make_layer_draft): the same model with fewer layers (early-exit self-speculation, the
same tensors, the final norm and head on layer n's output), or the same model over a small
streaming store.
"""
from __future__ import annotations

import time

import numpy as np

from ringllm.runtime import compile_clock
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.errors import ConfigError


def make_layer_draft(spec, tensors, n_layers: int, **engine_kwargs):
    """A CPUEngine of the first n_layers layers of a model, with its final norm and output head
    (early-exit self-draft). spec, tensors: a LoadedModel's fields."""
    if not 1 <= n_layers <= spec.n_layer:
        raise ConfigError(f"draft layers must be in 1..{spec.n_layer}, got {n_layers}")
    sub = spec.first_layers(n_layers)
    keep = {name: t for name, t in tensors.items()
            if not name.startswith("blk.") or int(name.split(".")[1]) < n_layers}
    return CPUEngine(sub, keep, **engine_kwargs)


def greedy_generate(engine, store, prompt_ids, n_tokens: int):
    """Plain greedy decoding: (tokens (n_tokens,) list, seconds spent after the prefill)."""
    logits = engine.prefill(prompt_ids, store)
    toks = [int(np.argmax(logits))]
    t0 = time.perf_counter()
    while len(toks) < n_tokens:
        toks.append(int(np.argmax(engine.step(toks[-1], store))))
    return toks, time.perf_counter() - t0


def speculative_generate(target_engine, target_store, draft_engine, draft_store, prompt_ids, n_tokens: int,
                         gamma: int):
    """n_tokens greedy tokens of the target, drafted gamma at a time. Returns (tokens list, stats):
    stats = rounds, drafted, accepted, acceptance (accepted / drafted), tokens_per_round, and
    seconds spent after the prefills in draft, verify, rollback, total (less compile_s, the kernels
    compiled meanwhile; the phases' own seconds include them)."""
    if gamma < 1:
        raise ConfigError(f"gamma must be >= 1, got {gamma}")
    if n_tokens < 1:
        raise ConfigError(f"n_tokens must be >= 1, got {n_tokens}")
    if target_engine.spec.n_vocab != draft_engine.spec.n_vocab:
        raise ConfigError("draft and target must share the vocabulary")
    toks = [int(np.argmax(target_engine.prefill(prompt_ids, target_store)))]   # before the draft reuses buffers
    draft_engine.prefill(prompt_ids, draft_store)
    owed: list[int] = []              # tokens the draft store still has to process before `cur`
    st = {"rounds": 0, "drafted": 0, "accepted": 0, "draft_s": 0.0, "verify_s": 0.0, "rollback_s": 0.0}
    t_start, c_start = time.perf_counter(), compile_clock.totals()[0]
    while len(toks) < n_tokens:
        cur = toks[-1]
        # -- draft: gamma tokens, journaled so the rejected ones can be taken back out
        t0 = time.perf_counter()
        draft_store.begin_journal(gamma + len(owed))
        dl = draft_engine.forward(owed + [cur], draft_store, all_logits=False, few_rows=True)[-1]
        drafts = [int(np.argmax(dl))]
        for _ in range(gamma - 1):
            drafts.append(int(np.argmax(draft_engine.step(drafts[-1], draft_store))))
        n_owed = len(owed)
        t1 = time.perf_counter()
        # -- verify: one forward of gamma + 1 rows through the target store
        target_store.begin_journal(gamma + 1)
        rows = target_engine.logits([cur] + drafts, target_store, few_rows=True)
        pred = np.argmax(rows, axis=1)
        a = 0
        while a < gamma and drafts[a] == int(pred[a]):
            a += 1
        t2 = time.perf_counter()
        # -- rollback: both stores keep exactly [cur, d_1..d_a]
        target_store.rollback(a + 1)
        target_store.commit()
        if a < gamma:
            draft_store.rollback(n_owed + a + 1)
            owed = []
        else:
            owed = [drafts[-1]]
        draft_store.commit()
        t3 = time.perf_counter()
        toks.extend(drafts[:a] + [int(pred[a])])
        st["rounds"] += 1
        st["drafted"] += gamma
        st["accepted"] += a
        st["draft_s"] += t1 - t0
        st["verify_s"] += t2 - t1
        st["rollback_s"] += t3 - t2
    st["compile_s"] = compile_clock.totals()[0] - c_start
    st["total_s"] = time.perf_counter() - t_start - st["compile_s"]
    st["acceptance"] = st["accepted"] / max(st["drafted"], 1)
    st["tokens_per_round"] = (len(toks) - 1) / max(st["rounds"], 1)
    return toks[:n_tokens], st
