"""bench/inner_loop_asm.py finds the multiply-add loops of the tile kernels on this CPU."""
from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "bench"))
import inner_loop_asm as ila  # noqa: E402


def test_q4_0_tile_has_a_multiply_add_loop():
    found = [(n, f) for _, n, f in ila.loops(ila.asm_of("q4_0")) if f]
    assert found, "no loop with vector multiply-adds in tile_q4_0"
    assert all(n > f for n, f in found)       # a loop holds more than its multiply-adds (loads, decode, branch)
