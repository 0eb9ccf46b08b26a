"""ringllm.runtime: kernels, KV store, eviction policies, CPU and reference engines.

Numba's OpenMP layer (libgomp) keeps a thread that has finished its share of a parallel kernel
spinning before it sleeps; how long (GOMP_SPINCOUNT) is chosen by runtime/omp_spin.py as a time,
before libgomp is loaded. OMP_WAIT_POLICY=active keeps that count when libgomp "throttles": once a
process holds more OpenMP threads than cores (two threads that each ran a parallel kernel, e.g. a
server that warmed up on its main thread and decodes on a worker thread, each with its own thread
team), libgomp's default cuts the spin to 100 iterations, every kernel's workers fall asleep between
the parallel regions of a decode step, and decoding runs at half speed. With the policy active and
the spin count set, the throttled count is the same (threads still sleep after it: an idle process
stays idle). Values the user exported win.

Numba's on-disk cache (cache=True) checks only the source file a kernel is defined in: a kernel
that compiles in one from another file (a policy's layer step compiles in the store's write
kernel, the attention kernel and the policy's own functions) keeps its stale machine code when only
that other file changes.
The cache therefore lives in a directory named by a hash of every source file of this package
(under NUMBA_CACHE_DIR when the user set one, else ~/.cache/ringllm/numba, else the temporary
directory): any change to the kernels starts a fresh cache, and the three newest directories are kept.
"""
import hashlib
import importlib
import os
import shutil
import sys
import tempfile

os.environ.setdefault("OMP_WAIT_POLICY", "active")

from ringllm.runtime.user_cache import user_cache_dir  # noqa: E402


def _source_digest() -> str:
    """Hash of every source file of this package: names the cache directory of this exact code."""
    here = os.path.dirname(os.path.abspath(__file__))
    digest = hashlib.sha1()
    for root, dirs, files in os.walk(here):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith(".py"):
                with open(os.path.join(root, name), "rb") as f:
                    digest.update(name.encode() + b"\0" + f.read())
    return digest.hexdigest()[:16]


def _claim(base: str, digest: str) -> str:
    """base/digest created, touched and shown writable (the two newest others kept, older removed);
    raises OSError when it cannot be written."""
    path = os.path.join(base, digest)
    os.makedirs(path, exist_ok=True)
    os.utime(path)
    probe = os.path.join(path, f".write-probe-{os.getpid()}")
    with open(probe, "w"):
        pass
    os.remove(probe)
    olds = sorted((e for e in os.scandir(base) if e.is_dir() and len(e.name) == 16 and e.path != path),
                  key=lambda e: e.stat().st_mtime, reverse=True)
    for e in olds[2:]:
        shutil.rmtree(e.path, ignore_errors=True)
    return path


def _numba_cache_dir() -> str:
    """The kernel cache directory: under the user's NUMBA_CACHE_DIR or ~/.cache/ringllm/numba; when
    that cannot be written (a read-only home in a container), under the system's temporary directory,
    said once on stderr. "" when no directory can be written (Numba then compiles in every process)."""
    digest = _source_digest()
    preferred = os.environ["RINGLLM_NUMBA_CACHE_BASE"] or user_cache_dir("numba")
    fallback = os.path.join(tempfile.gettempdir(), f"ringllm-numba-{os.getuid() if hasattr(os, 'getuid') else 0}")
    for base in (preferred, fallback):
        try:
            path = _claim(base, digest)
        except OSError as exc:
            reason = exc
            continue
        if base != preferred and not os.environ.get("RINGLLM_CACHE_FALLBACK_SAID"):
            os.environ["RINGLLM_CACHE_FALLBACK_SAID"] = "1"      # once, child processes included
            print(f"ringllm: cannot write the kernel cache under {preferred} ({reason.strerror or reason}); "
                  f"using {base} instead (set NUMBA_CACHE_DIR to choose)", file=sys.stderr)
        return path
    return ""


def _set_numba_cache_dir() -> None:
    # the user's NUMBA_CACHE_DIR, remembered for child processes (which inherit the hashed one)
    os.environ.setdefault("RINGLLM_NUMBA_CACHE_BASE", os.environ.get("NUMBA_CACHE_DIR", ""))
    path = _numba_cache_dir()
    if not path:
        return
    os.environ["NUMBA_CACHE_DIR"] = path
    _import_numba()
    import numba.core.config as numba_config     # already imported by a caller: it read the environment then
    numba_config.CACHE_DIR = path


def _import_without(name: str, blocked: str) -> None:
    """Import Numba's module `name` with module `blocked` unimportable for that one import (the import
    machinery's "halted" marker, None in sys.modules: ImportError), unless the process has imported
    either already. Three of the modules Numba imports (at its own import, or on a first compile) import
    an optional dependency no ringllm kernel uses, at a cost every process would pay:

    - numba.np.arraymath probes for a BLAS by importing scipy.linalg (OpenBLAS: 0.2-0.5 s and tens of
      MB). Its only use is np.correlate/np.convolve picking BLAS over a plain loop; a user's own np.dot
      still imports it when compiled.
    - numba.core.typing.cffi_utils builds a cffi.FFI() when cffi is installed (ringllm's CUDA backend
      installs it), which imports cffi's C parser, pycparser. It lets Numba kernels call cffi
      functions, which no ringllm kernel does; a process that imports cffi before ringllm keeps it.
    - numba.core.config imports PyYAML, only to read a `.numba_config.yaml` in the working directory
      (_import_numba)."""
    if blocked in sys.modules or name in sys.modules:
        return
    sys.modules[blocked] = None
    try:
        importlib.import_module(name)
    finally:
        if sys.modules.get(blocked, 0) is None:
            del sys.modules[blocked]


def _import_numba() -> None:
    """Import Numba; without PyYAML unless the working directory holds the `.numba_config.yaml` that
    Numba's config module would read with it: otherwise every start pays yaml's import for a file
    that is not there."""
    if os.path.isfile(".numba_config.yaml"):
        importlib.import_module("numba.core.config")
    else:
        _import_without("numba.core.config", "yaml")


_set_numba_cache_dir()
_import_without("numba.core.typing.cffi_utils", "cffi")


def _registries_without_blas() -> None:
    """numba.np.arraymath (and with it Numba's array, string and hashing implementations) is imported
    by the lowering registries' first load (CPUContext.load_additional_registries), which a compile runs
    and a cache load no longer does (_load_cached_without_refresh): it is imported there, with
    scipy.linalg unimportable for that import (_import_without), instead of at every start. A warm
    process that only loads kernels never imports it. The hash secret that numba.cpython.hashing
    registers, the one symbol such an import provides that a cached kernel may need, is imported by the
    kernel loader when a kernel refers to it (kernel_load.py)."""
    from numba.core import cpu

    numba_load = cpu.CPUContext.load_additional_registries
    if getattr(numba_load, "_ringllm", False):
        return

    def load_additional_registries(self):
        _import_without("numba.np.arraymath", "scipy.linalg")
        return numba_load(self)

    load_additional_registries._ringllm = True
    load_additional_registries.__doc__ = numba_load.__doc__
    cpu.CPUContext.load_additional_registries = load_additional_registries


def _load_cached_without_refresh() -> None:
    """Numba's cache loader (caching.Cache.load_overload) refreshes the target context before it loads
    a kernel: it imports every module of Numba's typing and lowering registries and installs them, the
    better part of a tenth of a second at the first load of a process, although rebuilding compiled code
    uses none of them (a compile refreshes the context itself, compiler.compile_extra). What a loaded
    kernel does need is the NRT (its allocator and reference counting), whose initialisation the refresh
    also runs; the loader here runs that alone, then loads as Numba's does. Numba's other symbols are in
    place without a refresh (the C helpers and math functions from the context's construction, the
    threading layer's from its launch, the hash secret from numba.cpython.hashing's import, which the
    kernel loader makes for a kernel that refers to it). Applied only where Numba's loader is the
    refresh-then-load this replaces."""
    from numba.core import caching
    from numba.core.runtime import rtsys

    names = caching.Cache.load_overload.__code__.co_names
    if not {"refresh", "_guard_against_spurious_io_errors", "_load_overload"} <= set(names) or \
            not hasattr(rtsys, "initialize"):
        return

    def load_overload(self, sig, target_context):
        rtsys.initialize(target_context)
        with self._guard_against_spurious_io_errors():
            return self._load_overload(sig, target_context)

    load_overload.__doc__ = caching.Cache.load_overload.__doc__
    caching.Cache.load_overload = load_overload


def _environments_without_import() -> None:
    """A cached kernel's data holds the environment of each function compiled into it, named by the
    module that function comes from, and Numba's rebuild of one (environment._rebuild_env) imports that
    module to give the environment its globals. Most kernels hold one of numba.np.arrayobj's functions
    (np.empty's implementation, for one), whose import, with numba.cpython.unicode, charseq and hashing
    behind it, is the largest part of a warm process's first kernel load: for globals that nothing
    reads. Compiled nopython code takes what it needs from the environment's constants; only object-mode
    lowering reads an environment's globals. A module not imported yet gets an environment whose globals
    hold its name alone, which is all that caching the environment again (Environment.__reduce__,
    can_cache) reads; an imported module's environment keeps its real globals. Applied only where
    Numba's rebuild is the look-up, import, build this replaces."""
    from numba.core import environment

    rebuild = environment._rebuild_env
    if getattr(rebuild, "_ringllm", False) or not {"lookup_environment", "import_module", "Environment",
                                                     "_memo"} <= set(rebuild.__code__.co_names):
        return

    def _rebuild_env(modname, consts, env_name):
        if modname in sys.modules or environment.lookup_environment(env_name) is not None:
            return rebuild(modname, consts, env_name)
        env = environment.Environment({"__name__": modname})
        env.consts[:] = consts
        env.env_name = env_name
        environment.Environment._memo[env_name] = env
        return env

    _rebuild_env._ringllm = True
    environment._rebuild_env = _rebuild_env


_load_cached_without_refresh()
_registries_without_blas()
_environments_without_import()

from ringllm.runtime import kernel_load  # noqa: E402

if not kernel_load.install():          # Numba's own loader: the hash secret's symbols at hand (kernel_load)
    importlib.import_module("numba.cpython.hashing")

from ringllm.runtime import own_kernels  # noqa: E402  (before any kernel is defined)

own_kernels.install()

from ringllm.runtime import compile_clock, compile_gc  # noqa: E402  (after the cache directory is set)

compile_clock.set_cache_dir(os.environ.get("NUMBA_CACHE_DIR"))
compile_gc.install()

from ringllm.runtime import omp_spin  # noqa: E402  (its kernel caches in the directory set above)

omp_spin.choose_at_import()
