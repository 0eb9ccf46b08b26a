"""Compilation flags shared by the float32 kernels of attention and RoPE.

FASTMATH: reassociation lets LLVM vectorize the float32 dot products and sums (a plain loop is a
serial chain); no approximate functions, so exp stays exact. Differences against the NumPy
reference are float32 rounding, well inside the engine's 1e-3 logit tolerance.

Every kernel states its flags, FASTMATH or fastmath=False (tests/test_kernel_flags.py): Numba
compiles a kernel that leaves fastmath unset with the flags of the first kernel that calls it, and
caches that code, so its bits would depend on the order in which a process met its callers.
"""
FASTMATH = {"reassoc", "contract", "nsz"}
