"""Build step of the GPU backend, loaded by setup.py: nvcc -> libringllm_cuda.so, then the cffi module.

setup.py's build_ext is `BuildExtWithCUDA`; cffi's setuptools integration (cffi_modules) wraps it
and calls its `pre_run(ext, ffi)` hook just before generating the module's C source. There:

  * nvcc found (RINGLLM_NVCC, $CUDA_HOME/bin, PATH, /usr/local/cuda/bin), RINGLLM_NO_CUDA unset:
    src/*.cu are compiled in parallel (one nvcc per file) for sm_80 and sm_90 plus PTX compute_90
    (RINGLLM_CUDA_ARCHS="80;90" overrides, the last also gets PTX) and linked into
    libringllm_cuda.so with the CUDA runtime linked statically: the library needs only
    libcuda.so.1 (the driver), which the runtime opens when the first CUDA call is made, so
    importing the module works on machines without a driver or toolkit. The cffi module links to
    the library with rpath $ORIGIN; the library is copied next to the module.
  * no nvcc (or a failed compile, with a warning): the module is compiled with src/stub.c and every
    call reports "built without CUDA".

Either way a line starting with "ringllm:" says which (pip shows it with -v). The library is
rebuilt only when a source under src/ or include/ is newer than it.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from setuptools.command.build_ext import build_ext

HERE = os.path.dirname(os.path.abspath(__file__))
SRC = os.path.join(HERE, "src")
INCLUDE = os.path.join(HERE, "include")
MODULE = "ringllm.native._ringllm_cuda"
LIB_NAME = "ringllm_cuda"
LIB_FILE = f"lib{LIB_NAME}.so"
CUDA_SOURCES = ("api.cu", "attention.cu", "forward.cu", "gvote.cu", "kernels.cu", "kv_write.cu", "model.cu", "prefill.cu",
                "quant.cu", "store.cu")
DEFAULT_ARCHS = ("80", "90")


def say(msg: str) -> None:
    print(f"ringllm: {msg}", file=sys.stderr, flush=True)


def find_nvcc() -> str | None:
    """Path of nvcc, or None (also when RINGLLM_NO_CUDA is set)."""
    if os.environ.get("RINGLLM_NO_CUDA"):
        return None
    candidates = [os.environ.get("RINGLLM_NVCC")]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if os.environ.get(var):
            candidates.append(os.path.join(os.environ[var], "bin", "nvcc"))
    candidates += [shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"]
    for c in candidates:
        if c and os.path.isfile(c) and os.access(c, os.X_OK):
            return c
    return None


def archs() -> list[str]:
    raw = os.environ.get("RINGLLM_CUDA_ARCHS", "")
    vals = [a.strip().replace("sm_", "") for a in raw.replace(",", ";").split(";") if a.strip()]
    return vals or list(DEFAULT_ARCHS)


def gencode_flags(arch_list: list[str]) -> list[str]:
    flags = []
    for a in arch_list[:-1]:
        flags += ["-gencode", f"arch=compute_{a},code=sm_{a}"]
    a = arch_list[-1]
    flags += ["-gencode", f"arch=compute_{a},code=[sm_{a},compute_{a}]"]
    return flags


def arch_text(arch_list: list[str]) -> str:
    return " ".join(f"sm_{a}" for a in arch_list) + f" + PTX compute_{arch_list[-1]}"


def _newest_source() -> float:
    paths = [os.path.join(SRC, f) for f in os.listdir(SRC)] + [os.path.join(INCLUDE, f) for f in os.listdir(INCLUDE)]
    paths.append(os.path.abspath(__file__))
    return max(os.path.getmtime(p) for p in paths)


def compile_library(nvcc: str, out_dir: str, jobs: int | None = None) -> str:
    """Compile src/*.cu into out_dir/libringllm_cuda.so; returns its path. Raises CalledProcessError."""
    os.makedirs(out_dir, exist_ok=True)
    lib = os.path.join(out_dir, LIB_FILE)
    if os.path.exists(lib) and os.path.getmtime(lib) >= _newest_source():
        say(f"CUDA library up to date: {lib}")
        return lib
    arch_list = archs()
    common = [nvcc, "-O3", "-std=c++17", "-Xcompiler", "-fPIC", "-I", INCLUDE,
              f'-DRL_ARCHS="{arch_text(arch_list)}"', *gencode_flags(arch_list)]
    objs = [os.path.join(out_dir, f[:-3] + ".o") for f in CUDA_SOURCES]

    def one(src_obj):
        src, obj = src_obj
        subprocess.run([*common, "-c", os.path.join(SRC, src), "-o", obj], check=True)

    t0 = time.time()
    say(f"compiling the CUDA library with {nvcc} ({arch_text(arch_list)})")
    with ThreadPoolExecutor(max_workers=jobs or min(len(CUDA_SOURCES), os.cpu_count() or 1)) as pool:
        list(pool.map(one, zip(CUDA_SOURCES, objs)))
    # -cudart static: the runtime is inside the library (it dlopens the driver on first use)
    subprocess.run([nvcc, "-shared", "-cudart", "static", *gencode_flags(arch_list), *objs, "-o", lib], check=True)
    say(f"built {lib} in {time.time() - t0:.0f} s")
    return lib


class BuildExtWithCUDA(build_ext):
    """build_ext that compiles the CUDA library before the cffi module links to it."""

    def pre_run(self, ext, ffi) -> None:
        self._cuda_lib = None
        nvcc = find_nvcc()
        lib_dir = os.path.join(os.path.abspath(self.build_temp), "ringllm_cuda")
        if nvcc is None:
            say("nvcc not found: building the native module without CUDA (backend='cuda' will say so; "
                "set CUDA_HOME or put nvcc on PATH and reinstall to build it)")
        else:
            try:
                self._cuda_lib = compile_library(nvcc, lib_dir)
            except (subprocess.CalledProcessError, OSError) as e:
                say(f"WARNING: compiling the CUDA library failed ({e}); building the native module without CUDA")
        if self._cuda_lib:
            ext.library_dirs.append(lib_dir)
            ext.libraries.append(LIB_NAME)
            ext.extra_link_args.append("-Wl,-rpath,$ORIGIN")
        else:
            ext.sources.append(os.path.relpath(os.path.join(SRC, "stub.c")))

    def run(self) -> None:
        super().run()
        lib = getattr(self, "_cuda_lib", None)
        if not lib:
            return
        # the library goes next to the module (rpath $ORIGIN): in the build tree and, for in-place
        # and editable builds, in the source package too
        dests = {os.path.dirname(os.path.abspath(self.get_ext_fullpath(MODULE)))}
        if self.inplace or getattr(self, "editable_mode", False):
            pkg_dir = self.get_finalized_command("build_py").get_package_dir("ringllm.native")
            dests.add(os.path.abspath(pkg_dir))
        for d in dests:
            os.makedirs(d, exist_ok=True)
            shutil.copy2(lib, os.path.join(d, LIB_FILE))

    def get_outputs(self):
        outs = super().get_outputs()
        if getattr(self, "_cuda_lib", None):
            outs.append(os.path.join(os.path.dirname(self.get_ext_fullpath(MODULE)), LIB_FILE))
        return outs
