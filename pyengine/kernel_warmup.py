"""`ringllm warmup`: compile a model's kernels ahead of time, so its first run starts warm.

The kernels are compiled per CPU and cached on disk (runtime/__init__.py says where); a fresh
install, an upgrade or a new container starts with an empty cache. Running this once (a Dockerfile
step, a post-install hook) pays the compile then: afterwards a new process loads every kernel from
the cache.

What gets compiled: for each KV configuration asked for (by default every eviction policy with its
default knobs), everything a generation with it runs (runtime/warmup.py: prefill of few rows and of
many, decode, eviction by the policy); with all_types, also every supported weight type's kernels
(for models not at hand). The kernels shared by all configurations (the model's weight types,
attention, norms, RoPE) are compiled first, in this process; the rest (each policy's own kernels,
each weight type's) are then compiled by `jobs` processes side by side, each loading the shared ones
from the cache.
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
    """One item's warm-up: what ("policy NAME", "type NAME"; "policy full" also holds the shared
    kernels), compile seconds, signatures compiled, wall seconds."""

    what: str
    compile_s: float
    signatures: int
    wall_s: float


def _engine_for(model, precision: str = "f32"):
    """The model's CPU engine (model: a file, a directory, or None for the bundled model)."""
    from ringllm.models.loader import load_model
    from ringllm.runtime.engine import CPUEngine
    loaded = load_model(model, tokenizer=False)
    return CPUEngine(loaded.spec, loaded.tensors, precision=precision)


def _warm_one(engine, item: str, knobs: dict) -> WarmupResult:
    """Compile item "policy NAME" (the engine's code paths under that policy) or "type NAME"."""
    from ringllm.runtime.quant_types import GGMLType
    from ringllm.runtime.warmup import warm, warm_weight_type
    kind, name = item.split(" ")
    t0 = time.perf_counter()
    with CompileSpan() as span:
        if kind == "type":
            warm_weight_type(GGMLType[name])
        else:
            warm(engine, KVConfig(policy=name, capacity=None if name == "full" else 64, **knobs))
    return WarmupResult(item, span.seconds, span.signatures, time.perf_counter() - t0)


def _worker_init(model, knobs: dict, precision: str) -> None:
    from ringllm.runtime import compile_clock
    compile_clock.quiet()
    _worker_state["engine"] = _engine_for(model, precision)
    _worker_state["knobs"] = knobs


def _worker_run(item: str) -> WarmupResult:
    return _warm_one(_worker_state["engine"], item, _worker_state["knobs"])


def warmup(model=None, policies: list[str] | None = None, jobs: int | None = None, knobs: dict | None = None,
           all_types: bool = False, report=None, precision: str = "f32") -> list[WarmupResult]:
    """Compile (or find cached) every kernel `model` runs under each policy in `policies` (default: all of
    POLICIES), and with all_types every supported weight type's kernels. jobs: processes compiling side by
    side (default: the CPU count). knobs: other KVConfig fields every configuration takes (e.g.
    {"positions": "original"}). precision: the engine's ("q8": its 8-bit activation kernels).
    report(WarmupResult): called as each item finishes. Returns the results, "policy full" (the shared
    kernels) first."""
    from ringllm.runtime.quant_types import SUPPORTED_TYPES
    policies = list(POLICIES) if policies is None else list(dict.fromkeys(policies))
    unknown = [p for p in policies if p not in POLICIES]
    if unknown:
        raise ValueError(f"unknown policy {unknown[0]!r}; valid: {', '.join(POLICIES)}")
    knobs = dict(knobs or {})
    jobs = max(1, jobs or os.cpu_count() or 1)
    report = report or (lambda r: None)
    from ringllm.runtime import compile_clock
    compile_clock.quiet()
    engine = _engine_for(model, precision)
    results = [_warm_one(engine, "policy full", knobs)]          # the kernels every configuration shares
    report(results[0])
    rest = [f"policy {p}" for p in policies if p != "full"]
    if all_types:
        rest += [f"type {t.name}" for t in sorted(SUPPORTED_TYPES)]
    if len(rest) <= 1 or jobs == 1:
        for item in rest:
            results.append(_warm_one(engine, item, knobs))
            report(results[-1])
        return results
    ctx = multiprocessing.get_context("spawn")       # a fresh interpreter: no forked Numba or OpenMP state
    with ctx.Pool(min(jobs, len(rest)), initializer=_worker_init, initargs=(model, knobs, precision)) as pool:
        for r in pool.imap_unordered(_worker_run, rest):
            results.append(r)
            report(r)
    return results
