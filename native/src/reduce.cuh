// Warp and block reductions shared by the kernels (blockDim.x a multiple of 32, at most 1024):
// kernels.cu (norms, token choice), attention.cu, prefill.cu, kv_write.cu and gvote.cu (float64 maxima).
#pragma once

#include <math.h>

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

template <typename T> __device__ __forceinline__ T warp_max(T v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Sum over the block; every thread gets the result. `red` is shared scratch of 32 entries.
template <typename T> __device__ inline T block_sum(T v, T *red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    T r = lane < nw ? red[lane] : T(0);
    return warp_sum(r);
}

// Maximum over the block (float or double: exact, so the same in any order); every thread gets the
// result. `red` is shared scratch of 32 entries.
template <typename T> __device__ inline T block_max(T v, T *red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    T r = lane < nw ? red[lane] : T(-INFINITY);
    return warp_max(r);
}
