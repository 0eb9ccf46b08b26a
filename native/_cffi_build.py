"""cffi out-of-line API build script of `ringllm.native._ringllm_cuda` (setup.py's cffi_modules).

`cdef` reads include/ringllm_cuda.h as is (no #include, no macros beyond integer #defines). The
C side of the module is chosen at build time by native/build_cuda.py (BuildExtWithCUDA.pre_run):
linked against libringllm_cuda.so (compiled with nvcc, rpath $ORIGIN) when nvcc is found, else
compiled with src/stub.c, whose functions all return RL_ERR_NO_CUDA.

Run directly (python native/_cffi_build.py) it only checks that the header parses.
"""
import os

from cffi import FFI

HERE = os.path.dirname(os.path.abspath(__file__))
HEADER = os.path.join(HERE, "include", "ringllm_cuda.h")
MODULE = "ringllm.native._ringllm_cuda"

ffibuilder = FFI()
with open(HEADER, encoding="utf-8") as fh:
    ffibuilder.cdef(fh.read())
ffibuilder.set_source(
    MODULE,
    '#include <stddef.h>\n#include <stdint.h>\n#include "ringllm_cuda.h"\n',
    include_dirs=[os.path.relpath(os.path.join(HERE, "include"))],
)

if __name__ == "__main__":
    print(f"{HEADER}: parsed by cffi")
