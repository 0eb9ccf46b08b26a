"""load_model: a GGUF file or an HF safetensors directory -> LoadedModel (spec, weights, tokenizer).

Weights are memory-mapped QTensors under internal (GGUF-style) names, already in the engine's
conventions (rotate-half q/k rows, folded norm offsets, split qkv); every tensor the spec needs is
checked for presence and shape here, so engines never see a malformed model.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from typing import Any

from ringllm.models import registry
from ringllm.models.bundled import default_model_path
from ringllm.models.gguf_file import GGUFFile
from ringllm.models.safetensors_file import read_checkpoint_dir
from ringllm.models.common import GGUFHParams
from ringllm.runtime.errors import ModelFileError, UnsupportedModelError
from ringllm.runtime.model_spec import ModelSpec
from ringllm.runtime.qtensor import QTensor


@dataclass
class LoadedModel:
    """A model ready for an engine.

    path:      the file or directory it came from.
    format:    "gguf" | "safetensors".
    spec:      ModelSpec of the architecture.
    tensors:   internal name -> QTensor (see ModelSpec's docstring for names and shapes).
    tokenizer: ringllm.models.tokenizer.Tokenizer.
    metadata:  GGUF metadata (without its vocabulary arrays: without_vocabulary) or HF config.json,
               for reference.
    """

    path: str
    format: str
    spec: ModelSpec
    tensors: dict[str, QTensor]
    tokenizer: Any
    metadata: dict = field(repr=False, default_factory=dict)

    @property
    def weight_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())


def load_model(path: str | os.PathLike | None = None, tokenizer: bool = True) -> LoadedModel:
    """Load a model. `path` None = the bundled default (SmolLM2-135M-Instruct Q4_1)."""
    path = default_model_path() if path is None else os.fspath(path)
    if os.path.isdir(path):
        return _load_hf_dir(path, tokenizer)
    if not os.path.exists(path):
        raise ModelFileError(path, "no such file or directory")
    if path.endswith(".safetensors"):
        return _load_hf_dir(os.path.dirname(path) or ".", tokenizer)
    return _load_gguf(path, tokenizer)


def _load_gguf(path: str, with_tokenizer: bool) -> LoadedModel:
    f = GGUFFile(path)
    arch = registry.by_gguf_arch(f.architecture, path)
    spec = arch.spec_from_gguf(f)
    unread = GGUFHParams(f).unread_keys()
    if unread:
        raise UnsupportedModelError(path, f"metadata {', '.join(repr(k) for k in unread)} of architecture "
                                    f"{spec.arch!r} is not implemented by ringllm; it may change the model's "
                                    "computation, so the file is refused rather than run wrong")
    known = set(spec.expected_shapes()) | set(spec.optional_shapes()) | registry.gguf_extra_tensors(arch, spec.n_layer)
    unknown = sorted(set(f.tensors) - known)
    if unknown:
        shown = ", ".join(repr(n) for n in unknown[:5]) + (f" and {len(unknown) - 5} more" if len(unknown) > 5 else "")
        raise UnsupportedModelError(path, f"tensor(s) {shown} are not used by ringllm's {spec.arch!r} architecture; "
                                    "they may change the model's computation, so the file is refused rather than "
                                    "run wrong")
    try:
        mapped = arch.gguf_tensors(spec, dict(f.tensors))
    except ModelFileError as exc:
        raise ModelFileError(path, exc.problem) from exc
    tensors = _checked(spec, mapped, path)
    tok = None
    if with_tokenizer:
        from ringllm.models.tokenizer import Tokenizer
        tok = Tokenizer.from_gguf(f.metadata, path)
    return LoadedModel(path, "gguf", spec, tensors, tok, without_vocabulary(f.metadata))


# GGUF keys whose values are arrays with one entry per token or merge: the tokenizer keeps what it
# needs of them in its own tables, and as Python lists they hold 9 MB (SmolLM2, 49,152 tokens) to 26 MB
# (Gemma 3, 262,144) for nothing once it is built
VOCABULARY_KEYS = ("tokenizer.ggml.tokens", "tokenizer.ggml.scores", "tokenizer.ggml.token_type",
                   "tokenizer.ggml.merges")


def without_vocabulary(metadata: dict) -> dict:
    """A GGUF metadata dict without VOCABULARY_KEYS (LoadedModel.metadata: kept for reference)."""
    return {k: v for k, v in metadata.items() if k not in VOCABULARY_KEYS}


def _load_hf_dir(path: str, with_tokenizer: bool) -> LoadedModel:
    cfg_path = os.path.join(path, "config.json")
    if not os.path.isfile(cfg_path):
        raise ModelFileError(path, "no config.json in this directory; an HF checkpoint directory needs "
                             "config.json and model.safetensors")
    try:
        with open(cfg_path, encoding="utf-8") as fh:
            config = json.load(fh)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ModelFileError(cfg_path, f"not valid JSON: {exc}") from exc
    if not isinstance(config, dict) or "model_type" not in config:
        raise ModelFileError(cfg_path, "config.json has no 'model_type'")
    arch = registry.by_hf_model_type(config["model_type"], cfg_path)
    spec = arch.spec_from_hf(config, cfg_path)
    raw = read_checkpoint_dir(path)
    if spec.tied_output is False and "lm_head.weight" not in raw and "embed_out.weight" not in raw:
        from dataclasses import replace
        spec = replace(spec, tied_output=True)   # checkpoints saved with tied weights omit the head
    try:
        mapped = arch.hf_tensors(spec, raw)
    except ModelFileError as exc:
        raise ModelFileError(path, exc.problem) from exc
    tensors = _checked(spec, mapped, path)
    tok = None
    if with_tokenizer:
        from ringllm.models.tokenizer import Tokenizer
        tok = Tokenizer.from_hf_dir(path)
    return LoadedModel(path, "safetensors", spec, tensors, tok, config)


def _checked(spec: ModelSpec, tensors: dict[str, QTensor], path: str) -> dict[str, QTensor]:
    """Keep the tensors the spec uses; every required one present with its declared shape."""
    required, optional = spec.expected_shapes(), spec.optional_shapes()
    out: dict[str, QTensor] = {}
    for name in required:
        if name not in tensors:
            raise ModelFileError(path, f"tensor '{name}' is missing (architecture {spec.arch})")
        out[name] = tensors[name]
    for name in optional:
        if name in tensors:
            out[name] = tensors[name]
    for name, t in out.items():
        shape = required.get(name) or optional[name]
        if tuple(t.shape) != tuple(shape):
            raise ModelFileError(path, f"tensor '{name}' has shape {tuple(t.shape)}, expected {tuple(shape)} "
                                 f"from the model's hyperparameters")
    return out
