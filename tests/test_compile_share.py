"""Two processes sharing a cold start's compiles (runtime/compile_share.py): a kernel claimed by one
is loaded from the cache by the other, never compiled twice; a claimant that dies or a compile that
fails leaves the other to compile it; an LLM's cold start hands kernels over from its helper and
generates what a warm start generates; the helper ends with its parent (exit, kill), a forked child
leaves both alone, and a killed parent's claims directory is swept by the next; a kernel asked for
under unless_compiling() while the helper runs is refused (NotReady), neither compiled nor awaited.

Every program runs as a subprocess on a kernel cache of its own (an empty NUMBA_CACHE_DIR)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from ringllm.runtime import compile_share

# role: wait for the file GO.<role>, then run gated_act_fused (about a second to compile) once; print
# what it compiled, this process's share and the result. Role "bad" passes a 1-d input (a typing error).
ROLE = r"""
import json, os, sys, time
import numpy as np
role, claims, go = sys.argv[1:4]
from ringllm.runtime import compile_share
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.ops import gated_act_fused
compile_share.join(claims)
open(go + "." + role + ".ready", "w").close()
while not os.path.exists(go + "." + role):
    time.sleep(0.002)
x = np.linspace(-2, 2, 256, dtype=np.float32).reshape(2, 128)
out = np.zeros((2, 64), np.float32)
error = None
with CompileSpan() as span:
    try:
        gated_act_fused(out, x.reshape(-1) if role == "bad" else x, 0)
    except Exception as exc:
        error = type(exc).__name__
print(json.dumps({"compiled": span.signatures, "stats": compile_share.stats(), "out": out.tolist(), "error": error}))
"""

LLM_RUN = r"""
import json, sys
from numba.core import event
from ringllm import LLM
from ringllm.runtime import compile_share
compiled = []                       # every kernel this process compiles (not those it loads)
class Compiled(event.Listener):
    def on_start(self, ev):
        compiled.append(ev.data["dispatcher"].py_func.__name__)
    def on_end(self, ev):
        pass
event.register("numba:compile", Compiled())
llm = LLM(n_threads=2)
done = llm.complete("The capital of France is", max_tokens=int(sys.argv[1]), ignore_eos=True)
print(json.dumps({"tokens": list(done.tokens), "stats": compile_share.stats(), "compiled": compiled,
                  "compile_s": done.timings.compile_s, "prompt_s": done.timings.prompt_s}))
"""


def _env(cache):
    env = dict(os.environ, NUMBA_CACHE_DIR=str(cache))
    env.pop("RINGLLM_NUMBA_CACHE_BASE", None)
    env.pop(compile_share.HELPER_ENV, None)
    return env


def _start(role, claims, go, cache):
    return subprocess.Popen([sys.executable, "-c", ROLE, role, str(claims), str(go)], env=_env(cache),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _until(cond, timeout=120.0):
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out"
        time.sleep(0.002)


def _result(proc):
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _claims(claims):
    return [f for f in os.listdir(claims) if f.endswith(".claim")]


@pytest.fixture
def dirs(tmp_path):
    claims, cache = tmp_path / "claims", tmp_path / "cache"
    claims.mkdir()
    cache.mkdir()
    return claims, tmp_path / "go", cache


def test_a_claimed_kernel_is_loaded_not_compiled_again(dirs):
    claims, go, cache = dirs
    a, b = _start("a", claims, go, cache), _start("b", claims, go, cache)
    _until(lambda: os.path.exists(f"{go}.a.ready") and os.path.exists(f"{go}.b.ready"))
    open(f"{go}.a", "w").close()
    _until(lambda: _claims(claims))         # a is compiling now: b asks for the same kernel
    open(f"{go}.b", "w").close()
    ra, rb = _result(a), _result(b)
    assert ra["compiled"] >= 1 and ra["stats"]["claimed"] >= 1
    assert rb["compiled"] == 0 and rb["stats"]["claimed"] == 0 and rb["stats"]["waited"] >= 1
    assert rb["out"] == ra["out"]
    assert {f[:-5] for f in os.listdir(claims) if f.endswith(".done")} == {f[:-6] for f in _claims(claims)}


def test_a_claimant_that_dies_leaves_the_kernel_to_the_other(dirs):
    claims, go, cache = dirs
    a, b = _start("a", claims, go, cache), _start("b", claims, go, cache)
    _until(lambda: os.path.exists(f"{go}.a.ready") and os.path.exists(f"{go}.b.ready"))
    open(f"{go}.a", "w").close()
    _until(lambda: _claims(claims))
    a.kill()                                # mid-compile: its claim stays, its pid is gone
    a.communicate()
    open(f"{go}.b", "w").close()
    rb = _result(b)
    assert rb["compiled"] >= 1 and rb["error"] is None
    assert rb["out"][0][:2] != [0.0, 0.0]


def test_a_failing_compile_releases_its_claims(dirs):
    claims, go, cache = dirs
    bad = _start("bad", claims, go, cache)
    _until(lambda: os.path.exists(f"{go}.bad.ready"))
    open(f"{go}.bad", "w").close()
    r = _result(bad)
    assert r["error"] == "TypingError"
    held = {f[:-6] for f in _claims(claims)}
    assert held and held <= {f[:-5] for f in os.listdir(claims) if f.endswith(".done")}


@pytest.mark.parametrize("cold_tokens", [1, 4])
def test_llm_cold_start_shares_compiles_with_its_helper_and_generates_as_warm(tmp_path, cold_tokens):
    """A cold run that only feeds its prompt (1 token: the prompt's attention ran the one-thread stand-in)
    still leaves the threaded attention in the cache (its exit waits for the helper to save it); one that
    decodes leaves every kernel a decode needs."""
    if not compile_share.helper_wanted():
        pytest.skip("one core for this process: a cold start compiles alone")
    run = lambda n: subprocess.run([sys.executable, "-c", LLM_RUN, str(n)], env=_env(tmp_path), capture_output=True,
                                   text=True, timeout=900)
    cold = run(cold_tokens)
    assert cold.returncode == 0, cold.stderr[-3000:]
    c = json.loads(cold.stdout.strip().splitlines()[-1])
    assert c["stats"]["helper"] and c["stats"]["waited"] >= 1      # it loaded a kernel the helper compiled
    assert c["compile_s"] > 0
    warm = run(4)
    assert warm.returncode == 0, warm.stderr[-3000:]
    w = json.loads(warm.stdout.strip().splitlines()[-1])
    assert not w["stats"]["helper"] and w["stats"]["claimed"] == 0
    assert "attend_stored_parallel" not in w["compiled"]
    if cold_tokens > 1:
        assert w["compiled"] == [] and w["compile_s"] == 0.0
    assert w["tokens"][:cold_tokens] == c["tokens"]
    assert not [d for d in os.listdir(tmp_path / os.listdir(tmp_path)[0]) if d.startswith(".claims-")]


# the start of a program: a stand-in helper (it joins the claims and sleeps) started on an empty cache
SLEEPING_HELPER = r"""
import sys
from ringllm.runtime import compile_share
helper = ("import os, time; from ringllm.runtime import compile_share as c; "
          "c.join(os.environ[c.CLAIMS_ENV]); time.sleep(120)")
assert compile_share.start_helper([sys.executable, "-c", helper], 1)
"""

# with a stand-in helper, print whether it started and the claims directories, then: "fork" forks a child
# that exits normally; "kill" waits to be killed
LIFETIME = SLEEPING_HELPER + r"""
import glob, os, time
from numba.core import config
print(compile_share.stats()["helper"], flush=True)
claims = lambda: sorted(glob.glob(os.path.join(config.CACHE_DIR, ".claims-*")))
if sys.argv[1] == "fork":
    pid = os.fork()
    if pid == 0:
        sys.exit(0)                      # a child's normal exit runs the inherited exit handlers
    os.waitpid(pid, 0)
    print(len(claims()), flush=True)
else:
    print(compile_share.stats()["helper_pid"], flush=True)
    time.sleep(120)
"""


def _lifetime(mode, cache):
    return subprocess.Popen([sys.executable, "-c", LIFETIME, mode], env=_env(cache), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def _claims_dirs(cache):
    return [p for p, dirs, _ in os.walk(cache) for d in dirs if d.startswith(".claims-")]


@pytest.mark.skipif(os.name != "posix" or not compile_share.helper_wanted(), reason="POSIX, two cores")
def test_a_forked_child_leaves_the_claims_and_the_helper_to_its_parent(tmp_path):
    p = _lifetime("fork", tmp_path)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err[-3000:]
    lines = out.split()
    assert lines[0] == "True" and lines[1] == "1"      # the claims directory outlived the child
    assert not _claims_dirs(tmp_path)                  # and went with the parent


@pytest.mark.skipif(not sys.platform.startswith("linux") or not compile_share.helper_wanted(),
                    reason="Linux (PR_SET_PDEATHSIG), two cores")
def test_the_helper_ends_with_a_killed_parent_and_its_claims_are_swept(tmp_path):
    p = _lifetime("kill", tmp_path)
    assert p.stdout.readline().strip() == "True"
    helper = int(p.stdout.readline())
    _until(lambda: _claims_dirs(tmp_path))
    p.kill()                                           # no exit handlers run
    p.communicate()
    _until(lambda: not os.path.exists(f"/proc/{helper}") or open(f"/proc/{helper}/stat").read().split()[2] == "Z",
           timeout=30)
    assert _claims_dirs(tmp_path)                      # left behind ...
    again = _lifetime("fork", tmp_path)                # ... until the next claims directory is made
    out, err = again.communicate(timeout=120)
    assert again.returncode == 0, err[-3000:]
    assert not _claims_dirs(tmp_path)


# with a stand-in helper: a kernel asked for under unless_compiling() raises NotReady and is neither compiled
# nor run; with the helper stopped, the same call compiles
STAND_IN = SLEEPING_HELPER + r"""
import json
import numpy as np
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.ops import gated_act_fused
x = np.linspace(-2, 2, 256, dtype=np.float32).reshape(2, 128)
out = np.zeros((2, 64), np.float32)
result = {}
with CompileSpan() as span:
    try:
        with compile_share.unless_compiling():
            gated_act_fused(out, x, 0)
        result["first"] = "ran"
    except compile_share.NotReady as exc:
        result["first"] = "not ready: " + str(exc)
result["compiled_first"], result["out_first"] = span.signatures, float(np.abs(out).sum())
compile_share.stop_helper()
with CompileSpan() as span:
    with compile_share.unless_compiling():
        gated_act_fused(out, x, 0)
result["compiled_after"], result["out_after"] = span.signatures, float(np.abs(out).sum())
print(json.dumps(result))
"""


@pytest.mark.skipif(os.name != "posix" or not compile_share.helper_wanted(), reason="POSIX, two cores")
def test_unless_compiling_refuses_a_kernel_the_helper_has_yet_to_compile(tmp_path):
    p = subprocess.run([sys.executable, "-c", STAND_IN], env=_env(tmp_path), capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    assert r["first"].startswith("not ready: gated_act_fused")
    assert r["compiled_first"] == 0 and r["out_first"] == 0.0           # nothing compiled, nothing run
    assert r["compiled_after"] >= 1 and r["out_after"] > 0.0            # the helper gone: compiled here


# a parent whose helper compiles gated_act_fused and holds it back for 3 s before saving it: the parent queues
# idle jobs (one compiles rms_norm_rows, one raises, one asks for the kernel the helper holds, one records the
# time); while the helper holds its claim it runs two jobs at once with run_unclaimed (one asks for the held
# kernel), then asks for gated_act_fused itself; it prints what ran and when
IDLE_HELPER = r"""
import os, time
import numpy as np
from numba.core.caching import Cache
from ringllm.runtime import compile_share as c
from ringllm.runtime.ops import gated_act_fused
c.join(os.environ[c.CLAIMS_ENV])
save = Cache.save_overload
def slow_save(self, sig, data):
    time.sleep(3.0)
    save(self, sig, data)
Cache.save_overload = slow_save
x = np.linspace(-2, 2, 256, dtype=np.float32).reshape(2, 128)
gated_act_fused(np.zeros((2, 64), np.float32), x, 0)
time.sleep(120)
"""
IDLE_JOBS = r"""
import glob, json, os, sys, time
import numpy as np
from numba.core import config
from ringllm.runtime import compile_share
from ringllm.runtime.compile_clock import CompileSpan
from ringllm.runtime.ops import gated_act_fused, rms_norm_rows
ran = []
compile_share.when_idle(lambda: ran.append("before the helper"))      # no helper yet: never queued
assert compile_share.start_helper([sys.executable, "-c", sys.argv[1]], 1)
def norm():
    out = np.zeros((2, 128), np.float32)
    rms_norm_rows(out, np.ones((2, 128), np.float32), np.ones(128, np.float32), np.float32(1e-6))
    ran.append("norm %.3f" % out[0, 0])
def boom():
    raise RuntimeError("a failing idle job")
def held():
    gated_act_fused(np.zeros((2, 64), np.float32), np.ones((2, 128), np.float32), 0)
    ran.append("held")
def last():
    ran.append("last")
    marks.append(time.monotonic())
marks = []
for job in (norm, boom, held, last):
    compile_share.when_idle(job)
claims = lambda: glob.glob(os.path.join(config.CACHE_DIR, ".claims-*", "*.claim"))
t0 = time.monotonic()
while not claims():
    assert time.monotonic() - t0 < 120
    time.sleep(0.002)
t0 = time.monotonic()
compile_share.run_unclaimed([held, lambda: ran.append("unclaimed")])
unclaimed_s = time.monotonic() - t0
x = np.linspace(-2, 2, 256, dtype=np.float32).reshape(2, 128)
out = np.zeros((2, 64), np.float32)
with CompileSpan() as span:
    gated_act_fused(out, x, 0)
print(json.dumps({"ran": ran, "stats": compile_share.stats(), "compiled": span.signatures, "unclaimed_s": unclaimed_s,
                  "out": float(np.abs(out).sum()), "last_before_end": time.monotonic() - marks[0]}))
"""


@pytest.mark.skipif(os.name != "posix" or not compile_share.helper_wanted(), reason="POSIX, two cores")
def test_a_parent_runs_its_idle_jobs_while_it_waits_for_the_helper(tmp_path):
    p = subprocess.run([sys.executable, "-c", IDLE_JOBS, IDLE_HELPER], env=_env(tmp_path), capture_output=True,
                       text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    r = json.loads(p.stdout.strip().splitlines()[-1])
    # run_unclaimed first: the job asking for the kernel the helper holds is dropped at once, the next one runs.
    # Then the wait's jobs in order; the failing one dropped; the one asking for the helper's kernel put off
    # (not waiting there: the next job ran long before the helper saved it); none queued before the helper started
    assert r["ran"] == ["unclaimed", "norm 1.000", "last"]
    assert r["unclaimed_s"] < 2.0
    assert r["last_before_end"] > 0.5
    assert r["compiled"] == 1                           # rms_norm_rows compiled here, gated_act_fused loaded
    assert r["stats"]["waited"] >= 1 and r["out"] > 0.0


def test_helper_command_line_takes_numpy_knobs():
    import numpy as np
    from ringllm.compile_helper import helper_argv
    from ringllm.runtime.kv_config import KVConfig
    kv = KVConfig(capacity=64, policy="pyramidkv", pyramid_beta=np.float32(20.0))
    argv = helper_argv("model.gguf", kv, "f32")
    assert KVConfig.from_dict(json.loads(argv[argv.index("--kv") + 1])) == kv
