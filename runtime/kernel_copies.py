"""Copies of one kernel source specialised by the functions it calls.

A kernel that picks among callees at run time (`if family == 0: ... elif ...`) makes Numba type and
compile every branch, although a model needs one; a policy's layer step needs that policy's
functions only. Instead the source is written once against global names (its callees, flags), and
each variant is a copy of the Python function whose globals bind those names: Numba compiles each
copy on its first call, only those a model uses, and caches each under its own name.
"""
from __future__ import annotations

import types


def bind_copy(fn, name: str, namespace: dict):
    """A copy of fn whose globals are `namespace`, named `name`. Numba's disk cache keys a function by
    its module and qualified name: each copy needs a name of its own, or a process would load another
    copy's machine code from the cache. The namespace's __name__ must stay fn's module: Numba rebuilds
    a cached kernel's environment by importing it."""
    bound = types.FunctionType(fn.__code__, namespace, name, fn.__defaults__)
    bound.__qualname__ = name
    bound.__doc__ = fn.__doc__
    return bound
