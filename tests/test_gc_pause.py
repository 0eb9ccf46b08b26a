"""gc_pause.collector_paused: the cyclic collector is off inside the block, as it was found after the
outermost one, the objects made inside are left to the oldest generation (none stays frozen), and a
cycle made inside is still collected. The package's import and LLM's construction run inside it and
leave the collector as they found it."""
from __future__ import annotations

import gc
import subprocess
import sys
import weakref

from ringllm.gc_pause import collector_paused


class _Node:
    def __init__(self):
        self.other = None


def test_off_inside_restored_after_and_nested_blocks_leave_it_to_the_outermost():
    assert gc.isenabled()
    with collector_paused():
        assert not gc.isenabled()
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()            # the inner block's end does not turn it back on
    assert gc.isenabled()
    assert gc.get_freeze_count() == 0        # promoted, not left in the permanent generation


def test_a_collector_found_off_stays_off():
    gc.disable()
    try:
        with collector_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_restored_when_the_block_raises():
    try:
        with collector_paused():
            raise KeyError("x")
    except KeyError:
        pass
    assert gc.isenabled()


def test_objects_made_inside_go_to_the_oldest_generation_and_their_cycles_are_still_collected():
    gc.collect()
    with collector_paused():
        a, b = _Node(), _Node()
        a.other, b.other = b, a              # a cycle: only the cyclic collector frees it
        kept = [[i] for i in range(5000)]    # tracked containers made inside the block
    assert gc.get_count()[0] < 100           # not waiting in the youngest generation for a pass
    probe = weakref.ref(a)
    del a, b
    assert probe() is not None               # a cycle outlives its last reference...
    gc.collect()
    assert probe() is None                   # ...until a whole-heap pass, as without the block
    assert len(kept) == 5000


def _in_a_generation(obj):
    """Whether obj is in one of the collector's generations (gc.get_objects lists those, never the
    permanent generation that gc.freeze fills)."""
    return any(o is obj for o in gc.get_objects())


def test_objects_the_application_froze_stay_frozen():
    held = [[0], [1]]                  # an object the application froze, which lives on
    gc.collect()
    gc.freeze()
    try:
        assert gc.get_freeze_count() > 0 and not _in_a_generation(held)
        with collector_paused():
            made = [[i] for i in range(100)]
        assert gc.isenabled()
        # not thawed by the block's end (the count alone is no test: frozen objects that die leave it)
        assert not _in_a_generation(held)
        assert gc.get_freeze_count() > 0
        assert len(made) == 100
    finally:
        gc.unfreeze()
    assert _in_a_generation(held)      # the check above can see a thaw


def test_import_and_an_llm_leave_the_collector_on():
    code = ("import gc, ringllm; assert gc.isenabled(); "
            "from ringllm import LLM; llm = LLM(backend='none'); "
            "assert gc.isenabled() and gc.get_freeze_count() == 0; print('ok', len(llm.tokenize('Hello')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("ok ")
