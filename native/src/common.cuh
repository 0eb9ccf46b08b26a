// Internal declarations shared by the CUDA translation units of libringllm_cuda.so.
//
//   quant.cu     dequant, matmul/matvec (single and grouped with fused epilogues), embedding kernels
//   dequant.cuh  GGUF block decoding in registers (also plain C++: tests/native_dequant_check.cpp)
//   kernels.cu   norms, activations, residual adds, token choice
//   kv_write.cu  KV writes with eviction (victims chosen on the device), the shift-and-append
//                baseline, the policies' record of each attention step (observe), adakv's choice
//   gvote.cu     gvote's budget and votes before an evicting write, its query history
//   attention.cu the decode attention step (one block per query head, or split-K and a merge), the
//                RoPE table
//   prefill.cu   chunk mode of the prefill on ring layers: a chunk's KV write and causal attention
//   api.cu       the C API of include/ringllm_cuda.h: errors, devices, single kernels (tests)
//   model.cu     the model handle: weights, RoPE, graph / fusion switches
//   store.cu     the KV store handle: init, reset, a sequence's view of a batch store, inspection
//   forward.cu   the forward pass, token choice, decode steps (one sequence, a batch)
//   handles.cuh  rl_model and rl_store, device buffers: what the four above share
//   kv_rows.cuh  KV store rows in their element types (f32, f16, q8_0): encode, decode, copy, and
//                the host dispatch on them (with_kv_types)
//   rope.cuh     RoPE cos/sin of the attention kernels (table or float64 sincos)
//   reduce.cuh   warp and block reductions
//   policy_math.cuh  staged eviction's keep_after, splitmix64 (kv_write.cu, gvote.cu)
//
// Launchers take the destination first (house style), then inputs, then sizes, then the stream,
// and return nothing: forward.cu checks cudaGetLastError after each group of launches.
#pragma once

#include <stddef.h>
#include <stdint.h>

#include <cuda_runtime.h>

extern "C" {
#include "ringllm_cuda.h"
}

#include "kv_rows.cuh"

// ---------------------------------------------------------------------------------------------
// Errors: a thread-local message and helpers that turn a cudaError_t into a status
// ---------------------------------------------------------------------------------------------

int rl_fail(int status, const char *fmt, ...);
int rl_cuda_fail(cudaError_t err, const char *what);

#define RL_CK(call)                                   \
    do {                                              \
        cudaError_t rl_err_ = (call);                 \
        if (rl_err_ != cudaSuccess)                   \
            return rl_cuda_fail(rl_err_, #call);      \
    } while (0)

#define RL_TRY(call)                                  \
    do {                                              \
        int rl_st_ = (call);                          \
        if (rl_st_ != RL_OK) return rl_st_;           \
    } while (0)

// ---------------------------------------------------------------------------------------------
// Block layouts (values per block, bytes per block), as runtime/quant_types.py
// ---------------------------------------------------------------------------------------------

bool rl_type_layout(int qtype, int *block, int *size);

// ---------------------------------------------------------------------------------------------
// Activations (runtime/ops.py): kernels.cu's act_kernel and quant.cu's fused FFN epilogue
// ---------------------------------------------------------------------------------------------

__device__ __forceinline__ float act_f(float x, int kind) {
    if (kind == RL_ACT_SILU) return x / (1.0f + expf(-x));
    if (kind == RL_ACT_GELU) return (float)(0.5 * (double)x * (1.0 + erf((double)x / sqrt(2.0))));
    // 0.5 x (1 + tanh(u)) = x sigmoid(2u), in runtime/ops.py's form (no cancellation for x << 0)
    const float u = 0.7978845608028654f * (x + 0.044715f * x * x * x);
    return x / (1.0f + expf(-2.0f * u));
}

// ---------------------------------------------------------------------------------------------
// Per-layer store views passed to kernels by value
// ---------------------------------------------------------------------------------------------

struct LayerStore {
    uint8_t *k, *v;        // (n_kv, P) rows of kv_row_bytes(k_type / v_type, hd) bytes: keys before RoPE, values
    int32_t *seq;          // (n_kv, P) sequence index held, -1 empty
    int32_t *rank;         // (n_kv, P) rank by sequence index among held (= position when reindexed)
    double *score;         // (n_kv, P) policy score (accumulated mass, latest mean, key norm; rkv: 1/|k|)
    uint64_t *aux;         // (n_kv, P) SimHash code of the key (lsh), history bits (scissorhands), window
                           // mass total in fixed point, an int64 (snapkv, rkv, adakv: window_fixed)
    float *hist;           // (n_kv, w, P) window policies: mass the slot got from each of the last w queries
                           // (column = query's sequence index mod w), else NULL
    int64_t *ksum;         // (n_kv, hd) rkv: sum of the held unit keys in units of 2^-40, else NULL
    double *work;          // (n_kv, 2P) window policies' scratch: masses by rank, then pooled (or rkv's keys)
    int32_t *drops;        // (n_kv,) adakv: victims of the next write per head (chosen for the layer); gvote:
                           // each sequence's budget at its first kv head; else NULL
    float *qhist;          // gvote: (B x n_head, w, hd) the last w queries (before RoPE), column = seq mod w
    double *gv_w;          // gvote: (B x n_head x (S + 1), gv_p2) weights of each nucleus (store-wide scratch)
    int32_t *gv_i;         // gvote: their slots, sorted with them
    int gv_p2;             // gvote: the scratch rows' length, a power of two >= every layer's P
    int32_t *count;        // (n_kv,) occupied slots, always [0, count)
    int64_t *evicted;      // (n_kv,) tokens evicted
    int32_t *victims;      // (n_kv, P) scratch: chosen victims
    uint8_t *taken;        // (n_kv, P) scratch: slot already chosen this round
    uint8_t *scratch;      // update "shift" only: compact_ordered's destinations, shift_scratch_bytes per head
    int P, C, sinks, ring;
    int il;                // layer index (the random policy's draws)
    int k_type, v_type;    // RL_TYPE_F32 | RL_TYPE_F16 | RL_TYPE_Q8_0 (kv_rows.cuh)
};

// Bytes of one head's shift scratch (LayerStore.scratch): the P slots' destinations (int32) of an
// ordered compaction (kv_write.cu compact_ordered).
__host__ __device__ inline int64_t shift_scratch_bytes(int P) { return (int64_t)P * 4; }

struct StorePolicy {
    int policy, reindexed, recent, lazy, slack, max_drop, lsh_bits, history;
    uint64_t seed;
    int shift;             // 1: the shift-and-append baseline (ordered slots), 0: in place
    int window, pool;      // observation window w, pooling kernel (snapkv, rkv, adakv)
    int head_floor;        // adakv: tokens each head keeps at least
    double lam;            // rkv: weight of importance against redundancy
    int gv_samples;        // gvote: synthetic queries S
    double gv_p;           // gvote: nucleus mass p
};

// kv heads of one sequence adakv's layer-wide choice takes (kv_write.cu adakv_select_kernel)
constexpr int ADAKV_MAX_HEADS = 64;
// head_dim of rkv's key sum in shared memory (kv_write.cu kv_write_kernel)
constexpr int MAX_HEAD_DIM = 512;

// The window policies (a per-slot mass history: LayerStore.hist, aux as its fixed-point total).
__host__ __device__ inline bool window_policy(int policy) {
    return policy == RL_POLICY_SNAPKV || policy == RL_POLICY_RKV || policy == RL_POLICY_ADAKV;
}

// The policies whose victims are chosen for a whole layer before its write (launch_select).
__host__ __device__ inline bool layer_choice_policy(int policy) {
    return policy == RL_POLICY_ADAKV || policy == RL_POLICY_GVOTE;
}

// Blocks of `threads` covering n elements (elementwise launches).
inline unsigned grid_for(int64_t n, int threads) { return (unsigned)((n + threads - 1) / threads); }

// ---------------------------------------------------------------------------------------------
// Launchers
// ---------------------------------------------------------------------------------------------

// quant.cu
void launch_dequant(float *out, const uint8_t *w, int qtype, int64_t n_rows, int64_t n_cols, int64_t row_bytes,
                    cudaStream_t st);
void launch_matmul(float *out, const uint8_t *w, const float *x, int qtype, int64_t n_rows, int64_t n_cols,
                   int64_t row_bytes, int T, cudaStream_t st);
void launch_embed(float *out, const uint8_t *w, const int32_t *ids, int qtype, int64_t n_cols, int64_t row_bytes,
                  int n, float scale, cudaStream_t st);

// One weight matrix of a grouped matmul launch: its sums are x (T, n_cols) @ W.T, the same float
// operations as launch_matmul's, so the fused forward pass is bit-identical to the unfused one.
struct MatmulPart {
    float *out;           // (T, n_rows)
    const uint8_t *w;     // (n_rows, row_bytes) GGUF blocks of qtype
    const float *b;       // (n_rows,) bias added to the sums, or NULL
    int64_t row_bytes;
    int n_rows, qtype;
};
constexpr int MM_MAX_PARTS = 3;
// epi of launch_matmul_group: what the epilogue writes (s: a part's sums, plus its bias)
constexpr int MM_EPI_STORE = 0;   // every part: out = s (q, k, v in one launch)
constexpr int MM_EPI_ADD = 1;     // every part: out = out + s (a residual add, as launch_add)
constexpr int MM_EPI_ACT = 2;     // parts {u} or {g, u} with equal n_rows: parts[0].out = act(u) or act(g) * u
                                  // (launch_act: non-gated, gated); parts[1].out is not written
// Up to MM_MAX_PARTS matrices of n_cols columns (qtypes may differ) applied to the same x in one
// launch; outputs must not overlap x.
void launch_matmul_group(const MatmulPart *parts, int n_parts, int epi, int act, const float *x, int64_t n_cols, int T,
                         cudaStream_t st);

// kernels.cu
void launch_norm(float *out, const float *x, const float *w, const float *b, int kind, int rows, int n, double eps,
                 cudaStream_t st);
void launch_act(float *out, const float *gate, const float *up, int act, int gated, int T, int n, cudaStream_t st);
void launch_add(float *x, const float *y, int64_t n, cudaStream_t st);
void launch_add_bias(float *x, const float *b, int T, int n, cudaStream_t st);
void launch_softcap(float *x, float cap, int64_t n, cudaStream_t st);
void launch_advance(int64_t *n_seen, int T, int n_seq, cudaStream_t st);
void launch_pick(int32_t *token, const float *logits, int n, const float *params, int rows, cudaStream_t st);

// kv_write.cu
void launch_kv_write(LayerStore L, StorePolicy pol, const float *k_new, const float *v_new, const float *q_new,
                     const float *proj, const int64_t *n_seen, int t, int n_kv, int n_head, int hd, int kv_per_seq,
                     cudaStream_t st);
// the policy's record of the attention step just taken (h2o, tova, scissorhands, the window policies; a
// no-op for the others); token t of the chunk, n_seen the sequences' counters
void launch_observe(LayerStore L, StorePolicy pol, const float *weights, const int64_t *n_seen, int t, int n_head,
                    int n_kv, int n_seq, cudaStream_t st);
// adakv: the next write's victims of every head of a layer, one choice per sequence over its kv heads
// (L.drops, L.victims); a no-op for the other policies
void launch_select(LayerStore L, StorePolicy pol, int n_kv, int n_seq, cudaStream_t st);

// gvote.cu: before a write (token t of the chunk, q (n_seq x n_head, hd) its query rows before RoPE),
// each sequence's budget (L.drops[h0]) and votes (L.work, h0's row) when the write must evict; after
// the attention, the query rows into the history (L.qhist). n_head, n_kv: of all sequences.
void launch_gvote_votes(LayerStore L, StorePolicy pol, const float *q, const int64_t *n_seen, int t, int n_head,
                        int n_kv, int n_seq, int hd, int rotary_dim, double rope_scale, const double *inv_freq,
                        const float2 *tab, int n_tab, double attn_scale, cudaStream_t st);
void launch_gvote_record(LayerStore L, StorePolicy pol, const float *q, const int64_t *n_seen, int t, int n_head,
                         int n_seq, int hd, cudaStream_t st);

// attention.cu
// out (n_head, hd), weights (n_head, P); path RL_ATTEND_AUTO | _SINGLE | _SPLIT (include/ringllm_cuda.h).
// The split-K path needs scratch of attend_scratch_floats(n_head, hd, P) floats and a group / hd that
// attend_split_fits (group = n_head / n_kv); otherwise (or scratch NULL) the single-block kernel runs.
void launch_attend(float *out, float *weights, float *scratch, const float *q, const uint8_t *k, const uint8_t *v,
                   int k_type, int v_type, const int32_t *pos, const int32_t *count, const int64_t *q_pos_seq,
                   int q_pos_fixed, int q_pos_mode, int n_head, int n_kv, int P, int hd, int rotary_dim, double scale,
                   const double *inv_freq, const float2 *rope_tab, int n_tab, float attn_scale, int kv_per_seq,
                   int path, cudaStream_t st);
bool attend_split_fits(int group, int hd, int P);
int64_t attend_scratch_floats(int n_head, int hd, int P);
// tab (n_tab, half) = cos/sin of angle (p / scale) * inv_freq[i] (the attention's RoPE table)
void launch_rope_table(float2 *tab, const double *inv_freq, double scale, int n_tab, int half, cudaStream_t st);

// q_pos_mode of launch_attend: where the query's logical position comes from
#define RL_QPOS_FIXED 0     // q_pos_fixed
#define RL_QPOS_COUNT 1     // count[h] - 1 (reindexed: the newest token's rank in its head)
#define RL_QPOS_SEQ 2       // q_pos_seq[h / kv_per_seq] + q_pos_fixed (original: the sequence's n_seen + t)

// A batch of B sequences (a store made with batch B, rl_decode_batch) is laid out as B x n_kv heads
// (sequence b's kv head h is head b * n_kv + h of every per-head array) with one n_seen counter per
// sequence, so the per-head kernels run a whole batch step in one launch: kv_write over B x n_kv
// heads, attention over B x n_head query heads (the rows of q are the sequences), kv_per_seq = n_kv
// mapping a head to its sequence's counter.

// prefill.cu: chunk mode of a ring layer where no token of the chunk evicts (nb tokens held, all in
// slots [0, nb) at positions = slot indices, nb + T <= C). launch_kv_append: rows t of k_new, v_new
// (T, n_kv * hd) float32 (keys before RoPE) into slots nb + t, seq = rank = nb + t, count = nb + T.
// launch_prefill_attend: out (T, n_head * hd) row t = attention of q row t (before RoPE, position
// nb + t) over slots [0, nb + t], attend_kernel's numerics up to summation order; no weights. The
// cos/sin come from rope_tab alone, which must hold positions [0, nb + T) (NULL when rotary_dim is
// 0). The slots are split across blocks as far as scratch (scratch_floats floats; NULL: no split)
// holds the partial sums: prefill_scratch_floats(n_batch, n_head, hd) is enough for any chunk.
// prefill_fits: the head_dims the kernels take (multiples of 4 up to 256; forward.cu takes a model of
// another head_dim token by token).
bool prefill_fits(int hd);
void launch_kv_append(LayerStore L, const float *k_new, const float *v_new, int nb, int T, int n_kv, int hd,
                      cudaStream_t st);
void launch_prefill_attend(float *out, float *scratch, int64_t scratch_floats, const float *q, const uint8_t *k,
                           const uint8_t *v, int k_type, int v_type, int nb, int T, int n_head, int n_kv, int P,
                           int hd, int rotary_dim, const float2 *rope_tab, float attn_scale, cudaStream_t st);
int64_t prefill_scratch_floats(int n_batch, int n_head, int hd);
