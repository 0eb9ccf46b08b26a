"""ringllm: an embeddable LLM runtime with an in-place, fixed-capacity KV store."""
import importlib

from ringllm.gc_pause import collector_paused

with collector_paused():        # the runtime imports Numba: no collector passes over what it builds
    from ringllm.runtime.errors import ConfigError, ModelFileError, RingLLMError, UnsupportedModelError
    from ringllm.runtime.kv_config import KVConfig

__all__ = ["RingLLMError", "ModelFileError", "UnsupportedModelError", "ConfigError", "KVConfig",
           "LLM", "Chunk", "Completion", "Generation", "Timings", "SamplingParams", "Sampler", "ChatSession",
           "SessionFileError", "GrammarError"]
__version__ = "0.1.0"

_LAZY = {"LLM": "ringllm.llm", "Chunk": "ringllm.generation", "Completion": "ringllm.generation",
         "Generation": "ringllm.generation", "Timings": "ringllm.generation", "SamplingParams": "ringllm.sampling",
         "Sampler": "ringllm.sampling", "ChatSession": "ringllm.session", "SessionFileError": "ringllm.session",
         "GrammarError": "ringllm.constraints"}


def __getattr__(name: str):
    """The API classes import numpy and the engine on first use, so `import ringllm` stays light."""
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'ringllm' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(list(globals()) + list(_LAZY))
