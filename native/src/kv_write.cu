// The KV write with on-device victim selection (one block per kv head; runtime/kv_store.py
// kv_write_streaming / kv_write_policy, runtime/kv_write.py, runtime/policies/*), the
// shift-and-append baseline, and the policies' record of each attention step (observe).
//
// Victims are chosen as the CPU policies choose them, in the same order where ties matter. The
// kernels that touch K / V rows are templates on the store's element types (KT, VT: kv_rows.cuh).
#include "common.cuh"
#include "policy_math.cuh"
#include "reduce.cuh"

#include <float.h>
#include <math.h>

namespace {

// ==============================================================================================
// KV write: one block per kv head (runtime/kv_store.py kv_write_streaming / kv_write_policy)
// ==============================================================================================

constexpr int KV_THREADS = 256;
constexpr int MAX_GROUP = 64;      // query heads per kv head (checked at model init)

// SimHash bit i of the row x (hd values of type T): sign of proj[i] . x, summed in float32 in
// index order with no FMA (runtime/policies/lsh.py simhash_rows).
template <int T> __device__ __forceinline__ bool simhash_bit(const float *proj_i, const uint8_t *x, int hd) {
    float acc = 0.0f;
    for (int d = 0; d < hd; d++) acc = __fadd_rn(acc, __fmul_rn(proj_i[d], kv_get<T>(x, d)));
    return acc > 0.0f;
}

// The random policy's draws at one eviction share this base: splitmix64 of (seed, layer il, kv head
// h, the new token's sequence index), chained as runtime/policies/random_policy.py _random_keys.
__device__ __forceinline__ uint64_t random_base(uint64_t seed, int il, int h, int seq_new) {
    return splitmix64(splitmix64(splitmix64(seed) ^ (uint64_t)(il * 1024 + h)) ^ (uint64_t)seq_new);
}

// A window policy's mass in fixed point: round(m x 2^48) as int64 (runtime/policies/snapkv.py
// mass_fixed): window totals are integer sums, the same in any order.
constexpr double MASS_FIXED = 281474976710656.0;   // 2^48
__device__ __forceinline__ int64_t mass_fixed(float m) {
    return (int64_t)floor(__dadd_rn(__dmul_rn((double)m, MASS_FIXED), 0.5));
}

// One component of a unit key in rkv's key sum: round(x * inv * 2^40) as int64 (runtime/key_sum.py
// key_sum_move); the same bits when the key enters and when it leaves.
constexpr double KEY_SUM_FIXED = 1099511627776.0;  // 2^40
__device__ __forceinline__ int64_t unit_fixed(float x, double inv) {
    return (int64_t)floor(__dadd_rn(__dmul_rn(__dmul_rn((double)x, inv), KEY_SUM_FIXED), 0.5));
}

// runtime/eviction.py grid_value: GRID_LOG for masses, GRID_ABS for signed O(1) scores (KEY_GRID 4096).
__device__ __forceinline__ double grid_log(double x) { return floor(4096.0 * log2(x + 1e-30) + 0.5); }
__device__ __forceinline__ double grid_abs(double x) { return floor(x * 4096.0 + 0.5); }

// The window policies' scores of head h (n held slots; runtime/policies/snapkv.py pooled_keys): its
// scratch row work (2P) gets the window totals by rank, work[r] = tot x 2^-48 of the slot of rank r,
// then work[P + r] = their max over the ranks within pool / 2 of r (clipped to [0, n)). Max is exact:
// the same values as the CPU's, whatever the order. Called by the whole block.
__device__ void pool_by_rank(const LayerStore &L, int h, int n, int pool) {
    const int P = L.P;
    double *w = L.work + (int64_t)h * 2 * P;
    const int32_t *rank = L.rank + h * P;
    const int64_t *tot = reinterpret_cast<const int64_t *>(L.aux) + h * P;
    for (int j = threadIdx.x; j < n; j += blockDim.x) w[rank[j]] = (double)tot[j] * (1.0 / MASS_FIXED);
    __syncthreads();
    const int half = pool / 2;
    for (int r = threadIdx.x; r < n; r += blockDim.x) {
        double m = w[r];
        for (int o = 1; o <= half; o++) {
            if (r + o < n) m = fmax(m, w[r + o]);
            if (r - o >= 0) m = fmax(m, w[r - o]);
        }
        w[P + r] = m;
    }
    __syncthreads();
}

// rkv's victim keys of head h into work[j] (runtime/policies/rkv.py rkv_keys), on the grid: lambda I_j -
// (1 - lambda) R_j, I_j = window total / the head's largest, R_j = ((k_j . S) / |k_j| - 1) / (n - 1),
// S the sum of the held unit keys (ksum x 2^-40), 1/|k_j| in score[j]. s: hd doubles of shared memory,
// red: 32 doubles. Called by the whole block.
template <int KT>
__device__ void rkv_keys(const LayerStore &L, int h, int n, int hd, double lam, const uint8_t *K, int64_t krb,
                         double *s, double *red) {
    const int P = L.P;
    const int64_t *tot = reinterpret_cast<const int64_t *>(L.aux) + h * P;
    double top = 0.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) top = fmax(top, (double)tot[j]);
    top = block_max(top, red);
    top = top > 0.0 ? 1.0 / top : 0.0;
    for (int d = threadIdx.x; d < hd; d += blockDim.x) s[d] = (double)L.ksum[(int64_t)h * hd + d] / KEY_SUM_FIXED;
    __syncthreads();
    const double *inv = L.score + h * P;
    double *key = L.work + (int64_t)h * 2 * P;
    const double denom = n - 1 > 1 ? (double)(n - 1) : 1.0;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        const uint8_t *kj = K + j * krb;
        double dot = 0.0;
        for (int d = 0; d < hd; d++) dot += (double)kv_get<KT>(kj, d) * s[d];
        const double red_j = (dot * inv[j] - 1.0) / denom;
        key[j] = grid_abs(lam * (double)tot[j] * top - (1.0 - lam) * red_j);
    }
    __syncthreads();
}

// Victim key of slot j: the lowest key among unprotected slots goes (ties -> older token).
// Attention masses (h2o, tova) are compared on runtime/eviction.py's grid (GRID_LOG, KEY_GRID = 4096
// steps per octave): masses that differ only by rounding tie, and the older token goes, as on the CPU.
// scissorhands: minus the count of unimportant steps in the slot's history bits (aux); random: the
// top 53 bits of splitmix64(rbase ^ seq) (the CPU's draw before its scaling to [0, 1), same order).
// snapkv: the pooled window mass of the slot's rank (work[P + rank], pool_by_rank) on the log grid;
// rkv: work[j] (rkv_keys, on its grid already).
__device__ __forceinline__ double victim_key(int policy, int j, const int32_t *seq, const double *score,
                                             const uint64_t *aux, const uint64_t *qcode, int group,
                                             uint64_t rbase, const double *work, const int32_t *rank, int P) {
    switch (policy) {
        case RL_POLICY_SNAPKV: return grid_log(work[P + rank[j]]);
        case RL_POLICY_GVOTE: return work[j];   // the sequence's votes (gvote.cu), compared as they are
        case RL_POLICY_RKV: return work[j];
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
__device__ void compact_ordered(LayerStore L, int h, int n, int got, const int32_t *victims, int64_t krb, int64_t vrb,
                                int w) {
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
    for (int i = 0; L.hist && i < w; i++) {       // the window policies' masses, one window column at a time
        float *col = L.hist + ((int64_t)h * w + i) * P;
        for (int j0 = 0; j0 < n; j0 += blockDim.x) {
            const int j = j0 + tid;
            const int d = j < n && dest[j] != j ? dest[j] : -1;
            const float x = d >= 0 ? col[j] : 0.0f;
            __syncthreads();
            if (d >= 0) col[d] = x;
            __syncthreads();
        }
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
    __shared__ double s_sum[MAX_HEAD_DIM];   // rkv: the key sum as float64, then the new key's 1/|k|
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
            compact_ordered(L, h, n, 1, victims, krb, vrb, pol.window);
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
    // adakv: the victims were chosen for the whole layer (adakv_select_kernel), drops[h] of them in victims
    const int held = n + 1, w = pol.window;
    const bool given = pol.policy == RL_POLICY_ADAKV;
    int n_drop = given ? L.drops[h] : held - keep_after(held, L.C, pol.lazy, pol.slack, pol.max_drop);
    if (given) {   // consumed (every thread has read it): a write without a new choice evicts nothing
        __syncthreads();
        if (tid == 0) L.drops[h] = 0;
    }
    const int h0 = h / kv_per_seq * kv_per_seq;   // the sequence's first kv head
    if (pol.policy == RL_POLICY_GVOTE && n_drop > 0) {   // the budget may drop more than the capacity asks
        const int budget = L.drops[h0], floor = L.sinks + pol.recent;
        const int wanted = n - (budget > floor ? budget : floor);
        n_drop = wanted > n_drop ? wanted : n_drop;
    }
    if (tid == 0) s_got = given ? n_drop : 0;
    if (n_drop > 0 && given) {   // flag them as the rounds below would (compact_ordered reads the flags)
        for (int j = tid; j < n; j += blockDim.x) taken[j] = 0;
        __syncthreads();
        for (int m = tid; m < n_drop; m += blockDim.x) taken[victims[m]] = 1;
    }
    if (n_drop > 0 && !given) {
        if (pol.policy == RL_POLICY_SNAPKV) pool_by_rank(L, h, n, pol.pool);
        if (pol.policy == RL_POLICY_RKV) rkv_keys<KT>(L, h, n, hd, pol.lam, K, krb, s_sum, red_key);
        // gvote's votes are its sequence's, in its first kv head's row
        const double *work = L.work ? L.work + (int64_t)(pol.policy == RL_POLICY_GVOTE ? h0 : h) * 2 * P : nullptr;
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
                const double kj = victim_key(pol.policy, j, seq, score, aux, qcode, group, rbase, work, rank, P);
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
    }
    __syncthreads();
    if (n_drop > 0) {
        const int got = s_got;
        if (pol.policy == RL_POLICY_RKV) {   // the victims' unit keys leave the head's sum
            for (int d = tid; d < hd; d += blockDim.x) {
                int64_t acc = 0;
                for (int m = 0; m < got; m++) acc += unit_fixed(kv_get<KT>(K + victims[m] * krb, d), score[victims[m]]);
                L.ksum[(int64_t)h * hd + d] -= acc;
            }
            __syncthreads();
        }
        if (pol.shift) {
            compact_ordered(L, h, n, got, victims, krb, vrb, pol.window);
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
                    for (int i = tid; L.hist && i < w; i += blockDim.x) {
                        float *col = L.hist + ((int64_t)h * w + i) * P;
                        col[j] = col[last];
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
    if (slot >= P) __trap();   // every held token protected and no slot free: unreachable for valid stores
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
    for (int i = tid; L.hist && i < w; i += blockDim.x) L.hist[((int64_t)h * w + i) * P + slot] = 0.0f;
    if (pol.policy == RL_POLICY_RKV) {   // the new key's 1/|k| (float64 of the values held), its unit key enters
        __syncthreads();
        if (tid == 0) {
            double nrm = 0.0;
            for (int d = 0; d < hd; d++) {
                const double x = (double)kv_get<KT>(kheld, d);
                nrm += x * x;
            }
            s_sum[0] = 1.0 / fmax(sqrt(nrm), 1e-30);
        }
        __syncthreads();
        const double inv = s_sum[0];
        for (int d = tid; d < hd; d += blockDim.x) L.ksum[(int64_t)h * hd + d] += unit_fixed(kv_get<KT>(kheld, d), inv);
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
        if (pol.policy == RL_POLICY_RKV) sc = s_sum[0];
        score[slot] = sc;
        aux[slot] = code;
        L.count[h] = slot + 1;
        L.evicted[h] += s_got;
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

// The window policies (snapkv, pyramidkv, rkv, adakv; runtime/policies/snapkv.py record_window): the
// step's mass, summed over the group's query heads in float32, enters column (the query's sequence
// index) mod w of each slot's window, and the slot's total (aux, int64 fixed point) moves by the new
// entry minus the one it replaces. One block per kv head (of all sequences of a batch).
__global__ void observe_window_kernel(LayerStore L, const float *weights, const int64_t *n_seen, int t, int group,
                                      int kv_per_seq, int w) {
    const int h = blockIdx.x, n = L.count[h], P = L.P;
    const int col = (int)((n_seen[h / kv_per_seq] + t) % w);
    int64_t *tot = reinterpret_cast<int64_t *>(L.aux) + (int64_t)h * P;
    float *hc = L.hist + ((int64_t)h * w + col) * P;
    for (int j = threadIdx.x; j < n; j += blockDim.x) {
        float m = 0.0f;
        for (int g = 0; g < group; g++) m += weights[(int64_t)(h * group + g) * P + j];
        tot[j] += mass_fixed(m) - mass_fixed(hc[j]);
        hc[j] = m;
    }
}

// ==============================================================================================
// adakv: one layer-wide choice of the next write's victims (runtime/policies/adakv.py select_drops)
// ==============================================================================================

// The lowest candidate of head h (ranks [lo, hi) of its pooled masses' grid keys work[P + r])
// after (g0, r0) in (grid key, rank) order: *g, *r (r = -1: none). Called by the whole block; red_key,
// red_r: blockDim.x entries of shared memory.
__device__ void next_candidate(const double *work, int P, int lo, int hi, double g0, int r0, double *g, int *r,
                               double *red_key, int *red_r) {
    double bg = 0.0;
    int br = -1;
    for (int x = lo + threadIdx.x; x < hi; x += blockDim.x) {
        const double gx = work[P + x];
        if (gx < g0 || (gx == g0 && x <= r0)) continue;   // taken already
        if (br < 0 || gx < bg || (gx == bg && x < br)) {
            bg = gx;
            br = x;
        }
    }
    red_key[threadIdx.x] = bg;
    red_r[threadIdx.x] = br;
    __syncthreads();
    for (int stride = blockDim.x / 2; stride > 0; stride >>= 1) {
        if (threadIdx.x < stride) {
            const int o = red_r[threadIdx.x + stride];
            const double og = red_key[threadIdx.x + stride];
            const int me = red_r[threadIdx.x];
            if (o >= 0 && (me < 0 || og < red_key[threadIdx.x] || (og == red_key[threadIdx.x] && o < me))) {
                red_key[threadIdx.x] = og;
                red_r[threadIdx.x] = o;
            }
        }
        __syncthreads();
    }
    *g = red_key[0];
    *r = red_r[0];
    __syncthreads();
}

// One block per sequence, over its kv_per_seq heads h0..: how many victims the layer gives (staged
// eviction on the layer totals: the held tokens of all heads plus the one entering each, capacity,
// lazy, slack and max_drop times the heads), then the victims one at a time, each the lowest pooled
// window mass on the log grid among the heads' unprotected slots (ties -> the older token, then the
// lower head), a head that would fall to head_floor giving no more. drops[h] <- head h's count,
// victims[h, :drops[h]] <- their slots, in the order chosen.
__global__ void __launch_bounds__(KV_THREADS) adakv_select_kernel(LayerStore L, StorePolicy pol, int kv_per_seq) {
    const int h0 = blockIdx.x * kv_per_seq, nkv = kv_per_seq, P = L.P, tid = threadIdx.x;
    __shared__ double red_key[KV_THREADS];
    __shared__ int red_r[KV_THREADS];
    __shared__ double s_g[ADAKV_MAX_HEADS];
    __shared__ int s_r[ADAKV_MAX_HEADS], s_drop[ADAKV_MAX_HEADS];
    __shared__ int s_best;
    int held = nkv;
    for (int i = 0; i < nkv; i++) held += L.count[h0 + i];
    const int n_total = held - keep_after(held, L.C * nkv, pol.lazy * nkv, pol.slack * nkv, pol.max_drop * nkv);
    if (tid < nkv) s_drop[tid] = 0;
    __syncthreads();
    if (n_total > 0) {
        for (int i = 0; i < nkv; i++) {   // pooled masses by rank on the log grid, each rank's slot beside them
            const int h = h0 + i, n = L.count[h];
            pool_by_rank(L, h, n, pol.pool);
            double *w = L.work + (int64_t)h * 2 * P;
            for (int j = tid; j < n; j += blockDim.x) w[L.rank[h * P + j]] = (double)j;
            for (int r = tid; r < n; r += blockDim.x) w[P + r] = grid_log(w[P + r]);
            __syncthreads();
            double g;
            int r;
            next_candidate(w, P, L.sinks, n - pol.recent, -INFINITY, -1, &g, &r, red_key, red_r);
            if (tid == 0) {
                s_g[i] = g;
                s_r[i] = r;
            }
        }
        __syncthreads();
        for (int got = 0; got < n_total; got++) {
            if (tid == 0) {
                int best = -1, best_seq = 0;
                for (int i = 0; i < nkv; i++) {
                    const int h = h0 + i;
                    if (s_r[i] < 0 || L.count[h] + 1 - s_drop[i] <= pol.head_floor) continue;
                    const int sq = L.seq[h * P + (int)L.work[(int64_t)h * 2 * P + s_r[i]]];
                    if (best < 0 || s_g[i] < s_g[best] || (s_g[i] == s_g[best] && sq < best_seq)) {
                        best = i;
                        best_seq = sq;
                    }
                }
                s_best = best;
                if (best >= 0) {
                    const int h = h0 + best;
                    L.victims[h * P + s_drop[best]] = (int)L.work[(int64_t)h * 2 * P + s_r[best]];
                    s_drop[best] += 1;
                }
            }
            __syncthreads();
            const int best = s_best;
            if (best < 0) break;
            const int h = h0 + best;
            double g;
            int r;
            next_candidate(L.work + (int64_t)h * 2 * P, P, L.sinks, L.count[h] - pol.recent, s_g[best], s_r[best], &g,
                           &r, red_key, red_r);
            if (tid == 0) {
                s_g[best] = g;
                s_r[best] = r;
            }
            __syncthreads();
        }
    }
    if (tid < nkv) L.drops[h0 + tid] = s_drop[tid];
}

}  // namespace

// ==============================================================================================
// Launchers
// ==============================================================================================

void launch_kv_write(LayerStore L, StorePolicy pol, const float *k_new, const float *v_new, const float *q_new,
                     const float *proj, const int64_t *n_seen, int t, int n_kv, int n_head, int hd, int kv_per_seq,
                     cudaStream_t st) {
    with_kv_types(L.k_type, L.v_type, [&](auto kt, auto vt) {
        kv_write_kernel<decltype(kt)::value, decltype(vt)::value>
            <<<n_kv, KV_THREADS, 0, st>>>(L, pol, k_new, v_new, q_new, proj, n_seen, t, n_head, hd, kv_per_seq);
    });
}

void launch_select(LayerStore L, StorePolicy pol, int n_kv, int n_seq, cudaStream_t st) {
    if (pol.policy == RL_POLICY_ADAKV && !L.ring) adakv_select_kernel<<<n_seq, KV_THREADS, 0, st>>>(L, pol, n_kv / n_seq);
}

void launch_observe(LayerStore L, StorePolicy pol, const float *weights, const int64_t *n_seen, int t, int n_head,
                    int n_kv, int n_seq, cudaStream_t st) {
    if (window_policy(pol.policy)) {
        observe_window_kernel<<<n_kv, 128, 0, st>>>(L, weights, n_seen, t, n_head / n_kv, n_kv / n_seq, pol.window);
        return;
    }
    if (pol.policy == RL_POLICY_H2O) observe_h2o_kernel<<<n_kv, 128, 0, st>>>(L, weights, n_head / n_kv);
    else if (pol.policy == RL_POLICY_TOVA)
        observe_tova_kernel<<<n_seq, 256, 0, st>>>(L, weights, n_head / n_kv, n_kv / n_seq);
    else if (pol.policy == RL_POLICY_SCISSORHANDS)
        observe_scissorhands_kernel<<<n_kv, 128, 0, st>>>(L, weights, n_head / n_kv, pol.history);
}
