"""Shared fixtures: the bundled models (skipped cleanly when absent) and the test text."""
from __future__ import annotations

import os

import pytest

from ringllm.runtime.errors import ModelFileError

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")


def novel_text() -> str:
    with open(os.path.join(DATA_DIR, "prideprejudice.txt"), encoding="utf-8") as fh:
        return fh.read()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    from ringllm.models.bundled import default_model_path
    try:
        return default_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    from ringllm.models.bundled import gemma3_model_path
    try:
        return gemma3_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))
