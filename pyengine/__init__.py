"""ringllm: an embeddable LLM runtime with an in-place, fixed-capacity KV store."""
from ringllm.runtime.errors import ConfigError, ModelFileError, RingLLMError, UnsupportedModelError

__all__ = ["RingLLMError", "ModelFileError", "UnsupportedModelError", "ConfigError"]
__version__ = "0.1.0"
