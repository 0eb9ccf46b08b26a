"""Compilation flags shared by the float32 kernels of attention and RoPE.

FASTMATH: reassociation lets LLVM vectorize the float32 dot products and sums (a plain loop is a
serial chain); no approximate functions, so exp stays exact. Differences against the NumPy
reference are float32 rounding, well inside the engine's 1e-3 logit tolerance.
"""
FASTMATH = {"reassoc", "contract", "nsz"}
