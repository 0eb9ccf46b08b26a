"""ringllm: an embeddable LLM runtime with an in-place, fixed-capacity KV store."""
from ringllm.runtime.errors import ConfigError, ModelFileError, RingLLMError, UnsupportedModelError
from ringllm.runtime.kv_config import KVConfig

__all__ = ["RingLLMError", "ModelFileError", "UnsupportedModelError", "ConfigError", "KVConfig"]
__version__ = "0.1.0"
