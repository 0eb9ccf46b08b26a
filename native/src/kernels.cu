// Kernels of the forward pass other than the quantized projections (quant.cu), the KV write and the
// policies' observations (kv_write.cu) and attention (attention.cu, prefill.cu): norms, activations,
// adds, and the choice of the next token.
//
// Each mirrors a CPU kernel (runtime/ops.py, runtime/sampling.py) in formula and operation order.
#include "common.cuh"
#include "reduce.cuh"

#include <float.h>
#include <math.h>

namespace {

// ==============================================================================================
// Norms, activations, elementwise (runtime/ops.py)
// ==============================================================================================

constexpr int NORM_PER_THREAD = 8;   // rms_norm_kernel's values per thread (rows up to 8 x 1,024)

// RMS norm's formula, shared by both norm kernels: inv = float32(1 / sqrt(mean(x^2) + eps)) from the
// float64 sum of squares ss, then out = (x * inv) * w, two rounded products.
__device__ __forceinline__ float rms_inv(double ss, int n, double eps) { return (float)(1.0 / sqrt(ss / n + eps)); }

__device__ __forceinline__ float rms_out(float x, float inv, float w) { return __fmul_rn(__fmul_rn(x, inv), w); }

// RMS norm of one row per block, as norm_kernel's, with the row held in registers: every thread
// issues all its loads before the first use and reads its values once, where norm_kernel's loops
// wait on one load per step, twice. A decode row (2,048 values) is one block, so that latency was
// all of its time. ceil(n / blockDim.x) <= NORM_PER_THREAD. The float64 sum's order differs from
// norm_kernel's; out may alias x (each thread writes only the values it read).
__global__ void rms_norm_kernel(float *out, const float *x, const float *w, int n, double eps) {
    __shared__ double red[32];
    const float *xr = x + (int64_t)blockIdx.x * n;
    float *o = out + (int64_t)blockIdx.x * n;
    float v[NORM_PER_THREAD];
#pragma unroll
    for (int k = 0; k < NORM_PER_THREAD; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        v[k] = i < n ? xr[i] : 0.0f;
    }
    double ss = 0.0;
#pragma unroll
    for (int k = 0; k < NORM_PER_THREAD; k++) ss += (double)(v[k] * v[k]);
    const float inv = rms_inv(block_sum(ss, red), n, eps);
#pragma unroll
    for (int k = 0; k < NORM_PER_THREAD; k++) {
        const int i = threadIdx.x + k * blockDim.x;
        if (i < n) o[i] = rms_out(v[k], inv, w[i]);
    }
}

// One block per row. RMS: out = x * float32(1 / sqrt(mean(x^2) + eps)) * w, sum of squares in
// float64. Layer: out = float32((x - mu) / sqrt(var + eps)) * w + b, mu and var in float64.
__global__ void norm_kernel(float *out, const float *x, const float *w, const float *b, int kind, int n, double eps) {
    __shared__ double red[32];
    const float *xr = x + (int64_t)blockIdx.x * n;
    float *o = out + (int64_t)blockIdx.x * n;
    if (kind == RL_NORM_RMS) {
        double ss = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)(xr[i] * xr[i]);
        const float inv = rms_inv(block_sum(ss, red), n, eps);
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = rms_out(xr[i], inv, w[i]);
        return;
    }
    double mu = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) mu += (double)xr[i];
    mu = block_sum(mu, red) / n;
    double var = 0.0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const double d = (double)xr[i] - mu;
        var += d * d;
    }
    var = block_sum(var, red);
    const double inv = 1.0 / sqrt(var / n + eps);
    for (int i = threadIdx.x; i < n; i += blockDim.x)
        o[i] = __fadd_rn(__fmul_rn((float)(((double)xr[i] - mu) * inv), w[i]), b[i]);
}

// act_f: common.cuh (shared with the fused FFN epilogue of quant.cu's matmul_group_kernel)
__global__ void act_kernel(float *out, const float *gate, const float *up, int kind, int gated, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = gated ? act_f(gate[i], kind) * up[i] : act_f(up[i], kind);
}

__global__ void add_kernel(float *x, const float *y, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] += y[i];
}

__global__ void add_bias_kernel(float *x, const float *b, int64_t n_total, int n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n_total) x[i] += b[i % n];
}

__global__ void softcap_kernel(float *x, float cap, int64_t n) {
    const int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = cap * tanhf(x[i] / cap);
}

__global__ void advance_kernel(int64_t *n_seen, int T) { n_seen[threadIdx.x] += T; }   // a thread per sequence

// ==============================================================================================
// Next token: greedy or temperature / top-k / top-p sampling, one block
// ==============================================================================================

constexpr int PICK_THREADS = 1024;

// params: temperature, top_k, top_p, u (float32 each). Greedy: the first maximal logit.
// Sampling: p_i = exp((l_i - max) / temperature); kept = p_i >= tau where tau is the largest
// threshold keeping at least top_k tokens and then at least top_p of the mass (bisection on the
// value, 48 halvings: float32 resolution); the token is found by inverse CDF in index order.
__global__ void __launch_bounds__(PICK_THREADS)
pick_kernel(int32_t *token, const float *logits, int n, const float *params) {
    token += blockIdx.x;                      // one block per row of a batch's logits
    logits += (int64_t)blockIdx.x * n;
    __shared__ float redf[32];
    __shared__ float sbest[PICK_THREADS];
    __shared__ int sidx[PICK_THREADS];
    __shared__ float csum[PICK_THREADS];
    const int tid = threadIdx.x;
    const float temp = params[0], top_p = params[2], u = params[3];
    const int top_k = (int)params[1];
    float best = -INFINITY;
    int bi = n;
    auto consider = [&](float l, int i) {
        if (l > best || (l == best && i < bi)) {
            best = l;
            bi = i;
        }
    };
    if ((n & 3) == 0 && (reinterpret_cast<uintptr_t>(logits) & 15) == 0) {
        // 16-byte loads, four in flight per thread: one pass over a 151,936-entry vocabulary was a
        // chain of 148 dependent steps per thread in this single block
        const float4 *l4 = reinterpret_cast<const float4 *>(logits);
#pragma unroll 4
        for (int i4 = tid; i4 < n / 4; i4 += blockDim.x) {
            const float4 q = l4[i4];
            consider(q.x, 4 * i4);
            consider(q.y, 4 * i4 + 1);
            consider(q.z, 4 * i4 + 2);
            consider(q.w, 4 * i4 + 3);
        }
    } else {
        for (int i = tid; i < n; i += blockDim.x) consider(logits[i], i);
    }
    sbest[tid] = best;
    sidx[tid] = bi;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (tid < stride) {
            const float ob = sbest[tid + stride];
            const int oi = sidx[tid + stride];
            if (ob > sbest[tid] || (ob == sbest[tid] && oi < sidx[tid])) {
                sbest[tid] = ob;
                sidx[tid] = oi;
            }
        }
        __syncthreads();
    }
    const float mx = sbest[0];
    const int argmax = sidx[0] < n ? sidx[0] : 0;
    if (!(temp > 0.0f)) {
        if (tid == 0) *token = argmax;
        return;
    }
    const float it = 1.0f / temp;
#define PROB(i) expf((logits[i] - mx) * it)
    float z = 0.0f;
    for (int i = tid; i < n; i += blockDim.x) z += PROB(i);
    z = block_sum(z, redf);
    float lo = 0.0f, hi = 2.0f;
    if (top_k > 0 && top_k < n) {     // largest tau with count(p >= tau) >= top_k
        for (int it2 = 0; it2 < 48; it2++) {
            const float mid = 0.5f * (lo + hi);
            float c = 0.0f;
            for (int i = tid; i < n; i += blockDim.x) c += PROB(i) >= mid ? 1.0f : 0.0f;
            c = block_sum(c, redf);
            if (c >= (float)top_k) lo = mid;
            else hi = mid;
        }
    }
    if (top_p < 1.0f) {               // largest tau >= tau_k with mass(p >= tau) >= top_p * z
        const float target = top_p * z;
        hi = 2.0f;
        for (int it2 = 0; it2 < 48; it2++) {
            const float mid = 0.5f * (lo + hi);
            float m = 0.0f;
            for (int i = tid; i < n; i += blockDim.x) {
                const float p = PROB(i);
                m += p >= mid ? p : 0.0f;
            }
            m = block_sum(m, redf);
            if (m >= target) lo = mid;
            else hi = mid;
        }
    }
    const float tau = lo;
    // contiguous chunk per thread, exclusive scan of chunk sums, then one thread walks its chunk
    const int chunk = (n + blockDim.x - 1) / blockDim.x;
    const int b0 = tid * chunk, b1 = min(n, b0 + chunk);
    float cs = 0.0f;
    for (int i = b0; i < b1; i++) {
        const float p = PROB(i);
        cs += p >= tau ? p : 0.0f;
    }
    csum[tid] = cs;
    __syncthreads();
    if (tid == 0) {
        float run = 0.0f;
        for (int i = 0; i < (int)blockDim.x; i++) {
            const float c = csum[i];
            csum[i] = run;
            run += c;
        }
        redf[0] = run;
    }
    __syncthreads();
    const float target = u * redf[0];
    const float start = csum[tid];
    const float end = tid + 1 < (int)blockDim.x ? csum[tid + 1] : redf[0];
    __shared__ int s_pick;
    if (tid == 0) s_pick = -1;
    __syncthreads();
    if (b0 < b1 && target >= start && target < end) {   // at most one thread: chunks are disjoint
        float run = start;
        int pick = -1, lastk = -1;
        for (int i = b0; i < b1; i++) {
            const float p = PROB(i);
            if (p < tau) continue;
            lastk = i;
            run += p;
            if (run > target) {
                pick = i;
                break;
            }
        }
        s_pick = pick >= 0 ? pick : lastk;
    }
#undef PROB
    __syncthreads();
    // rounding can leave the target at the very end: the most likely token (always kept) then
    if (tid == 0) *token = s_pick >= 0 ? s_pick : argmax;
}

}  // namespace

// ==============================================================================================
// Launchers
// ==============================================================================================

void launch_norm(float *out, const float *x, const float *w, const float *b, int kind, int rows, int n, double eps,
                 cudaStream_t st) {
    if (kind == RL_NORM_RMS && n <= NORM_PER_THREAD * 1024) {
        // about 4 values per thread: loads in flight without a 1,024-thread block for a 128-wide head
        const int threads = n <= 4 * 1024 ? (((n + 3) / 4 + 31) / 32) * 32 : 1024;
        rms_norm_kernel<<<rows, threads, 0, st>>>(out, x, w, n, eps);
        return;
    }
    norm_kernel<<<rows, 256, 0, st>>>(out, x, w, b, kind, n, eps);
}

void launch_act(float *out, const float *gate, const float *up, int act, int gated, int T, int n, cudaStream_t st) {
    const int64_t total = (int64_t)T * n;
    act_kernel<<<grid_for(total, 256), 256, 0, st>>>(out, gate, up, act, gated, total);
}

void launch_add(float *x, const float *y, int64_t n, cudaStream_t st) {
    add_kernel<<<grid_for(n, 256), 256, 0, st>>>(x, y, n);
}

void launch_add_bias(float *x, const float *b, int T, int n, cudaStream_t st) {
    const int64_t total = (int64_t)T * n;
    add_bias_kernel<<<grid_for(total, 256), 256, 0, st>>>(x, b, total, n);
}

void launch_softcap(float *x, float cap, int64_t n, cudaStream_t st) {
    softcap_kernel<<<grid_for(n, 256), 256, 0, st>>>(x, cap, n);
}

void launch_advance(int64_t *n_seen, int T, int n_seq, cudaStream_t st) { advance_kernel<<<1, n_seq, 0, st>>>(n_seen, T); }

void launch_pick(int32_t *token, const float *logits, int n, const float *params, int rows, cudaStream_t st) {
    pick_kernel<<<rows, PICK_THREADS, 0, st>>>(token, logits, n, params);
}
