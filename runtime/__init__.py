"""ringllm.runtime: kernels, KV store, eviction policies, CPU and reference engines.

Numba's OpenMP layer (libgomp) spins for GOMP_SPINCOUNT (default 300,000) iterations before a
waiting thread sleeps. When another process wants one of the cores, the spinning thread holds it
while the thread that has work waits for the scheduler: measured here, a 2-thread decode with one
busy process beside it went from p50 16 ms / p99 179 ms (default) to p50 18 ms / p99 23 ms with a
spin count of 1,000, at the same speed on an idle machine (bench/results/long_stream.md). Set
before libgomp is loaded; a value the user exported wins.
"""
import os

os.environ.setdefault("GOMP_SPINCOUNT", "1000")
