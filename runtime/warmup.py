"""Run every kernel a generation will use once, so that compiling (or loading from the cache) happens
now, not inside the first prompt.

Numba compiles a kernel per argument-type signature; sizes do not matter. A short run therefore
compiles what a long one needs, provided it takes every code path the long one takes:

- prefill of fewer than matvec.MATMUL_MIN_T rows (one matvec per row) and of more (the tiled
  matrix-matrix kernels), for each weight type of the model;
- a single-token step (decode);
- writes into a full store, where the policy chooses victims (its compiled layer step, its
  scores), with the store's position mode and staged-eviction settings.

`warm(engine, kv)` does that on a small store of the same configuration: its capacity is the
smallest of a few sizes the configuration accepts, so the run costs a few dozen tokens however large
the real store is.
"""
from __future__ import annotations

import dataclasses

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.matvec import MATMUL_MIN_T

_SMALL_CAPACITIES = (16, 32, 64, 128)


def small_config(kv: KVConfig) -> KVConfig | None:
    """kv with the smallest capacity in _SMALL_CAPACITIES it validates with (its own when smaller);
    None when none does (a protected window larger than the sizes tried)."""
    for cap in _SMALL_CAPACITIES:
        if kv.capacity is not None and kv.capacity <= cap:
            return kv
        try:
            return dataclasses.replace(kv, capacity=cap)
        except ConfigError:
            continue
    return None


def warm(engine, kv: KVConfig) -> None:
    """Run `engine` through the code paths of a generation with `kv` (module docstring) on a small
    store of its own. Results are discarded; the engine's scratch may grow to the small store."""
    small = small_config(kv)
    if small is None:               # only the paths that do not evict: still most of the kernels
        small = KVConfig(capacity=max(_SMALL_CAPACITIES), policy="full", positions=kv.positions)
    n_vocab = engine.spec.n_vocab
    store = engine.new_store(small)
    few = [t % n_vocab for t in range(1, MATMUL_MIN_T)]          # the matvec path
    engine.prefill(few, store)
    if small.policy == "full":
        many = small.capacity - len(few) - 1
    else:                           # past the capacity and any staging slack: the policy evicts
        many = small.capacity + small.lazy + small.slack + 2
    many = max(many, MATMUL_MIN_T)
    engine.prefill([(7 * t + 3) % n_vocab for t in range(many)], store)   # the matrix-matrix path
    engine.step(1 % n_vocab, store)
