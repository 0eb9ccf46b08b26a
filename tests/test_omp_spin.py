"""The OpenMP spin count (runtime/omp_spin.py): a time turned into GOMP_SPINCOUNT from this CPU's
measured `pause`, recorded once in the user's cache and read at import by later processes, never
over a value the user exported. The processes run with a cache directory of their own
(XDG_CACHE_HOME), so the user's record is not touched."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ringllm.runtime import omp_spin
from ringllm.runtime.simd import X86

SHOW = ("import json, os, ringllm.runtime; "
        "print(json.dumps([os.environ.get('GOMP_SPINCOUNT'), os.environ.get('RINGLLM_GOMP_SPINCOUNT')]))")


def _python(code: str, cache_home, **env_extra) -> list:
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "RINGLLM_GOMP_SPINCOUNT")}
    env.update(XDG_CACHE_HOME=str(cache_home), **env_extra)
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def test_spin_count_is_the_spin_time_over_one_pause():
    assert omp_spin.spin_count_for(10e-9) == round(omp_spin.SPIN_SECONDS / 10e-9)
    assert omp_spin.spin_count_for(30e-9) == round(omp_spin.SPIN_SECONDS / 30e-9)
    assert omp_spin.spin_count_for(1e-12) == omp_spin.MAX_SPIN_COUNT
    assert omp_spin.spin_count_for(1e-3) == omp_spin.MIN_SPIN_COUNT
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        assert omp_spin.spin_count_for(bad) == omp_spin.DEFAULT_SPIN_COUNT


def test_a_recorded_pause_sets_the_count_at_import(tmp_path):
    record = tmp_path / "ringllm" / "omp_spin.json"
    record.parent.mkdir()
    record.write_text(json.dumps({omp_spin.cpu_key(): 12.5}))
    count, mark = _python(SHOW, tmp_path)
    want = omp_spin.spin_count_for(12.5e-9) if X86 else omp_spin.DEFAULT_SPIN_COUNT
    assert count == mark == str(want)


def test_without_a_record_the_default_count(tmp_path):
    assert _python(SHOW, tmp_path) == [str(omp_spin.DEFAULT_SPIN_COUNT)] * 2
    (tmp_path / "ringllm").mkdir(exist_ok=True)
    (tmp_path / "ringllm" / "omp_spin.json").write_text("not json")
    assert _python(SHOW, tmp_path) == [str(omp_spin.DEFAULT_SPIN_COUNT)] * 2


def test_the_users_count_wins(tmp_path):
    assert _python(SHOW, tmp_path, GOMP_SPINCOUNT="77") == ["77", None]
    code = ("import json, os, ringllm.runtime\nfrom ringllm.runtime import omp_spin\nomp_spin.calibrate()\n"
            "print(json.dumps([os.environ['GOMP_SPINCOUNT'], os.path.exists(omp_spin.record_path())]))")
    assert _python(code, tmp_path, GOMP_SPINCOUNT="77") == ["77", False]


@pytest.mark.skipif(not X86, reason="the spin is calibrated on x86 only (libgomp's poll has no pause elsewhere)")
def test_calibration_records_the_pause_and_sets_this_process_count(tmp_path):
    """calibrate() before any parallel kernel: the record is written and this process's count follows;
    a later process reads the same count at import."""
    code = ("import json, os, ringllm.runtime\nfrom ringllm.runtime import omp_spin\nomp_spin.calibrate()\n"
            "rec = json.load(open(omp_spin.record_path()))\n"
            "print(json.dumps([os.environ['GOMP_SPINCOUNT'], rec[omp_spin.cpu_key()]]))")
    count, ns = _python(code, tmp_path)
    assert 0.1 < ns < 1000                  # nanoseconds: one pause is a few to a few hundred cycles
    assert count == str(omp_spin.spin_count_for(ns * 1e-9))
    assert _python(SHOW, tmp_path) == [count, count]
