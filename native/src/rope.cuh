// RoPE cos/sin of the attention kernels (attention.cu: the table and the per-token step; prefill.cu:
// the chunked prefill). Rotate-half convention: dim pair (i, i + half) of the first rotary_dim dims.
//
// cos/sin of position p for dim pair i: angle (p / scale) * inv_freq[i] in float64, rounded to
// float32, as the CPU's RopeTable; read from the model's table (tab: (n_tab, half) pairs, made once
// by rope_table_kernel) for p < n_tab, computed the same way past it (original positions of a long
// stream) or without a table (tab NULL, n_tab 0).
#pragma once

#include <stdint.h>

#include <cuda_runtime.h>

__device__ __forceinline__ float2 rope_angle_cs(int64_t p, double scale, double inv_freq) {
    double sd, cd;
    sincos(((double)p / scale) * inv_freq, &sd, &cd);
    return make_float2((float)cd, (float)sd);
}

// cos/sin of dim pair i at a position p < n_tab, from the table alone (prefill.cu: its chunks stay
// inside the table, so its kernel has no float64 sincos and no call to sincos's slow path)
__device__ __forceinline__ float2 rope_tab_cs(const float2 *tab, int64_t p, int i, int half) {
    return tab[p * half + i];
}

__device__ __forceinline__ float2 rope_cs(int64_t p, int i, int half, double scale, const double *inv_freq,
                                          const float2 *tab, int n_tab) {
    return p < n_tab ? rope_tab_cs(tab, p, i, half) : rope_angle_cs(p, scale, inv_freq[i]);
}

