"""Shared fixtures: the bundled models (skipped cleanly when absent), the test text, and the openai
client of the server tests."""
from __future__ import annotations

import os

import pytest

from ringllm.runtime.errors import ModelFileError

DATA_DIR = os.path.join(os.path.dirname(__file__), "data")

# Slow tests (marked `slow`) run a short form by default, the one CI runs: fewer steps or tokens
# through the same code paths. RINGLLM_TEST_FULL=1 runs each at its full length (the issues'
# acceptance runs: 1,000 greedy tokens, 2,000-token prompts, every policy x KV type).
FULL = os.environ.get("RINGLLM_TEST_FULL") == "1"


def full_or_short(full, short):
    """A slow test's size: `full` under RINGLLM_TEST_FULL=1, else CI's `short`."""
    return full if FULL else short


def novel_text() -> str:
    with open(os.path.join(DATA_DIR, "prideprejudice.txt"), encoding="utf-8") as fh:
        return fh.read()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The bundled SmolLM2 GGUF, or the file RINGLLM_TEST_SMOLLM2 names (a GPU machine that cannot
    receive the whole file runs the device-parity tests on bench/truncated_gguf.py's cut of it)."""
    from ringllm.models.bundled import default_model_path
    override = os.environ.get("RINGLLM_TEST_SMOLLM2")
    if override:
        return override
    try:
        return default_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))


def smollm2_first_layers(smollm2_path: str, n_layer: int, tmp_path_factory) -> str:
    """A GGUF of SmolLM2's first n_layer of 30 layers, every other tensor and key as they are
    (bench/truncated_gguf.py), written under a fresh temporary directory; returns its path."""
    import sys
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench"))
    from truncated_gguf import truncate
    out = str(tmp_path_factory.mktemp(f"smollm2_{n_layer}") / f"smollm2-{n_layer}layers.gguf")
    truncate(smollm2_path, n_layer, out)
    return out


@pytest.fixture(scope="session")
def smollm2_cut_path(smollm2_path, tmp_path_factory) -> str:
    """A tiny model with a real tokenizer and chat template: SmolLM2's first 2 of 30 layers
    (smollm2_first_layers). Its answers are not SmolLM2's; it serves the short soaks, which measure
    the runtime (memory, files, reloads), not the model."""
    return smollm2_first_layers(smollm2_path, 2, tmp_path_factory)


@pytest.fixture(scope="session")
def gemma3_path() -> str:
    from ringllm.models.bundled import gemma3_model_path
    try:
        return gemma3_model_path()
    except ModelFileError as exc:
        pytest.skip(str(exc))


# The server tests: each module defines `server` (the base URL of a running `ringllm serve`) and
# `server_key` (its API key); these two fixtures give the official openai client on it.

@pytest.fixture(scope="module")
def client(server, server_key):
    openai = pytest.importorskip("openai")
    return openai.OpenAI(base_url=server + "/v1", api_key=server_key, max_retries=0, timeout=300)


@pytest.fixture(scope="module")
def model_id(client):
    return client.models.list().data[0].id


# CI time: most of a cold run is Numba compiling kernels, and a test's duration does not say how much
# of it was compiling (the first test to need a kernel pays for every later one). Each test's compile
# seconds in this process (setup and call; subprocesses not counted) are listed in the run's summary.
_COMPILE_SECONDS: dict[str, list] = {}


def _timed_compiles(nodeid: str):
    """A hook wrapper's body: the compile seconds and signatures of the phase it wraps, added to nodeid's."""
    from ringllm.runtime.compile_clock import CompileSpan
    with CompileSpan() as span:
        yield
    entry = _COMPILE_SECONDS.setdefault(nodeid, [0.0, 0])
    entry[0] += span.seconds
    entry[1] += span.signatures


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_setup(item):
    yield from _timed_compiles(item.nodeid)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    yield from _timed_compiles(item.nodeid)


def pytest_terminal_summary(terminalreporter):
    spent = sorted(((s, n, k) for k, (s, n) in _COMPILE_SECONDS.items() if s >= 0.5), reverse=True)
    if not spent:
        return
    total = sum(s for s, _, _ in spent)
    terminalreporter.write_sep("=", f"kernel compiles in the test process: {total:.0f} s, largest 25")
    for s, n, k in spent[:25]:
        terminalreporter.write_line(f"{s:7.2f}s {n:4d} signatures  {k}")
