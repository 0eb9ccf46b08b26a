"""Architecture registry: GGUF `general.architecture` and HF `model_type` -> the model file that reads it."""
from __future__ import annotations

from types import ModuleType

from ringllm.models import gemma3, gptneox, llama, qwen2
from ringllm.runtime.errors import UnsupportedModelError

ARCHITECTURES: dict[str, ModuleType] = {m.ARCH: m for m in (llama, qwen2, gemma3, gptneox)}
HF_TYPES: dict[str, ModuleType] = {t: m for m in ARCHITECTURES.values() for t in m.HF_MODEL_TYPES}


def by_gguf_arch(arch: str, path: str) -> ModuleType:
    if arch not in ARCHITECTURES:
        raise UnsupportedModelError(path, f"architecture {arch!r} is not supported; supported: {sorted(ARCHITECTURES)}")
    return ARCHITECTURES[arch]


def by_hf_model_type(model_type: str, path: str) -> ModuleType:
    if model_type not in HF_TYPES:
        raise UnsupportedModelError(path, f"model_type {model_type!r} is not supported; supported: {sorted(HF_TYPES)}")
    return HF_TYPES[model_type]
