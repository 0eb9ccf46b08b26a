// Device arithmetic the eviction kernels share (kv_write.cu, gvote.cu), each the CPU's exactly.
#pragma once

#include <stdint.h>

// Staged eviction, Algorithm 1 (runtime/eviction.py keep_after): tokens kept of `length` held.
__device__ __forceinline__ int keep_after(int length, int cap, int lazy, int slack, int max_drop) {
    if (length <= cap || length - cap < lazy) return length;
    if (max_drop == 0) return cap;
    const int k = length - max_drop > cap ? length - max_drop : cap;
    return k < cap + slack ? k : cap + slack;
}

// One splitmix64 output for state x (runtime/policies/random_policy.py splitmix64).
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}
