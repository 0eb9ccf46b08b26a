"""`ringllm warmup`: compile a model's kernels ahead of time, so its first run starts warm.

The kernels are compiled per CPU and cached on disk (runtime/__init__.py says where); a fresh
install, an upgrade or a new container starts with an empty cache. Running this once (a Dockerfile
step, a post-install hook) pays the compile then: afterwards a new process loads every kernel from
the cache.

What gets compiled: for each KV configuration asked for (by default every eviction policy with its
default knobs), everything a generation with it runs (runtime/warmup.py: prefill of few rows and of
many, decode, eviction by the policy). The kernels shared by all configurations (the model's weight
types, attention, norms, RoPE) are compiled first, in this process; the policies' own kernels are
then compiled by `jobs` processes side by side, each loading the shared ones from the cache.
"""
from __future__ import annotations

import multiprocessing
import os
import time
from dataclasses import dataclass

from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.kv_config import POLICIES, KVConfig

_worker_state: dict = {}


@dataclass
class WarmupResult:
    """One configuration's warm-up: its policy, compile seconds, signatures compiled, wall seconds."""

    policy: str
    compile_s: float
    signatures: int
    wall_s: float


def _engine_for(model):
    """The model's CPU engine (model: a file, a directory, or None for the bundled model)."""
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    loaded = load_model(model, tokenizer=False)
    return CPUEngine(loaded.spec, loaded.tensors)


def _warm_one(engine, policy: str, knobs: dict) -> WarmupResult:
    from ringllm.runtime.warmup import warm
    kv = KVConfig(policy=policy, capacity=None if policy == "full" else 64, **knobs)
    t0 = time.perf_counter()
    with CompileSpan() as span:
        warm(engine, kv)
    return WarmupResult(policy, span.seconds, span.signatures, time.perf_counter() - t0)


def _worker_init(model, knobs: dict) -> None:
    from ringllm.runtime import compile_clock
    compile_clock.quiet()
    _worker_state["engine"] = _engine_for(model)
    _worker_state["knobs"] = knobs


def _worker_run(policy: str) -> WarmupResult:
    return _warm_one(_worker_state["engine"], policy, _worker_state["knobs"])


def warmup(model=None, policies: list[str] | None = None, jobs: int | None = None, knobs: dict | None = None,
           report=None) -> list[WarmupResult]:
    """Compile (or find cached) every kernel `model` runs under each policy in `policies` (default: all of
    POLICIES). jobs: processes compiling policies side by side (default: the CPU count). knobs: other
    KVConfig fields every configuration takes (e.g. {"positions": "original"}). report(WarmupResult):
    called as each configuration finishes. Returns the results, the shared kernels first (as "full")."""
    policies = list(POLICIES) if policies is None else list(dict.fromkeys(policies))
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; valid: {', '.join(POLICIES)}")
    knobs = dict(knobs or {})
    jobs = max(1, jobs or os.cpu_count() or 1)
    report = report or (lambda r: None)
    from ringllm.runtime import compile_clock
    compile_clock.quiet()
    engine = _engine_for(model)
    results = [_warm_one(engine, "full", knobs)]          # the kernels every configuration shares
    report(results[0])
    rest = [p for p in policies if p != "full"]
    if len(rest) <= 1 or jobs == 1:
        for p in rest:
            results.append(_warm_one(engine, p, knobs))
            report(results[-1])
        return results
    ctx = multiprocessing.get_context("spawn")       # a fresh interpreter: no forked Numba or OpenMP state
    with ctx.Pool(min(jobs, len(rest)), initializer=_worker_init, initargs=(model, knobs)) as pool:
        for r in pool.imap_unordered(_worker_run, rest):
            results.append(r)
            report(r)
    return results
