// The handles behind the C API (rl_model, rl_store) and what the translation units implementing it
// share: device buffers, host-to-device uploads, the RoPE table's extent, one sequence's view of a
// batch store.
//
//   api.cu      errors, devices, single kernels (tests)
//   model.cu    rl_model: init, weights, RoPE, graph / fusion switches
//   store.cu    rl_store: init, reset, a sequence's view, counters, inspection
//   forward.cu  the forward pass, token choice, decode steps (one sequence and a batch)
#pragma once

#include "common.cuh"

#include <vector>

#define RL_LAUNCHED(what) RL_CK(cudaPeekAtLastError())

// Select `device` for the calling thread (RL_ERR_NO_DEVICE / RL_ERR_ARG when it does not exist).
int use_device(int device);

// ==============================================================================================
// Device buffers
// ==============================================================================================

template <typename T> inline int dev_alloc(T **p, int64_t count, const char *what) {
    *p = nullptr;
    if (count <= 0) count = 1;
    cudaError_t err = cudaMalloc((void **)p, (size_t)count * sizeof(T));
    if (err != cudaSuccess) {
        *p = nullptr;
        return rl_cuda_fail(err, what);
    }
    return RL_OK;
}

template <typename T> inline void dev_free(T *&p) {
    if (p) cudaFree((void *)p);
    p = nullptr;
}

// A scoped device buffer for the single-kernel entry points.
struct DBuf {
    void *p = nullptr;
    ~DBuf() { if (p) cudaFree(p); }
    template <typename T> int alloc(int64_t count, const T *host = nullptr) {
        RL_CK(cudaMalloc(&p, (size_t)(count > 0 ? count : 1) * sizeof(T)));
        if (host) RL_CK(cudaMemcpy(p, host, (size_t)count * sizeof(T), cudaMemcpyHostToDevice));
        return RL_OK;
    }
    template <typename T> T *as() const { return (T *)p; }
};

// ==============================================================================================
// Model
// ==============================================================================================

struct Matrix {
    uint8_t *d = nullptr;
    int qtype = -1;
    int64_t rows = 0, cols = 0, row_bytes = 0;
};

inline bool is_global_role(int role) {
    return role == RL_TOKEN_EMBD || role == RL_OUTPUT || role == RL_OUTPUT_NORM || role == RL_OUTPUT_NORM_B;
}

// Positions whose RoPE cos/sin the attention reads from a table (rl_model_ready builds it on the
// device); later positions (original positions of long streams) are computed the same way in place.
constexpr int ROPE_TABLE_POSITIONS = 32768;

struct rl_model {
    rl_model_params p{};
    cudaStream_t stream = nullptr;
    std::vector<Matrix> mats;      // (n_layer + 1) * RL_N_ROLES, global roles in slot n_layer
    std::vector<float *> vecs;     // same indexing
    std::vector<double> rope_base, rope_scale;
    double *d_inv_freq = nullptr;  // (n_layer, rotary_dim / 2)
    // RoPE cos/sin tables (ROPE_TABLE_POSITIONS, rotary_dim / 2) per layer, shared by layers of equal
    // base and scale (rope_tab[il] points into rope_tab_owned); NULL when rotary_dim is 0
    std::vector<float2 *> rope_tab, rope_tab_owned;
    // run buffers (B = n_batch rows): x, h, a, h2 (B, e); q, att (B, nq); k, v (B, nkv*hd);
    // ffa, ffb (B, n_ff); logits (B, n_vocab); ids (B,); pick params (4,); token (B,): a batch step's
    float *x = nullptr, *h = nullptr, *a = nullptr, *h2 = nullptr, *q = nullptr, *att = nullptr, *k = nullptr,
          *v = nullptr, *ffa = nullptr, *ffb = nullptr, *logits = nullptr, *pick_params = nullptr;
    int32_t *ids = nullptr, *token = nullptr;
    const float *last_logits = nullptr;   // row of `logits` holding the last token's, after a forward
    int use_graph = 0;
    int prefill_chunk = 1;   // chunk mode of the prefill on ring layers (layer(), prefill.cu)
    float *pf_part = nullptr;   // (pf_part_floats,) chunk mode's split-attention partial sums, or NULL
    int64_t pf_part_floats = 0;
    int fused = 1;   // grouped / epilogue-fused launches (rl_model_set_fused)
    int n_stores = 0;

    size_t idx(int role, int il) const { return (size_t)(is_global_role(role) ? p.n_layer : il) * RL_N_ROLES + role; }
    const Matrix &mat(int role, int il) const { return mats[idx(role, il)]; }
    const float *vec(int role, int il) const { return vecs[idx(role, il)]; }
};

// Host -> device copy on the model's stream, complete on return.
int upload(rl_model *m, void *dst, const void *src, size_t bytes);

// ==============================================================================================
// Store
// ==============================================================================================

struct rl_store {
    rl_model *m = nullptr;
    StorePolicy pol{};
    int k_type = RL_TYPE_F32, v_type = RL_TYPE_F32;
    int64_t k_row = 0, v_row = 0;   // bytes of one K / V row (kv_row_bytes)
    std::vector<LayerStore> layers;
    float *proj = nullptr;       // (n_layer, lsh_bits, hd) or null
    float *weights = nullptr;    // (batch x n_head, max P) softmax weights of the last attention step
    float *att_part = nullptr;   // split-K attention scratch: attend_scratch_floats(batch x n_head, hd, max P)
    int64_t *n_seen = nullptr;   // (batch,) device counters of tokens fed
    double *gv_w = nullptr;      // gvote's nucleus scratch, shared by the layers (LayerStore.gv_w, gv_i)
    int32_t *gv_i = nullptr;
    int64_t n_seen_host = 0;     // tokens fed (a one-sequence store or a view of one sequence)
    int batch = 1;               // sequences (common.cuh: B x n_kv heads per layer array)
    std::vector<int64_t> seen_host;   // (batch,) tokens fed per sequence of a batch store
    int max_p = 0;
    cudaGraphExec_t graph = nullptr;
    int graph_failed = 0;
};

// Sequence b of a batch store as a one-sequence store (shares its buffers; store.cu).
rl_store seq_view(const rl_store *s, int b);

// RL_ERR_ARG (naming fn and what) unless `type` is a KV store element type the device holds for
// head_dim hd (store.cu).
int check_kv_type(int type, const char *what, int hd, const char *fn);
