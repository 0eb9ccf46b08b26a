"""The engines an LLM can run on, and the few store verbs the front end needs from any of them.

    eng = make_engine("cpu", spec, tensors, n_threads=2)    # "cpu" | "cuda" | "reference"
    store = eng.new_store(kv)
    check_room(store, spec, len(ids))                       # ConfigError before any work
    store_stats(store, kv)                                  # capacity, length, evicted_total, ...

Every engine has the verbs of runtime.engine.CPUEngine: new_store(kv), prefill(ids, store) ->
(n_vocab,), step(token, store) -> (n_vocab,), logits(ids, store) -> (len(ids), n_vocab).
ReferenceBackend puts the NumPy oracle (runtime.reference) behind those verbs. Stores differ
(KVStore, PagedStore, CUDAStore, the reference cache), so check_room and store_stats use the
store's own method when it has one and fall back to what every store has (n_seen, policy).

Each engine's module is imported by make_engine only when that backend is chosen: the Numba
engine compiles (or loads) its kernels on import, and the CPU path must never import
ringllm.native (tests/test_native.py checks it).
"""
from __future__ import annotations

from ringllm.generation import peak_rss_bytes
from ringllm.runtime.errors import ConfigError
from ringllm.runtime.kv_config import KVConfig

__all__ = ["BACKENDS", "ReferenceBackend", "check_room", "engine_peak_memory", "make_engine", "store_stats"]

BACKENDS = ("cpu", "cuda", "reference", "none")


def make_engine(backend: str, spec, tensors: dict, n_threads: int | None = None, n_batch: int = 64,
                precision: str = "f32"):
    """The engine of `backend` over a loaded model's spec and tensors (None for "none": a front end
    that never runs the model). precision "q8" (8-bit activations) exists on the cpu backend only.
    ConfigError when the CUDA backend is not built or precision is not available on the backend."""
    if backend == "none":
        return None
    if backend == "cpu":
        from ringllm.runtime.engine import CPUEngine
        return CPUEngine(spec, tensors, n_threads=n_threads, n_batch=n_batch, precision=precision)
    if precision != "f32":
        raise ConfigError(f"precision {precision!r} is implemented by the cpu backend only, not {backend!r}")
    if backend == "reference":
        return ReferenceBackend(spec, tensors)
    try:
        from ringllm.native import CUDAEngine
    except ImportError as exc:
        raise ConfigError(f"the CUDA backend is not built (ringllm.native could not be imported: {exc}); "
                          "build it or use backend='cpu'") from None
    return CUDAEngine(spec, tensors)


class ReferenceBackend:
    """The NumPy reference engine behind CPUEngine's verbs (slow; the oracle)."""

    def __init__(self, spec, tensors):
        from ringllm.runtime.reference import ReferenceEngine
        self.ref = ReferenceEngine(spec, tensors)
        self.spec = spec

    def new_store(self, kv: KVConfig):
        return self.ref.new_cache(kv)

    def prefill(self, ids, store):
        return self.ref.forward(ids, store)[-1]

    def step(self, token, store):
        return self.ref.forward([token], store)[-1]

    def logits(self, ids, store):
        return self.ref.forward(ids, store)


def check_room(store, spec, n: int) -> None:
    """ConfigError when n more tokens do not fit (policy full past the context)."""
    fn = getattr(store, "check_room", None)
    if fn is not None:
        fn(n)
    elif getattr(store, "policy", None) == "full" and store.n_seen - getattr(store, "released", 0) + n > spec.n_ctx:
        raise ConfigError(f"{store.n_seen + n} tokens exceed the model's context {spec.n_ctx} with policy 'full'; "
                          "choose an eviction policy (e.g. streaming) or a shorter input")


def store_stats(store, kv: KVConfig) -> dict:
    """The store's stats (at least capacity, length, evicted_total, policy, tokens_seen)."""
    fn = getattr(store, "stats", None)
    if fn is not None:
        return dict(fn())
    n = int(getattr(store, "n_seen", 0))
    return {"capacity": kv.capacity, "length": n if kv.capacity is None else min(n, kv.capacity),
            "evicted_total": None, "policy": kv.policy, "tokens_seen": n}


def engine_peak_memory(engine) -> int:
    """The process's peak resident memory plus the engine's device peak, where it reports one."""
    gpu = getattr(engine, "peak_memory_bytes", None)
    extra = 0
    if gpu is not None:
        try:
            extra = int(gpu() if callable(gpu) else gpu)
        except Exception:       # a backend gauge must never break a generation
            extra = 0
    return peak_rss_bytes() + extra
