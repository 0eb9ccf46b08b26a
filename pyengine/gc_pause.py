"""Start-up without the cyclic garbage collector walking what start-up builds.

Importing Numba and building a model (a tokenizer's hundreds of thousands of strings and tuples, the
engine's tables) allocates container objects by the hundred thousand. CPython's cyclic collector runs
a pass every 700 net allocations and, as the survivors age, walks them again in its older generations,
whole-heap passes included, each longer as the heap grows: tenths of a second of a start that
frees next to nothing, since what start-up keeps is long-lived and what it drops is freed by
reference counting.

`collector_paused()` turns the collector off for a block and, when it was on, back on at the end
of the outermost block (nested blocks leave it to that one). At that end every object the collector
tracks is moved to its oldest generation without a pass over them (gc.freeze, then gc.unfreeze,
which merges the frozen objects into the oldest generation): were they left in the youngest, the
first allocation after the block would start a pass over all of them, and the next older passes
would walk them again, most of the cost the pause saved. Nothing escapes collection: a cycle made
in the block is collected by the next whole-heap pass, as the collector makes them anyway. A process
that froze objects itself (gc.freeze before forking workers) keeps them frozen: the move is skipped
there, since unfreezing would thaw them too, and the block's objects stay young.
Only start-up runs inside the block: the package's imports and LLM's construction (loading,
repacking), not a generation. Numba's compiles make cyclic garbage by the megabyte and mostly run in
a generation, outside it; on a cold start the repacking's few kernels compile inside it, and their
garbage waits for the next whole-heap pass.
"""
from __future__ import annotations

import gc
import threading
from contextlib import contextmanager

__all__ = ["collector_paused"]

_lock = threading.Lock()
_depth = 0          # blocks open in this process (any thread)
_resume = False     # whether the outermost block found the collector on


@contextmanager
def collector_paused():
    """The cyclic garbage collector off inside the block (module docstring)."""
    global _depth, _resume
    with _lock:
        if _depth == 0:
            _resume = gc.isenabled()
            gc.disable()
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _resume:
                if gc.get_freeze_count() == 0:     # unfreeze would also thaw what the application froze itself
                    gc.freeze()      # every tracked object to the permanent generation, no pass over them,
                    gc.unfreeze()    # then all of them into the oldest generation
                gc.enable()
