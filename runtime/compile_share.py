"""Compiling on both cores: processes that share one kernel cache split a cold start's compiles.

Numba compiles one kernel at a time per process, so a cold start (an empty kernel cache: a fresh
install, an upgrade, a new container) leaves every core but one idle while it compiles for most of
its seconds. Processes that share a claims directory (`CLAIMS_ENV`) split the work instead:

- a process about to compile a ringllm kernel signature that is not in the on-disk cache first
  claims it: it creates `<key>.claim` (exclusively, holding its pid) and compiles;
- a process that finds the signature claimed by another waits until the claimant has saved it to
  the cache (`<key>.done`) and loads it from there, as a warm start would;
- a claimant that is gone (its pid ended) or slower than WAIT_S leaves the waiter to compile it
  itself, so cooperation can delay a compile but never lose one. A compile that fails releases
  its claims (`.done` without a cache entry: the waiter compiles and meets the same error).

No deadlock: a process waits only at the start of a compile, holding claims only on the kernels
whose compiles enclose that point (a caller being typed needs its callee); the claimant of the
awaited kernel would need one of those back only if the awaited kernel called its own caller, and
kernels do not recurse.

The key of a signature is the kernel's cache index file (module, name, source line) and its
argument types, so both processes must reach a kernel with the same argument types for the hand-over
to happen; when they do not, each compiles its own, as before.

`plan_helper(argv)` names a helper process, started at this process's first claim (its first
compile): the engine runs a model's code paths in their natural order (a prompt's matrix products,
then attention, FFN, output head, then decode), and the helper (ringllm.compile_helper) runs
them attention-first, so the two meet few kernels at the same time. A warm start never claims
anything and never starts it; `HELPER_ENV=0` turns it off. The helper is stopped when this process
exits (what it finished is in the cache).
"""
from __future__ import annotations

import atexit
import hashlib
import os
import shutil
import subprocess
import tempfile
import threading
import time

from ringllm.runtime import compile_clock

__all__ = ["CLAIMS_ENV", "HELPER_ENV", "WAIT_S", "join", "plan_helper", "helper_wanted", "stop_helper", "stats"]

CLAIMS_ENV = "RINGLLM_COMPILE_CLAIMS"     # the shared claims directory, for a helper process
HELPER_ENV = "RINGLLM_COMPILE_HELPER"     # "0": compile alone (no helper process)
WAIT_S = 300.0                            # longest wait for another process's compile
_POLL_S = 0.005

_lock = threading.Lock()
_local = threading.local()               # .claimed: keys this thread claimed and has not saved yet
_state: dict = {"dir": None, "owner": False, "plan": None, "plan_started": None, "helper": None,
                "claimed": 0, "waited": 0, "wait_s": 0.0}


def helper_wanted() -> bool:
    """Whether a cold start here should start a helper: two or more cores for this process, and
    HELPER_ENV not "0"."""
    if os.environ.get(HELPER_ENV, "1") == "0":
        return False
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return cores >= 2


def join(claims_dir: str) -> None:
    """Take part in the claims of `claims_dir` (a helper process does, with its parent's directory)."""
    _install_hooks()
    with _lock:
        _state["dir"] = claims_dir


def plan_helper(argv: list[str]) -> None:
    """Start `argv` as a helper sharing a claims directory of its own (CLAIMS_ENV in its
    environment): now when the kernel cache holds no kernel at all (a cold start: the helper's
    imports and model load overlap this process's), else at this process's first compile of a
    ringllm kernel (never on a warm start). Each plan starts at most once; a new plan replaces one
    not started yet. Nothing happens without an on-disk cache (NUMBA_CACHE_DIR) to hand kernels over."""
    if not os.environ.get("NUMBA_CACHE_DIR"):
        return
    _install_hooks()
    with _lock:
        _state["plan"] = list(argv)
    if _cache_is_empty():
        _start_helper()


def _claims_dir() -> str:
    """This process's claims directory, made on first use (in the kernel cache directory); removed at exit."""
    with _lock:
        if _state["dir"] is None:
            try:
                _state["dir"] = tempfile.mkdtemp(prefix=".claims-", dir=os.environ.get("NUMBA_CACHE_DIR") or None)
            except OSError:
                _state["dir"] = tempfile.mkdtemp(prefix="ringllm-claims-")
            _state["owner"] = True
            atexit.register(_shutdown)
        return _state["dir"]


def _cache_is_empty() -> bool:
    """No kernel in the cache directory (NUMBA_CACHE_DIR, one subdirectory per source folder)."""
    base = os.environ.get("NUMBA_CACHE_DIR")
    if not base:
        return False
    for root, _dirs, files in os.walk(base):
        if any(f.endswith(".nbi") for f in files):
            return False
    return True


def stats() -> dict:
    """This process's share so far: kernels it claimed, kernels it waited for, seconds waited, and
    whether a helper was started."""
    with _lock:
        return {"claimed": _state["claimed"], "waited": _state["waited"], "wait_s": _state["wait_s"],
                "helper": _state["helper"] is not None}


def stop_helper() -> None:
    """Stop the helper if it still runs (its finished kernels stay in the cache)."""
    helper = _state["helper"]
    if helper is None or helper.poll() is not None:
        return
    helper.terminate()
    try:
        helper.wait(2.0)
    except subprocess.TimeoutExpired:
        helper.kill()
        helper.wait()


def _shutdown() -> None:
    stop_helper()
    if _state["owner"] and _state["dir"]:
        shutil.rmtree(_state["dir"], ignore_errors=True)


def _start_helper() -> None:
    """Start the planned helper (called with the claim of this process's first compile)."""
    claims = _claims_dir()
    with _lock:
        plan = _state["plan"]
        if plan is None or _state["plan_started"] is plan:
            return
        running = _state["helper"]
        if running is not None and running.poll() is None:
            return
        _state["plan_started"] = plan
        env = dict(os.environ)
        env[CLAIMS_ENV] = claims
        env[HELPER_ENV] = "0"
        try:
            _state["helper"] = subprocess.Popen(plan, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                                stderr=subprocess.DEVNULL)
        except OSError:
            _state["helper"] = None


def _path(key: str) -> str:
    return os.path.join(_state["dir"], key)


def _key(cache, sig) -> str:
    """The claim name of a signature: the kernel's cache index file (Numba's own, per kernel) and its types."""
    return hashlib.sha1(f"{cache._cache_file._index_path}\0{sig}".encode()).hexdigest()


def _ours(cache) -> bool:
    """A ringllm kernel's cache, while this process shares its compiles (a helper's claims joined,
    or a helper planned). The Numba internals _key reads exist (else nothing is shared)."""
    if _state["dir"] is None and _state["plan"] is None:
        return False
    index = getattr(getattr(cache, "_cache_file", None), "_index_path", None)
    return index is not None and getattr(getattr(cache, "_py_func", None), "__module__", "").startswith("ringllm")


def _take(key: str) -> bool:
    """Claim key for this process; False when another process holds it."""
    try:
        fd = os.open(_path(key) + ".claim", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
    except FileExistsError:
        return False
    except OSError:
        return True                   # no claims directory to write: compile here, as alone
    with os.fdopen(fd, "w") as f:
        f.write(str(os.getpid()))
    with _lock:
        _state["claimed"] += 1
    if not hasattr(_local, "claimed"):
        _local.claimed = []
    _local.claimed.append(key)
    return True


def _done(key: str) -> None:
    try:
        with open(_path(key) + ".done", "w"):
            pass
    except OSError:
        pass
    claimed = getattr(_local, "claimed", [])
    if key in claimed:
        claimed.remove(key)


def _alive(pid: int) -> bool:
    helper = _state["helper"]
    if helper is not None and helper.pid == pid:
        return helper.poll() is None          # our child: a zombie answers kill(0) until reaped
    try:                                       # Linux: a zombie (ended, not yet reaped) is gone too
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _wait(key: str) -> bool:
    """Wait for another process's claim of key to be saved; False when it will not be (its claimant
    ended, or WAIT_S passed)."""
    t0 = time.monotonic()
    done, claim = _path(key) + ".done", _path(key) + ".claim"
    pid = None
    try:
        while not os.path.exists(done):
            if pid is None:
                try:
                    with open(claim) as f:
                        pid = int(f.read() or 0) or None
                except (OSError, ValueError):
                    pid = None           # written a moment after the file was created
            if (pid is not None and not _alive(pid)) or time.monotonic() - t0 > WAIT_S:
                return os.path.exists(done)
            time.sleep(_POLL_S)
        return True
    finally:
        waited = time.monotonic() - t0
        compile_clock.count_wait(waited)
        with _lock:
            _state["waited"] += 1
            _state["wait_s"] += waited


def _install_hooks() -> None:
    """Wrap Numba's cache lookup and save (every cached dispatcher goes through them) and its compile
    (to release the claims of a compile that raises). Idempotent."""
    from numba.core.caching import Cache
    from numba.core.dispatcher import Dispatcher

    if getattr(Cache, "_ringllm_claims", False):
        return
    load, save, compile_ = Cache.load_overload, Cache.save_overload, Dispatcher.compile

    def load_overload(self, sig, target_context):
        cres = load(self, sig, target_context)
        if cres is not None or not _ours(self):
            return cres
        _claims_dir()
        key = _key(self, sig)
        if _take(key):
            _start_helper()
            return None
        if _wait(key):
            return load(self, sig, target_context)
        return None

    def save_overload(self, sig, data):
        try:
            save(self, sig, data)
        finally:
            if _state["dir"] is not None and _ours(self):
                _done(_key(self, sig))

    def compile(self, sig):
        depth = len(getattr(_local, "claimed", ()))
        try:
            return compile_(self, sig)
        except BaseException:
            claimed = getattr(_local, "claimed", [])
            for key in claimed[depth:]:
                _done(key)
            raise

    Cache.load_overload, Cache.save_overload, Dispatcher.compile = load_overload, save_overload, compile
    Cache._ringllm_claims = True
