// Kernels of the forward pass other than the quantized projections: norms, activations, adds,
// the KV write with on-device victim selection, the attention step over the in-place store, the
// policies' attention-mass bookkeeping, and the choice of the next token.
//
// Each mirrors a CPU kernel (runtime/ops.py, runtime/kv_store.py, runtime/attention.py,
// runtime/policies/*) in formula and, where it matters for tie-breaking, in operation order.
// The kernels that touch K / V rows are templates on the store's element types (KT, VT:
// kv_rows.cuh); the f32 instances are the plain float32 code.
#include "common.cuh"
#include "rope.cuh"

#include <float.h>
#include <math.h>

#include <type_traits>

namespace {

// ==============================================================================================
// Block reductions (blockDim.x a multiple of 32, at most 1024)
// ==============================================================================================

template <typename T> __device__ __forceinline__ T warp_sum(T v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, off));
    return v;
}

// Sum over the block; every thread gets the result. `red` is shared scratch of 32 entries.
template <typename T> __device__ T block_sum(T v, T *red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    T r = lane < nw ? red[lane] : T(0);
    return warp_sum(r);
}

__device__ float block_max(float v, float *red) {
    const int lane = threadIdx.x & 31, wid = threadIdx.x >> 5, nw = (blockDim.x + 31) >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) red[wid] = v;
    __syncthreads();
    float r = lane < nw ? red[lane] : -INFINITY;
    return warp_max(r);
}

// ==============================================================================================
// Norms, activations, elementwise (runtime/ops.py)
// ==============================================================================================

// One block per row. RMS: out = x * float32(1 / sqrt(mean(x^2) + eps)) * w, sum of squares in
// float64. Layer: out = float32((x - mu) / sqrt(var + eps)) * w + b, mu and var in float64.
__global__ void norm_kernel(float *out, const float *x, const float *w, const float *b, int kind, int n, double eps) {
    __shared__ double red[32];
    const float *xr = x + (int64_t)blockIdx.x * n;
    float *o = out + (int64_t)blockIdx.x * n;
    if (kind == RL_NORM_RMS) {
        double ss = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) ss += (double)(xr[i] * xr[i]);
        ss = block_sum(ss, red);
        const float inv = (float)(1.0 / sqrt(ss / n + eps));
        for (int i = threadIdx.x; i < n; i += blockDim.x) o[i] = __fmul_rn(__fmul_rn(xr[i], inv), w[i]);
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
// KV write: one block per kv head (runtime/kv_store.py kv_write_streaming / kv_write_policy)
// ==============================================================================================

constexpr int KV_THREADS = 256;
constexpr int MAX_GROUP = 64;      // query heads per kv head (checked at model init)

// Staged eviction, Algorithm 1 (runtime/kv_config.py keep_after)
__device__ __forceinline__ int keep_after(int length, int cap, int lazy, int slack, int max_drop) {
    if (length <= cap || length - cap < lazy) return length;
    if (max_drop == 0) return cap;
    const int k = length - max_drop > cap ? length - max_drop : cap;
    return k < cap + slack ? k : cap + slack;
}

// SimHash bit i of the row x (hd values of type T): sign of proj[i] . x, summed in float32 in
// index order with no FMA (runtime/policies/lsh.py simhash_rows).
template <int T> __device__ __forceinline__ bool simhash_bit(const float *proj_i, const uint8_t *x, int hd) {
    float acc = 0.0f;
    for (int d = 0; d < hd; d++) acc = __fadd_rn(acc, __fmul_rn(proj_i[d], kv_get<T>(x, d)));
    return acc > 0.0f;
}

// One splitmix64 output for state x (runtime/policies/random_policy.py splitmix64).
__device__ __forceinline__ uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// The random policy's draws at one eviction share this base: splitmix64 of (seed, layer il, kv head
// h, the new token's sequence index), chained as runtime/policies/random_policy.py _random_keys.
__device__ __forceinline__ uint64_t random_base(uint64_t seed, int il, int h, int seq_new) {
    return splitmix64(splitmix64(splitmix64(seed) ^ (uint64_t)(il * 1024 + h)) ^ (uint64_t)seq_new);
}

// Victim key of slot j: the lowest key among unprotected slots goes (ties -> older token).
// Attention masses (h2o, tova) are compared on runtime/eviction.py's grid (GRID_LOG, KEY_GRID = 4096
// steps per octave): masses that differ only by rounding tie, and the older token goes, as on the CPU.
// scissorhands: minus the count of unimportant steps in the slot's history bits (aux); random: the
// top 53 bits of splitmix64(rbase ^ seq) (the CPU's draw before its scaling to [0, 1), same order).
__device__ __forceinline__ double victim_key(int policy, int j, const int32_t *seq, const double *score,
                                             const uint64_t *aux, const uint64_t *qcode, int group,
                                             uint64_t rbase) {
    switch (policy) {
        case RL_POLICY_SCISSORHANDS: return -(double)__popcll(aux[j]);
        case RL_POLICY_RANDOM: return (double)(splitmix64(rbase ^ (uint64_t)(int64_t)seq[j]) >> 11);
        case RL_POLICY_H2O:
        case RL_POLICY_TOVA: return floor(4096.0 * log2(score[j] + 1e-30) + 0.5);
        case RL_POLICY_KNORM: return -score[j];
        case RL_POLICY_LSH: {
            int dist = 0;
            for (int g = 0; g < group; g++) dist += __popcll(qcode[g] ^ aux[j]);
            return -(double)dist;
        }
        default: return (double)seq[j];   // streaming with staging: oldest first
    }
}

// Rows [0, n) of one head (units_per_row units of type U each) moved down to row dest[j] (-1: the
// row goes), in place and in ascending order: each pass reads a tile of blockDim x TILE units into
// registers, then writes them. dest[j] <= j, so a write lands on a unit already read (this tile's or
// an earlier one's): one read and one write per moved unit, as an ordered cache's memmove.
template <typename U>
__device__ void move_rows_down(uint8_t *base, int64_t units_per_row, int n, const int32_t *dest) {
    constexpr int TILE = 8;
    U *b = reinterpret_cast<U *>(base);
    const int64_t total = (int64_t)n * units_per_row;
    for (int64_t u0 = 0; u0 < total; u0 += (int64_t)TILE * blockDim.x) {
        U val[TILE];
        int64_t to[TILE];
#pragma unroll
        for (int i = 0; i < TILE; i++) {
            const int64_t u = u0 + (int64_t)i * blockDim.x + threadIdx.x;
            to[i] = -1;
            if (u < total) {
                const int64_t j = u / units_per_row, d = dest[j];
                if (d >= 0 && d != j) {
                    val[i] = b[u];
                    to[i] = d * units_per_row + (u - j * units_per_row);
                }
            }
        }
        __syncthreads();
#pragma unroll
        for (int i = 0; i < TILE; i++)
            if (to[i] >= 0) b[to[i]] = val[i];
        __syncthreads();
    }
}

// move_rows_down over rows of `row_bytes` bytes (even: kv_rows.cuh), in 4-byte units when they divide it.
__device__ __forceinline__ void move_kv_rows_down(uint8_t *base, int64_t row_bytes, int n, const int32_t *dest) {
    if (row_bytes % 4 == 0) move_rows_down<uint32_t>(base, row_bytes / 4, n, dest);
    else move_rows_down<uint16_t>(base, row_bytes / 2, n, dest);
}

// The shift-and-append baseline (update "shift", runtime/kv_write.py kv_write_shift and
// evict_slots_shift): head h's slots stay in sequence order (slot = rank), and removing the `got`
// slots flagged in taken (victims lists them) moves every survivor down over them, in place (K and
// V rows, seq, score, aux), as an ordered cache does. The destinations are staged in L.scratch
// (shift_scratch_bytes per head). Leaves count unchanged.
__device__ void compact_ordered(LayerStore L, int h, int n, int got, const int32_t *victims, int64_t krb, int64_t vrb) {
    const int P = L.P, tid = threadIdx.x;
    uint8_t *K = L.k + (int64_t)h * P * krb, *V = L.v + (int64_t)h * P * vrb;
    int32_t *seq = L.seq + h * P, *rank = L.rank + h * P;
    double *score = L.score + h * P;
    uint64_t *aux = L.aux + h * P;
    const uint8_t *taken = L.taken + h * P;
    int32_t *dest = reinterpret_cast<int32_t *>(L.scratch + h * shift_scratch_bytes(P));
    for (int j = tid; j < n; j += blockDim.x) {
        int below = 0;
        for (int m = 0; m < got; m++) below += victims[m] < j;
        dest[j] = taken[j] ? -1 : j - below;
    }
    __syncthreads();
    move_kv_rows_down(K, krb, n, dest);
    move_kv_rows_down(V, vrb, n, dest);
    for (int j0 = 0; j0 < n; j0 += blockDim.x) {   // the slots' metadata, a tile of blockDim rows per pass
        const int j = j0 + tid;
        int d = -1, sj = 0;
        double sc = 0.0;
        uint64_t ax = 0;
        if (j < n && dest[j] >= 0 && dest[j] != j) {
            d = dest[j];
            sj = seq[j];
            sc = score[j];
            ax = aux[j];
        }
        __syncthreads();
        if (d >= 0) {
            seq[d] = sj;
            score[d] = sc;
            aux[d] = ax;
        }
        __syncthreads();
    }
    const int kept = n - got;
    for (int j = tid; j < n; j += blockDim.x) {
        if (j >= kept) seq[j] = -1;
        rank[j] = j;
    }
    __syncthreads();
}

// Token t of the chunk (k_new, v_new (n_kv, hd) float32, k before RoPE) into the store, its rows
// encoded in KT / VT here; victims' slots are refilled by moving encoded rows (update "inplace") or
// the survivors are copied down in order (update "shift", compact_ordered). Policy scores of the
// key (knorm, lsh) are taken from the key as the store holds it (decoded), as the CPU store's.
template <int KT, int VT>
__global__ void __launch_bounds__(KV_THREADS)
kv_write_kernel(LayerStore L, StorePolicy pol, const float *k_new, const float *v_new, const float *q_new,
                const float *proj, const int64_t *n_seen, int t, int n_head, int hd, int kv_per_seq) {
    const int h = blockIdx.x, n_kv = gridDim.x, group = n_head / n_kv, tid = threadIdx.x;
    const int P = L.P;
    const int64_t krb = kv_row_bytes(KT, hd), vrb = kv_row_bytes(VT, hd);
    uint8_t *K = L.k + (int64_t)h * P * krb, *V = L.v + (int64_t)h * P * vrb;
    int32_t *seq = L.seq + h * P, *rank = L.rank + h * P, *victims = L.victims + h * P;
    double *score = L.score + h * P;
    uint64_t *aux = L.aux + h * P;
    uint8_t *taken = L.taken + h * P;
    const float *kn = k_new + h * hd, *vn = v_new + h * hd;
    const int seq_new = (int)(n_seen[h / kv_per_seq] + t);   // the sequence's counter (a batch: one each)
    const int n = L.count[h];

    __shared__ double red_key[KV_THREADS];
    __shared__ int red_seq[KV_THREADS], red_j[KV_THREADS];
    __shared__ uint8_t bits[MAX_GROUP * 64];
    __shared__ uint64_t qcode[MAX_GROUP];
    __shared__ int s_got, s_stop;

    if (L.ring) {
        // Ring: a free slot while there is one. Full, in place: the oldest non-sink token's slot,
        // sinks + evictions mod (C - sinks); shift-and-append: the ordered slots move down one over
        // the oldest non-sink token (slot sinks) and the new token goes at the end.
        int slot = n, rank_new = n;
        if (n >= L.C && pol.shift) {
            if (tid == 0) {
                victims[0] = L.sinks;
                taken[L.sinks] = 1;
            }
            __syncthreads();
            compact_ordered(L, h, n, 1, victims, krb, vrb);
            if (tid == 0) taken[L.sinks] = 0;
            slot = rank_new = n - 1;
        } else if (n >= L.C) {
            slot = L.sinks + (int)(L.evicted[h] % (int64_t)(L.C - L.sinks));
            const int vs = seq[slot];
            if (pol.reindexed)   // every held token newer than the victim moves down one rank
                for (int j = tid; j < L.C; j += blockDim.x)
                    if (seq[j] > vs) rank[j] -= 1;
            rank_new = L.C - 1;
        }
        kv_put<KT>(K + slot * krb, kn, hd);
        kv_put<VT>(V + slot * vrb, vn, hd);
        __syncthreads();   // every thread has read count, evicted and seq[slot]
        if (tid == 0) {
            seq[slot] = seq_new;
            rank[slot] = rank_new;
            if (n < L.C) L.count[h] = n + 1;
            else L.evicted[h] += 1;
        }
        return;
    }

    // Policy layer: evict n_drop tokens (staged eviction), lowest victim key first.
    const int held = n + 1;
    const int n_drop = held - keep_after(held, L.C, pol.lazy, pol.slack, pol.max_drop);
    if (tid == 0) s_got = 0;
    if (n_drop > 0) {
        if (pol.policy == RL_POLICY_LSH) {   // codes of the new token's group queries (pre-RoPE)
            const int nb = pol.lsh_bits;
            for (int gi = tid; gi < group * nb; gi += blockDim.x) {
                const int g = gi / nb, i = gi % nb;
                const float *qg = q_new + (int64_t)(h * group + g) * hd;
                bits[gi] = simhash_bit<RL_TYPE_F32>(proj + (int64_t)i * hd, reinterpret_cast<const uint8_t *>(qg), hd);
            }
            __syncthreads();
            if (tid < group) {
                uint64_t c = 0;
                for (int i = 0; i < nb; i++)
                    if (bits[tid * nb + i]) c |= 1ull << i;
                qcode[tid] = c;
            }
        }
        const uint64_t rbase = pol.policy == RL_POLICY_RANDOM ? random_base(pol.seed, L.il, h % kv_per_seq, seq_new) : 0;
        for (int j = tid; j < n; j += blockDim.x) taken[j] = 0;
        for (int round = 0; round < n_drop; round++) {
            __syncthreads();
            double bk = 0.0;
            int bs = 0, bj = -1;
            for (int j = tid; j < n; j += blockDim.x) {
                const int r = rank[j];
                if (r < L.sinks || r >= n - pol.recent || taken[j]) continue;
                const double kj = victim_key(pol.policy, j, seq, score, aux, qcode, group, rbase);
                if (bj < 0 || kj < bk || (kj == bk && seq[j] < bs)) {
                    bk = kj;
                    bs = seq[j];
                    bj = j;
                }
            }
            red_key[tid] = bk;
            red_seq[tid] = bs;
            red_j[tid] = bj;
            __syncthreads();
            for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
                if (tid < stride) {
                    const int oj = red_j[tid + stride];
                    if (oj >= 0) {
                        const double ok = red_key[tid + stride];
                        const int os = red_seq[tid + stride];
                        if (red_j[tid] < 0 || ok < red_key[tid] || (ok == red_key[tid] && os < red_seq[tid])) {
                            red_key[tid] = ok;
                            red_seq[tid] = os;
                            red_j[tid] = oj;
                        }
                    }
                }
                __syncthreads();
            }
            if (tid == 0) {
                s_stop = red_j[0] < 0;
                if (!s_stop) {
                    victims[s_got] = red_j[0];
                    taken[red_j[0]] = 1;
                    s_got += 1;
                }
            }
            __syncthreads();
            if (s_stop) break;
        }
        __syncthreads();
        const int got = s_got;
        if (pol.shift) {
            compact_ordered(L, h, n, got, victims, krb, vrb);
        } else {
            // ranks drop by the number of victims older than the token (positions follow when reindexed)
            for (int j = tid; j < n; j += blockDim.x) {
                const int s = seq[j];
                int older = 0;
                for (int m = 0; m < got; m++) older += seq[victims[m]] < s;
                rank[j] -= older;
            }
            __syncthreads();
            if (tid == 0) {   // holes highest first: the last occupied slot is then never a pending victim
                for (int a = 0; a < got; a++) {
                    int best = a;
                    for (int b = a + 1; b < got; b++)
                        if (victims[b] > victims[best]) best = b;
                    const int tmp = victims[a];
                    victims[a] = victims[best];
                    victims[best] = tmp;
                }
            }
            __syncthreads();
            for (int m = 0; m < got; m++) {
                const int j = victims[m], last = n - 1 - m;
                if (j != last) {
                    kv_copy<KT>(K + j * krb, K + last * krb, hd);
                    kv_copy<VT>(V + j * vrb, V + last * vrb, hd);
                    if (tid == 0) {
                        seq[j] = seq[last];
                        rank[j] = rank[last];
                        score[j] = score[last];
                        aux[j] = aux[last];
                    }
                }
                __syncthreads();
                if (tid == 0) seq[last] = -1;
                __syncthreads();
            }
        }
    }
    __syncthreads();
    const int slot = n - s_got;
    kv_put<KT>(K + slot * krb, kn, hd);
    kv_put<VT>(V + slot * vrb, vn, hd);
    // the key as the store holds it: kn itself for f32, else the row just encoded (read back once
    // every thread's part of it is written)
    const uint8_t *kheld = KT == RL_TYPE_F32 ? reinterpret_cast<const uint8_t *>(kn) : K + slot * krb;
    if constexpr (KT != RL_TYPE_F32) __syncthreads();
    if (pol.policy == RL_POLICY_LSH) {
        const int nb = pol.lsh_bits;
        for (int i = tid; i < nb; i += blockDim.x) bits[i] = simhash_bit<KT>(proj + (int64_t)i * hd, kheld, hd);
    }
    __syncthreads();
    if (tid == 0) {
        seq[slot] = seq_new;
        rank[slot] = slot;
        double sc = 0.0;
        uint64_t code = 0;
        if (pol.policy == RL_POLICY_KNORM) {
            // L2 norm of the pre-RoPE key (float64 of float32 values) on a log grid of 1/256 octave,
            // as runtime/policies/knorm.py: twins that differ by rounding tie, and the older goes
            for (int d = 0; d < hd; d++) {
                const double x = (double)kv_get<KT>(kheld, d);
                sc += x * x;
            }
            sc = floor(256.0 * log2(sqrt(sc) + 1e-30) + 0.5);
        }
        if (pol.policy == RL_POLICY_LSH)
            for (int i = 0; i < pol.lsh_bits; i++)
                if (bits[i]) code |= 1ull << i;
        score[slot] = sc;
        aux[slot] = code;
        L.count[h] = slot + 1;
        L.evicted[h] += s_got;
    }
}

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

// ==============================================================================================
// Attention mass of the policies (runtime/policies/h2o.py, tova.py)
// ==============================================================================================

// h2o: score[h, j] += sum over the group's query heads of the weight slot j received (float64).
__global__ void observe_h2o_kernel(LayerStore L, const float *weights, int group) {
    const int h = blockIdx.x, n = L.count[h];
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float m = 0.0f;
        for (int g = 0; g < group; g++) m += weights[(int64_t)(h * group + g) * L.P + j];
        L.score[h * L.P + j] += (double)m;
    }
}

// scissorhands: aux[h, j] = the slot's history bits shifted left by one, the new bit set when the
// group-summed weight over the group size is below 1/n (n = slots attended; float64 comparison of the
// float32 sum, as runtime/policies/scissorhands.py update_history), kept to `history` bits.
__global__ void observe_scissorhands_kernel(LayerStore L, const float *weights, int group, int history) {
    const int h = blockIdx.x, n = L.count[h];
    const uint64_t mask = history < 64 ? (1ull << history) - 1 : ~0ull;
    const double thresh = 1.0 / n;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float m = 0.0f;
        for (int g = 0; g < group; g++) m += weights[(int64_t)(h * group + g) * L.P + j];
        const uint64_t low = (double)m / group < thresh ? 1ull : 0ull;
        L.aux[h * L.P + j] = ((L.aux[h * L.P + j] << 1) | low) & mask;
    }
}

// tova: score[:, j] = (sum over kv heads of the group-summed weight) / n_head, the same in every kv
// head, replaced after each step (slot maps are identical across heads under tova).
// One block per sequence of a batch (blockIdx.x; its n_kv heads follow those of the previous ones).
__global__ void observe_tova_kernel(LayerStore L, const float *weights, int group, int n_kv) {
    const int h0 = blockIdx.x * n_kv, n = L.count[h0], n_head = group * n_kv;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        double acc = 0.0;
        for (int h = h0; h < h0 + n_kv; h++) {
            float m = 0.0f;
            for (int g = 0; g < group; g++) m += weights[(int64_t)(h * group + g) * L.P + j];
            acc += (double)m;
        }
        acc /= n_head;
        for (int h = h0; h < h0 + n_kv; h++) L.score[h * L.P + j] = acc;
    }
}

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
    for (int i = tid; i < n; i += blockDim.x) {
        const float l = logits[i];
        if (l > best || (l == best && i < bi)) {
            best = l;
            bi = i;
        }
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

static unsigned grid_for(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

// fn(KT, VT) with the store's element types as std::integral_constant (the kernels' template
// arguments); types were validated at store init (any other code runs as f32).
template <int KT, typename Fn> static void with_v_type(int v_type, Fn &&fn) {
    using K = std::integral_constant<int, KT>;
    if (v_type == RL_TYPE_F16) fn(K{}, std::integral_constant<int, RL_TYPE_F16>{});
    else if (v_type == RL_TYPE_Q8_0) fn(K{}, std::integral_constant<int, RL_TYPE_Q8_0>{});
    else fn(K{}, std::integral_constant<int, RL_TYPE_F32>{});
}

template <typename Fn> static void with_kv_types(int k_type, int v_type, Fn &&fn) {
    if (k_type == RL_TYPE_F16) with_v_type<RL_TYPE_F16>(v_type, fn);
    else if (k_type == RL_TYPE_Q8_0) with_v_type<RL_TYPE_Q8_0>(v_type, fn);
    else with_v_type<RL_TYPE_F32>(v_type, fn);
}

void launch_norm(float *out, const float *x, const float *w, const float *b, int kind, int rows, int n, double eps,
                 cudaStream_t st) {
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

void launch_kv_write(LayerStore L, StorePolicy pol, const float *k_new, const float *v_new, const float *q_new,
                     const float *proj, const int64_t *n_seen, int t, int n_kv, int n_head, int hd, int kv_per_seq,
                     cudaStream_t st) {
    with_kv_types(L.k_type, L.v_type, [&](auto kt, auto vt) {
        kv_write_kernel<decltype(kt)::value, decltype(vt)::value>
            <<<n_kv, KV_THREADS, 0, st>>>(L, pol, k_new, v_new, q_new, proj, n_seen, t, n_head, hd, kv_per_seq);
    });
}

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

void launch_observe(LayerStore L, StorePolicy pol, const float *weights, int n_head, int n_kv, int n_seq,
                    cudaStream_t st) {
    if (pol.policy == RL_POLICY_H2O) observe_h2o_kernel<<<n_kv, 128, 0, st>>>(L, weights, n_head / n_kv);
    else if (pol.policy == RL_POLICY_TOVA)
        observe_tova_kernel<<<n_seq, 256, 0, st>>>(L, weights, n_head / n_kv, n_kv / n_seq);
    else if (pol.policy == RL_POLICY_SCISSORHANDS)
        observe_scissorhands_kernel<<<n_kv, 128, 0, st>>>(L, weights, n_head / n_kv, pol.history);
}

void launch_pick(int32_t *token, const float *logits, int n, const float *params, int rows, cudaStream_t st) {
    pick_kernel<<<rows, PICK_THREADS, 0, st>>>(token, logits, n, params);
}
