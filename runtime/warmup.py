"""Run every kernel a generation will use once, so that compiling (or loading from the cache) happens
now, not inside the first prompt.

Numba compiles a kernel per argument-type signature; sizes do not matter. A short run therefore
compiles what a long one needs, provided it takes every code path the long one takes:

- prefill of fewer than matvec.TILED_MIN_T rows (one matvec per row) and of more (the tiled
  matrix-matrix kernels, and the whole-chunk attention however few pairs the chunk attends: a long
  prompt's later chunks take it), for each weight type of the model; and, unless left out, the few-row kernels
  batched decode and speculative decoding run (rows in pairs through each tile), and the attention of a
  verification's tokens as one run (warm_verify_run);
- a single-token step (decode);
- writes into a full store, where the policy chooses victims (its compiled layer step, its
  scores), with the store's position mode and staged-eviction settings.

`warm(engine, kv)` does that on a small store of the same configuration: its capacity is the
smallest of a few sizes the configuration accepts, so the run costs a few dozen tokens however large
the real store is. `warm_weight_type(qtype)` compiles one weight type's kernels (matvec, matmul,
embedding-row dequantization) on a small random matrix, for models not at hand.
"""
from __future__ import annotations

import dataclasses

import numpy as np

from ringllm.runtime import compile_share
from ringllm.runtime import matvec as mv
from ringllm.runtime.dequant import dequantize_rows
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.matvec import MATMUL_MIN_T, TILED_MIN_T
from ringllm.runtime.quant_types import GGMLType
from ringllm.runtime.random_weights import random_qtensor

_SMALL_CAPACITIES = (16, 32, 64, 128)
_FEW = 3            # rows of warm()'s short prefill chunk (below matvec.TILED_MIN_T)


def small_config(kv: KVConfig) -> KVConfig | None:
    """kv with the smallest capacity in _SMALL_CAPACITIES it validates with (an evicting policy's own
    capacity when smaller; policy full the smallest that holds warm()'s tokens without evicting);
    None when none does (a protected window larger than the sizes tried)."""
    for cap in _SMALL_CAPACITIES:
        if kv.policy == "full" and cap < _FEW + 2 * TILED_MIN_T + 1:
            continue
        if kv.policy != "full" and kv.capacity is not None and kv.capacity <= cap:
            return kv
        try:
            return dataclasses.replace(kv, capacity=cap)
        except ConfigError:
            continue
    return None


def _small_or_full(kv: KVConfig) -> KVConfig:
    """small_config(kv), or where none validates a small store of policy full in kv's position mode
    and KV types (only the paths that do not evict: still most of the kernels)."""
    return small_config(kv) or KVConfig(capacity=max(_SMALL_CAPACITIES), policy="full", positions=kv.positions,
                                        k_type=kv.k_type, v_type=kv.v_type)


def warm(engine, kv: KVConfig, few_rows: bool = True) -> None:
    """Run `engine` through the code paths of a generation with `kv` (module docstring) on a small
    store of its own. Results are discarded; the engine's scratch may grow to the small store.
    few_rows=False leaves out the few-row kernels (2..MATMUL_MIN_T - 1 rows: each weight type's
    takes 1.5-4.5 s to compile), which only batched decode (CPUEngine.step_batch) and speculative
    decoding (forward(few_rows=True)) run; a single sequence's short prefill chunk runs one matvec
    per row, the same bits."""
    small = _small_or_full(kv)
    n_vocab = engine.spec.n_vocab
    store = engine.new_store(small)
    few = [t % n_vocab for t in range(1, _FEW + 1)]               # a short chunk: one matvec per row
    engine.prefill(few, store)
    chunk = [(5 * t + 2) % n_vocab for t in range(TILED_MIN_T)]   # tiled, and fits: the whole-chunk attention
    saved = getattr(engine, "chunk_min_pairs", None)
    if saved is not None:           # taken however few pairs it attends (a long prompt's later chunks take it)
        engine.chunk_min_pairs = 0
    try:
        engine.prefill(chunk, store)
    finally:
        if saved is not None:
            engine.chunk_min_pairs = saved
    if small.policy == "full":
        many = small.capacity - len(few) - len(chunk) - 1
    else:                           # past the capacity and any staging slack: the policy evicts
        many = small.capacity + small.lazy + small.slack + 2
    many = max(many, TILED_MIN_T)
    engine.prefill([(7 * t + 3) % n_vocab for t in range(many)], store)   # the matrix-matrix path
    engine.step(1 % n_vocab, store)
    if few_rows:
        warm_few_rows(engine)
        warm_verify_run(engine, small)


def warm_decode(engine, kv: KVConfig, one_thread_first: bool = False) -> None:
    """Run a decode step's kernels on a small store of kv's configuration (small_config), attention
    first: every layer's write and attention and the output head (CPUEngine.attend_and_head), then
    a whole step (the decode matvecs, the FFN). The order of a helper compiling beside a process
    that feeds a prompt (runtime/compile_share.py): the prompt's matrix products come first there,
    its attention next, the head at its end, decode's matvecs only after its first token.
    one_thread_first: the attention on one thread (attend_stored) before anything else, even the
    RoPE and write kernels a token's attention runs first (CPUEngine.attend_empty); then what the
    parent needs after it and has not claimed (CPUEngine.warm_ahead, compile_share.run_unclaimed);
    the threaded kernel after those: the parent runs the one-thread one until it is saved
    (rope._attend_stored)."""
    small = _small_or_full(kv)
    if one_thread_first:
        parallel, engine.sc.parallel = engine.sc.parallel, False
        try:
            store = engine.new_store(small)
            engine.attend_empty(store)
            compile_share.run_unclaimed(engine.warm_ahead())
            engine.attend_and_head(store)
        finally:
            engine.sc.parallel = parallel
    engine.attend_and_head(engine.new_store(small))
    engine.step(1 % engine.spec.n_vocab, engine.new_store(small))


def warm_few_rows(engine) -> None:
    """Compile (or load) the few-row kernels of every weight type of `engine`'s matrices, for a caller
    that batches (the server's worker) and should not pay their compile inside its first batch."""
    for qtype in sorted({pm.qtype for pm in getattr(engine, "mats", {}).values()}):
        warm_weight_type(qtype)


def warm_verify_run(engine, kv: KVConfig) -> None:
    """Compile (or load) the attention a speculative verification runs when its tokens fit in a ring
    layer's free slots (rope.StoredRope.write_attend_run): two journaled tokens into a fresh store of
    kv's configuration, taken back out. A store the journal cannot undo never verifies: nothing to do."""
    store = engine.new_store(kv)
    try:
        store.begin_journal(2)
    except ConfigError:
        return
    engine.logits([1 % engine.spec.n_vocab, 2 % engine.spec.n_vocab], store, few_rows=True)
    store.rollback(0)
    store.commit()


def warm_weight_type(qtype: GGMLType) -> None:
    """Run the kernels a weight of `qtype` uses (decode matvec, few-row and many-row matmul, embedding
    rows) once, on a random 48 x 512 matrix (512: a whole number of blocks of every type)."""
    rng = np.random.default_rng(0)
    t = random_qtensor(qtype, 48, 512, rng)
    pm = mv.pack(t)
    x = rng.standard_normal((MATMUL_MIN_T, 512)).astype(np.float32)
    out = np.empty((MATMUL_MIN_T, 48), np.float32)
    mv.matvec(out[0], pm, x[0])
    mv.matmul(out[:3], pm, x[:3])
    mv.matmul(out, pm, x)
    dequantize_rows(t.data, qtype, 512, np.arange(3))


# Cold-compile seconds per unit on a 2-core x86-64 (bench/results/startup_profile.md): the kernels every
# model runs (attention, RoPE, norms, the store's write, embedding rows), each weight type's decode
# matvec and repacking kernel, each weight family's prefill matmul, and a policy's compiled layer step.
_COMPILE_S = {"shared": 4.0, "matvec": 1.8, "matmul": 4.5, "policy_step": 40.0}


def estimate_compile_seconds(qtypes, kv: KVConfig) -> float:
    """Rough cold-compile time of a model whose matrices have types `qtypes` under `kv`, for the
    first-compile notice (a machine slower or faster than the one measured scales it)."""
    from ringllm.runtime.matvec_kernels import KERNELS
    qtypes = {GGMLType(int(q)) for q in qtypes} & set(KERNELS)
    families = {KERNELS[q][1] for q in qtypes}
    return (_COMPILE_S["shared"] + _COMPILE_S["matvec"] * len(qtypes) + _COMPILE_S["matmul"] * len(families)
            + (0.0 if kv.ring else _COMPILE_S["policy_step"]))
