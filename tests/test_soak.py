"""Short form of bench/soak.py: one chat session of a tiny model (SmolLM2's tokenizer, chat template
and first 2 layers: the smollm2_cut_path fixture) at capacity 64 takes 20,000 tokens (user turns of
Pride and Prejudice, 8-token greedy answers), saved and reloaded every 5,000 tokens, and the same
conversation without reloads. The answers are the same tokens; open file descriptors
are the same at every reload; RSS after the last reload is within 10% of RSS after the first (the
store is fixed, and the session keeps a bounded history: ChatSession(history_tokens=...)); the
saved file stops growing once the history is full."""
from __future__ import annotations

import os
import sys


import ringllm

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from soak import run_soak  # noqa: E402


def test_soak_short(smollm2_cut_path, tmp_path):
    llm = ringllm.LLM(smollm2_cut_path, n_threads=1, progress=False)
    kw = dict(tokens=20000, capacity=64, policy="streaming", turn_chars=600, answer_tokens=8, folder=str(tmp_path),
              history_tokens=500)
    reloaded = run_soak(llm, reload_every=5000, **kw)
    plain = run_soak(llm, reload_every=None, **kw)
    assert reloaded["tokens_fed"] >= 20000 and len(reloaded["samples"]) >= 5
    assert len(reloaded["answer_digests"]) >= 3
    assert reloaded["answer_digests"] == plain["answer_digests"]
    after_reloads = reloaded["samples"][1:]
    assert len({fds for _, _, fds in after_reloads}) == 1, after_reloads
    first, last = after_reloads[0][1], after_reloads[-1][1]
    assert last <= first * 1.10, after_reloads
    assert reloaded["kv"]["length"] <= 64
    print(reloaded["samples"], reloaded["segments"])
