// GGUF block decoding in registers, and the kernels that read quantized weights: dequant (tests),
// matmul / matvec (every projection), grouped matmuls with fused epilogues (q/k/v in one launch;
// FFN gate/up with the activation; bias and residual adds), embedding rows.
//
// Block layouts follow ggml-common.h (block_q4_0 ... block_q6_K) and the value order of
// ggml-quants.c's dequantize_row_*, exactly as runtime/dequant.py documents them. Decoding uses
// __fmul_rn / __fadd_rn where a multiply is followed by an add so that nvcc cannot fuse them into an
// FMA: the decoded values are then bit-identical to runtime/dequant.py and gguf.quants.
#include "common.cuh"

#include <limits.h>

#include <cuda_fp16.h>

namespace {

constexpr int QK_K = 256;

// Every block size is even and every weight tensor has an allocation of its own, so a block's
// half-width fields are 2-byte aligned: one 16-bit load each.
__device__ __forceinline__ uint32_t ld_u16(const uint8_t *p) { return __ldg(reinterpret_cast<const unsigned short *>(p)); }

__device__ __forceinline__ uint32_t ld_u32(const uint8_t *p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

// Bytes p[0..7] as two little-endian words, from aligned 32-bit loads: 2 or 3 loads where reading them
// one by one took 8. Blocks of 18, 22, 34 or 210 bytes leave a row's values 2-byte aligned only,
// hence the funnel shift. The third word is read only when p is not 4-aligned; it then holds byte
// p[7], so it lies inside the allocation (device allocations are 256-byte aligned).
__device__ __forceinline__ uint2 ld8(const uint8_t *p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t *w = reinterpret_cast<const uint32_t *>(a & ~(uintptr_t)3);
    const uint32_t sh = (uint32_t)(a & 3) * 8;
    const uint32_t w0 = __ldg(w), w1 = __ldg(w + 1), w2 = sh ? __ldg(w + 2) : 0u;
    return make_uint2(__funnelshift_r(w0, w1, sh), __funnelshift_r(w1, w2, sh));
}

// byte k (a compile-time constant in the unrolled loops) of the 8 that ld8 read
__device__ __forceinline__ int byte_of(uint2 q, int k) { return (int)(((k < 4 ? q.x : q.y) >> (8 * (k & 3))) & 0xFFu); }

// IEEE binary16 bits -> float32 (exact, like NumPy's cast: subnormals, signed zeros, inf/NaN)
__device__ __forceinline__ float f16_at(const uint8_t *p) { return __half2float(__ushort_as_half((unsigned short)ld_u16(p))); }

// get_scale_min_k4 of ggml-quants.c: 6-bit scale and min of sub-block j from 12 packed bytes
__device__ __forceinline__ void scale_min_k4(const uint8_t *q, int j, int *sc, int *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// ---------------------------------------------------------------------------------------------
// dq8<QT>(row, i0, v): values i0 .. i0 + 7 of one row (i0 % 8 == 0) into v[8]
// ---------------------------------------------------------------------------------------------

template <int QT> __device__ __forceinline__ void dq8(const uint8_t *row, int i0, float v[8]);

template <> __device__ __forceinline__ void dq8<RL_TYPE_F32>(const uint8_t *row, int i0, float v[8]) {
    const float *p = reinterpret_cast<const float *>(row) + i0;
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
        const float4 a = __ldg(reinterpret_cast<const float4 *>(p)), b = __ldg(reinterpret_cast<const float4 *>(p) + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = p[k];
}

// 8 half-width values as four words (one 16-byte load when aligned): element k is half k & 1 of word k / 2
__device__ __forceinline__ uint4 ld16_halves(const unsigned short *p) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) return __ldg(reinterpret_cast<const uint4 *>(p));
    uint4 r;
    r.x = (uint32_t)p[0] | ((uint32_t)p[1] << 16);
    r.y = (uint32_t)p[2] | ((uint32_t)p[3] << 16);
    r.z = (uint32_t)p[4] | ((uint32_t)p[5] << 16);
    r.w = (uint32_t)p[6] | ((uint32_t)p[7] << 16);
    return r;
}

__device__ __forceinline__ unsigned short half_of(uint4 q, int k) {
    const uint32_t w = k < 2 ? q.x : k < 4 ? q.y : k < 6 ? q.z : q.w;
    return (unsigned short)(w >> (16 * (k & 1)));
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_F16>(const uint8_t *row, int i0, float v[8]) {
    const uint4 q = ld16_halves(reinterpret_cast<const unsigned short *>(row) + i0);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = __half2float(__ushort_as_half(half_of(q, k)));
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_BF16>(const uint8_t *row, int i0, float v[8]) {
    const uint4 q = ld16_halves(reinterpret_cast<const unsigned short *>(row) + i0);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = __uint_as_float((uint32_t)half_of(q, k) << 16);
}

// Legacy 32-value blocks: value j < 16 is the low nibble of qs[j], value j + 16 its high nibble.
template <> __device__ __forceinline__ void dq8<RL_TYPE_Q4_0>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 >> 5) * 18;
    const int j0 = i0 & 31, sh = j0 >= 16 ? 4 : 0;
    const float d = f16_at(b);
    const uint2 qs = ld8(b + 2 + (j0 & 15));
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * (float)(((byte_of(qs, k) >> sh) & 15) - 8);
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_Q4_1>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 >> 5) * 20;
    const int j0 = i0 & 31, sh = j0 >= 16 ? 4 : 0;
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint2 qs = ld8(b + 4 + (j0 & 15));
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = __fadd_rn(__fmul_rn(d, (float)((byte_of(qs, k) >> sh) & 15)), m);
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_Q5_0>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 >> 5) * 22;
    const int j0 = i0 & 31, sh = j0 >= 16 ? 4 : 0;
    const float d = f16_at(b);
    const uint32_t qh = ld_u32(b + 2);
    const uint2 qs = ld8(b + 6 + (j0 & 15));
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int q = ((byte_of(qs, k) >> sh) & 15) | (int)(((qh >> (j0 + k)) & 1u) << 4);
        v[k] = d * (float)(q - 16);
    }
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_Q5_1>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 >> 5) * 24;
    const int j0 = i0 & 31, sh = j0 >= 16 ? 4 : 0;
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = ld_u32(b + 4);
    const uint2 qs = ld8(b + 8 + (j0 & 15));
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int q = ((byte_of(qs, k) >> sh) & 15) | (int)(((qh >> (j0 + k)) & 1u) << 4);
        v[k] = __fadd_rn(__fmul_rn(d, (float)q), m);
    }
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_Q8_0>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 >> 5) * 34;
    const float d = f16_at(b);
    const uint2 qs = ld8(b + 2 + (i0 & 31));
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = (float)(int8_t)byte_of(qs, k) * d;
}

// K-quants: chunk c = j / 64 of a super-block holds sub-blocks 2c (low nibbles of qs[32c..]) and
// 2c + 1 (high nibbles); y = (d * sc) * q - dmin * m.
template <> __device__ __forceinline__ void dq8<RL_TYPE_Q4_K>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 / QK_K) * 144;
    const int j = i0 % QK_K, c = j >> 6, hi = (j >> 5) & 1, l0 = j & 31;
    int sc, mn;
    scale_min_k4(b + 4, 2 * c + hi, &sc, &mn);
    const float d1 = __fmul_rn(f16_at(b), (float)sc), dm = __fmul_rn(f16_at(b + 2), (float)mn);
    const uint2 qs = ld8(b + 16 + 32 * c + l0);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = __fsub_rn(__fmul_rn(d1, (float)((byte_of(qs, k) >> (4 * hi)) & 15)), dm);
}

template <> __device__ __forceinline__ void dq8<RL_TYPE_Q5_K>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 / QK_K) * 176;
    const int j = i0 % QK_K, c = j >> 6, hi = (j >> 5) & 1, l0 = j & 31;
    int sc, mn;
    scale_min_k4(b + 4, 2 * c + hi, &sc, &mn);
    const float d1 = __fmul_rn(f16_at(b), (float)sc), dm = __fmul_rn(f16_at(b + 2), (float)mn);
    const uint2 qh = ld8(b + 16 + l0);
    const uint2 qs = ld8(b + 48 + 32 * c + l0);
    const int hb = 2 * c + hi;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int q = ((byte_of(qs, k) >> (4 * hi)) & 15) | (((byte_of(qh, k) >> hb) & 1) << 4);
        v[k] = __fsub_rn(__fmul_rn(d1, (float)q), dm);
    }
}

// Q6_K: per 128-value half n, quarter qd = (j % 128) / 32, l = j % 32:
// q = (ql[64n + l + 32(qd & 1)] >> 4(qd >> 1)) & 15 | ((qh[32n + l] >> 2qd) & 3) << 4, minus 32;
// y = (d * scales[8n + l/16 + 2qd]) * q.
template <> __device__ __forceinline__ void dq8<RL_TYPE_Q6_K>(const uint8_t *row, int i0, float v[8]) {
    const uint8_t *b = row + (i0 / QK_K) * 210;
    const int j = i0 % QK_K, n = j >> 7, qd = (j >> 5) & 3, l0 = j & 31;
    const float d = f16_at(b + 208);
    const float ds = d * (float)(int8_t)b[192 + 8 * n + (l0 >> 4) + 2 * qd];
    const uint2 ql = ld8(b + 64 * n + 32 * (qd & 1) + l0);
    const uint2 qh = ld8(b + 128 + 32 * n + l0);
    const int shl = 4 * (qd >> 1), shh = 2 * qd;
#pragma unroll
    for (int k = 0; k < 8; k++) {
        const int q = (((byte_of(ql, k) >> shl) & 15) | (((byte_of(qh, k) >> shh) & 3) << 4)) - 32;
        v[k] = ds * (float)q;
    }
}

// One value (tails of float rows whose length is not a multiple of 8): floats only.
template <int QT> __device__ __forceinline__ float dq1(const uint8_t *row, int i) {
    if (QT == RL_TYPE_F32) return reinterpret_cast<const float *>(row)[i];
    if (QT == RL_TYPE_F16) return __half2float(__ushort_as_half(reinterpret_cast<const unsigned short *>(row)[i]));
    return __uint_as_float((uint32_t)reinterpret_cast<const unsigned short *>(row)[i] << 16);
}

// ---------------------------------------------------------------------------------------------
// Kernels
// ---------------------------------------------------------------------------------------------

// out (n_rows, n_cols): one thread per 8 values (block types have n_cols % 32 == 0).
template <int QT>
__global__ void dequant_kernel(float *out, const uint8_t *w, int64_t n_rows, int64_t n_cols, int64_t row_bytes) {
    const int64_t per_row = (n_cols + 7) / 8;
    const int64_t g = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (g >= n_rows * per_row) return;
    const int64_t r = g / per_row;
    const int i0 = (int)(g % per_row) * 8;
    const uint8_t *row = w + r * row_bytes;
    float *o = out + r * n_cols;
    if (i0 + 8 <= n_cols) {
        float v[8];
        dq8<QT>(row, i0, v);
#pragma unroll
        for (int k = 0; k < 8; k++) o[i0 + k] = v[k];
    } else {
        for (int i = i0; i < n_cols; i++) o[i] = dq1<QT>(row, i);
    }
}

constexpr int MM_WARPS = 4;   // rows per block (one warp per row)

// acc[t] = W[row] . x[t0 + t] for the TT tokens t0 + t < T of a block column (0 past T), every
// lane of the warp getting the sums. Each lane decodes 8 consecutive values per step (a warp
// covers 256 values per step) and multiplies them into TT float32 accumulators; warp shuffle
// reduction at the end. matmul_kernel and matmul_group_kernel share it, so a row's sums are the
// same float operations in the same order in both.
template <int QT, int TT>
__device__ __forceinline__ void row_dot(float acc[TT], const uint8_t *row, const float *x, int n_cols, int t0, int T) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int t = 0; t < TT; t++) acc[t] = 0.0f;
    const int n8 = n_cols & ~7;
    const bool vec4 = (n_cols & 3) == 0 && (reinterpret_cast<uintptr_t>(x) & 15) == 0;
    // A decode row (TT = 1) is a short chain of steps (8 for 2,048 columns) whose time is memory
    // latency: unrolled, the loads of four steps are issued before the first is used. The sums keep
    // their order. Several tokens (TT = 8) already give each step enough arithmetic.
#pragma unroll(TT == 1 ? 4 : 1)
    for (int i0 = lane * 8; i0 < n8; i0 += 256) {
        float v[8];
        dq8<QT>(row, i0, v);
#pragma unroll
        for (int t = 0; t < TT; t++) {
            if (t0 + t < T) {
                const float *xr = x + (int64_t)(t0 + t) * n_cols + i0;
                if (vec4) {   // rows 16-byte aligned: two 128-bit loads
                    const float4 a = reinterpret_cast<const float4 *>(xr)[0], b = reinterpret_cast<const float4 *>(xr)[1];
                    acc[t] += v[0] * a.x + v[1] * a.y + v[2] * a.z + v[3] * a.w
                            + v[4] * b.x + v[5] * b.y + v[6] * b.z + v[7] * b.w;
                } else {
#pragma unroll
                    for (int k = 0; k < 8; k++) acc[t] += v[k] * xr[k];
                }
            }
        }
    }
    if (n8 < n_cols) {   // float types only
        for (int i = n8 + lane; i < n_cols; i += 32) {
            const float wv = dq1<QT>(row, i);
#pragma unroll
            for (int t = 0; t < TT; t++)
                if (t0 + t < T) acc[t] += wv * x[(int64_t)(t0 + t) * n_cols + i];
        }
    }
#pragma unroll
    for (int t = 0; t < TT; t++) {
        float a = acc[t];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) a += __shfl_xor_sync(0xffffffffu, a, off);
        acc[t] = a;
    }
}

// row_dot of a type known at run time (the parts of a grouped launch may differ in type)
template <int TT>
__device__ __forceinline__ void row_dot_any(int qtype, float acc[TT], const uint8_t *row, const float *x, int n_cols,
                                            int t0, int T) {
    switch (qtype) {
        case RL_TYPE_F32: row_dot<RL_TYPE_F32, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_F16: row_dot<RL_TYPE_F16, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_BF16: row_dot<RL_TYPE_BF16, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q4_0: row_dot<RL_TYPE_Q4_0, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q4_1: row_dot<RL_TYPE_Q4_1, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q5_0: row_dot<RL_TYPE_Q5_0, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q5_1: row_dot<RL_TYPE_Q5_1, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q8_0: row_dot<RL_TYPE_Q8_0, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q4_K: row_dot<RL_TYPE_Q4_K, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q5_K: row_dot<RL_TYPE_Q5_K, TT>(acc, row, x, n_cols, t0, T); break;
        case RL_TYPE_Q6_K: row_dot<RL_TYPE_Q6_K, TT>(acc, row, x, n_cols, t0, T); break;
        default:   // callers validated the type (rl_type_layout)
#pragma unroll
            for (int t = 0; t < TT; t++) acc[t] = 0.0f;
    }
}

// out (T, n_rows) = x (T, n_cols) @ W.T: one warp per weight row, TT tokens per block column.
template <int QT, int TT>
__global__ void __launch_bounds__(MM_WARPS * 32)
matmul_kernel(float *out, const uint8_t *w, const float *x, int n_rows, int n_cols, int64_t row_bytes, int T) {
    const int r = blockIdx.x * MM_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * TT;
    if (r >= n_rows) return;
    float acc[TT];
    row_dot<QT, TT>(acc, w + (int64_t)r * row_bytes, x, n_cols, t0, T);
    if ((threadIdx.x & 31) != 0) return;
#pragma unroll
    for (int t = 0; t < TT; t++)
        if (t0 + t < T) out[(int64_t)(t0 + t) * n_rows + r] = acc[t];
}

// Up to MM_MAX_PARTS matrices sharing x in one launch (common.cuh, launch_matmul_group). block0[i]:
// the first block of part i (MM_EPI_STORE / MM_EPI_ADD: each part's rows in blocks of their own);
// UINT_MAX for parts without blocks of their own (MM_EPI_ACT's second part, unused slots).
struct MatmulGroup {
    MatmulPart part[MM_MAX_PARTS];
    unsigned block0[MM_MAX_PARTS];
    int n_parts, epi, act;
};

constexpr int MM_MIXED = -1;   // QT of a grouped launch whose parts differ in type

template <int QT, int TT>
__device__ __forceinline__ void part_dot(float acc[TT], int qtype, const uint8_t *row, const float *x, int n_cols,
                                         int t0, int T) {
    if constexpr (QT == MM_MIXED) row_dot_any<TT>(qtype, acc, row, x, n_cols, t0, T);
    else row_dot<QT, TT>(acc, row, x, n_cols, t0, T);
}

// QT: the parts' common type, or MM_MIXED. The epilogue applies the unfused path's elementwise
// kernels to a warp's sums in their order and float operations: + b (add_bias_kernel), out + y
// (add_kernel), act(g) * u (act_kernel's act_f). MM_MIXED holds every type's code: at least 4
// blocks per SM lets it use up to 128 registers, where ptxas's own choice spilled (0: no minimum).
template <int QT, int TT>
__global__ void __launch_bounds__(MM_WARPS * 32, QT == MM_MIXED ? 4 : 0)
matmul_group_kernel(MatmulGroup g, const float *x, int n_cols, int T) {
    // this block's part (parts in fixed slots: an indexed kernel argument would go to local memory)
    MatmulPart mp = g.part[0];
    unsigned b0 = 0;
#pragma unroll
    for (int i = 1; i < MM_MAX_PARTS; i++)
        if (blockIdx.x >= g.block0[i]) {
            mp = g.part[i];
            b0 = g.block0[i];
        }
    const int r = (int)(blockIdx.x - b0) * MM_WARPS + (threadIdx.x >> 5);
    const int t0 = blockIdx.y * TT;
    if (r >= mp.n_rows) return;
    // every lane holds every sum after row_dot; lane t < TT finishes token t0 + t, so one value per
    // lane (not TT) stays live across the gated second dot product
    const int lane = threadIdx.x & 31;
    float acc[TT], a = 0.0f, u = 0.0f;
    part_dot<QT, TT>(acc, mp.qtype, mp.w + (int64_t)r * mp.row_bytes, x, n_cols, t0, T);
#pragma unroll
    for (int t = 0; t < TT; t++)
        if (lane == t) a = acc[t];   // a select, not an indexed (local memory) array
    const bool gated = g.epi == MM_EPI_ACT && g.n_parts == 2;
    const MatmulPart &up = g.part[1];
    if (gated) {
        part_dot<QT, TT>(acc, up.qtype, up.w + (int64_t)r * up.row_bytes, x, n_cols, t0, T);
#pragma unroll
        for (int t = 0; t < TT; t++)
            if (lane == t) u = acc[t];
    }
    if (lane >= TT || t0 + lane >= T) return;
    if (mp.b) a = a + mp.b[r];
    float *o = mp.out + (int64_t)(t0 + lane) * mp.n_rows + r;
    if (g.epi == MM_EPI_STORE) {
        *o = a;
    } else if (g.epi == MM_EPI_ADD) {
        *o = *o + a;
    } else if (gated) {
        if (up.b) u = u + up.b[r];
        *o = act_f(a, g.act) * u;
    } else {
        *o = act_f(a, g.act);
    }
}

// out (n, n_cols) = scale * W[ids[i]]: one block per token.
template <int QT>
__global__ void embed_kernel(float *out, const uint8_t *w, const int32_t *ids, int n_cols, int64_t row_bytes,
                             float scale) {
    const uint8_t *row = w + (int64_t)ids[blockIdx.x] * row_bytes;
    float *o = out + (int64_t)blockIdx.x * n_cols;
    for (int i0 = threadIdx.x * 8; i0 < n_cols; i0 += blockDim.x * 8) {
        if (i0 + 8 <= n_cols) {
            float v[8];
            dq8<QT>(row, i0, v);
#pragma unroll
            for (int k = 0; k < 8; k++) o[i0 + k] = scale == 1.0f ? v[k] : v[k] * scale;
        } else {
            for (int i = i0; i < n_cols; i++) o[i] = scale == 1.0f ? dq1<QT>(row, i) : dq1<QT>(row, i) * scale;
        }
    }
}

// Dispatch over the GGML type: F(QT) is a generic lambda called with an integral constant.
template <int QT> struct TypeTag { static constexpr int value = QT; };

template <typename F> void dispatch_type(int qtype, F &&f) {
    switch (qtype) {
        case RL_TYPE_F32: f(TypeTag<RL_TYPE_F32>()); break;
        case RL_TYPE_F16: f(TypeTag<RL_TYPE_F16>()); break;
        case RL_TYPE_BF16: f(TypeTag<RL_TYPE_BF16>()); break;
        case RL_TYPE_Q4_0: f(TypeTag<RL_TYPE_Q4_0>()); break;
        case RL_TYPE_Q4_1: f(TypeTag<RL_TYPE_Q4_1>()); break;
        case RL_TYPE_Q5_0: f(TypeTag<RL_TYPE_Q5_0>()); break;
        case RL_TYPE_Q5_1: f(TypeTag<RL_TYPE_Q5_1>()); break;
        case RL_TYPE_Q8_0: f(TypeTag<RL_TYPE_Q8_0>()); break;
        case RL_TYPE_Q4_K: f(TypeTag<RL_TYPE_Q4_K>()); break;
        case RL_TYPE_Q5_K: f(TypeTag<RL_TYPE_Q5_K>()); break;
        case RL_TYPE_Q6_K: f(TypeTag<RL_TYPE_Q6_K>()); break;
        default: break;   // callers validated the type (rl_type_layout)
    }
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// Layouts and launchers
// ---------------------------------------------------------------------------------------------

bool rl_type_layout(int qtype, int *block, int *size) {
    switch (qtype) {
        case RL_TYPE_F32: *block = 1; *size = 4; return true;
        case RL_TYPE_F16: *block = 1; *size = 2; return true;
        case RL_TYPE_BF16: *block = 1; *size = 2; return true;
        case RL_TYPE_Q4_0: *block = 32; *size = 18; return true;
        case RL_TYPE_Q4_1: *block = 32; *size = 20; return true;
        case RL_TYPE_Q5_0: *block = 32; *size = 22; return true;
        case RL_TYPE_Q5_1: *block = 32; *size = 24; return true;
        case RL_TYPE_Q8_0: *block = 32; *size = 34; return true;
        case RL_TYPE_Q4_K: *block = 256; *size = 144; return true;
        case RL_TYPE_Q5_K: *block = 256; *size = 176; return true;
        case RL_TYPE_Q6_K: *block = 256; *size = 210; return true;
        default: return false;
    }
}

void launch_dequant(float *out, const uint8_t *w, int qtype, int64_t n_rows, int64_t n_cols, int64_t row_bytes,
                    cudaStream_t st) {
    const int64_t n = n_rows * ((n_cols + 7) / 8);
    const int threads = 256;
    const unsigned blocks = (unsigned)((n + threads - 1) / threads);
    dispatch_type(qtype, [&](auto tag) {
        dequant_kernel<decltype(tag)::value><<<blocks, threads, 0, st>>>(out, w, n_rows, n_cols, row_bytes);
    });
}

void launch_matmul(float *out, const uint8_t *w, const float *x, int qtype, int64_t n_rows, int64_t n_cols,
                   int64_t row_bytes, int T, cudaStream_t st) {
    const unsigned gx = (unsigned)((n_rows + MM_WARPS - 1) / MM_WARPS);
    dispatch_type(qtype, [&](auto tag) {
        constexpr int QT = decltype(tag)::value;
        if (T == 1) {
            matmul_kernel<QT, 1><<<dim3(gx, 1), MM_WARPS * 32, 0, st>>>(out, w, x, (int)n_rows, (int)n_cols,
                                                                       row_bytes, T);
        } else {
            constexpr int TT = 8;
            matmul_kernel<QT, TT><<<dim3(gx, (T + TT - 1) / TT), MM_WARPS * 32, 0, st>>>(
                out, w, x, (int)n_rows, (int)n_cols, row_bytes, T);
        }
    });
}

void launch_matmul_group(const MatmulPart *parts, int n_parts, int epi, int act, const float *x, int64_t n_cols, int T,
                         cudaStream_t st) {
    MatmulGroup g{};
    g.n_parts = n_parts;
    g.epi = epi;
    g.act = act;
    unsigned gx = 0;
    for (int i = 0; i < MM_MAX_PARTS; i++) {
        g.part[i] = parts[i < n_parts ? i : 0];
        g.block0[i] = i < n_parts && (i == 0 || epi != MM_EPI_ACT) ? gx : UINT_MAX;
        if (g.block0[i] != UINT_MAX) gx += (unsigned)((parts[i].n_rows + MM_WARPS - 1) / MM_WARPS);
    }
    int qt = parts[0].qtype;   // one type: that type's kernel; else the one that switches per part
    for (int i = 1; i < n_parts; i++)
        if (parts[i].qtype != qt) qt = MM_MIXED;
    auto launch = [&](auto tag) {
        constexpr int QT = decltype(tag)::value;
        if (T == 1) {
            matmul_group_kernel<QT, 1><<<dim3(gx, 1), MM_WARPS * 32, 0, st>>>(g, x, (int)n_cols, T);
        } else {
            constexpr int TT = 8;   // as launch_matmul
            matmul_group_kernel<QT, TT><<<dim3(gx, (T + TT - 1) / TT), MM_WARPS * 32, 0, st>>>(g, x, (int)n_cols, T);
        }
    };
    if (qt == MM_MIXED) launch(TypeTag<MM_MIXED>());
    else dispatch_type(qt, launch);
}

void launch_embed(float *out, const uint8_t *w, const int32_t *ids, int qtype, int64_t n_cols, int64_t row_bytes,
                  int n, float scale, cudaStream_t st) {
    dispatch_type(qtype, [&](auto tag) {
        embed_kernel<decltype(tag)::value><<<n, 128, 0, st>>>(out, w, ids, (int)n_cols, row_bytes, scale);
    });
}
