"""A ringllm kernel's handle on Numba's disk cache is made when the kernel is first compiled or loaded,
not when the module defining it is imported.

`@njit(cache=True)` makes the dispatcher's cache handle (numba.core.caching.FunctionCache) at once:
it finds the kernel's source file, works out its cache directory and index name, and proves the
directory writable by creating and removing a temporary file there, for every kernel. ringllm defines
a few hundred kernels and inlined helpers, and a generation calls a few dozen of them; the helpers are
only ever compiled into their callers. Made for all of them, the handles are a large part of what
importing the package costs.

install() makes Numba's Dispatcher.enable_caching give the dispatchers of ringllm's own modules a
stand-in that makes the real handle at its first use (any attribute: the dispatcher asks it for
load_overload before every compile) and puts it in the dispatcher's place, so every later use goes
straight to it. The handle is the one Numba would have made at definition: same locator, same
directory, same index. Kernels of other modules (an embedding application's) keep Numba's behaviour,
including its immediate error for a function whose source cannot be located.
"""
from __future__ import annotations

__all__ = ["install"]

_PACKAGE = "ringllm."


class _HandleOnFirstUse:
    """Stands in for a dispatcher's FunctionCache until the dispatcher first uses it."""

    __slots__ = ("_dispatcher",)

    def __init__(self, dispatcher):
        self._dispatcher = dispatcher

    def __getattr__(self, name):
        from numba.core.caching import FunctionCache

        handle = FunctionCache(self._dispatcher.py_func)
        self._dispatcher._cache = handle
        return getattr(handle, name)


def install() -> bool:
    """Install the deferred handles (module docstring); False, and nothing changed, where Numba's
    Dispatcher.enable_caching is not the one-line FunctionCache construction this defers."""
    from numba.core import dispatcher

    numba_enable = dispatcher.Dispatcher.__dict__.get("enable_caching")
    if numba_enable is None or getattr(numba_enable, "_ringllm", False) or \
            numba_enable.__code__.co_names != ("FunctionCache", "py_func", "_cache"):
        return False

    def enable_caching(self):
        if getattr(self.py_func, "__module__", "").startswith(_PACKAGE):
            self._cache = _HandleOnFirstUse(self)
        else:
            numba_enable(self)

    enable_caching._ringllm = True
    enable_caching.__doc__ = numba_enable.__doc__
    dispatcher.Dispatcher.enable_caching = enable_caching
    return True
