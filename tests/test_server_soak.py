"""Short form of bench/server_soak.py: a real `ringllm serve` on a tiny model (SmolLM2's tokenizer,
chat template and first 2 layers: the smollm2_cut_path fixture) takes 20,000 tokens of streamed
greedy chat from 8 clients, 30% of whose requests hang up mid-stream. The server
is up at the end; every request that stayed got its whole answer (finish_reason "length", usage of
max_tokens completion tokens, [DONE]); after the first tenth of the tokens the RSS does not climb:
the second half's largest sample is within 10% plus the prompt cache's budget of the first half's,
and the last within that of the first (the full-length run is bench/results/server_soak.md)."""
from __future__ import annotations

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
from server_soak import soak_server  # noqa: E402

CACHE_MB = 16


def test_server_soak_short(smollm2_cut_path):
    args = argparse.Namespace(model=smollm2_cut_path, tokens=20000, clients=8, disconnect=0.3, max_tokens="8,32",
                              cache_mb=CACHE_MB, max_batch=8, sample_s=1.0, settle=0.1, seed=0, name="unused")
    res = soak_server(args)
    print({k: v for k, v in res.items() if k != "rss_samples"})
    assert res["health_at_end"] == 200
    assert res["tokens"] >= 20000
    assert res["incomplete"] == 0, res["incomplete_kinds"]
    assert res["completed"] >= 10 and res["disconnects"] >= 3
    assert res["rss_last_mib"] <= res["rss_settled_mib"] * 1.10 + CACHE_MB, res["rss_samples"]
    first_half, second_half = res["rss_max_settled_halves_mib"]
    assert second_half <= first_half * 1.10 + CACHE_MB, res["rss_samples"]
    assert res["rss_max_mib"] <= res["rss_settled_mib"] * 1.25 + CACHE_MB, res["rss_samples"]
