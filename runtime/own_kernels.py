"""Two things Numba does for every dispatcher, narrowed for ringllm's own kernels (those defined in the
package's modules); every other module's kernels (an embedding application's) keep Numba's behaviour.

- The disk-cache handle is made at the kernel's first use, not at its definition. `@njit(cache=True)`
  makes the dispatcher's handle (numba.core.caching.FunctionCache) at once: it finds the kernel's
  source file, works out its cache directory and index name, and proves the directory writable by
  creating and removing a temporary file there. ringllm defines a few hundred kernels and inlined
  helpers, and a generation calls a few dozen of them (the helpers are only ever compiled into their
  callers); made for all of them, the handles were a large part of what importing the package cost.
  The stand-in makes the real handle at its first use (any attribute: the dispatcher asks it for
  load_overload before every compile) and puts it in the dispatcher's place. It is the handle Numba
  would have made at definition: same locator, same directory, same index.
- No scan of the installed packages' extension entry points. Before the first call of a dispatcher
  with new argument types (a compile or a cache load), Numba's `_compilation_chain_init_hook`
  initialises the `numba_extensions` entry points of every installed distribution once per process
  (numba.core.entrypoints.init_all), a scan whose cost grows with the packages installed. ringllm's
  kernels take NumPy arrays, scalars and tuples of them and call no extension, so their calls skip it;
  another module's kernel still runs it, and a ringllm kernel's call does not mark it done. A compile
  scans anyway (the lowering registries' first load, numba.core.cpu, runs the same initialisation), so
  what is skipped is the scan of a process that only loads cached kernels.
"""
from __future__ import annotations

__all__ = ["install"]


def _own(dispatcher) -> bool:
    """Whether the dispatcher's function is defined in one of ringllm's modules."""
    return getattr(dispatcher.py_func, "__module__", "").startswith("ringllm.")


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


def _narrow(cls, name: str, names: tuple, ours) -> bool:
    """Replace method `name` of `cls` by one that runs ours(self) for ringllm's kernels and Numba's method
    for the others; False, and nothing changed, where Numba's method is not the code this narrows (the
    names its code uses differ from `names`) or is narrowed already."""
    numba_method = cls.__dict__.get(name)
    if numba_method is None or getattr(numba_method, "_ringllm", False) or numba_method.__code__.co_names != names:
        return False

    def method(self):
        if _own(self):
            ours(self)
        else:
            numba_method(self)

    method._ringllm = True
    method.__doc__ = numba_method.__doc__
    setattr(cls, name, method)
    return True


def _deferred_handle(self) -> None:
    self._cache = _HandleOnFirstUse(self)


def _no_scan(self) -> None:
    pass


def install() -> tuple[bool, bool]:
    """Install both (module docstring): whether each was (the cache handle, the entry-point scan)."""
    from numba.core import dispatcher

    return (_narrow(dispatcher.Dispatcher, "enable_caching", ("FunctionCache", "py_func", "_cache"),
                    _deferred_handle),
            _narrow(dispatcher._DispatcherBase, "_compilation_chain_init_hook", ("entrypoints", "init_all"),
                    _no_scan))
