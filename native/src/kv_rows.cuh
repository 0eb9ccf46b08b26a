// KV store rows in their element types (KVConfig k_type / v_type): the layouts of
// runtime/kv_types.py, encoded and decoded as runtime/kv_codec.py does them, bit for bit.
//
//   type          row of head_dim values
//   RL_TYPE_F32   head_dim float32
//   RL_TYPE_F16   head_dim IEEE half bit patterns (round to nearest even)
//   RL_TYPE_Q8_0  head_dim / 32 blocks of llama.cpp's block_q8_0: the f16 scale d (2 bytes, little
//                 endian) then 32 int8 q; d = amax / 127, q = roundf(x * (1 / d)) with 1 / d in
//                 float32 (0 when d is 0); value = q * d
//
// A row is encoded once, by the KV write that stores its token (kv_put), decoded in registers by
// every reader (kv_get: attention, the policies' key scores), and copied as it is when a slot moves
// (kv_copy). Row offsets are multiples of the row's bytes, which are even, so 2-byte loads and
// stores are aligned. The scalar codecs are __host__ __device__: tests/test_native_kv_types.py
// compiles them for the host and checks them against kv_codec's bytes.
//
// Included by common.cuh after include/ringllm_cuda.h (the RL_TYPE_* codes).
#pragma once

#include <math.h>
#include <stdint.h>

#include <cuda_fp16.h>

#include <type_traits>

constexpr int KV_QBLOCK = 32;        // values per q8_0 block
constexpr int KV_Q8_0_BYTES = 34;    // bytes per q8_0 block: f16 scale + 32 int8

// Bytes of one row of `type` holding hd values; 0 when the store cannot hold that type (or q8_0
// with hd not a multiple of 32).
__host__ __device__ constexpr int64_t kv_row_bytes(int type, int hd) {
    return type == RL_TYPE_F32    ? 4 * (int64_t)hd
           : type == RL_TYPE_F16  ? 2 * (int64_t)hd
           : type == RL_TYPE_Q8_0 ? (hd % KV_QBLOCK ? 0 : (int64_t)(hd / KV_QBLOCK) * KV_Q8_0_BYTES)
                                  : 0;
}

// ---------------------------------------------------------------------------------------------
// Scalars (host and device)
// ---------------------------------------------------------------------------------------------

__host__ __device__ __forceinline__ uint16_t kv_f16_bits(float x) { return __half_as_ushort(__float2half_rn(x)); }

__host__ __device__ __forceinline__ float kv_f16_value(uint16_t bits) { return __half2float(__ushort_as_half(bits)); }

// Lane i of a q8_0 block whose largest magnitude is amax: q_i into blk[2 + i], and the scale into
// blk[0..1] when i == 0. IEEE division and product (no reciprocal approximation, no contraction).
__host__ __device__ __forceinline__ void q8_0_put(uint8_t *blk, int i, float x, float amax) {
#ifdef __CUDA_ARCH__
    const float d = __fdiv_rn(amax, 127.0f);
    const float inv = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const float y = __fmul_rn(x, inv);
#else
    const float d = amax / 127.0f;
    const float inv = d != 0.0f ? 1.0f / d : 0.0f;
    const float y = x * inv;
#endif
    if (i == 0) *reinterpret_cast<uint16_t *>(blk) = kv_f16_bits(d);
    blk[2 + i] = (uint8_t)(int8_t)(int)roundf(y);   // roundf: halves away from zero, as gguf's np_roundf
}

// ---------------------------------------------------------------------------------------------
// Rows: value i of a row, in registers
// ---------------------------------------------------------------------------------------------

template <int T> __host__ __device__ __forceinline__ float kv_get(const uint8_t *row, int i);

template <> __host__ __device__ __forceinline__ float kv_get<RL_TYPE_F32>(const uint8_t *row, int i) {
    return reinterpret_cast<const float *>(row)[i];
}

template <> __host__ __device__ __forceinline__ float kv_get<RL_TYPE_F16>(const uint8_t *row, int i) {
    return kv_f16_value(reinterpret_cast<const uint16_t *>(row)[i]);
}

template <> __host__ __device__ __forceinline__ float kv_get<RL_TYPE_Q8_0>(const uint8_t *row, int i) {
    const uint8_t *blk = row + (i / KV_QBLOCK) * KV_Q8_0_BYTES;
    const float d = kv_f16_value(*reinterpret_cast<const uint16_t *>(blk));
    return d * (float)(int8_t)blk[2 + i % KV_QBLOCK];
}

// ---------------------------------------------------------------------------------------------
// Rows: block-cooperative writes (every thread of the block calls them; blockDim.x a multiple of 32)
// ---------------------------------------------------------------------------------------------

// row = the hd float32 values x, encoded (quantized here, once).
template <int T> __device__ __forceinline__ void kv_put(uint8_t *row, const float *x, int hd) {
    if constexpr (T == RL_TYPE_F32) {
        float *r = reinterpret_cast<float *>(row);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) r[d] = x[d];
    } else if constexpr (T == RL_TYPE_F16) {
        uint16_t *r = reinterpret_cast<uint16_t *>(row);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) r[d] = kv_f16_bits(x[d]);
    } else {   // one warp per q8_0 block: lane i holds value i, amax by shuffles (exact in any order)
        const int lane = threadIdx.x & 31, nw = blockDim.x >> 5;
        for (int b = threadIdx.x >> 5; b < hd / KV_QBLOCK; b += nw) {
            const float xv = x[b * KV_QBLOCK + lane];
            float amax = fabsf(xv);
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, off));
            q8_0_put(row + b * KV_Q8_0_BYTES, lane, xv, amax);
        }
    }
}

// dst = src, one encoded row as it is (2-byte units: every row's bytes are even; f32 in 4-byte units).
template <int T> __device__ __forceinline__ void kv_copy(uint8_t *dst, const uint8_t *src, int hd) {
    if constexpr (T == RL_TYPE_F32) {
        float *o = reinterpret_cast<float *>(dst);
        const float *i = reinterpret_cast<const float *>(src);
        for (int d = threadIdx.x; d < hd; d += blockDim.x) o[d] = i[d];
    } else {
        uint16_t *o = reinterpret_cast<uint16_t *>(dst);
        const uint16_t *i = reinterpret_cast<const uint16_t *>(src);
        const int n = (int)(kv_row_bytes(T, hd) / 2);
        for (int d = threadIdx.x; d < n; d += blockDim.x) o[d] = i[d];
    }
}

// fn(KT, VT) with the store's element types as std::integral_constant (the kernels' template
// arguments); types were validated at store init (any other code runs as f32).
template <int KT, typename Fn> inline void with_v_type(int v_type, Fn &&fn) {
    using K = std::integral_constant<int, KT>;
    if (v_type == RL_TYPE_F16) fn(K{}, std::integral_constant<int, RL_TYPE_F16>{});
    else if (v_type == RL_TYPE_Q8_0) fn(K{}, std::integral_constant<int, RL_TYPE_Q8_0>{});
    else fn(K{}, std::integral_constant<int, RL_TYPE_F32>{});
}

template <typename Fn> inline void with_kv_types(int k_type, int v_type, Fn &&fn) {
    if (k_type == RL_TYPE_F16) with_v_type<RL_TYPE_F16>(v_type, fn);
    else if (k_type == RL_TYPE_Q8_0) with_v_type<RL_TYPE_Q8_0>(v_type, fn);
    else with_v_type<RL_TYPE_F32>(v_type, fn);
}
