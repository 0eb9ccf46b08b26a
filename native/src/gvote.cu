// gvote on the device (runtime/policies/gvote.py): the query history each layer keeps, and the votes
// of a write that must evict. One block per (query head, query, sequence) computes one nucleus: query
// 0 is the new token's own (rotated at its position p; the largest nucleus over the layer's query heads
// is the budget), queries 1..S are synthetic (drawn from a Gaussian fitted to the head's last w
// queries, rotated at p + w/2; each adds one vote to every key of its nucleus). kv_write.cu then drops
// max(capacity rule, held - max(budget, sinks + recent)) tokens, the fewest votes first.
//
// Numerics follow the CPU's: the Gaussian draws are splitmix64 + Box-Muller in float64, the synthetic
// query is rounded to float32, keys are rotated in float32 with cos/sin of (p / scale) x inv_freq
// computed in float64, each product of the dot is a float32 product summed in float64, the softmax
// and the nucleus's running mass are float64 sums in the CPU's order (by slot for the total, by
// descending weight, ties to the lower slot, for the nucleus).
#include "common.cuh"
#include "policy_math.cuh"
#include "reduce.cuh"
#include "rope.cuh"

#include <limits.h>
#include <math.h>

namespace {

constexpr int GV_THREADS = 256;

// Standard normal d of synthetic query s (runtime/policies/gvote.py gaussian_draws): Box-Muller over
// the pair (d & ~1, d | 1) of splitmix64 draws chained from base.
__device__ double gauss(uint64_t base, int s, int d) {
    const int e = d & ~1;
    const uint64_t a = splitmix64(base ^ (uint64_t)(s * 65536 + e));
    const uint64_t b = splitmix64(a);
    const double u1 = __dmul_rn((double)(a >> 11) + 1.0, 1.0 / 9007199254740992.0);
    const double u2 = __dmul_rn((double)(b >> 11), 1.0 / 9007199254740992.0);
    const double r = sqrt(__dmul_rn(-2.0, log(u1)));
    const double ang = __dmul_rn(2.0 * M_PI, u2);
    return __dmul_rn(r, (d & 1) ? sin(ang) : cos(ang));
}

// cos/sin of dim pair i at position p, as runtime/rope_kernels.py angles_at: the model's table when it
// holds them (scale 1: the same float64 angle), else computed in float64 and rounded.
__device__ __forceinline__ float2 gv_cs(int64_t p, int i, int half, double scale, const double *inv_freq,
                                       const float2 *tab, int n_tab) {
    if (scale == 1.0 && p < n_tab) return rope_tab_cs(tab, p, i, half);
    double s, c;
    sincos(__dmul_rn(__dmul_rn((double)p, 1.0 / scale), inv_freq[i]), &s, &c);
    return make_float2((float)c, (float)s);
}

// (weight, slot) pairs sw, si of n2 entries (a power of two) sorted by descending weight, ties to the
// lower slot: NumPy's stable argsort of -w (bitonic network; the whole block).
__device__ void sort_desc(double *sw, int32_t *si, int n2) {
    for (int k = 2; k <= n2; k <<= 1) {
        for (int j = k >> 1; j > 0; j >>= 1) {
            for (int i = threadIdx.x; i < n2; i += blockDim.x) {
                const int l = i ^ j;
                if (l <= i) continue;
                const bool before = sw[l] > sw[i] || (sw[l] == sw[i] && si[l] < si[i]);   // l should precede i
                const bool after = sw[i] > sw[l] || (sw[i] == sw[l] && si[i] < si[l]);
                if ((i & k) == 0 ? before : after) {
                    const double tw = sw[i];
                    sw[i] = sw[l];
                    sw[l] = tw;
                    const int32_t ti = si[i];
                    si[i] = si[l];
                    si[l] = ti;
                }
            }
            __syncthreads();
        }
    }
}

// Zero each sequence's votes (L.work, its first kv head's row) and budget (L.drops[h0]).
__global__ void gvote_clear_kernel(LayerStore L, int kv_per_seq) {
    const int h0 = blockIdx.x * kv_per_seq;
    double *votes = L.work + (int64_t)h0 * 2 * L.P;
    for (int j = threadIdx.x; j < L.P; j += blockDim.x) votes[j] = 0.0;
    if (threadIdx.x == 0) L.drops[h0] = 0;
}

template <int KT>
__global__ void __launch_bounds__(GV_THREADS)
gvote_votes_kernel(LayerStore L, StorePolicy pol, const float *q, const int64_t *n_seen, int t, int kv_per_seq,
                   int n_head, int hd, int rotary_dim, double rope_scale, const double *inv_freq, const float2 *tab,
                   int n_tab, double attn_scale) {
    const int hq = blockIdx.x, smp = blockIdx.y, b = blockIdx.z, tid = threadIdx.x;
    const int group = n_head / kv_per_seq, h0 = b * kv_per_seq, h = h0 + hq / group, P = L.P;
    const int n = L.count[h0], held = n + 1;   // gvote's heads hold the same slots
    if (held - keep_after(held, L.C, pol.lazy, pol.slack, pol.max_drop) <= 0) return;   // nothing goes: no votes
    const int64_t seq_new = n_seen[b] + t;
    const int w = pol.window, half = rotary_dim / 2;
    const int n_rows = seq_new < w ? (int)seq_new : w;
    if (smp > 0 && n_rows == 0) return;
    const int64_t p_now = pol.reindexed ? n : seq_new;
    const int64_t pq = smp == 0 ? p_now : p_now + w / 2;
    const int hq_all = b * n_head + hq;

    __shared__ float qf[MAX_HEAD_DIM], qr[MAX_HEAD_DIM];
    __shared__ double red[GV_THREADS];
    __shared__ int s_size;
    if (smp == 0) {
        for (int d = tid; d < hd; d += blockDim.x) qf[d] = q[(int64_t)hq_all * hd + d];
    } else {   // mean and standard deviation of the head's last n_rows queries, per dimension
        const uint64_t base = splitmix64(splitmix64(splitmix64(pol.seed) ^ (uint64_t)(L.il * 4096 + hq)) ^
                                         (uint64_t)seq_new);
        const float *qh = L.qhist + (int64_t)hq_all * w * hd;
        for (int d = tid; d < hd; d += blockDim.x) {
            double mu = 0.0;
            for (int r = 0; r < n_rows; r++) mu = __dadd_rn(mu, (double)qh[r * hd + d]);
            mu = mu / n_rows;
            double var = 0.0;
            for (int r = 0; r < n_rows; r++) {
                const double x = __dsub_rn((double)qh[r * hd + d], mu);
                var = __dadd_rn(var, __dmul_rn(x, x));
            }
            qf[d] = (float)__dadd_rn(mu, __dmul_rn(sqrt(var / n_rows), gauss(base, smp - 1, d)));
        }
    }
    __syncthreads();
    for (int i = tid; i < half; i += blockDim.x) {
        const float2 cs = gv_cs(pq, i, half, rope_scale, inv_freq, tab, n_tab);
        const float a = qf[i], c = qf[i + half];
        qr[i] = a * cs.x - c * cs.y;
        qr[i + half] = c * cs.x + a * cs.y;
    }
    for (int d = rotary_dim + tid; d < hd; d += blockDim.x) qr[d] = qf[d];
    __syncthreads();

    // weights of the held keys, each rotated at its position; then exp(w - max)
    const int64_t krb = kv_row_bytes(KT, hd);
    const uint8_t *K = L.k + (int64_t)h * P * krb;
    const int32_t *pos = (pol.reindexed ? L.rank : L.seq) + h * P;
    const int64_t blk = ((int64_t)b * n_head + hq) * gridDim.y + smp;
    double *sw = L.gv_w + blk * L.gv_p2;
    int32_t *si = L.gv_i + blk * L.gv_p2;
    double mx = -INFINITY;
    for (int j = tid; j < n; j += blockDim.x) {
        const uint8_t *kj = K + j * krb;
        const int64_t pj = pos[j];
        double acc = 0.0;
        for (int i = 0; i < half; i++) {
            const float2 cs = gv_cs(pj, i, half, rope_scale, inv_freq, tab, n_tab);
            const float a = kv_get<KT>(kj, i), c = kv_get<KT>(kj, i + half);
            acc += (double)__fmul_rn(qr[i], a * cs.x - c * cs.y);
        }
        for (int i = 0; i < half; i++) {
            const float2 cs = gv_cs(pj, i, half, rope_scale, inv_freq, tab, n_tab);
            const float a = kv_get<KT>(kj, i), c = kv_get<KT>(kj, i + half);
            acc += (double)__fmul_rn(qr[i + half], c * cs.x + a * cs.y);
        }
        for (int d = rotary_dim; d < hd; d++) acc += (double)__fmul_rn(qr[d], kv_get<KT>(kj, d));
        const double wj = acc * attn_scale;
        sw[j] = wj;
        si[j] = j;
        mx = fmax(mx, wj);
    }
    for (int j = n + tid; j < L.gv_p2; j += blockDim.x) {
        sw[j] = -INFINITY;
        si[j] = INT_MAX;
    }
    mx = block_max(mx, red);
    for (int j = tid; j < n; j += blockDim.x) sw[j] = exp(sw[j] - mx);
    __syncthreads();
    if (tid == 0) {   // the total in slot order, as the CPU sums it
        double tot = 0.0;
        for (int j = 0; j < n; j++) tot += sw[j];
        red[0] = tot;
    }
    __syncthreads();
    const double tot = red[0];
    sort_desc(sw, si, L.gv_p2);
    if (tid == 0) {   // the nucleus: the heaviest keys until their share reaches p
        double acc = 0.0;
        int size = 0;
        for (int i = 0; i < n; i++) {
            acc += sw[i] / tot;
            size += 1;
            if (acc >= pol.gv_p) break;
        }
        s_size = size;
    }
    __syncthreads();
    if (smp == 0) {
        if (tid == 0) atomicMax(&L.drops[h0], s_size);
        return;
    }
    double *votes = L.work + (int64_t)h0 * 2 * P;
    for (int i = tid; i < s_size; i += blockDim.x) atomicAdd(&votes[si[i]], 1.0);
}

// The new token's query rows (before RoPE) into the history, column (its sequence index) mod w.
__global__ void gvote_record_kernel(LayerStore L, const float *q, const int64_t *n_seen, int t, int n_head, int hd,
                                    int w) {
    const int hq_all = blockIdx.x, b = hq_all / n_head;
    const int col = (int)((n_seen[b] + t) % w);
    float *dst = L.qhist + ((int64_t)hq_all * w + col) * hd;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) dst[d] = q[(int64_t)hq_all * hd + d];
}

}  // namespace

void launch_gvote_votes(LayerStore L, StorePolicy pol, const float *q, const int64_t *n_seen, int t, int n_head,
                        int n_kv, int n_seq, int hd, int rotary_dim, double rope_scale, const double *inv_freq,
                        const float2 *tab, int n_tab, double attn_scale, cudaStream_t st) {
    const int kv_per_seq = n_kv / n_seq, head_per_seq = n_head / n_seq;
    gvote_clear_kernel<<<n_seq, 256, 0, st>>>(L, kv_per_seq);
    const dim3 grid(head_per_seq, pol.gv_samples + 1, n_seq);
    with_kv_types(L.k_type, L.v_type, [&](auto kt, auto) {
        gvote_votes_kernel<decltype(kt)::value><<<grid, GV_THREADS, 0, st>>>(
            L, pol, q, n_seen, t, kv_per_seq, head_per_seq, hd, rotary_dim, rope_scale, inv_freq, tab, n_tab,
            attn_scale);
    });
}

void launch_gvote_record(LayerStore L, StorePolicy pol, const float *q, const int64_t *n_seen, int t, int n_head,
                         int n_seq, int hd, cudaStream_t st) {
    gvote_record_kernel<<<n_head, 64, 0, st>>>(L, q, n_seen, t, n_head / n_seq, hd, pol.window);
}
