"""compile_gc: while Numba compiles, the youngest generation's threshold is COMPILE_GEN0, and the
process's own thresholds come back when the compile ends; a collector turned off, or a threshold set
higher by the process, is left alone."""
from __future__ import annotations

import gc

from numba import njit
from numba.core import event

import ringllm.runtime  # noqa: F401  (installs the listener)
from ringllm.runtime.compile_gc import COMPILE_GEN0


def _thresholds_seen_while_compiling(fn, *args):
    seen = []

    class Probe(event.Listener):
        def on_start(self, ev):
            seen.append(gc.get_threshold())      # registered after compile_gc's listener: called after it

        def on_end(self, ev):
            pass

    probe = Probe()
    event.register("numba:compile", probe)
    try:
        fn(*args)
    finally:
        event.unregister("numba:compile", probe)
    return seen


def test_threshold_raised_during_a_compile_and_restored_after():
    before = gc.get_threshold()

    @njit
    def add(x):
        return x + 1

    seen = _thresholds_seen_while_compiling(add, 1)
    assert seen and all(t == (COMPILE_GEN0,) + before[1:] for t in seen)
    assert gc.get_threshold() == before


def test_a_higher_threshold_or_a_disabled_collector_is_left_alone():
    before = gc.get_threshold()
    try:
        gc.set_threshold(COMPILE_GEN0 * 2, 10, 10)

        @njit
        def sub(x):
            return x - 1

        assert all(t == (COMPILE_GEN0 * 2, 10, 10) for t in _thresholds_seen_while_compiling(sub, 1))
        gc.set_threshold(*before)
        gc.disable()

        @njit
        def mul(x):
            return x * 3

        assert all(t == before for t in _thresholds_seen_while_compiling(mul, 2))
        assert gc.get_threshold() == before
    finally:
        gc.set_threshold(*before)
        gc.enable()
