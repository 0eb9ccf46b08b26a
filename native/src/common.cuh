// Internal declarations shared by the CUDA translation units of libringllm_cuda.so.
//
//   quant.cu     GGUF block decoding in registers; dequant, matmul/matvec, embedding kernels
//   kernels.cu   norms, activations, residual adds, the attention step, KV writes with eviction,
//                attention-mass bookkeeping of the policies, token choice
//   api.cu       the C API of include/ringllm_cuda.h: handles, uploads, the forward pass
//   kv_rows.cuh  KV store rows in their element types (f32, f16, q8_0): encode, decode, copy
//
// Launchers take the destination first (house style), then inputs, then sizes, then the stream,
// and return nothing: api.cu checks cudaGetLastError after each group of launches.
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
// Per-layer store views passed to kernels by value
// ---------------------------------------------------------------------------------------------

struct LayerStore {
    uint8_t *k, *v;        // (n_kv, P) rows of kv_row_bytes(k_type / v_type, hd) bytes: keys before RoPE, values
    int32_t *seq;          // (n_kv, P) sequence index held, -1 empty
    int32_t *rank;         // (n_kv, P) rank by sequence index among held (= position when reindexed)
    double *score;         // (n_kv, P) policy score (accumulated mass, latest mean, key norm)
    uint64_t *aux;         // (n_kv, P) SimHash code of the key (lsh)
    int32_t *count;        // (n_kv,) occupied slots, always [0, count)
    int64_t *evicted;      // (n_kv,) tokens evicted
    int32_t *victims;      // (n_kv, P) scratch: chosen victims
    uint8_t *taken;        // (n_kv, P) scratch: slot already chosen this round
    int P, C, sinks, ring;
    int k_type, v_type;    // RL_TYPE_F32 | RL_TYPE_F16 | RL_TYPE_Q8_0 (kv_rows.cuh)
};

struct StorePolicy {
    int policy, reindexed, recent, lazy, slack, max_drop, lsh_bits;
};

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

// kernels.cu
void launch_norm(float *out, const float *x, const float *w, const float *b, int kind, int rows, int n, double eps,
                 cudaStream_t st);
void launch_act(float *out, const float *gate, const float *up, int act, int gated, int T, int n, cudaStream_t st);
void launch_add(float *x, const float *y, int64_t n, cudaStream_t st);
void launch_add_bias(float *x, const float *b, int T, int n, cudaStream_t st);
void launch_softcap(float *x, float cap, int64_t n, cudaStream_t st);
void launch_kv_write(LayerStore L, StorePolicy pol, const float *k_new, const float *v_new, const float *q_new,
                     const float *proj, const int64_t *n_seen, int t, int n_kv, int n_head, int hd,
                     cudaStream_t st);
void launch_attend(float *out, float *weights, const float *q, const uint8_t *k, const uint8_t *v, int k_type,
                   int v_type, const int32_t *pos, const int32_t *count, const int64_t *q_pos_seq, int q_pos_fixed,
                   int q_pos_mode, int n_head, int n_kv, int P, int hd, int rotary_dim, double scale,
                   const double *inv_freq, const float2 *rope_tab, int n_tab, float attn_scale, cudaStream_t st);
// tab (n_tab, half) = cos/sin of angle (p / scale) * inv_freq[i] (the attention's RoPE table)
void launch_rope_table(float2 *tab, const double *inv_freq, double scale, int n_tab, int half, cudaStream_t st);
void launch_observe(LayerStore L, int policy, const float *weights, int n_head, int n_kv, cudaStream_t st);
void launch_advance(int64_t *n_seen, int T, cudaStream_t st);
void launch_pick(int32_t *token, const float *logits, int n, const float *params, cudaStream_t st);

// q_pos_mode of launch_attend: where the query's logical position comes from
#define RL_QPOS_FIXED 0     // q_pos_fixed
#define RL_QPOS_COUNT 1     // count[0] - 1 (reindexed: the newest token's rank)
#define RL_QPOS_SEQ 2       // *q_pos_seq + q_pos_fixed (original: n_seen + t)
