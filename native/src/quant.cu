// The kernels that read quantized weights: dequant (tests), matmul / matvec (every projection),
// grouped matmuls with fused epilogues (q/k/v in one launch; FFN gate/up with the activation; bias
// and residual adds), embedding rows. Each decodes GGUF blocks in registers with dequant.cuh's
// dq8, whose values are bit-identical to runtime/dequant.py and gguf.quants.
#include "common.cuh"
#include "dequant.cuh"

#include <limits.h>

namespace {

using rl_dequant::dispatch_type;
using rl_dequant::dq1;
using rl_dequant::dq8;
using rl_dequant::LaneBlocks;
using rl_dequant::TypeTag;

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
    // Decode (TT = 1) is bound by the decoding arithmetic: the lane's values within a block (j) are
    // the same at every step, so the block pointer just moves by 256 values' bytes and everything
    // derived from j is computed once (dequant.cuh, LaneBlocks); the loop is unrolled 4 steps.
    // Several tokens (TT = 8) share each step's decoding, and carrying the pointer there costs the
    // registers that its 8 accumulators need: dq8 finds the block from i0.
    LaneBlocks<QT> blocks(row, lane);
#pragma unroll(TT == 1 ? 4 : 1)
    for (int i0 = lane * 8; i0 < n8; i0 += 256, blocks.next()) {
        float v[8];
        if constexpr (TT == 1) blocks.decode(v);
        else dq8<QT>(row, i0, v);
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
