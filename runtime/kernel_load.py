"""Loading a cached kernel without parsing its LLVM bitcode.

Numba caches a compiled kernel as its object code plus its module's bitcode
(CPUCodeLibrary.serialize_using_object_code). The object code is what runs. The bitcode is there for
a later compile that links the kernel into its own module (a new kernel calling it:
CPUCodeLibrary._get_module_for_linking), yet Numba's loader parses it at every load, also to list
the symbols the library defines (JitEngine._load_defined_symbols), which the dispatcher's
entry-point lookup (get_pointer_to_function -> is_symbol_defined) checks. A warm process links
nothing, and parsing is most of a load's time.

install() replaces the loader of object-code libraries: the bitcode stays bytes until a compile asks
for the module to link (then it is parsed, as Numba would have, and its symbols listed), and the
symbols come from the object code's ELF symbol table, its defined global and weak ones: the entry
points get_pointer_to_function asks for, a subset of what the bitcode lists (which adds the
library's internal functions). A lookup of any other name first parses the libraries still pending,
so the engine answers every question as Numba's does. Object code that is not 64-bit little-endian
ELF (macOS, Windows) is loaded as Numba loads it. Installed only where Numba's loader and engine
have the shape this replaces (checked by the names their code uses).

The symbols a kernel's object code refers to must be known to the JIT before it is added. Numba's
own C helpers are registered when its context is made; the hash secret (`_numba_hashsecret_*`, which
a kernel that hashes refers to) is registered by importing numba.cpython.hashing, which ringllm no
longer imports at start (runtime/__init__.py: _registries_without_blas), so the loader imports it
before adding object code that refers to it, and before any object code it cannot read.
"""
from __future__ import annotations

import importlib
import weakref

import numpy as np

__all__ = ["install", "elf_symbols"]

# ELF64 symbol table entry
_SYM = np.dtype([("name", "<u4"), ("info", "u1"), ("other", "u1"), ("shndx", "<u2"), ("value", "<u8"),
                 ("size", "<u8")])
_SHT_SYMTAB = 2
_STB_GLOBAL, _STB_WEAK = 1, 2

# library -> its bitcode, not parsed yet (libraries loaded from the cache since install)
_pending: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


_HASH_SECRET = "_numba_hashsecret_"      # prefix of the symbols numba.cpython.hashing registers


def elf_symbols(obj: bytes) -> tuple[set[str], set[str]] | None:
    """(global and weak symbols defined, symbols referred to but not defined) of a 64-bit
    little-endian ELF object, or None when `obj` is not one (or holds no symbol table)."""
    if len(obj) < 64 or obj[:4] != b"\x7fELF" or obj[4] != 2 or obj[5] != 1:
        return None

    def u(off: int, n: int) -> int:
        return int.from_bytes(obj[off:off + n], "little")

    shoff, shentsize, shnum = u(0x28, 8), u(0x3A, 2), u(0x3C, 2)
    for i in range(shnum):
        hdr = shoff + i * shentsize
        if u(hdr + 4, 4) != _SHT_SYMTAB:
            continue
        sym_off, sym_size, link = u(hdr + 0x18, 8), u(hdr + 0x20, 8), u(hdr + 0x28, 4)
        str_hdr = shoff + link * shentsize
        strtab = obj[u(str_hdr + 0x18, 8):u(str_hdr + 0x18, 8) + u(str_hdr + 0x20, 8)]
        syms = np.frombuffer(obj, _SYM, count=sym_size // _SYM.itemsize, offset=sym_off)
        bind = syms["info"] >> 4
        named = syms["name"] != 0
        keep = (syms["shndx"] != 0) & named & ((bind == _STB_GLOBAL) | (bind == _STB_WEAK))
        undefined = (syms["shndx"] == 0) & named

        def names(which):
            return {strtab[n:strtab.index(b"\0", n)].decode("utf-8", "surrogateescape")
                    for n in syms["name"][which].tolist()}
        return names(keep), names(undefined)
    return None


def _register_hash_secret() -> None:
    """Import numba.cpython.hashing, whose import registers the _numba_hashsecret_* symbols."""
    importlib.import_module("numba.cpython.hashing")


def _parse(library, ll) -> None:
    """Parse a pending library's bitcode into its module for linking and list its symbols, as Numba's
    loader would have."""
    bitcode = _pending.pop(library, None)
    if bitcode is not None and library._shared_module is None:
        library._shared_module = ll.parse_bitcode(bitcode)
        library._codegen._engine._load_defined_symbols(library._shared_module)


def install() -> bool:
    """Install the loader (module docstring); False, and nothing changed, where Numba differs."""
    import llvmlite.binding as ll
    from numba.core import codegen

    lib_cls, engine_cls = codegen.CPUCodeLibrary, codegen.JitEngine
    unserialize = lib_cls.__dict__.get("_unserialize")
    linking = lib_cls.__dict__.get("_get_module_for_linking")
    defined = engine_cls.__dict__.get("is_symbol_defined")
    if not isinstance(unserialize, classmethod) or linking is None or defined is None or \
            getattr(unserialize.__func__, "_ringllm", False):
        return False
    needed = {"parse_bitcode", "enable_object_caching", "_set_compiled_object", "_finalize_final_module",
              "_load_defined_symbols"}
    if not needed <= set(unserialize.__func__.__code__.co_names) or \
            "_defined_symbols" not in defined.__code__.co_names:
        return False
    numba_unserialize = unserialize.__func__

    def _unserialize(cls, codegen_, state):
        name, kind, data = state
        found = elf_symbols(data[0]) if kind == "object" else None
        if found is None:
            _register_hash_secret()
            return numba_unserialize(cls, codegen_, state)
        symbols, refers = found
        if any(n.startswith(_HASH_SECRET) for n in refers):
            _register_hash_secret()
        object_code, shared_bitcode = data
        self = codegen_.create_library(name)
        assert isinstance(self, cls)
        self.enable_object_caching()
        self._set_compiled_object(object_code)
        _pending[self] = shared_bitcode
        self._finalize_final_module()
        self._codegen._engine._defined_symbols |= symbols
        return self

    def _get_module_for_linking(self):
        _parse(self, ll)
        return linking(self)

    def is_symbol_defined(self, name):
        if name in self._defined_symbols:
            return True
        for library in list(_pending.keys()):
            _parse(library, ll)
        return name in self._defined_symbols

    _unserialize._ringllm = True
    _unserialize.__doc__ = numba_unserialize.__doc__
    lib_cls._unserialize = classmethod(_unserialize)
    lib_cls._get_module_for_linking = _get_module_for_linking
    engine_cls.is_symbol_defined = is_symbol_defined
    return True
