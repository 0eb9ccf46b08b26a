"""Start-up: compile time told apart from prompt and decode time, the first-compile notice,
`ringllm warmup` filling the cache a later run loads from, and the cache directory's fallback.

The programs run as subprocesses on a kernel cache of their own (an empty NUMBA_CACHE_DIR), as a
fresh install would."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
from numba import njit

from ringllm.runtime import compile_clock
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.host_memory import small_pages
from ringllm.runtime.kv_config import POLICIES, KVConfig
from ringllm.runtime.warmup import small_config

RINGLLM = [sys.executable, "-m", "ringllm"]
NOTICE = "compiling kernels for this CPU, once"
PROMPT = "It is a truth universally acknowledged, that a single man in possession of a good fortune"


def _run(args, cache_dir, timeout=900):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache_dir))
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    return subprocess.run(RINGLLM + list(args), env=env, capture_output=True, text=True, timeout=timeout)


def test_compile_span_counts_compiles_not_calls():
    @njit
    def add_one(x):
        return x + 1

    with CompileSpan() as first:
        assert add_one(1) == 2
    with CompileSpan() as again:
        assert add_one(2) == 3
    assert first.signatures == 1 and first.seconds > 0
    assert again.signatures == 0 and again.seconds == 0.0
    seconds, count = compile_clock.totals()
    assert seconds >= first.seconds and count >= 1


def test_small_config_fits_every_policy():
    """warm()'s small store: for each policy, a valid config no larger than 128 slots with the policy's
    own knobs (and the configuration itself when it is already small)."""
    for policy in POLICIES:
        kv = KVConfig(policy=policy, capacity=None if policy == "full" else 4096)
        small = small_config(kv)
        assert small is not None and small.policy == policy and small.capacity <= 128
        small.validate()
    tiny = KVConfig(policy="h2o", capacity=12, sinks=2)
    assert small_config(tiny) is tiny
    from ringllm.runtime.matvec import TILED_MIN_T
    full = small_config(KVConfig(capacity=8)).capacity              # full: room for warm()'s tokens
    assert TILED_MIN_T + 4 <= full <= 128
    assert small_config(KVConfig(policy="h2o", capacity=4096, recent=1000)) is None


def test_warmup_llm_on_a_small_full_store():
    """LLM(warmup=True) warms on a store of its own: a full store smaller than warm()'s tokens works."""
    from ringllm.llm import LLM
    llm = LLM(kv=KVConfig(capacity=8), warmup=True, progress=False)
    out = llm.complete("Hello", max_tokens=2, ignore_eos=True)
    assert len(out.tokens) == 2


def test_small_pages_restores_numpy_advice():
    from numpy._core.multiarray import _set_madvise_hugepage
    before = _set_madvise_hugepage(True)
    try:
        with small_pages():
            a = np.zeros((4, 1 << 20), np.float32)
            assert _set_madvise_hugepage(False) is False      # off inside
        assert _set_madvise_hugepage(True) is True            # back on after
        assert a.sum() == 0
    finally:
        _set_madvise_hugepage(before)


def test_cold_run_reports_compile_time_apart_then_warm_run_compiles_nothing(tmp_path):
    cold = _run(["generate", "-p", PROMPT, "-n", "3", "--ignore-eos", "-t", "1", "--no-progress"], tmp_path)
    assert cold.returncode == 0, cold.stderr[-3000:]
    assert cold.stderr.count(NOTICE) == 1 and str(tmp_path) in cold.stderr
    assert "compiled kernels in" in cold.stderr
    warm = _run(["generate", "-p", PROMPT, "-n", "3", "--ignore-eos", "-t", "1", "--no-progress", "--json"], tmp_path)
    assert warm.returncode == 0, warm.stderr[-3000:]
    assert NOTICE not in warm.stderr and "compiled kernels" not in warm.stderr
    tm = json.loads(warm.stdout)["timings"]
    assert tm["compile_s"] == 0.0 and tm["prompt_s"] > 0 and tm["gen_tokens"] == 3


BATCHED_STEP = r"""
import json
from ringllm.models.bundled import default_model_path
from ringllm.models.loader import load_model
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.kv_config import KVConfig

model = load_model(default_model_path())
eng = CPUEngine(model.spec, model.tensors, n_threads=1)
stores = [eng.new_store(KVConfig(capacity=16, policy="streaming", sinks=2)) for _ in range(2)]
for st in stores:
    eng.prefill([1, 2, 3], st)
with CompileSpan() as span:
    eng.step_batch([4, 5], stores)
print(json.dumps(span.signatures))
"""


def test_a_batched_step_compiles_nothing_in_a_later_process():
    """step_batch hands the streams' arrays to its kernel in typed lists, made by cached kernels: a
    later process's batched step compiles nothing (a numba.typed.List built from Python compiles
    Numba's own, uncached, list helpers in every process). On the suite's kernel cache: the first
    process compiles what the cache lacks."""
    counts = []
    for _ in range(2):
        r = subprocess.run([sys.executable, "-c", BATCHED_STEP], capture_output=True, text=True, timeout=900)
        assert r.returncode == 0, r.stderr[-3000:]
        counts.append(json.loads(r.stdout.strip().splitlines()[-1]))
    assert counts[1] == 0, counts


# modules a run imports only where it uses them (docs/startup.md): the q8 mode's kernels, the batched
# step's attention, and Jinja with the chat-template sandbox
LAZY_MODULES = ("ringllm.runtime.quant_tiles_q8", "ringllm.runtime.quant_tiles_q8_wide",
                "ringllm.runtime.stream_attention", "ringllm.chat_sandbox", "jinja2")
LAZY_IMPORTS = r"""
import json, sys
from ringllm.llm import LLM

lazy = %r
llm = LLM(n_threads=1, progress=False)
list(llm.generate(llm.tokenizer.encode("Hello"), max_tokens=1))
plain = sorted(m for m in lazy if m in sys.modules)
llm.render_chat([{"role": "user", "content": "Hello"}], add_generation_prompt=True)
print(json.dumps({"plain": plain, "chat": sorted(m for m in lazy if m in sys.modules)}))
""" % (LAZY_MODULES,)


def test_a_plain_generation_imports_no_q8_batched_or_template_modules():
    """A one-token generation in exact precision imports none of LAZY_MODULES; rendering a chat then
    imports Jinja and the sandbox (and nothing else of them). On the suite's kernel cache."""
    r = subprocess.run([sys.executable, "-c", LAZY_IMPORTS], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    seen = json.loads(r.stdout.strip().splitlines()[-1])
    assert seen == {"plain": [], "chat": ["jinja2", "ringllm.chat_sandbox"]}, seen


@pytest.mark.slow
def test_warmup_command_fills_the_cache_a_policy_run_loads(tmp_path):
    """`ringllm warmup --policy streaming` compiles the shared kernels and the ring policy's paths;
    a later run under that policy (a prompt past the capacity, so it evicts) compiles nothing."""
    w = _run(["warmup", "--policy", "streaming", "--json"], tmp_path)
    assert w.returncode == 0, w.stderr[-3000:]
    report = json.loads(w.stdout)
    assert [r["what"] for r in report["results"]] == ["policy full", "policy streaming"]
    assert report["results"][0]["signatures"] > 0 and report["compile_s"] > 0
    assert report["cache_dir"].startswith(str(tmp_path))
    gen = _run(["generate", "-p", PROMPT, "-n", "4", "--ignore-eos", "--kv-policy", "streaming", "--kv-capacity", "16",
                "-t", "1", "--no-progress", "--json"], tmp_path)
    assert gen.returncode == 0, gen.stderr[-3000:]
    out = json.loads(gen.stdout)
    assert out["kv"]["evicted_total"] > 0
    assert out["timings"]["compile_s"] == 0.0 and NOTICE not in gen.stderr


def test_warmup_refuses_what_it_cannot_compile(tmp_path):
    r = _run(["warmup", "--engine", "cuda"], tmp_path, timeout=120)
    assert r.returncode == 1 and "cpu engine" in r.stderr
    r = _run(["warmup", "--policy", "nonesuch"], tmp_path, timeout=120)
    assert r.returncode == 2 and "nonesuch" in r.stderr


def test_unwritable_cache_directory_falls_back_and_says_so(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    env = dict(os.environ, NUMBA_CACHE_DIR=str(blocker / "cache"))
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    env.pop("RINGLLM_CACHE_FALLBACK_SAID", None)
    r = subprocess.run([sys.executable, "-c", "import os, ringllm.runtime; print(os.environ['NUMBA_CACHE_DIR'])"],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "cannot write the kernel cache" in r.stderr and str(blocker) in r.stderr
    used = r.stdout.strip()
    assert os.path.isdir(used) and not used.startswith(str(blocker))
