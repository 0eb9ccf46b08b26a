// The decode attention step over the in-place store (runtime/attention.py attend,
// runtime/stored_attention.py): one block per query head, or split-K over the slots with a merge
// for large stores; and the RoPE cos/sin table the attention kernels read.
//
// Keys are stored before RoPE and rotated by each slot's logical position; K / V rows are decoded
// in registers (templates on the store's element types KT, VT: kv_rows.cuh); f32 accumulation.
#include "common.cuh"
#include "reduce.cuh"
#include "rope.cuh"

#include <float.h>
#include <math.h>

namespace {

// ==============================================================================================
// Attention step (runtime/attention.py attend): one block per query head, or split-K over the
// slots (flash-decoding) for large stores
// ==============================================================================================

constexpr int ATT_THREADS = 256;
constexpr int ATT_DIMS = 256;      // value dims summed per pass of the weighted sum
constexpr int ATT_SPLIT = 64;      // slots per block of the split-K path
constexpr int ATT_GCHUNK = 8;      // query heads whose value sums a thread holds at once (split-K)
constexpr int ATT_SPLIT_SMEM = 40 * 1024;   // split-K dynamic shared memory bound: 48 KiB less `part`

// RoPE cos/sin (rope_angle_cs, rope_cs): rope.cuh, shared with prefill.cu.

__global__ void rope_table_kernel(float2 *tab, const double *inv_freq, double scale, int n_tab, int half) {
    const int64_t idx = (int64_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx < (int64_t)n_tab * half) tab[idx] = rope_angle_cs(idx / half, scale, inv_freq[idx % half]);
}

// k, v: (n_kv, P) rows of types KT, VT (keys before RoPE), decoded in registers; f32 accumulation.
template <int KT, int VT>
__global__ void __launch_bounds__(ATT_THREADS)
attend_kernel(float *out, float *weights, const float *q, const uint8_t *k, const uint8_t *v, const int32_t *pos,
              const int32_t *count, const int64_t *q_pos_seq, int q_pos_fixed, int q_pos_mode, int n_kv, int P,
              int hd, int rotary_dim, double scale, const double *inv_freq, const float2 *tab, int n_tab,
              float attn_scale, int kv_per_seq) {
    extern __shared__ float qr[];   // (hd,) the query rotated at its position, times attn_scale
    __shared__ float red[32];
    __shared__ float part[ATT_THREADS / 32 * ATT_DIMS];   // per-warp partial sums of the value rows
    const int hq = blockIdx.x, group = gridDim.x / n_kv, h = hq / group, tid = threadIdx.x;
    const int half = rotary_dim / 2;
    const int n = count[h];
    int64_t qp = q_pos_fixed;
    if (q_pos_mode == RL_QPOS_COUNT) qp = count[h] - 1;
    else if (q_pos_mode == RL_QPOS_SEQ) qp = q_pos_seq[h / kv_per_seq] + q_pos_fixed;
    const float *qh = q + (int64_t)hq * hd;
    for (int i = tid; i < half; i += blockDim.x) {
        const float2 r = rope_cs(qp, i, half, scale, inv_freq, tab, n_tab);
        const float c = r.x, s = r.y;
        const float a = qh[i], b = qh[i + half];
        qr[i] = (a * c - b * s) * attn_scale;
        qr[i + half] = (b * c + a * s) * attn_scale;
    }
    for (int d = rotary_dim + tid; d < hd; d += blockDim.x) qr[d] = qh[d] * attn_scale;
    __syncthreads();

    const int64_t krb = kv_row_bytes(KT, hd), vrb = kv_row_bytes(VT, hd);
    float *w = weights + (int64_t)hq * P;
    const uint8_t *kh = k + (int64_t)h * P * krb;
    const int32_t *ph = pos + h * P;
    float mx = -INFINITY;
    for (int j = tid; j < n; j += blockDim.x) {
        const uint8_t *kj = kh + (int64_t)j * krb;
        const int64_t p = ph[j];
        float acc = 0.0f;
        for (int i = 0; i < half; i++) {
            const float2 r = rope_cs(p, i, half, scale, inv_freq, tab, n_tab);
            const float c = r.x, s = r.y;
            const float a = kv_get<KT>(kj, i), b = kv_get<KT>(kj, i + half);
            acc += qr[i] * (a * c - b * s) + qr[i + half] * (b * c + a * s);
        }
        for (int d = rotary_dim; d < hd; d++) acc += qr[d] * kv_get<KT>(kj, d);
        w[j] = acc;
        mx = fmaxf(mx, acc);
    }
    mx = block_max(mx, red);
    float tot = 0.0f;
    for (int j = tid; j < n; j += blockDim.x) {
        const float e = expf(fmaxf(w[j] - mx, -87.3f));   // exp_f32's clamp: never below ~1.2e-38
        w[j] = e;
        tot += e;
    }
    tot = block_sum(tot, red);
    const float inv = 1.0f / tot;
    for (int j = tid; j < n; j += blockDim.x) {   // no subnormal weights (softmax_inplace): they become 0
        const float wj = w[j] * inv;
        w[j] = wj >= FLT_MIN ? wj : 0.0f;
    }
    __syncthreads();
    // out = sum_j w[j] v[j], 256 dims at a time: warp wi sums the slots j = wi, wi + nw, ... with its
    // lanes over the dims (coalesced row reads, eight independent chains per lane), then the nw
    // partial rows are added in warp order
    const uint8_t *vh = v + (int64_t)h * P * vrb;
    const int lane = tid & 31, wi = tid >> 5, nw = blockDim.x >> 5;
    for (int d0 = 0; d0 < hd; d0 += ATT_DIMS) {
        float acc[ATT_DIMS / 32];
#pragma unroll
        for (int c = 0; c < ATT_DIMS / 32; c++) acc[c] = 0.0f;
        for (int j = wi; j < n; j += nw) {
            const float wj = w[j];
            const uint8_t *vj = vh + (int64_t)j * vrb;
#pragma unroll
            for (int c = 0; c < ATT_DIMS / 32; c++) {
                const int d = d0 + c * 32 + lane;
                if (d < hd) acc[c] += wj * kv_get<VT>(vj, d);
            }
        }
#pragma unroll
        for (int c = 0; c < ATT_DIMS / 32; c++) part[wi * ATT_DIMS + c * 32 + lane] = acc[c];
        __syncthreads();
        for (int d = d0 + tid; d < hd && d < d0 + ATT_DIMS; d += blockDim.x) {
            float sum = 0.0f;
            for (int x = 0; x < nw; x++) sum += part[x * ATT_DIMS + (d - d0)];
            out[(int64_t)hq * hd + d] = sum;
        }
        __syncthreads();
    }
}

// Split-K (flash-decoding; runtime/stored_attention.py does the same on the CPU): block (h, s) of
// attend_split_kernel takes slots [s * ATT_SPLIT, (s + 1) * ATT_SPLIT) of kv head h for all the
// group's query heads, so each K / V row is read once per group. For query head hq = h * group + g
// it writes the raw scores into weights[hq, j], and into scratch (floats):
//
//   ml (n_head, S) float2     the split's score maximum m and l = sum_j exp(max(s_j - m, -87.3))
//   o  (n_head, S, hd)        after ml: the unnormalized value sum sum_j exp(max(s_j - m, -87.3)) v_j
//
// Blocks whose slots start at or past count[h] return at once: attend_merge_kernel (one block per
// query head) reads only the ceil(count / ATT_SPLIT) splits in use. The grid is fixed by P, so the
// launch can be captured in a graph. Needs hd <= ATT_DIMS (= ATT_THREADS: a thread per value dim)
// and group * (hd + ATT_SPLIT) floats of shared memory (attend_split_fits).
//
// rope_cs with the angles past the table computed in a call (the same rope_angle_cs, the same
// bits): the float64 sincos and its argument reduction stay out of the kernel's registers.
__device__ __noinline__ float2 rope_angle_cs_call(int64_t p, double scale, double inv_freq) {
    return rope_angle_cs(p, scale, inv_freq);
}

__device__ __forceinline__ float2 rope_cs_split(int64_t p, int i, int half, double scale, const double *inv_freq,
                                                const float2 *tab, int n_tab) {
    return p < n_tab ? tab[p * half + i] : rope_angle_cs_call(p, scale, inv_freq[i]);
}

template <int KT, int VT>
__global__ void __launch_bounds__(ATT_THREADS)
attend_split_kernel(float *weights, float *scratch, const float *q, const uint8_t *k, const uint8_t *v,
                    const int32_t *pos, const int32_t *count, const int64_t *q_pos_seq, int q_pos_fixed,
                    int q_pos_mode, int n_head, int P, int hd, int rotary_dim, double scale, const double *inv_freq,
                    const float2 *tab, int n_tab, float attn_scale, int kv_per_seq) {
    extern __shared__ float sm[];
    __shared__ float part[ATT_GCHUNK * ATT_THREADS];   // per-thread partial value sums of a head chunk
    const int h = blockIdx.x, s = blockIdx.y, S = gridDim.y, group = n_head / gridDim.x, tid = threadIdx.x;
    const int n = count[h], j0 = s * ATT_SPLIT;
    if (j0 >= n) return;   // the same for the whole block: before any barrier
    const int len = n - j0 < ATT_SPLIT ? n - j0 : ATT_SPLIT;
    const int half = rotary_dim / 2;
    float *qr = sm;                 // (group, hd) the group's queries rotated at their position, times attn_scale
    float *e = sm + group * hd;     // (group, ATT_SPLIT) the split's scores, then exp(max(score - m, -87.3))
    int64_t qp = q_pos_fixed;
    if (q_pos_mode == RL_QPOS_COUNT) qp = n - 1;
    else if (q_pos_mode == RL_QPOS_SEQ) qp = q_pos_seq[h / kv_per_seq] + q_pos_fixed;
    const float *qh = q + (int64_t)h * group * hd;
    for (int x = tid; x < group * hd; x += blockDim.x) {
        const int d = x % hd;
        const float *qg = qh + (x - d);
        float r;
        if (d < half) {
            const float2 cs = rope_cs_split(qp, d, half, scale, inv_freq, tab, n_tab);
            r = qg[d] * cs.x - qg[d + half] * cs.y;
        } else if (d < rotary_dim) {
            const float2 cs = rope_cs_split(qp, d - half, half, scale, inv_freq, tab, n_tab);
            r = qg[d] * cs.x + qg[d - half] * cs.y;
        } else {
            r = qg[d];
        }
        qr[x] = r * attn_scale;
    }
    __syncthreads();

    // scores: a warp per slot, its lanes over the dims (coalesced row reads); the rotated key stays
    // in registers (lo / hi: dim pairs (i, i + half); tl: dims past rotary_dim) for the group's heads
    const int64_t krb = kv_row_bytes(KT, hd), vrb = kv_row_bytes(VT, hd);
    const int lane = tid & 31, wi = tid >> 5, nw = blockDim.x >> 5;
    const uint8_t *kh = k + ((int64_t)h * P + j0) * krb;
    const int32_t *ph = pos + (int64_t)h * P + j0;
    float *wh = weights + (int64_t)h * group * P + j0;   // query head h * group + g: row wh + g * P
    for (int jj = wi; jj < len; jj += nw) {
        const uint8_t *kj = kh + (int64_t)jj * krb;
        const int64_t p = ph[jj];
        float lo[ATT_DIMS / 64], hi[ATT_DIMS / 64], tl[ATT_DIMS / 32];
#pragma unroll
        for (int c = 0; c < ATT_DIMS / 64; c++) {
            const int i = c * 32 + lane;
            lo[c] = 0.0f;
            hi[c] = 0.0f;
            if (i < half) {
                const float2 cs = rope_cs_split(p, i, half, scale, inv_freq, tab, n_tab);
                const float a = kv_get<KT>(kj, i), b = kv_get<KT>(kj, i + half);
                lo[c] = a * cs.x - b * cs.y;
                hi[c] = b * cs.x + a * cs.y;
            }
        }
#pragma unroll
        for (int c = 0; c < ATT_DIMS / 32; c++) {
            const int d = rotary_dim + c * 32 + lane;
            tl[c] = d < hd ? kv_get<KT>(kj, d) : 0.0f;
        }
        for (int g = 0; g < group; g++) {
            const float *qg = qr + g * hd;
            float acc = 0.0f;
#pragma unroll
            for (int c = 0; c < ATT_DIMS / 64; c++) {
                const int i = c * 32 + lane;
                if (i < half) acc += qg[i] * lo[c] + qg[i + half] * hi[c];
            }
#pragma unroll
            for (int c = 0; c < ATT_DIMS / 32; c++) {
                const int d = rotary_dim + c * 32 + lane;
                if (d < hd) acc += qg[d] * tl[c];
            }
            acc = warp_sum(acc);
            if (lane == 0) {
                e[g * ATT_SPLIT + jj] = acc;
                wh[(int64_t)g * P + jj] = acc;
            }
        }
    }
    __syncthreads();

    // the split's softmax pieces, a warp per query head: m, then e = exp(max(s - m, -87.3)) and l
    float2 *ml = reinterpret_cast<float2 *>(scratch);
    for (int g = wi; g < group; g += nw) {
        float *eg = e + g * ATT_SPLIT;
        float m = -INFINITY;
        for (int jj = lane; jj < len; jj += 32) m = fmaxf(m, eg[jj]);
        m = warp_max(m);
        float l = 0.0f;
        for (int jj = lane; jj < len; jj += 32) {
            const float x = expf(fmaxf(eg[jj] - m, -87.3f));   // exp_f32's clamp, as attend_kernel
            eg[jj] = x;
            l += x;
        }
        l = warp_sum(l);
        if (lane == 0) ml[(int64_t)(h * group + g) * S + s] = make_float2(m, l);
    }
    __syncthreads();

    // o = sum_j e_j v_j: thread (r, d) sums dim d of the slots r, r + R, ... (a warp reads a row's
    // consecutive dims), for up to ATT_GCHUNK heads at once; the R partial rows are then added in order
    float *o = scratch + (int64_t)n_head * S * 2;
    const int R = blockDim.x / hd, d = tid % hd, r = tid / hd;
    const uint8_t *vh = v + ((int64_t)h * P + j0) * vrb;
    for (int g0 = 0; g0 < group; g0 += ATT_GCHUNK) {
        float acc[ATT_GCHUNK];
#pragma unroll
        for (int u = 0; u < ATT_GCHUNK; u++) acc[u] = 0.0f;
        if (r < R) {
            for (int jj = r; jj < len; jj += R) {
                const float x = kv_get<VT>(vh + (int64_t)jj * vrb, d);
#pragma unroll
                for (int u = 0; u < ATT_GCHUNK; u++)
                    if (g0 + u < group) acc[u] += e[(g0 + u) * ATT_SPLIT + jj] * x;
            }
        }
#pragma unroll
        for (int u = 0; u < ATT_GCHUNK; u++) part[u * ATT_THREADS + tid] = acc[u];
        __syncthreads();
        const int gc = group - g0 < ATT_GCHUNK ? group - g0 : ATT_GCHUNK;
        for (int x = tid; x < gc * hd; x += blockDim.x) {
            const int u = x / hd, dd = x % hd;
            float sum = 0.0f;
            for (int y = 0; y < R; y++) sum += part[u * ATT_THREADS + y * hd + dd];
            o[((int64_t)(h * group + g0 + u) * S + s) * hd + dd] = sum;
        }
        __syncthreads();
    }
}

// Weight of a split whose maximum is m against the head's maximum M (0 for a split with no finite
// score, which also covers M = -inf).
__device__ __forceinline__ float split_factor(float m, float M) { return m == -INFINITY ? 0.0f : expf(m - M); }

// Merge of attend_split_kernel's splits, one block per query head hq: M = max_s m_s,
// L = sum_s l_s exp(m_s - M), out = sum_s o_s exp(m_s - M) / L, and the scores in weights become
// exp(max(score - M, -87.3)) / L with subnormals flushed to 0, as attend_kernel writes them.
__global__ void __launch_bounds__(ATT_THREADS)
attend_merge_kernel(float *out, float *weights, const float *scratch, const int32_t *count, int n_kv, int P, int hd,
                    int S) {
    __shared__ float red[32];
    const int hq = blockIdx.x, n_head = gridDim.x, h = hq / (n_head / n_kv), tid = threadIdx.x;
    const int n = count[h], ns = (n + ATT_SPLIT - 1) / ATT_SPLIT;
    const float2 *ml = reinterpret_cast<const float2 *>(scratch) + (int64_t)hq * S;
    const float *o = scratch + (int64_t)n_head * S * 2 + (int64_t)hq * S * hd;
    float mx = -INFINITY;
    for (int s = tid; s < ns; s += blockDim.x) mx = fmaxf(mx, ml[s].x);
    mx = block_max(mx, red);
    float tot = 0.0f;
    for (int s = tid; s < ns; s += blockDim.x) tot += ml[s].y * split_factor(ml[s].x, mx);
    tot = block_sum(tot, red);
    const float inv = tot > 0.0f ? 1.0f / tot : 0.0f;   // no slot: out = 0, as attend_kernel
    for (int d = tid; d < hd; d += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < ns; s++) acc += o[(int64_t)s * hd + d] * split_factor(ml[s].x, mx);
        out[(int64_t)hq * hd + d] = acc * inv;
    }
    float *w = weights + (int64_t)hq * P;
    for (int j = tid; j < n; j += blockDim.x) {   // no subnormal weights (softmax_inplace): they become 0
        const float wj = expf(fmaxf(w[j] - mx, -87.3f)) * inv;
        w[j] = wj >= FLT_MIN ? wj : 0.0f;
    }
}

}  // namespace

// ==============================================================================================
// Launchers
// ==============================================================================================

static_assert(ATT_DIMS == ATT_THREADS, "split-K: a thread per value dim of a row");

static int attend_splits(int P) { return (P + ATT_SPLIT - 1) / ATT_SPLIT; }

bool attend_split_fits(int group, int hd, int P) {
    return hd >= 1 && hd <= ATT_DIMS && (int64_t)group * (hd + ATT_SPLIT) * (int64_t)sizeof(float) <= ATT_SPLIT_SMEM &&
           attend_splits(P) <= 65535;   // gridDim.y
}

int64_t attend_scratch_floats(int n_head, int hd, int P) { return (int64_t)n_head * attend_splits(P) * (hd + 2); }

void launch_attend(float *out, float *weights, float *scratch, const float *q, const uint8_t *k, const uint8_t *v,
                   int k_type, int v_type, const int32_t *pos, const int32_t *count, const int64_t *q_pos_seq,
                   int q_pos_fixed, int q_pos_mode, int n_head, int n_kv, int P, int hd, int rotary_dim, double scale,
                   const double *inv_freq, const float2 *rope_tab, int n_tab, float attn_scale, int kv_per_seq,
                   int path, cudaStream_t st) {
    const int group = n_head / n_kv, S = attend_splits(P), nt = rope_tab ? n_tab : 0;
    const bool split = scratch && attend_split_fits(group, hd, P) &&
                       (path == RL_ATTEND_SPLIT || (path == RL_ATTEND_AUTO && P > RL_ATTEND_SPLIT_MIN_P));
    with_kv_types(k_type, v_type, [&](auto kt, auto vt) {
        constexpr int KT = decltype(kt)::value, VT = decltype(vt)::value;
        if (split)
            attend_split_kernel<KT, VT>
                <<<dim3(n_kv, S), ATT_THREADS, (size_t)group * (hd + ATT_SPLIT) * sizeof(float), st>>>(
                    weights, scratch, q, k, v, pos, count, q_pos_seq, q_pos_fixed, q_pos_mode, n_head, P, hd,
                    rotary_dim, scale, inv_freq, rope_tab, nt, attn_scale, kv_per_seq);
        else
            attend_kernel<KT, VT><<<n_head, ATT_THREADS, hd * sizeof(float), st>>>(
                out, weights, q, k, v, pos, count, q_pos_seq, q_pos_fixed, q_pos_mode, n_kv, P, hd, rotary_dim, scale,
                inv_freq, rope_tab, nt, attn_scale, kv_per_seq);
    });
    if (split) attend_merge_kernel<<<n_head, ATT_THREADS, 0, st>>>(out, weights, scratch, count, n_kv, P, hd, S);
}

void launch_rope_table(float2 *tab, const double *inv_freq, double scale, int n_tab, int half, cudaStream_t st) {
    rope_table_kernel<<<grid_for((int64_t)n_tab * half, 256), 256, 0, st>>>(tab, inv_freq, scale, n_tab, half);
}
