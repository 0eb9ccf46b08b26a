// Chunk mode of the prefill (forward.cu layer()): on a ring layer where no token of a chunk evicts
// (tokens fed before the chunk, nb, plus its T <= C), the chunk's K/V rows are written in one launch
// and its T queries attend causally in one more, instead of T (kv_write, attend) launch pairs.
//
// Why the shortcut is exact: a ring layer that never evicted holds token s in slot s with
// seq = rank = s (kv_write_kernel's ring branch with a free slot), so the logical position of every
// held key is its slot index in both position modes (original: seq; reindexed: rank), and token t of
// the chunk sits at position nb + t and attends slots [0, nb + t], its own included (written before
// the attention, as kv_write then attend per token). Ring layers have no observing policy, so the
// softmax weights are not needed (and not written).
//
// Numerics: attend_kernel's (attention.cu) up to the order of the float32 sums: the query rotated at
// its position and times attn_scale, each key rotated at its slot's position, with the cos/sin of
// the same RoPE table (rope.cuh; forward.cu keeps chunk mode to positions inside it), scores and sums in
// float32, softmax terms expf(fmaxf(s - max, -87.3f)) with the exact expf. The softmax is taken
// online (flash attention: Dao et al. 2022, "FlashAttention", Algorithm 1): per tile of keys each
// query row's running max m and sum l are updated and its partial value sum rescaled by
// expf(m_old - m_new); out = acc / l at the end. attend_kernel's flush
// of subnormal normalized weights to 0 has no counterpart: such a weight (< 1.2e-38) moves an output
// by less than 1.2e-38 * |v|.
#include "common.cuh"
#include "reduce.cuh"
#include "rope.cuh"

#include <math.h>

namespace {

constexpr int PF_THREADS = 128;                    // attention block: 4 warps
constexpr int PF_ROWS = 4;                         // query rows (tokens) per warp
constexpr int PF_QT = PF_THREADS / 32 * PF_ROWS;   // query rows per block: 16
constexpr int PF_BK = 32;                          // keys per tile: one per lane in the scores
constexpr int PF_PUT_THREADS = 128;                // KV write block
constexpr int PF_TARGET_BLOCKS = 1024;             // key splits are added until the grid has about this many
                                                   // blocks (7-8 per SM of an H100 / A100 at 128 threads)
constexpr int PF_MAX_SPLITS = 64;
constexpr int PF_MERGE_THREADS = 128;              // merge block: one warp per (token, query head)
constexpr int PF_MAX_HD = 256;                     // 8 value dims per lane (DCH), 83 KiB of shared memory

// ==============================================================================================
// KV write of a whole chunk into free ring slots
// ==============================================================================================

// row = x (hd float32) encoded in `type` (kv_rows.cuh kv_put; every thread of the block calls it).
__device__ __forceinline__ void put_row(uint8_t *row, const float *x, int type, int hd) {
    if (type == RL_TYPE_F16) kv_put<RL_TYPE_F16>(row, x, hd);
    else if (type == RL_TYPE_Q8_0) kv_put<RL_TYPE_Q8_0>(row, x, hd);
    else kv_put<RL_TYPE_F32>(row, x, hd);
}

// Block (t, h): token t's K and V rows of kv head h (k_new, v_new (T, n_kv * hd) float32, keys
// before RoPE) into slot nb + t, with seq = rank = nb + t, as kv_write_kernel's ring branch does for
// a free slot; block (0, h) sets count[h] = nb + T (nothing here reads it).
__global__ void __launch_bounds__(PF_PUT_THREADS)
kv_append_kernel(LayerStore L, const float *k_new, const float *v_new, int nb, int T, int hd) {
    const int t = blockIdx.x, h = blockIdx.y, n_kv = gridDim.y;
    const int slot = nb + t;
    const int64_t at = (int64_t)h * L.P + slot;                  // slot index in (n_kv, P)
    const int64_t src = ((int64_t)t * n_kv + h) * hd;           // row (t, h) of k_new / v_new
    put_row(L.k + at * kv_row_bytes(L.k_type, hd), k_new + src, L.k_type, hd);
    put_row(L.v + at * kv_row_bytes(L.v_type, hd), v_new + src, L.v_type, hd);
    if (threadIdx.x == 0) {
        L.seq[at] = slot;
        L.rank[at] = slot;
        if (t == 0) L.count[h] = nb + T;
    }
}

// ==============================================================================================
// Causal attention of a chunk: block (query head, tile of PF_QT tokens), K/V tiles in shared memory
// ==============================================================================================

// ks (PF_BK, hd + 4) = keys j0 .. j0 + nk - 1 of one kv head (kh: its (P,) rows of KT), each rotated
// at its slot's position j, as attend_kernel rotates them; rows past nk zeroed. Rows are padded to
// hd + 4 floats: 16-byte aligned (hd % 4 == 0), and the 8 lanes of a quarter warp reading rows l at
// the same float4 hit 8 distinct groups of 4 banks when (hd + 4) / 4 is odd (hd % 8 == 0).
template <int KT>
__device__ __forceinline__ void stage_keys(float *ks, const uint8_t *kh, int j0, int nk, int hd, int rotary_dim,
                                           const float2 *tab) {
    const int64_t krb = kv_row_bytes(KT, hd);
    const int half = rotary_dim / 2, nr = hd - rotary_dim, ksd = hd + 4;
    for (int idx = threadIdx.x; idx < PF_BK * half; idx += blockDim.x) {
        const int kk = idx / half, i = idx - kk * half;
        float x = 0.0f, y = 0.0f;
        if (kk < nk) {
            const int j = j0 + kk;
            const uint8_t *kj = kh + (int64_t)j * krb;
            const float2 r = rope_tab_cs(tab, j, i, half);
            const float c = r.x, s = r.y;
            const float a = kv_get<KT>(kj, i), b = kv_get<KT>(kj, i + half);
            x = a * c - b * s;
            y = b * c + a * s;
        }
        ks[kk * ksd + i] = x;
        ks[kk * ksd + i + half] = y;
    }
    for (int idx = threadIdx.x; idx < PF_BK * nr; idx += blockDim.x) {   // dims past rotary_dim: as held
        const int kk = idx / nr, d = rotary_dim + (idx - kk * nr);
        ks[kk * ksd + d] = kk < nk ? kv_get<KT>(kh + (int64_t)(j0 + kk) * krb, d) : 0.0f;
    }
}

// vs (PF_BK, hd) = values j0 .. j0 + nk - 1 of one kv head (vh: its (P,) rows of VT); rows past nk zeroed.
template <int VT>
__device__ __forceinline__ void stage_values(float *vs, const uint8_t *vh, int j0, int nk, int hd) {
    const int64_t vrb = kv_row_bytes(VT, hd);
    for (int idx = threadIdx.x; idx < PF_BK * hd; idx += blockDim.x) {
        const int kk = idx / hd, d = idx - kk * hd;
        vs[idx] = kk < nk ? kv_get<VT>(vh + (int64_t)(j0 + kk) * vrb, d) : 0.0f;
    }
}

// out (T, n_head * hd): row t, head hq = softmax over slots j in [0, nb + t] of the scores
// (rotated query . rotated key j) times the values. q (T, n_head * hd) float32 before RoPE; k, v the
// layer's (n_kv, P) rows of k_type / v_type. Grid (n_head, ceil(T / PF_QT), S), PF_THREADS threads;
// warp w owns the block's query rows w * PF_ROWS .. + PF_ROWS - 1 and, for the weighted value sum,
// the dims d = c * 32 + lane (c < DCH, DCH * 32 >= hd). hd % 4 == 0 (float4 reads of the query and
// key rows). Dynamic shared memory: prefill_smem_bytes(hd).
// Split z takes the slots [z * span, (z + 1) * span) (span a multiple of PF_BK; a block past its tile's
// last slot returns at once). S = 1: the block writes out; S > 1: it writes each row's running max m, sum
// l and value sums acc (unnormalized) into part ((T, n_head, S), hd + 2) = (m, l, acc[hd]), and
// prefill_merge_kernel combines the splits (flash-decoding's split-K over the keys).
template <int DCH>
__global__ void __launch_bounds__(PF_THREADS)
prefill_attend_kernel(float *out, float *part, const float *q, const uint8_t *k, const uint8_t *v, int k_type,
                      int v_type, int nb, int T, int n_kv, int P, int hd, int rotary_dim, const float2 *tab,
                      float attn_scale, int span) {
    extern __shared__ float smem[];
    float *qs = smem;                        // (PF_QT, hd) queries rotated at their positions, times attn_scale
    float *ks = qs + PF_QT * hd;             // (PF_BK, hd + 4) keys rotated at their slots' positions
    float *vs = ks + PF_BK * (hd + 4);       // (PF_BK, hd) values
    float *ps = vs + PF_BK * hd + (threadIdx.x >> 5) * PF_ROWS * PF_BK;   // (PF_ROWS, PF_BK) this warp's weights
    const int hq = blockIdx.x, n_head = gridDim.x, h = hq / (n_head / n_kv);
    const int t0 = blockIdx.y * PF_QT, rows = min(PF_QT, T - t0);
    const int n_keys = nb + t0 + rows;                // the block's last row attends slots [0, n_keys)
    const int k_begin = blockIdx.z * span, k_end = min(n_keys, k_begin + span);
    if (k_begin >= n_keys) return;                    // the whole block: no slot of this split is attended
    const int tid = threadIdx.x, lane = tid & 31, r0 = (tid >> 5) * PF_ROWS;
    const int half = rotary_dim / 2, nr = hd - rotary_dim, hd4 = hd / 4;
    const int64_t ld = (int64_t)n_head * hd;   // floats per token in q and out

    // the block's queries: row r is token t0 + r at position nb + t0 + r (rows past `rows` zeroed)
    for (int idx = tid; idx < PF_QT * half; idx += blockDim.x) {
        const int r = idx / half, i = idx - r * half;
        float x = 0.0f, y = 0.0f;
        if (r < rows) {
            const float *qh = q + (int64_t)(t0 + r) * ld + (int64_t)hq * hd;
            const float2 cs = rope_tab_cs(tab, nb + t0 + r, i, half);
            const float c = cs.x, s = cs.y;
            const float a = qh[i], b = qh[i + half];
            x = (a * c - b * s) * attn_scale;
            y = (b * c + a * s) * attn_scale;
        }
        qs[r * hd + i] = x;
        qs[r * hd + i + half] = y;
    }
    for (int idx = tid; idx < PF_QT * nr; idx += blockDim.x) {
        const int r = idx / nr, d = rotary_dim + (idx - r * nr);
        qs[r * hd + d] = r < rows ? q[(int64_t)(t0 + r) * ld + (int64_t)hq * hd + d] * attn_scale : 0.0f;
    }

    float m[PF_ROWS], l[PF_ROWS], acc[PF_ROWS][DCH];   // per row: running max, sum, value sums
#pragma unroll
    for (int rr = 0; rr < PF_ROWS; rr++) {
        m[rr] = -INFINITY;
        l[rr] = 0.0f;
#pragma unroll
        for (int c = 0; c < DCH; c++) acc[rr][c] = 0.0f;
    }
    const int64_t krb = kv_row_bytes(k_type, hd), vrb = kv_row_bytes(v_type, hd);
    const uint8_t *kh = k + (int64_t)h * P * krb, *vh = v + (int64_t)h * P * vrb;
    for (int j0 = k_begin; j0 < k_end; j0 += PF_BK) {
        const int nk = min(PF_BK, k_end - j0);
        __syncthreads();   // every warp is done with the previous tile (first tile: the queries are staged)
        if (k_type == RL_TYPE_F16) stage_keys<RL_TYPE_F16>(ks, kh, j0, nk, hd, rotary_dim, tab);
        else if (k_type == RL_TYPE_Q8_0) stage_keys<RL_TYPE_Q8_0>(ks, kh, j0, nk, hd, rotary_dim, tab);
        else stage_keys<RL_TYPE_F32>(ks, kh, j0, nk, hd, rotary_dim, tab);
        if (v_type == RL_TYPE_F16) stage_values<RL_TYPE_F16>(vs, vh, j0, nk, hd);
        else if (v_type == RL_TYPE_Q8_0) stage_values<RL_TYPE_Q8_0>(vs, vh, j0, nk, hd);
        else stage_values<RL_TYPE_F32>(vs, vh, j0, nk, hd);
        __syncthreads();

        // scores: lane l holds key j0 + l against each of the warp's rows (query float4s broadcast)
        float s[PF_ROWS];
#pragma unroll
        for (int rr = 0; rr < PF_ROWS; rr++) s[rr] = 0.0f;
        const float4 *kl = reinterpret_cast<const float4 *>(ks + lane * (hd + 4));
        const float4 *qw = reinterpret_cast<const float4 *>(qs + r0 * hd);
        for (int d4 = 0; d4 < hd4; d4++) {
            const float4 kd = kl[d4];
#pragma unroll
            for (int rr = 0; rr < PF_ROWS; rr++) {
                const float4 qd = qw[rr * hd4 + d4];
                s[rr] += qd.x * kd.x;
                s[rr] += qd.y * kd.y;
                s[rr] += qd.z * kd.z;
                s[rr] += qd.w * kd.w;
            }
        }
        // online softmax; p[rr] = the unnormalized weight of key j0 + lane in row r0 + rr (0 when masked)
        float p[PF_ROWS];
#pragma unroll
        for (int rr = 0; rr < PF_ROWS; rr++) {
            const int r = r0 + rr, last = nb + t0 + r;    // row r attends slots [0, last]
            const bool on = r < rows && j0 <= last;       // the same in every lane of the warp
            const bool valid = on && lane < nk && j0 + lane <= last;
            const float sv = valid ? s[rr] : -INFINITY;
            const float mt = warp_max(sv);
            p[rr] = 0.0f;
            if (on) {
                const float mn = fmaxf(m[rr], mt);        // finite: key j0 is valid in the row
                const float alpha = expf(m[rr] - mn);     // 0 on the row's first tile of the split (m = -inf)
                p[rr] = valid ? expf(fmaxf(sv - mn, -87.3f)) : 0.0f;   // exp_f32's clamp, as attend_kernel
                l[rr] = l[rr] * alpha + warp_sum(p[rr]);
                m[rr] = mn;
#pragma unroll
                for (int c = 0; c < DCH; c++) acc[rr][c] *= alpha;
            }
        }
        // value sums: acc[rr][c] += p(key kk) v[kk][c * 32 + lane], the weights broadcast from the warp's
        // rows of ps, 4 keys per read up to 64 dims (keys past nk: weight 0, value row zeroed)
#pragma unroll
        for (int rr = 0; rr < PF_ROWS; rr++) ps[rr * PF_BK + lane] = p[rr];
        __syncwarp();
        if constexpr (DCH > 2) {   // registers: acc already holds PF_ROWS * DCH floats
            for (int kk = 0; kk < nk; kk++) {
                float vv[DCH];
#pragma unroll
                for (int c = 0; c < DCH; c++) {
                    const int d = c * 32 + lane;
                    vv[c] = d < hd ? vs[kk * hd + d] : 0.0f;
                }
#pragma unroll
                for (int rr = 0; rr < PF_ROWS; rr++) {
                    const float pk = ps[rr * PF_BK + kk];
#pragma unroll
                    for (int c = 0; c < DCH; c++) acc[rr][c] += pk * vv[c];
                }
            }
        } else {   // 4 keys per read of the weights
            for (int k4 = 0; k4 < nk; k4 += 4) {
                float4 pw[PF_ROWS];
#pragma unroll
                for (int rr = 0; rr < PF_ROWS; rr++) pw[rr] = *reinterpret_cast<const float4 *>(ps + rr * PF_BK + k4);
#pragma unroll
                for (int u = 0; u < 4; u++) {
                    float vv[DCH];
#pragma unroll
                    for (int c = 0; c < DCH; c++) {
                        const int d = c * 32 + lane;
                        vv[c] = d < hd ? vs[(k4 + u) * hd + d] : 0.0f;
                    }
#pragma unroll
                    for (int rr = 0; rr < PF_ROWS; rr++) {
                        const float pk = u == 0 ? pw[rr].x : u == 1 ? pw[rr].y : u == 2 ? pw[rr].z : pw[rr].w;
#pragma unroll
                        for (int c = 0; c < DCH; c++) acc[rr][c] += pk * vv[c];
                    }
                }
            }
        }
        __syncwarp();   // ps is rewritten by the next tile
    }
#pragma unroll
    for (int rr = 0; rr < PF_ROWS; rr++) {
        const int r = r0 + rr;
        if (r >= rows) continue;
        if (gridDim.z == 1) {   // one split: l > 0 (slot 0 is attended by every row)
            const float inv = 1.0f / l[rr];
            float *o = out + (int64_t)(t0 + r) * ld + (int64_t)hq * hd;
#pragma unroll
            for (int c = 0; c < DCH; c++) {
                const int d = c * 32 + lane;
                if (d < hd) o[d] = acc[rr][c] * inv;
            }
        } else {                // a row none of whose slots is in this split writes m = -inf, l = 0 (unread)
            float *e = part + (((int64_t)(t0 + r) * n_head + hq) * gridDim.z + blockIdx.z) * (hd + 2);
            if (lane == 0) {
                e[0] = m[rr];
                e[1] = l[rr];
            }
#pragma unroll
            for (int c = 0; c < DCH; c++) {
                const int d = c * 32 + lane;
                if (d < hd) e[2 + d] = acc[rr][c];
            }
        }
    }
}

// out row t, head hq = the S splits' partial softmax sums combined: with M the largest of their
// maxima, out = sum_z acc_z expf(m_z - M) / sum_z l_z expf(m_z - M) over the splits z that hold a
// slot the row attends (z * span <= nb + t: each has a finite m_z). One warp per (t, hq), lanes over
// the dims. part as prefill_attend_kernel writes it.
__global__ void __launch_bounds__(PF_MERGE_THREADS)
prefill_merge_kernel(float *out, const float *part, int nb, int T, int n_head, int hd, int S, int span) {
    const int w = blockIdx.x * (PF_MERGE_THREADS / 32) + (threadIdx.x >> 5), lane = threadIdx.x & 31;
    if (w >= T * n_head) return;
    const int t = w / n_head, hq = w - t * n_head;
    const int n_split = min(S, (nb + t) / span + 1);
    const float *e = part + (int64_t)w * S * (hd + 2);
    float M = -INFINITY;
    for (int z = 0; z < n_split; z++) M = fmaxf(M, e[(int64_t)z * (hd + 2)]);
    float L = 0.0f;
    for (int z = 0; z < n_split; z++) L += e[(int64_t)z * (hd + 2) + 1] * expf(e[(int64_t)z * (hd + 2)] - M);
    const float inv = 1.0f / L;
    float *o = out + (int64_t)t * n_head * hd + (int64_t)hq * hd;
    for (int d = lane; d < hd; d += 32) {
        float a = 0.0f;
        for (int z = 0; z < n_split; z++) {
            const float *ez = e + (int64_t)z * (hd + 2);
            a += ez[2 + d] * expf(ez[0] - M);
        }
        o[d] = a * inv;
    }
}

// Dynamic shared memory of prefill_attend_kernel for head_dim hd: queries, padded keys, values, and
// each warp's weights of the current tile.
size_t prefill_smem_bytes(int hd) {
    return ((size_t)PF_QT * hd + (size_t)PF_BK * (hd + 4) + (size_t)PF_BK * hd + (size_t)PF_QT * PF_BK) * sizeof(float);
}

}  // namespace

// ==============================================================================================
// Launchers
// ==============================================================================================

void launch_kv_append(LayerStore L, const float *k_new, const float *v_new, int nb, int T, int n_kv, int hd,
                      cudaStream_t st) {
    kv_append_kernel<<<dim3(T, n_kv), PF_PUT_THREADS, 0, st>>>(L, k_new, v_new, nb, T, hd);
}

// Key splits of a chunk: enough for about PF_TARGET_BLOCKS blocks (a chunk of few tokens over many
// slots has few (head, token tile) blocks), at most one per tile of slots, PF_MAX_SPLITS, and what
// the scratch holds. *span: slots per split, a multiple of PF_BK.
static int prefill_splits(int nb, int T, int n_head, int hd, int64_t scratch_floats, int *span) {
    const int n_tiles = (nb + T + PF_BK - 1) / PF_BK;
    const int base = n_head * ((T + PF_QT - 1) / PF_QT);
    int S = (PF_TARGET_BLOCKS + base - 1) / base;
    S = min(S, min(n_tiles, PF_MAX_SPLITS));
    const int64_t per = (int64_t)T * n_head * (hd + 2);   // scratch floats per split
    if (S > 1 && scratch_floats / per < S) S = (int)(scratch_floats / per);
    if (S < 1) S = 1;
    const int tiles = (n_tiles + S - 1) / S;
    *span = tiles * PF_BK;
    return (n_tiles + tiles - 1) / tiles;                   // no split past the chunk's last slot
}

bool prefill_fits(int hd) { return hd % 4 == 0 && hd <= PF_MAX_HD; }

int64_t prefill_scratch_floats(int n_batch, int n_head, int hd) {
    // prefill_splits keeps T * n_head * S <= T * n_head * (PF_TARGET_BLOCKS / base + 1) and
    // T <= PF_QT * ceil(T / PF_QT), so T * n_head * S <= PF_QT * PF_TARGET_BLOCKS + T * n_head
    return ((int64_t)PF_QT * PF_TARGET_BLOCKS + (int64_t)n_batch * n_head) * (hd + 2);
}

void launch_prefill_attend(float *out, float *scratch, int64_t scratch_floats, const float *q, const uint8_t *k,
                           const uint8_t *v, int k_type, int v_type, int nb, int T, int n_head, int n_kv, int P,
                           int hd, int rotary_dim, const float2 *rope_tab, float attn_scale, cudaStream_t st) {
    int span = 0;
    const int S = scratch ? prefill_splits(nb, T, n_head, hd, scratch_floats, &span) : 1;
    if (S == 1) span = nb + T;
    const dim3 grid(n_head, (T + PF_QT - 1) / PF_QT, S);
    const size_t smem = prefill_smem_bytes(hd);
    auto go = [&](auto kernel) {
        // past the default 48 KiB (head_dim > 144) the kernel must opt in; a failure surfaces as the
        // launch's error (forward.cu checks cudaPeekAtLastError)
        if (smem > 48 * 1024) cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem);
        kernel<<<grid, PF_THREADS, smem, st>>>(out, scratch, q, k, v, k_type, v_type, nb, T, n_kv, P, hd, rotary_dim,
                                               rope_tab, attn_scale, span);
    };
    if (hd <= 32) go(prefill_attend_kernel<1>);
    else if (hd <= 64) go(prefill_attend_kernel<2>);
    else if (hd <= 128) go(prefill_attend_kernel<4>);
    else go(prefill_attend_kernel<8>);   // hd <= PF_MAX_HD (prefill_fits: the caller's condition)
    if (S > 1) {
        const int per_block = PF_MERGE_THREADS / 32;
        prefill_merge_kernel<<<(T * n_head + per_block - 1) / per_block, PF_MERGE_THREADS, 0, st>>>(
            out, scratch, nb, T, n_head, hd, S, span);
    }
}
