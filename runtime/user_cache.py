"""Where ringllm keeps what it writes for later processes: the user's cache directory."""
from __future__ import annotations

import os

__all__ = ["user_cache_dir"]


def user_cache_dir(*parts: str) -> str:
    """ringllm's directory under the user's cache ($XDG_CACHE_HOME, else ~/.cache), joined with parts."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "ringllm", *parts)
