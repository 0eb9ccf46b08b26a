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


def _twice_on_a_fresh_cache(script, tmp_path, *args, cwd=None):
    """stdout, split, of `script` run in two processes in turn on a kernel cache of their own under
    tmp_path: the first compiles what the second loads."""
    env = dict(os.environ, NUMBA_CACHE_DIR=str(tmp_path / "cache"))
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    runs = [subprocess.run([sys.executable, "-c", script, *args], env=env, cwd=cwd, capture_output=True, text=True,
                           timeout=600) for _ in range(2)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    return [run.stdout.split() for run in runs]


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
    first, second = _twice_on_a_fresh_cache(LOAD_ONLY, tmp_path)
    assert first[1:] == ["True", "True"]   # compiled: the compile refreshed the registries
    assert second == ["ringllm.runtime", "False", "True"]


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
elf_symbols = kernel_load.elf_symbols
kernel_load.elf_symbols = lambda obj: listed.update((elf_symbols(obj) or (set(),))[0]) or elf_symbols(obj)
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
    first, second = _twice_on_a_fresh_cache(LOAD_LAZY, tmp_path, str(tmp_path))
    want = str(sum(v * 2.0 + 1.0 for v in range(10)))
    assert first[0] == want and first[3] == "7.5"
    assert second == [want, "0", "True", "7.5", "True", "False"], second


def test_elf_symbols_of_what_is_not_elf():
    """Object code that is not 64-bit little-endian ELF is left to Numba's own loader."""
    from ringllm.runtime.kernel_load import elf_symbols
    assert elf_symbols(b"") is None
    assert elf_symbols(b"\xcf\xfa\xed\xfe" + bytes(60)) is None        # Mach-O
    assert elf_symbols(b"\x7fELF\x01\x01" + bytes(58)) is None         # 32-bit ELF


REGISTRIES_PROBE = r"""
import sys
import numpy as np
import ringllm.runtime
from ringllm.runtime.ops import rms_norm_rows
x = np.arange(128, dtype=np.float32).reshape(2, 64)
out = np.empty_like(x)
rms_norm_rows(out, x, np.ones(64, np.float32), 1e-5)
from numba import njit
from numba.core import entrypoints
scanned = entrypoints._already_initialized
print(*("numba.np.arraymath" in sys.modules, "scipy.linalg" in sys.modules, "yaml" in sys.modules,
        bool(np.isfinite(out).all()), scanned, njit(lambda v: v + 1)(1) == 2 and entrypoints._already_initialized))
"""


def test_numbas_array_registries_are_imported_by_a_compile_not_by_a_warm_start(tmp_path):
    """runtime/__init__.py: a process that compiles imports numba.np.arraymath (with the lowering
    registries) and still not scipy.linalg (its BLAS probe stays blocked); a process that only loads
    the cached kernel imports neither, nor PyYAML (no .numba_config.yaml in the working directory),
    and does not scan the installed packages for Numba extensions (runtime/own_kernels.py), which
    a kernel of another module still does before its first compile."""
    first, second = _twice_on_a_fresh_cache(REGISTRIES_PROBE, tmp_path, cwd=tmp_path)
    assert first == ["True", "False", "False", "True", "True", "True"], first
    assert second == ["False", "False", "False", "True", "False", "True"], second


ALLOCATING_MODULE = r"""
import numpy as np
from numba import njit


@njit(cache=True)
def ramp(n):
    out = np.empty(n, np.float64)
    for i in range(n):
        out[i] = 0.5 * i
    return out
"""

ENVIRONMENT_PROBE = r"""
import sys
import numpy as np
import ringllm.runtime
sys.path.insert(0, sys.argv[1])
import kern
values = kern.ramp(4).tolist() == [0.0, 0.5, 1.0, 1.5]
try:
    kern.ramp(-1)
    raised = "nothing"
except ValueError as exc:                 # np.empty's own check, raised by arrayobj's implementation
    raised = "negative" in str(exc)
imported = "numba.np.arrayobj" in sys.modules
from numba import njit
@njit
def fresh(n):                             # a compile after the load: np.empty's environment is the one loaded
    return np.empty(n, np.int64).size + kern.ramp(n).size
print(values, raised, imported, fresh(3) == 6)
"""


def test_a_cached_kernel_loads_without_importing_its_callees_modules(tmp_path):
    """runtime/__init__.py (_environments_without_import): a kernel allocating with np.empty holds the
    environment of numba.np.arrayobj's implementation; a second process loads it without importing
    that module, gets its values, gets the ValueError that implementation raises for a negative size,
    and compiles a new kernel calling np.empty and the loaded one afterwards."""
    (tmp_path / "kern.py").write_text(ALLOCATING_MODULE)
    first, second = _twice_on_a_fresh_cache(ENVIRONMENT_PROBE, tmp_path, str(tmp_path))
    assert first == ["True", "True", "True", "True"], first
    assert second == ["True", "True", "False", "True"], second


HASHING_MODULE = r"""
from numba import njit


@njit(cache=True)
def text_hash(s):
    return hash(s)
"""

HASHING_PROBE = r"""
import sys
import ringllm.runtime
from ringllm.runtime import kernel_load
refers = set()                        # undefined symbols of the object code the loader reads
elf_symbols = kernel_load.elf_symbols
kernel_load.elf_symbols = lambda obj: refers.update((elf_symbols(obj) or ((), ()))[1]) or elf_symbols(obj)
sys.path.insert(0, sys.argv[1])
import kern
before = "numba.cpython.hashing" in sys.modules
value = kern.text_hash("ringllm")
loaded = sum(kern.text_hash.stats.cache_hits.values())
print(value == hash("ringllm"), loaded, before, any(n.startswith("_numba_hashsecret_") for n in refers))
"""


def test_a_cached_kernel_that_hashes_loads_in_a_new_process(tmp_path):
    """A kernel hashing a string refers to the hash secret's symbols (numba.cpython.hashing registers
    them when imported, which ringllm no longer does at start): the loader sees them among the object
    code's undefined symbols, and a second process loads the kernel and hashes as Python does."""
    (tmp_path / "kern.py").write_text(HASHING_MODULE)
    first, second = _twice_on_a_fresh_cache(HASHING_PROBE, tmp_path, str(tmp_path))
    assert first == ["True", "0", "False", "False"], first
    assert second == ["True", "1", "False", "True"], second


def test_a_kernels_cache_handle_is_made_at_its_first_use(tmp_path, monkeypatch):
    """runtime/own_kernels.py: a kernel of a ringllm module gets its FunctionCache when first
    compiled, the same one (same cache path and index) Numba makes at definition; another module's
    kernel gets Numba's at once."""
    import numba.core.config as numba_config
    from numba import njit
    from numba.core.caching import FunctionCache

    monkeypatch.setattr(numba_config, "CACHE_DIR", str(tmp_path / "cache"))
    src = tmp_path / "probe_kernels.py"
    src.write_text("def twice(x):\n    return 2 * x\n")

    def kernel(module):
        ns = {"__name__": module}
        exec(compile(src.read_text(), str(src), "exec"), ns)
        return njit(cache=True)(ns["twice"])

    ours, theirs = kernel("ringllm.probe_kernels"), kernel("app.probe_kernels")
    assert isinstance(theirs._cache, FunctionCache)
    assert not isinstance(ours._cache, FunctionCache)
    assert ours(21) == 42
    assert isinstance(ours._cache, FunctionCache)
    assert ours._cache.cache_path == FunctionCache(ours.py_func).cache_path
    assert ours._cache._cache_file._index_path == FunctionCache(ours.py_func)._cache_file._index_path
    assert sum(ours.stats.cache_misses.values()) == 1
