"""Exceptions a user can cause, one hierarchy for the whole package.

Every error names the thing at fault (a file, a tensor, a config key) and, where there is one,
the fix. Nothing a user passes reaches a Numba kernel unchecked: an out-of-bounds index there is
a segfault, not an IndexError.
"""
from __future__ import annotations

import os


class RingLLMError(Exception):
    """Base class of every error ringllm raises on purpose."""


class ModelFileError(RingLLMError):
    """A model file or directory that cannot be read: missing, truncated, corrupt, inconsistent.

    Args:
        path: the file or directory at fault.
        problem: what is wrong with it, in words a user can act on.
    """

    def __init__(self, path: str | os.PathLike, problem: str):
        self.path = os.fspath(path)
        self.problem = problem
        super().__init__(f"{self.path}: {problem}")


class UnsupportedModelError(ModelFileError):
    """A well-formed model that uses something ringllm does not implement (architecture, tensor type)."""


class ConfigError(RingLLMError, ValueError):
    """An invalid setting passed by the caller (KV config, engine options)."""
