"""Eviction policies, one file each, behind the interface of base.Policy (DESIGN.md "Eviction policies")."""
from __future__ import annotations

from ringllm.runtime.errors import ConfigError
from ringllm.runtime.policies.adakv import AdaKV
from ringllm.runtime.policies.base import Policy
from ringllm.runtime.policies.gvote import GVote
from ringllm.runtime.policies.h2o import H2O
from ringllm.runtime.policies.knorm import KNorm
from ringllm.runtime.policies.lsh import LSH
from ringllm.runtime.policies.random_policy import Random
from ringllm.runtime.policies.rkv import RKV
from ringllm.runtime.policies.scissorhands import Scissorhands
from ringllm.runtime.policies.snapkv import PyramidKV, SnapKV
from ringllm.runtime.policies.streaming import Full, Streaming
from ringllm.runtime.policies.tova import TOVA

REGISTRY: dict[str, type[Policy]] = {cls.name: cls for cls in (Full, Streaming, H2O, TOVA, Scissorhands, KNorm, LSH,
                                                                 Random, SnapKV, PyramidKV, AdaKV, RKV, GVote)}


def make_policy(kv, spec) -> Policy:
    """The policy object of a KVConfig (validated) for a model."""
    cls = REGISTRY.get(kv.policy)
    if cls is None:
        raise ConfigError(f"policy {kv.policy!r} is not implemented on the CPU engine yet; available: "
                          f"{', '.join(REGISTRY)}")
    return cls(kv, spec)
