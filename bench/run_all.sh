#!/usr/bin/env bash
# Every CPU benchmark in sequence (about 30 minutes on 2 cores). Set LLAMA_BENCH to a llama-bench binary
# built from llama.cpp to add the pure-C anchor; llama-cpp-python (pip install -e ".[bench]") is the other.
set -euo pipefail
cd "$(dirname "$0")/.."
python bench/cpu_speed.py --repeats 3
python bench/rope_strategies.py --repeats 3
python bench/long_stream.py -n 20000 --capacity 512
python bench/streaming_ppl.py -n 20000
python bench/perplexity_chunked.py --chunks 40
python bench/spin_count.py --rounds 2
