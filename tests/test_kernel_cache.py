"""Numba's disk cache of the policies' compiled layer steps: every policy's step is a copy of one
function (policy_step.bind_layer_step) with the policy's kernels bound in, cached under its own
name. A second process must load each from the cache (no compilation) and get the same results;
a step cached under another policy's name would load that policy's machine code instead."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tiny_checkpoints import build_tiny

PROBE = r"""
import json, sys
import numpy as np
from ringllm.models.loader import load_model
from ringllm.runtime.engine import CPUEngine
from ringllm.runtime.kv_config import KVConfig
from ringllm.runtime.policies import REGISTRY

m = load_model(sys.argv[1], tokenizer=False)
out = {}
for name in sys.argv[2:]:
    eng = CPUEngine(m.spec, m.tensors, n_batch=8)
    st = eng.new_store(KVConfig(capacity=12, policy=name, sinks=2, window=4, pool=3))
    logits = eng.logits(np.arange(30) % m.spec.n_vocab, st)
    stats = REGISTRY[name].layer_step.stats
    out[name] = {"logits": logits[-3:].round(6).tolist(), "hits": sum(stats.cache_hits.values()),
                 "misses": sum(stats.cache_misses.values())}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    d = str(tmp_path_factory.mktemp("tiny_cache_llama"))
    build_tiny("llama", d)
    return d


def _probe(model_dir, policies):
    """The probe in a new process, with this process's Numba cache directory (inherited)."""
    res = subprocess.run([sys.executable, "-c", PROBE, model_dir, *policies], env=dict(os.environ),
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_policy_steps_load_from_cache_in_a_new_process(tiny_dir):
    """Two policies with different flags (per-head choice, layer-wide choice): the first process
    compiles their steps (unless an earlier one did), the second loads both from the cache, with
    the same logits. (That the cached code is each policy's own is checked where every policy's
    logits meet the reference engine's: test_policies_engine.)"""
    policies = ["h2o", "tova"]
    first = _probe(tiny_dir, policies)
    warm = _probe(tiny_dir, policies)
    for name in policies:
        assert warm[name]["misses"] == 0 and warm[name]["hits"] >= 1, warm
        assert warm[name]["logits"] == first[name]["logits"], name
    assert first["h2o"]["logits"] != first["tova"]["logits"]


LOAD_ONLY = r"""
import sys
import numpy as np
import numba.core.caching as caching
import ringllm.runtime
from ringllm.runtime.ops import rms_norm_rows
x = np.arange(128, dtype=np.float32).reshape(2, 64)
out = np.empty_like(x)
rms_norm_rows(out, x, np.ones(64, np.float32), 1e-5)
want = x / np.sqrt((x.astype(np.float64) ** 2).mean(axis=1, keepdims=True) + 1e-5)
print(caching.Cache.load_overload.__module__, "numba.cpython.heapq" in sys.modules,
      bool(np.allclose(out, want, rtol=1e-5)))
"""


def test_a_cached_kernel_loads_without_the_registry_refresh(tmp_path):
    """The second process loads the kernel the first compiled, through ringllm's loader (no import of
    Numba's registry modules, which only a refresh imports) and gets the right values from it."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path))
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    runs = [subprocess.run([sys.executable, "-c", LOAD_ONLY], env=env, capture_output=True, text=True, timeout=600)
            for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout.split()[1:] == ["True", "True"]   # compiled: the compile refreshed the registries
    assert runs[1].stdout.split() == ["ringllm.runtime", "False", "True"]


KERNELS_MODULE = r"""
from numba import njit


@njit(cache=True)
def inner(x):
    return x * 2.0 + 1.0


@njit(cache=True)
def outer(a):
    s = 0.0
    for v in a:
        s += inner(v)
    return s
"""

LOAD_LAZY = r"""
import sys
import numpy as np
import llvmlite.binding as ll
import ringllm.runtime
from ringllm.runtime import kernel_load
listed = set()
elf_symbols = kernel_load.elf_defined_globals
kernel_load.elf_defined_globals = lambda obj: listed.update(elf_symbols(obj) or ()) or elf_symbols(obj)
parsed = []
parse = ll.parse_bitcode
ll.parse_bitcode = lambda data: parsed.append(len(data)) or parse(data)
sys.path.insert(0, sys.argv[1])
import kern
value = kern.outer(np.arange(10.0))
loaded_parses = len(parsed)
(cres,) = kern.outer.overloads.values()
entry = cres.fndesc.llvm_cpython_wrapper_name in listed     # its entry point, among the ELF symbols read
from numba import njit
@njit
def fresh(x):
    return kern.inner(x) + 0.5
print(value, loaded_parses, entry, fresh(3.0), len(parsed) > loaded_parses,
      cres.library._codegen._engine.is_symbol_defined("no_such_symbol_anywhere"))
"""


def test_a_cached_kernel_loads_without_parsing_its_bitcode(tmp_path):
    """runtime/kernel_load.py: a second process loads a cached kernel (and the cached kernel it calls)
    without parsing bitcode, finds its entry point among the object code's ELF symbols and gets the right
    value; a new kernel compiled in that process calling the loaded one links against it (its bitcode is
    parsed then) and computes the right value; a lookup of an unknown symbol answers False."""
    (tmp_path / "kern.py").write_text(KERNELS_MODULE)
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    runs = [subprocess.run([sys.executable, "-c", LOAD_LAZY, str(tmp_path)], env=env, capture_output=True,
                           text=True, timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    want = str(sum(v * 2.0 + 1.0 for v in range(10)))
    first, second = runs[0].stdout.split(), runs[1].stdout.split()
    assert first[0] == want and first[3] == "7.5"
    assert second == [want, "0", "True", "7.5", "True", "False"], second


def test_elf_symbols_of_what_is_not_elf():
    """Object code that is not 64-bit little-endian ELF is left to Numba's own loader."""
    from ringllm.runtime.kernel_load import elf_defined_globals
    assert elf_defined_globals(b"") is None
    assert elf_defined_globals(b"\xcf\xfa\xed\xfe" + bytes(60)) is None        # Mach-O
    assert elf_defined_globals(b"\x7fELF\x01\x01" + bytes(58)) is None         # 32-bit ELF
