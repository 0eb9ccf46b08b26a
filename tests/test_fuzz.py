"""Fuzzing of every parser of untrusted input (targets in tests/fuzz/targets.py).

Three forms per target, all bounded for CI:
- the committed corpus (seeds and every crasher found so far) replayed in-process;
- hypothesis: structured inputs (a seed with bytes overwritten, cut or spliced), max_examples bounded;
- atheris (coverage-guided libFuzzer) in a subprocess for RINGLLM_FUZZ_SECONDS (default 5) from the
  corpus. The long runs of docs/reliability.md are the same command with a larger -max_total_time.

A finding is any exception other than a RingLLMError (for the server: a 5xx, or a 4xx without an
error message), a hang past libFuzzer's -timeout, or a crash of the process.
"""
from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fuzz.targets import TARGETS, corpus_files

HERE = os.path.dirname(os.path.abspath(__file__))
FUZZ_SECONDS = int(os.environ.get("RINGLLM_FUZZ_SECONDS", "5"))
NEEDS_MODEL = {"session", "tokenizer", "server"}


def _need_model(name: str, request) -> None:
    """The model-backed targets use the bundled SmolLM2; skipped cleanly where it is absent."""
    if name in NEEDS_MODEL:
        request.getfixturevalue("smollm2_path")


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_corpus_replays_clean(name, request):
    _need_model(name, request)
    files = corpus_files(name)
    assert files, f"no corpus for {name}"
    for path in files:
        with open(path, "rb") as fh:
            TARGETS[name](fh.read())


def _mutated(name: str):
    """A seed of `name`'s corpus with some bytes overwritten, a cut, and a splice of another seed."""
    seeds = [open(p, "rb").read() for p in corpus_files(name)]

    @st.composite
    def strategy(draw):
        data = bytearray(draw(st.sampled_from(seeds)))
        for _ in range(draw(st.integers(0, 4))):
            if data:
                i = draw(st.integers(0, len(data) - 1))
                chunk = draw(st.binary(min_size=1, max_size=8))
                data[i:i + len(chunk)] = chunk
        if data and draw(st.booleans()):
            cut = draw(st.integers(0, len(data)))
            data = data[:cut] + (draw(st.sampled_from(seeds))[cut:] if draw(st.booleans()) else b"")
        return bytes(data)
    return strategy()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_hypothesis_mutations(name, request):
    _need_model(name, request)
    @settings(max_examples=60 if name == "server" else 150, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(_mutated(name))
    def run(data):
        TARGETS[name](data)
    run()


@pytest.mark.parametrize("name", sorted(TARGETS))
def test_atheris_short_run(name, request, tmp_path):
    pytest.importorskip("atheris")
    _need_model(name, request)
    new = tmp_path / "new"
    new.mkdir()
    # libFuzzer measures peak RSS (ru_maxrss), which a child inherits from the process that forked it:
    # the limit is 2 GiB over this (long-running pytest) process's own peak
    import resource
    limit_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // 1024 + 2048
    cmd = [sys.executable, os.path.join(HERE, "fuzz", "run_atheris.py"), name, f"-max_total_time={FUZZ_SECONDS}",
           "-timeout=20", f"-rss_limit_mb={limit_mb}", f"-artifact_prefix={tmp_path}/", str(new),
           os.path.join(HERE, "fuzz", "corpus", name)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=FUZZ_SECONDS + 180)
    log = proc.stdout + proc.stderr
    crashes = [f for f in os.listdir(tmp_path) if f.startswith(("crash-", "timeout-", "oom-"))]
    assert proc.returncode == 0 and not crashes, f"finding {crashes} (rc {proc.returncode}):\n{log[-6000:]}"
    done = re.search(r"Done (\d+) runs", log)
    assert done and int(done.group(1)) > 0, log[-3000:]
