// The C API of include/ringllm_cuda.h: errors, devices, model and store handles, the forward
// pass (runtime/engine.py's _chunk/_layer/_ffn, in the same order), token choice, single kernels.
#include "common.cuh"

#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

#ifndef RL_ARCHS
#define RL_ARCHS "unknown architectures"
#endif

// ==============================================================================================
// Errors
// ==============================================================================================

static thread_local char g_err[1024] = "";

int rl_fail(int status, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g_err, sizeof g_err, fmt, ap);
    va_end(ap);
    return status;
}

static bool no_device_error(cudaError_t err) {
    return err == cudaErrorNoDevice || err == cudaErrorInsufficientDriver || err == cudaErrorInitializationError ||
           err == cudaErrorSystemDriverMismatch || err == cudaErrorCompatNotSupportedOnDevice ||
           err == cudaErrorStubLibrary || err == cudaErrorDevicesUnavailable || err == cudaErrorInvalidDevice;
}

int rl_cuda_fail(cudaError_t err, const char *what) {
    cudaGetLastError();   // clear a non-sticky error so the next call starts clean
    if (no_device_error(err))
        return rl_fail(RL_ERR_NO_DEVICE, "no CUDA device/driver found: %s failed: %s (%s)", what,
                       cudaGetErrorString(err), cudaGetErrorName(err));
    if (err == cudaErrorMemoryAllocation)
        return rl_fail(RL_ERR_OOM, "CUDA device out of memory: %s failed: %s (%s)", what, cudaGetErrorString(err),
                       cudaGetErrorName(err));
    return rl_fail(RL_ERR_CUDA, "CUDA error: %s failed: %s (%s)", what, cudaGetErrorString(err), cudaGetErrorName(err));
}

#define RL_LAUNCHED(what) RL_CK(cudaPeekAtLastError())

extern "C" const char *rl_last_error(void) { return g_err; }
extern "C" int rl_has_cuda(void) { return 1; }

extern "C" int rl_build_info(char *buf, int buf_len) {
    if (!buf || buf_len < 1) return rl_fail(RL_ERR_ARG, "rl_build_info: buf is NULL or buf_len < 1");
    snprintf(buf, buf_len, "CUDA runtime %d.%d (static), %s", CUDART_VERSION / 1000, (CUDART_VERSION % 1000) / 10,
             RL_ARCHS);
    return RL_OK;
}

extern "C" int rl_device_count(int *n) {
    if (!n) return rl_fail(RL_ERR_ARG, "rl_device_count: n is NULL");
    *n = 0;
    int c = 0;
    RL_CK(cudaGetDeviceCount(&c));
    if (c < 1) return rl_fail(RL_ERR_NO_DEVICE, "no CUDA device/driver found: cudaGetDeviceCount reported 0 devices");
    *n = c;
    return RL_OK;
}

static int use_device(int device) {
    int c = 0;
    RL_TRY(rl_device_count(&c));
    if (device < 0 || device >= c)
        return rl_fail(RL_ERR_ARG, "device %d out of range: %d CUDA device(s) present", device, c);
    RL_CK(cudaSetDevice(device));
    return RL_OK;
}

extern "C" int rl_device_info(int device, char *name, int name_len, int64_t *total_mem) {
    RL_TRY(use_device(device));
    cudaDeviceProp prop;
    RL_CK(cudaGetDeviceProperties(&prop, device));
    if (name && name_len > 0) snprintf(name, name_len, "%s (sm_%d%d)", prop.name, prop.major, prop.minor);
    if (total_mem) *total_mem = (int64_t)prop.totalGlobalMem;
    return RL_OK;
}

// ==============================================================================================
// Device buffers
// ==============================================================================================

template <typename T> static int dev_alloc(T **p, int64_t count, const char *what) {
    *p = nullptr;
    if (count <= 0) count = 1;
    cudaError_t err = cudaMalloc((void **)p, (size_t)count * sizeof(T));
    if (err != cudaSuccess) {
        *p = nullptr;
        return rl_cuda_fail(err, what);
    }
    return RL_OK;
}

template <typename T> static void dev_free(T *&p) {
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

static bool is_matrix_role(int role) {
    return role == RL_TOKEN_EMBD || role == RL_OUTPUT || role == RL_ATTN_Q || role == RL_ATTN_K || role == RL_ATTN_V ||
           role == RL_ATTN_OUT || role == RL_FFN_GATE || role == RL_FFN_UP || role == RL_FFN_DOWN;
}

static bool is_global_role(int role) {
    return role == RL_TOKEN_EMBD || role == RL_OUTPUT || role == RL_OUTPUT_NORM || role == RL_OUTPUT_NORM_B;
}

static const char *role_name(int role) {
    static const char *names[RL_N_ROLES] = {
        "token_embd.weight", "output.weight", "output_norm.weight", "output_norm.bias", "attn_norm.weight",
        "attn_norm.bias", "attn_q.weight", "attn_q.bias", "attn_k.weight", "attn_k.bias", "attn_v.weight",
        "attn_v.bias", "attn_output.weight", "attn_output.bias", "attn_q_norm.weight", "attn_k_norm.weight",
        "post_attention_norm.weight", "ffn_norm.weight", "ffn_norm.bias", "ffn_gate.weight", "ffn_gate.bias",
        "ffn_up.weight", "ffn_up.bias", "ffn_down.weight", "ffn_down.bias", "post_ffw_norm.weight"};
    return role >= 0 && role < RL_N_ROLES ? names[role] : "?";
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
    // ffa, ffb (B, n_ff); logits (B, n_vocab); ids (B,); pick params (4,); token (1,)
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

static int64_t role_len(const rl_model_params &p, int role, int64_t *cols) {
    const int64_t e = p.n_embd, nq = (int64_t)p.n_head * p.head_dim, nkv = (int64_t)p.n_head_kv * p.head_dim;
    *cols = e;
    switch (role) {
        case RL_TOKEN_EMBD: case RL_OUTPUT: return p.n_vocab;
        case RL_ATTN_Q: case RL_ATTN_Q_B: return nq;
        case RL_ATTN_K: case RL_ATTN_K_B: case RL_ATTN_V: case RL_ATTN_V_B: return nkv;
        case RL_ATTN_OUT: *cols = nq; return e;
        case RL_ATTN_Q_NORM: case RL_ATTN_K_NORM: return p.head_dim;
        case RL_FFN_GATE: case RL_FFN_GATE_B: case RL_FFN_UP: case RL_FFN_UP_B: return p.n_ff;
        case RL_FFN_DOWN: *cols = p.n_ff; return e;
        default: return e;   // norms, output and down biases
    }
}

extern "C" int rl_model_free(rl_model *m) {
    if (!m) return RL_OK;
    if (m->n_stores > 0)
        return rl_fail(RL_ERR_STATE, "rl_model_free: %d store(s) of this model are still alive; free them first",
                       m->n_stores);
    cudaSetDevice(m->p.device);
    for (auto &mt : m->mats) dev_free(mt.d);
    for (auto &vp : m->vecs) dev_free(vp);
    dev_free(m->d_inv_freq);
    for (float2 *t : m->rope_tab_owned) dev_free(t);
    float **bufs[] = {&m->x, &m->h, &m->a, &m->h2, &m->q, &m->att, &m->k, &m->v, &m->ffa, &m->ffb, &m->logits,
                      &m->pick_params};
    for (float **b : bufs) dev_free(*b);
    dev_free(m->ids);
    dev_free(m->token);
    dev_free(m->pf_part);
    if (m->stream) cudaStreamDestroy(m->stream);
    delete m;
    return RL_OK;
}

extern "C" int rl_model_init(rl_model **out, const rl_model_params *p) {
    if (!out || !p) return rl_fail(RL_ERR_ARG, "rl_model_init: NULL argument");
    *out = nullptr;
    if (p->n_vocab < 1 || p->n_embd < 1 || p->n_layer < 1 || p->n_head < 1 || p->n_head_kv < 1 || p->head_dim < 1 ||
        p->n_ff < 1 || p->n_batch < 1)
        return rl_fail(RL_ERR_ARG, "rl_model_init: every size must be >= 1");
    if (p->n_head % p->n_head_kv || p->n_head / p->n_head_kv > 64)
        return rl_fail(RL_ERR_ARG, "rl_model_init: n_head %d must be a multiple of n_head_kv %d, at most 64 times it",
                       p->n_head, p->n_head_kv);
    if (p->rotary_dim < 0 || p->rotary_dim % 2 || p->rotary_dim > p->head_dim)
        return rl_fail(RL_ERR_ARG, "rl_model_init: rotary_dim %d must be even and <= head_dim %d", p->rotary_dim,
                       p->head_dim);
    if (p->norm_kind != RL_NORM_RMS && p->norm_kind != RL_NORM_LAYER)
        return rl_fail(RL_ERR_ARG, "rl_model_init: unknown norm kind %d", p->norm_kind);
    if (p->act < RL_ACT_SILU || p->act > RL_ACT_GELU_TANH)
        return rl_fail(RL_ERR_ARG, "rl_model_init: unknown activation %d", p->act);
    if (p->prefill_mode < RL_PREFILL_DEFAULT || p->prefill_mode > RL_PREFILL_TOKEN)
        return rl_fail(RL_ERR_ARG, "rl_model_init: unknown prefill_mode %d (0 default, 1 chunk, 2 token)",
                       p->prefill_mode);
    RL_TRY(use_device(p->device));
    rl_model *m = new rl_model();
    m->p = *p;
    const size_t n_slots = (size_t)(p->n_layer + 1) * RL_N_ROLES;
    m->mats.resize(n_slots);
    m->vecs.assign(n_slots, nullptr);
    m->rope_base.assign(p->n_layer, 10000.0);
    m->rope_scale.assign(p->n_layer, 1.0);
    // the environment is read here, once: RINGLLM_CUDA_PREFILL=token turns the default to token by token
    const char *env_prefill = getenv("RINGLLM_CUDA_PREFILL");
    m->prefill_chunk = p->prefill_mode == RL_PREFILL_CHUNK ||
                       (p->prefill_mode == RL_PREFILL_DEFAULT && !(env_prefill && !strcmp(env_prefill, "token")));
    const int64_t B = p->n_batch, e = p->n_embd, nq = (int64_t)p->n_head * p->head_dim,
                  nkv = (int64_t)p->n_head_kv * p->head_dim;
    int st = RL_OK;
    cudaError_t err = cudaStreamCreateWithFlags(&m->stream, cudaStreamNonBlocking);
    if (err != cudaSuccess) st = rl_cuda_fail(err, "cudaStreamCreate");
    struct { float **b; int64_t n; } plan[] = {
        {&m->x, B * e}, {&m->h, B * e}, {&m->a, B * e}, {&m->h2, B * e}, {&m->q, B * nq}, {&m->att, B * nq},
        {&m->k, B * nkv}, {&m->v, B * nkv}, {&m->ffa, B * p->n_ff}, {&m->ffb, B * p->n_ff},
        {&m->logits, B * p->n_vocab}, {&m->pick_params, 4}};
    for (auto &b : plan)
        if (st == RL_OK) st = dev_alloc(b.b, b.n, "cudaMalloc (run buffers)");
    if (st == RL_OK) st = dev_alloc(&m->ids, B, "cudaMalloc (ids)");
    if (st == RL_OK) st = dev_alloc(&m->token, B, "cudaMalloc (tokens)");   // one per row of a batch step
    if (m->prefill_chunk && p->n_batch > 1)   // none when every chunk goes token by token
        m->pf_part_floats = prefill_scratch_floats(p->n_batch, p->n_head, p->head_dim);
    if (st == RL_OK && m->pf_part_floats)
        st = dev_alloc(&m->pf_part, m->pf_part_floats, "cudaMalloc (prefill scratch)");
    if (st == RL_OK) st = dev_alloc(&m->d_inv_freq, (int64_t)p->n_layer * (p->rotary_dim / 2 + 1), "cudaMalloc (rope)");
    if (st != RL_OK) {
        rl_model_free(m);
        return st;
    }
    *out = m;
    return RL_OK;
}

// Host -> device copy on the model's stream, complete on return. A plain cudaMemcpy from pageable
// memory runs on the legacy stream and may return before its DMA lands, and the model's stream is
// non-blocking (not ordered after the legacy stream): its kernels could read the old bytes.
static int upload(rl_model *m, void *dst, const void *src, size_t bytes) {
    RL_CK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyHostToDevice, m->stream));
    RL_CK(cudaStreamSynchronize(m->stream));
    return RL_OK;
}

extern "C" int rl_model_set_matrix(rl_model *m, int role, int il, int qtype, int64_t n_rows, int64_t n_cols,
                                   const uint8_t *data, int64_t row_bytes) {
    if (!m || !data) return rl_fail(RL_ERR_ARG, "rl_model_set_matrix: NULL argument");
    if (role < 0 || role >= RL_N_ROLES || !is_matrix_role(role))
        return rl_fail(RL_ERR_ARG, "rl_model_set_matrix: role %d is not a matrix role", role);
    if (!is_global_role(role) && (il < 0 || il >= m->p.n_layer))
        return rl_fail(RL_ERR_ARG, "rl_model_set_matrix: layer %d out of range 0..%d", il, m->p.n_layer - 1);
    int block, size;
    if (!rl_type_layout(qtype, &block, &size))
        return rl_fail(RL_ERR_ARG, "rl_model_set_matrix: %s: unsupported GGML type %d", role_name(role), qtype);
    int64_t want_cols;
    const int64_t want_rows = role_len(m->p, role, &want_cols);
    if (n_rows != want_rows || n_cols != want_cols)
        return rl_fail(RL_ERR_ARG, "rl_model_set_matrix: %s has shape (%lld, %lld), expected (%lld, %lld)",
                       role_name(role), (long long)n_rows, (long long)n_cols, (long long)want_rows,
                       (long long)want_cols);
    if (n_cols % block || row_bytes != n_cols / block * size)
        return rl_fail(RL_ERR_ARG, "rl_model_set_matrix: %s: %lld columns and %lld bytes per row do not fit type %d",
                       role_name(role), (long long)n_cols, (long long)row_bytes, qtype);
    RL_CK(cudaSetDevice(m->p.device));
    Matrix &mt = m->mats[m->idx(role, il)];
    dev_free(mt.d);
    RL_TRY(dev_alloc(&mt.d, n_rows * row_bytes, "cudaMalloc (weights)"));
    RL_TRY(upload(m, mt.d, data, (size_t)(n_rows * row_bytes)));
    mt.qtype = qtype;
    mt.rows = n_rows;
    mt.cols = n_cols;
    mt.row_bytes = row_bytes;
    return RL_OK;
}

extern "C" int rl_model_set_vector(rl_model *m, int role, int il, const float *data, int64_t n) {
    if (!m || !data) return rl_fail(RL_ERR_ARG, "rl_model_set_vector: NULL argument");
    if (role < 0 || role >= RL_N_ROLES || is_matrix_role(role))
        return rl_fail(RL_ERR_ARG, "rl_model_set_vector: role %d is not a vector role", role);
    if (!is_global_role(role) && (il < 0 || il >= m->p.n_layer))
        return rl_fail(RL_ERR_ARG, "rl_model_set_vector: layer %d out of range 0..%d", il, m->p.n_layer - 1);
    int64_t cols;
    const int64_t want = role_len(m->p, role, &cols);
    if (n != want)
        return rl_fail(RL_ERR_ARG, "rl_model_set_vector: %s has %lld values, expected %lld", role_name(role),
                       (long long)n, (long long)want);
    RL_CK(cudaSetDevice(m->p.device));
    float *&d = m->vecs[m->idx(role, il)];
    dev_free(d);
    RL_TRY(dev_alloc(&d, n, "cudaMalloc (vector)"));
    RL_TRY(upload(m, d, data, (size_t)n * sizeof(float)));
    return RL_OK;
}

extern "C" int rl_model_set_rope(rl_model *m, int il, double base, double scale) {
    if (!m) return rl_fail(RL_ERR_ARG, "rl_model_set_rope: NULL model");
    if (il < 0 || il >= m->p.n_layer) return rl_fail(RL_ERR_ARG, "rl_model_set_rope: layer %d out of range", il);
    if (!(base > 0) || !(scale > 0)) return rl_fail(RL_ERR_ARG, "rl_model_set_rope: base and scale must be > 0");
    m->rope_base[il] = base;
    m->rope_scale[il] = scale;
    return RL_OK;
}

extern "C" int rl_model_ready(rl_model *m) {
    if (!m) return rl_fail(RL_ERR_ARG, "rl_model_ready: NULL model");
    const rl_model_params &p = m->p;
    auto need_m = [&](int role, int il) { return m->mat(role, il).d != nullptr; };
    auto need_v = [&](int role, int il) { return m->vec(role, il) != nullptr; };
    auto missing = [&](int role, int il) {
        if (is_global_role(role)) return rl_fail(RL_ERR_STATE, "tensor %s was never set", role_name(role));
        return rl_fail(RL_ERR_STATE, "tensor blk.%d.%s was never set", il, role_name(role));
    };
    if (!need_m(RL_TOKEN_EMBD, 0)) return missing(RL_TOKEN_EMBD, 0);
    if (!p.tied_output && !need_m(RL_OUTPUT, 0)) return missing(RL_OUTPUT, 0);
    if (!need_v(RL_OUTPUT_NORM, 0)) return missing(RL_OUTPUT_NORM, 0);
    if (p.norm_kind == RL_NORM_LAYER && !need_v(RL_OUTPUT_NORM_B, 0)) return missing(RL_OUTPUT_NORM_B, 0);
    for (int il = 0; il < p.n_layer; il++) {
        const int mroles[] = {RL_ATTN_Q, RL_ATTN_K, RL_ATTN_V, RL_ATTN_OUT, RL_FFN_UP, RL_FFN_DOWN};
        for (int r : mroles)
            if (!need_m(r, il)) return missing(r, il);
        if (p.gated_ffn && !need_m(RL_FFN_GATE, il)) return missing(RL_FFN_GATE, il);
        if (!need_v(RL_ATTN_NORM, il)) return missing(RL_ATTN_NORM, il);
        if (!need_v(RL_FFN_NORM, il)) return missing(RL_FFN_NORM, il);
        if (p.norm_kind == RL_NORM_LAYER) {
            if (!need_v(RL_ATTN_NORM_B, il)) return missing(RL_ATTN_NORM_B, il);
            if (!need_v(RL_FFN_NORM_B, il)) return missing(RL_FFN_NORM_B, il);
        }
        if (p.qk_norm && !need_v(RL_ATTN_Q_NORM, il)) return missing(RL_ATTN_Q_NORM, il);
        if (p.qk_norm && !need_v(RL_ATTN_K_NORM, il)) return missing(RL_ATTN_K_NORM, il);
        if (p.sandwich_norm && !need_v(RL_POST_ATTN_NORM, il)) return missing(RL_POST_ATTN_NORM, il);
        if (p.sandwich_norm && !need_v(RL_POST_FFW_NORM, il)) return missing(RL_POST_FFW_NORM, il);
    }
    // inverse frequencies base^(-2i/rotary_dim), float64, per layer
    const int half = p.rotary_dim / 2;
    std::vector<double> inv((size_t)p.n_layer * (half + 1), 0.0);
    for (int il = 0; il < p.n_layer; il++)
        for (int i = 0; i < half; i++) inv[(size_t)il * (half + 1) + i] = pow(m->rope_base[il], -(i * 2.0) / p.rotary_dim);
    RL_CK(cudaSetDevice(p.device));
    RL_TRY(upload(m, m->d_inv_freq, inv.data(), inv.size() * sizeof(double)));
    // cos/sin tables of positions [0, ROPE_TABLE_POSITIONS), one per distinct (base, scale)
    for (float2 *t : m->rope_tab_owned) dev_free(t);
    m->rope_tab_owned.clear();
    m->rope_tab.assign(p.n_layer, nullptr);
    for (int il = 0; il < p.n_layer && half > 0; il++) {
        for (int jl = 0; jl < il && !m->rope_tab[il]; jl++)
            if (m->rope_base[jl] == m->rope_base[il] && m->rope_scale[jl] == m->rope_scale[il])
                m->rope_tab[il] = m->rope_tab[jl];
        if (m->rope_tab[il]) continue;
        float2 *t = nullptr;
        RL_TRY(dev_alloc(&t, (int64_t)ROPE_TABLE_POSITIONS * half, "cudaMalloc (rope table)"));
        m->rope_tab_owned.push_back(t);
        m->rope_tab[il] = t;
        launch_rope_table(t, m->d_inv_freq + (size_t)il * (half + 1), m->rope_scale[il], ROPE_TABLE_POSITIONS, half,
                          m->stream);
        RL_LAUNCHED("rope table");
    }
    RL_CK(cudaStreamSynchronize(m->stream));
    return RL_OK;
}

extern "C" int rl_model_weight_bytes(rl_model *m, int64_t *out) {
    if (!m || !out) return rl_fail(RL_ERR_ARG, "rl_model_weight_bytes: NULL argument");
    int64_t t = 0;
    for (auto &mt : m->mats) t += mt.d ? mt.rows * mt.row_bytes : 0;
    for (size_t i = 0; i < m->vecs.size(); i++) {
        if (!m->vecs[i]) continue;
        int64_t cols;
        t += role_len(m->p, (int)(i % RL_N_ROLES), &cols) * 4;
    }
    *out = t;
    return RL_OK;
}

extern "C" int rl_model_set_graph(rl_model *m, int enable) {
    if (!m) return rl_fail(RL_ERR_ARG, "rl_model_set_graph: NULL model");
    m->use_graph = enable ? 1 : 0;
    return RL_OK;
}

extern "C" int rl_model_set_fused(rl_model *m, int enable) {
    if (!m) return rl_fail(RL_ERR_ARG, "rl_model_set_fused: NULL model");
    if (m->n_stores > 0)   // their captured decode graphs hold the launches of the other path
        return rl_fail(RL_ERR_STATE, "rl_model_set_fused: %d store(s) of this model exist; set it before making stores",
                       m->n_stores);
    m->fused = enable ? 1 : 0;
    return RL_OK;
}

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
    int64_t n_seen_host = 0;     // tokens fed (a one-sequence store or a view of one sequence)
    int batch = 1;               // sequences (common.cuh: B x n_kv heads per layer array)
    std::vector<int64_t> seen_host;   // (batch,) tokens fed per sequence of a batch store
    int max_p = 0;
    cudaGraphExec_t graph = nullptr;
    int graph_failed = 0;
};

static void store_release(rl_store *s) {
    for (auto &L : s->layers) {
        dev_free(L.k); dev_free(L.v); dev_free(L.seq); dev_free(L.rank); dev_free(L.score); dev_free(L.aux);
        dev_free(L.count); dev_free(L.evicted); dev_free(L.victims); dev_free(L.taken); dev_free(L.scratch);
    }
    dev_free(s->proj);
    dev_free(s->weights);
    dev_free(s->att_part);
    dev_free(s->n_seen);
    if (s->graph) cudaGraphExecDestroy(s->graph);
    s->graph = nullptr;
}

// RL_ERR_ARG unless `type` is a KV store element type the device holds (kv_rows.cuh) for head_dim hd.
static int check_kv_type(int type, const char *what, int hd, const char *fn) {
    if (type != RL_TYPE_F32 && type != RL_TYPE_F16 && type != RL_TYPE_Q8_0)
        return rl_fail(RL_ERR_ARG, "%s: %s %d is not a KV store type of the device; supported: f32 (%d), f16 (%d), "
                       "q8_0 (%d)", fn, what, type, RL_TYPE_F32, RL_TYPE_F16, RL_TYPE_Q8_0);
    if (kv_row_bytes(type, hd) == 0)
        return rl_fail(RL_ERR_ARG, "%s: %s q8_0 quantizes blocks of %d values along head_dim; head_dim is %d", fn,
                       what, KV_QBLOCK, hd);
    return RL_OK;
}

// Empty `heads` kv heads of every layer of s (all of a store, or one sequence's through seq_view) and
// n_counters device counters of tokens fed.
static int clear_heads(rl_store *s, int64_t heads, int n_counters) {
    RL_CK(cudaSetDevice(s->m->p.device));
    for (auto &L : s->layers) {
        const size_t slots = (size_t)heads * L.P;
        RL_CK(cudaMemsetAsync(L.seq, 0xFF, slots * sizeof(int32_t), s->m->stream));   // -1: empty
        RL_CK(cudaMemsetAsync(L.rank, 0, slots * sizeof(int32_t), s->m->stream));
        RL_CK(cudaMemsetAsync(L.score, 0, slots * sizeof(double), s->m->stream));
        RL_CK(cudaMemsetAsync(L.aux, 0, slots * sizeof(uint64_t), s->m->stream));
        RL_CK(cudaMemsetAsync(L.taken, 0, slots, s->m->stream));   // compact_ordered reads every flag below count
        RL_CK(cudaMemsetAsync(L.k, 0, slots * s->k_row, s->m->stream));
        RL_CK(cudaMemsetAsync(L.v, 0, slots * s->v_row, s->m->stream));
        RL_CK(cudaMemsetAsync(L.count, 0, heads * sizeof(int32_t), s->m->stream));
        RL_CK(cudaMemsetAsync(L.evicted, 0, heads * sizeof(int64_t), s->m->stream));
    }
    RL_CK(cudaMemsetAsync(s->n_seen, 0, n_counters * sizeof(int64_t), s->m->stream));
    RL_CK(cudaStreamSynchronize(s->m->stream));
    return RL_OK;
}

extern "C" int rl_store_reset(rl_store *s) {
    if (!s) return rl_fail(RL_ERR_ARG, "rl_store_reset: NULL store");
    RL_TRY(clear_heads(s, (int64_t)s->m->p.n_head_kv * s->batch, s->batch));
    s->n_seen_host = 0;
    s->seen_host.assign(s->batch, 0);
    return RL_OK;
}

// Sequence b of a batch store as a one-sequence store: every per-head pointer moved to its heads, its
// counter. Shares the store's buffers (never freed through the view) and captures no graph.
static rl_store seq_view(const rl_store *s, int b) {
    rl_store v = *s;
    const int64_t nkv = s->m->p.n_head_kv, h0 = nkv * b;
    for (LayerStore &L : v.layers) {
        const int64_t slots = h0 * L.P;
        L.k += slots * s->k_row;
        L.v += slots * s->v_row;
        L.seq += slots;
        L.rank += slots;
        L.score += slots;
        L.aux += slots;
        L.victims += slots;
        L.taken += slots;
        L.count += h0;
        L.evicted += h0;
        if (L.scratch) L.scratch += h0 * shift_scratch_bytes(L.P);
    }
    v.n_seen = s->n_seen + b;
    v.n_seen_host = s->seen_host[b];
    v.batch = 1;
    v.seen_host.clear();
    v.graph = nullptr;
    v.graph_failed = 1;
    return v;
}

extern "C" int rl_store_reset_seq(rl_store *s, int b) {
    if (!s) return rl_fail(RL_ERR_ARG, "rl_store_reset_seq: NULL store");
    if (s->batch < 2) return rl_fail(RL_ERR_STATE, "rl_store_reset_seq: not a batch store (use rl_store_reset)");
    if (b < 0 || b >= s->batch) return rl_fail(RL_ERR_ARG, "rl_store_reset_seq: sequence %d outside [0, %d)", b, s->batch);
    rl_store v = seq_view(s, b);
    RL_TRY(clear_heads(&v, s->m->p.n_head_kv, 1));
    s->seen_host[b] = 0;
    return RL_OK;
}

extern "C" int rl_store_init(rl_store **out, rl_model *m, const rl_store_params *sp) {
    if (!out || !m || !sp) return rl_fail(RL_ERR_ARG, "rl_store_init: NULL argument");
    *out = nullptr;
    const rl_model_params &p = m->p;
    if (!sp->layer_capacity || !sp->layer_physical || !sp->layer_sinks || !sp->layer_ring)
        return rl_fail(RL_ERR_ARG, "rl_store_init: per-layer arrays must not be NULL");
    if (sp->policy < RL_POLICY_FULL || sp->policy > RL_POLICY_RANDOM)
        return rl_fail(RL_ERR_ARG, "rl_store_init: unknown policy %d", sp->policy);
    if (sp->policy == RL_POLICY_SCISSORHANDS && (sp->history < 1 || sp->history > 64))
        return rl_fail(RL_ERR_ARG, "rl_store_init: scissorhands needs history in 1..64, got %d", sp->history);
    if (sp->recent < 0 || sp->lazy < 0 || sp->slack < 0 || sp->max_drop < 0)
        return rl_fail(RL_ERR_ARG, "rl_store_init: recent, lazy, slack, max_drop must be >= 0");
    if (sp->batch < 0 || sp->batch > p.n_batch || sp->batch > 1024)
        return rl_fail(RL_ERR_ARG, "rl_store_init: batch %d must be in 0..min(n_batch %d, 1024)", sp->batch, p.n_batch);
    if (sp->policy == RL_POLICY_LSH && (!sp->lsh_proj || sp->lsh_bits < 1 || sp->lsh_bits > 64))
        return rl_fail(RL_ERR_ARG, "rl_store_init: lsh needs lsh_proj and lsh_bits in 1..64");
    RL_TRY(check_kv_type(sp->k_type, "k_type", p.head_dim, "rl_store_init"));
    RL_TRY(check_kv_type(sp->v_type, "v_type", p.head_dim, "rl_store_init"));
    for (int il = 0; il < p.n_layer; il++) {
        const int C = sp->layer_capacity[il], P = sp->layer_physical[il], S = sp->layer_sinks[il];
        if (C < 1 || P < C || S < 0 || S >= C || (sp->layer_ring[il] && P != C))
            return rl_fail(RL_ERR_ARG, "rl_store_init: layer %d: capacity %d, physical %d, sinks %d are inconsistent",
                           il, C, P, S);
        if (!sp->layer_ring[il] && sp->policy == RL_POLICY_FULL)
            return rl_fail(RL_ERR_ARG, "rl_store_init: policy full needs ring layers");
    }
    RL_CK(cudaSetDevice(p.device));
    rl_store *s = new rl_store();
    s->m = m;
    s->pol = StorePolicy{sp->policy, sp->reindexed ? 1 : 0, sp->recent, sp->lazy, sp->slack, sp->max_drop,
                         sp->lsh_bits, sp->history, sp->seed, sp->shift ? 1 : 0};
    s->k_type = sp->k_type;
    s->v_type = sp->v_type;
    s->k_row = kv_row_bytes(sp->k_type, p.head_dim);
    s->v_row = kv_row_bytes(sp->v_type, p.head_dim);
    s->layers.resize(p.n_layer);
    s->batch = sp->batch > 1 ? sp->batch : 1;
    int st = RL_OK;
    const int64_t nkv = (int64_t)p.n_head_kv * s->batch, hd = p.head_dim;   // kv heads of all sequences
    for (int il = 0; il < p.n_layer && st == RL_OK; il++) {
        LayerStore &L = s->layers[il];
        L = LayerStore{};
        L.C = sp->layer_capacity[il];
        L.P = sp->layer_physical[il];
        L.sinks = sp->layer_sinks[il];
        L.ring = sp->layer_ring[il] ? 1 : 0;
        L.il = il;
        L.k_type = s->k_type;
        L.v_type = s->v_type;
        s->max_p = L.P > s->max_p ? L.P : s->max_p;
        const int64_t slots = nkv * L.P;
        const char *what = "cudaMalloc (KV store)";
        if (st == RL_OK) st = dev_alloc(&L.k, slots * s->k_row, what);
        if (st == RL_OK) st = dev_alloc(&L.v, slots * s->v_row, what);
        if (st == RL_OK) st = dev_alloc(&L.seq, slots, what);
        if (st == RL_OK) st = dev_alloc(&L.rank, slots, what);
        if (st == RL_OK) st = dev_alloc(&L.score, slots, what);
        if (st == RL_OK) st = dev_alloc(&L.aux, slots, what);
        if (st == RL_OK) st = dev_alloc(&L.count, nkv, what);
        if (st == RL_OK) st = dev_alloc(&L.evicted, nkv, what);
        if (st == RL_OK) st = dev_alloc(&L.victims, slots, what);
        if (st == RL_OK) st = dev_alloc(&L.taken, slots, what);
        if (st == RL_OK && s->pol.shift)   // compact_ordered's destinations (kv_write.cu)
            st = dev_alloc(&L.scratch, nkv * shift_scratch_bytes(L.P), "cudaMalloc (shift scratch)");
    }
    const int nh = p.n_head * s->batch;
    if (st == RL_OK) st = dev_alloc(&s->weights, (int64_t)nh * s->max_p, "cudaMalloc (attention weights)");
    if (st == RL_OK)
        st = dev_alloc(&s->att_part, attend_scratch_floats(nh, p.head_dim, s->max_p), "cudaMalloc (attention scratch)");
    if (st == RL_OK) st = dev_alloc(&s->n_seen, s->batch, "cudaMalloc (counter)");
    if (st == RL_OK && sp->policy == RL_POLICY_LSH) {
        const int64_t n = (int64_t)p.n_layer * sp->lsh_bits * hd;
        st = dev_alloc(&s->proj, n, "cudaMalloc (lsh projections)");
        if (st == RL_OK) {
            st = upload(m, s->proj, sp->lsh_proj, (size_t)n * sizeof(float));
        }
    }
    if (st == RL_OK) st = rl_store_reset(s);
    if (st != RL_OK) {
        store_release(s);
        delete s;
        return st;
    }
    m->n_stores += 1;
    *out = s;
    return RL_OK;
}

extern "C" int rl_store_free(rl_store *s) {
    if (!s) return RL_OK;
    cudaSetDevice(s->m->p.device);
    store_release(s);
    s->m->n_stores -= 1;
    delete s;
    return RL_OK;
}

extern "C" int rl_store_counts(rl_store *s, int64_t *held, int64_t *evicted, int64_t *n_seen) {
    if (!s) return rl_fail(RL_ERR_ARG, "rl_store_counts: NULL store");
    const rl_model_params &p = s->m->p;
    RL_CK(cudaSetDevice(p.device));
    RL_CK(cudaStreamSynchronize(s->m->stream));
    const int heads = p.n_head_kv * s->batch;
    std::vector<int32_t> c(heads);
    for (int il = 0; il < p.n_layer; il++) {
        const LayerStore &L = s->layers[il];
        if (held) {
            RL_CK(cudaMemcpy(c.data(), L.count, c.size() * sizeof(int32_t), cudaMemcpyDeviceToHost));
            for (int h = 0; h < heads; h++) held[(size_t)il * heads + h] = c[h];
        }
        if (evicted)
            RL_CK(cudaMemcpy(evicted + (size_t)il * heads, L.evicted, heads * sizeof(int64_t), cudaMemcpyDeviceToHost));
    }
    if (n_seen) RL_CK(cudaMemcpy(n_seen, s->n_seen, s->batch * sizeof(int64_t), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_store_read_layer(rl_store *s, int il, void *k, void *v, int32_t *seq, int32_t *pos, double *score) {
    if (!s) return rl_fail(RL_ERR_ARG, "rl_store_read_layer: NULL store");
    const rl_model_params &p = s->m->p;
    if (il < 0 || il >= p.n_layer) return rl_fail(RL_ERR_ARG, "rl_store_read_layer: layer %d out of range", il);
    RL_CK(cudaSetDevice(p.device));
    RL_CK(cudaStreamSynchronize(s->m->stream));
    const LayerStore &L = s->layers[il];
    const size_t slots = (size_t)p.n_head_kv * s->batch * L.P;
    if (k) RL_CK(cudaMemcpy(k, L.k, slots * s->k_row, cudaMemcpyDeviceToHost));
    if (v) RL_CK(cudaMemcpy(v, L.v, slots * s->v_row, cudaMemcpyDeviceToHost));
    if (seq) RL_CK(cudaMemcpy(seq, L.seq, slots * sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (pos) RL_CK(cudaMemcpy(pos, s->pol.reindexed ? L.rank : L.seq, slots * sizeof(int32_t), cudaMemcpyDeviceToHost));
    if (score) RL_CK(cudaMemcpy(score, L.score, slots * sizeof(double), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_store_bytes(rl_store *s, int64_t *out) {
    if (!s || !out) return rl_fail(RL_ERR_ARG, "rl_store_bytes: NULL argument");
    const rl_model_params &p = s->m->p;
    int64_t t = 0;
    for (const LayerStore &L : s->layers) {
        const int64_t heads = (int64_t)p.n_head_kv * s->batch, slots = heads * L.P;
        t += slots * (s->k_row + s->v_row + 4 + 4 + 8 + 8 + 4 + 1) + heads * (4 + 8);
        if (L.scratch) t += heads * shift_scratch_bytes(L.P);
    }
    *out = t;
    return RL_OK;
}

// ==============================================================================================
// The forward pass (runtime/engine.py _chunk / _layer / _ffn)
// ==============================================================================================

// Matrix `role` of layer il and its bias (the bias role follows its matrix role) writing out.
static MatmulPart part_of(rl_model *m, float *out, int role, int il) {
    const Matrix &w = m->mat(role, il);
    return MatmulPart{out, w.d, m->vec(role + 1, il), w.row_bytes, (int)w.rows, w.qtype};
}

// out (T, rows) = x (T, cols) @ W.T + b. add (fused path only): out += that instead, the residual
// add in the matmul's epilogue. Fused, a bias is added in the epilogue too (no launch of its own).
static void linear(rl_model *m, float *out, int role, int il, const float *x, int T, bool add = false) {
    const Matrix &w = m->mat(role, il);
    const float *b = m->vec(role + 1, il);
    if (m->fused && (b || add)) {
        const MatmulPart part = part_of(m, out, role, il);
        launch_matmul_group(&part, 1, add ? MM_EPI_ADD : MM_EPI_STORE, 0, x, w.cols, T, m->stream);
        return;
    }
    launch_matmul(out, w.d, x, w.qtype, w.rows, w.cols, w.row_bytes, T, m->stream);
    if (b) launch_add_bias(out, b, T, (int)w.rows, m->stream);
}

static void norm(rl_model *m, float *out, const float *x, int role, int il, int T) {
    const rl_model_params &p = m->p;
    launch_norm(out, x, m->vec(role, il), p.norm_kind == RL_NORM_LAYER ? m->vec(role + 1, il) : nullptr,
                p.norm_kind, T, p.n_embd, p.norm_eps, m->stream);
}

// h2 = ffn(h); add (fused path only): x += ffn(h) instead, the residual add in the down projection.
static void ffn(rl_model *m, int il, int T, bool add = false) {
    const rl_model_params &p = m->p;
    if (m->fused) {   // up (and gate) in one launch, biases and the activation in its epilogue
        MatmulPart parts[2];
        int n = 0;
        if (p.gated_ffn) parts[n++] = part_of(m, m->ffa, RL_FFN_GATE, il);   // ffa = act(gate) * up
        parts[n++] = part_of(m, m->ffb, RL_FFN_UP, il);                      // else ffb = act(up)
        launch_matmul_group(parts, n, MM_EPI_ACT, p.act, m->h, p.n_embd, T, m->stream);
        linear(m, add ? m->x : m->h2, RL_FFN_DOWN, il, parts[0].out, T, add);
        return;
    }
    linear(m, m->ffb, RL_FFN_UP, il, m->h, T);
    if (p.gated_ffn) {
        linear(m, m->ffa, RL_FFN_GATE, il, m->h, T);
        launch_act(m->ffa, m->ffa, m->ffb, p.act, 1, T, p.n_ff, m->stream);
        linear(m, m->h2, RL_FFN_DOWN, il, m->ffa, T);
    } else {
        launch_act(m->ffb, nullptr, m->ffb, p.act, 0, T, p.n_ff, m->stream);
        linear(m, m->h2, RL_FFN_DOWN, il, m->ffb, T);
    }
}

// n_before: tokens fed through the store before this chunk (the host's count: chunk mode's condition)
// Layer il over the T rows of m->x: T tokens of one sequence (nseq = 1), or one token of each of the
// nseq = T sequences of a batch store (every row writes and attends its own sequence's heads).
static void layer(rl_model *m, rl_store *s, int il, int T, int64_t n_before, int nseq) {
    const rl_model_params &p = m->p;
    const int nh = p.n_head, nkv = p.n_head_kv, hd = p.head_dim;
    const int64_t e = p.n_embd, nq = (int64_t)nh * hd, nk = (int64_t)nkv * hd;
    cudaStream_t st = m->stream;
    norm(m, m->h, m->x, RL_ATTN_NORM, il, T);
    if (m->fused) {   // q, k, v in one launch (they share h), biases in its epilogue
        const MatmulPart qkv[3] = {part_of(m, m->q, RL_ATTN_Q, il), part_of(m, m->k, RL_ATTN_K, il),
                                   part_of(m, m->v, RL_ATTN_V, il)};
        launch_matmul_group(qkv, 3, MM_EPI_STORE, 0, m->h, e, T, st);
    } else {
        linear(m, m->q, RL_ATTN_Q, il, m->h, T);
        linear(m, m->k, RL_ATTN_K, il, m->h, T);
        linear(m, m->v, RL_ATTN_V, il, m->h, T);
    }
    if (p.qk_norm) {
        launch_norm(m->q, m->q, m->vec(RL_ATTN_Q_NORM, il), nullptr, RL_NORM_RMS, T * nh, hd, p.norm_eps, st);
        launch_norm(m->k, m->k, m->vec(RL_ATTN_K_NORM, il), nullptr, RL_NORM_RMS, T * nkv, hd, p.norm_eps, st);
    }
    LayerStore &L = s->layers[il];
    const float *proj = s->proj ? s->proj + (int64_t)il * s->pol.lsh_bits * hd : nullptr;
    const bool policy_layer = !L.ring;
    const double *inv_freq = m->d_inv_freq + (int64_t)il * (p.rotary_dim / 2 + 1);
    const int32_t *pos = s->pol.reindexed ? L.rank : L.seq;
    // Chunk mode (prefill.cu): on a ring layer where no token of the chunk evicts (n_before + T <= C:
    // it never evicted, token s sits in slot s at position s), the chunk is written in one launch and
    // attended causally in one more. Policy layers, a chunk that crosses C, decode steps (T = 1,
    // captured once in a CUDA graph) and positions past the RoPE table (over 32k) go token by token.
    const bool chunk_mode = nseq == 1 && m->prefill_chunk && T > 1 && L.ring && n_before + T <= L.C &&
                            n_before + T <= ROPE_TABLE_POSITIONS && prefill_fits(hd);
    const int qpos_mode = s->pol.reindexed ? RL_QPOS_COUNT : RL_QPOS_SEQ;
    if (nseq > 1) {   // a batch step: the same three launches over nseq x the heads (common.cuh)
        launch_kv_write(L, s->pol, m->k, m->v, m->q, proj, s->n_seen, 0, nkv * nseq, nh * nseq, hd, nkv, st);
        launch_attend(m->att, s->weights, s->att_part, m->q, L.k, L.v, L.k_type, L.v_type, pos, L.count, s->n_seen, 0,
                      qpos_mode, nh * nseq, nkv * nseq, L.P, hd, p.rotary_dim, m->rope_scale[il], inv_freq,
                      m->rope_tab[il], ROPE_TABLE_POSITIONS, p.attn_scale, nkv, RL_ATTEND_AUTO, st);
        if (policy_layer) launch_observe(L, s->pol, s->weights, nh * nseq, nkv * nseq, nseq, st);
    }
    if (chunk_mode) {
        launch_kv_append(L, m->k, m->v, (int)n_before, T, nkv, hd, st);
        launch_prefill_attend(m->att, m->pf_part, m->pf_part_floats, m->q, L.k, L.v, L.k_type, L.v_type,
                              (int)n_before, T, nh, nkv, L.P, hd, p.rotary_dim, m->rope_tab[il], p.attn_scale, st);
    }
    for (int t = 0; nseq == 1 && !chunk_mode && t < T; t++) {   // decode semantics: write (evicting first), attend, observe
        launch_kv_write(L, s->pol, m->k + t * nk, m->v + t * nk, m->q + t * nq, proj, s->n_seen, t, nkv, nh, hd, nkv, st);
        launch_attend(m->att + t * nq, s->weights, s->att_part, m->q + t * nq, L.k, L.v, L.k_type, L.v_type, pos,
                      L.count, s->n_seen, t, qpos_mode, nh, nkv, L.P, hd, p.rotary_dim, m->rope_scale[il], inv_freq,
                      m->rope_tab[il], ROPE_TABLE_POSITIONS, p.attn_scale, nkv, RL_ATTEND_AUTO, st);
        if (policy_layer) launch_observe(L, s->pol, s->weights, nh, nkv, 1, st);
    }
    if (m->fused && !p.sandwich_norm && !p.parallel_residual) {
        // x += out(att); x += ffn(ffn_norm(x)): both residual adds in the projections' epilogues
        linear(m, m->x, RL_ATTN_OUT, il, m->att, T, true);
        norm(m, m->h, m->x, RL_FFN_NORM, il, T);
        ffn(m, il, T, true);
        return;
    }
    linear(m, m->a, RL_ATTN_OUT, il, m->att, T);
    if (p.sandwich_norm)
        launch_norm(m->a, m->a, m->vec(RL_POST_ATTN_NORM, il), nullptr, RL_NORM_RMS, T, (int)e, p.norm_eps, st);
    if (p.parallel_residual) {
        norm(m, m->h, m->x, RL_FFN_NORM, il, T);
        ffn(m, il, T);
        launch_add(m->x, m->a, T * e, st);
        launch_add(m->x, m->h2, T * e, st);
        return;
    }
    launch_add(m->x, m->a, T * e, st);
    norm(m, m->h, m->x, RL_FFN_NORM, il, T);
    ffn(m, il, T);
    if (p.sandwich_norm)
        launch_norm(m->h2, m->h2, m->vec(RL_POST_FFW_NORM, il), nullptr, RL_NORM_RMS, T, (int)e, p.norm_eps, st);
    launch_add(m->x, m->h2, T * e, st);
}

// One chunk of T <= n_batch ids already in m->ids: T tokens of one sequence (nseq = 1) or one token
// of each of a batch store's nseq = T sequences. want: 0 no logits, 1 last row only (into logits row
// 0), 2 every row; n_before: tokens fed through the store before it (one sequence). Launches only (no
// host synchronization): capturable in a graph.
static void chunk(rl_model *m, rl_store *s, int T, int want, int64_t n_before, int nseq = 1) {
    const rl_model_params &p = m->p;
    const Matrix &embd = m->mat(RL_TOKEN_EMBD, 0);
    launch_embed(m->x, embd.d, m->ids, embd.qtype, embd.cols, embd.row_bytes, T, p.embed_scale, m->stream);
    for (int il = 0; il < p.n_layer; il++) layer(m, s, il, T, n_before, nseq);
    launch_advance(s->n_seen, nseq > 1 ? 1 : T, nseq, m->stream);
    if (!want) return;
    const int rows = want == 2 ? T : 1;
    const float *x = want == 2 ? m->x : m->x + (int64_t)(T - 1) * p.n_embd;
    norm(m, m->h, x, RL_OUTPUT_NORM, 0, rows);
    const Matrix &ow = p.tied_output ? embd : m->mat(RL_OUTPUT, 0);
    launch_matmul(m->logits, ow.d, m->h, ow.qtype, ow.rows, ow.cols, ow.row_bytes, rows, m->stream);
    if (p.final_logit_softcap != 0.0f)
        launch_softcap(m->logits, p.final_logit_softcap, (int64_t)rows * p.n_vocab, m->stream);
    m->last_logits = m->logits + (int64_t)(rows - 1) * p.n_vocab;
}

static int check_pair(rl_model *m, rl_store *s, const char *fn) {
    if (!m || !s) return rl_fail(RL_ERR_ARG, "%s: NULL model or store", fn);
    if (s->m != m) return rl_fail(RL_ERR_STATE, "%s: the store belongs to another model", fn);
    return RL_OK;
}

static int check_ids(rl_model *m, const int32_t *ids, int n, const char *fn) {
    if (!ids || n < 1) return rl_fail(RL_ERR_ARG, "%s: no tokens to feed", fn);
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= m->p.n_vocab)
            return rl_fail(RL_ERR_ARG, "%s: token id %d at index %d is outside [0, %d)", fn, ids[i], i, m->p.n_vocab);
    return RL_OK;
}

static int forward_store(rl_model *m, rl_store *s, const int32_t *ids, int n, float *logits, int all_logits);

extern "C" int rl_forward(rl_model *m, rl_store *s, const int32_t *ids, int n, float *logits, int all_logits) {
    RL_TRY(check_pair(m, s, "rl_forward"));
    if (s->batch > 1)
        return rl_fail(RL_ERR_STATE, "rl_forward: the store holds a batch of %d sequences; feed one with "
                       "rl_forward_seq", s->batch);
    RL_TRY(check_ids(m, ids, n, "rl_forward"));
    return forward_store(m, s, ids, n, logits, all_logits);
}

extern "C" int rl_forward_seq(rl_model *m, rl_store *s, int b, const int32_t *ids, int n, float *logits,
                              int all_logits) {
    RL_TRY(check_pair(m, s, "rl_forward_seq"));
    if (s->batch < 2) return rl_fail(RL_ERR_STATE, "rl_forward_seq: not a batch store (use rl_forward)");
    if (b < 0 || b >= s->batch) return rl_fail(RL_ERR_ARG, "rl_forward_seq: sequence %d outside [0, %d)", b, s->batch);
    RL_TRY(check_ids(m, ids, n, "rl_forward_seq"));
    rl_store v = seq_view(s, b);
    const int st = forward_store(m, &v, ids, n, logits, all_logits);
    s->seen_host[b] = v.n_seen_host;
    return st;
}

// Feed n checked ids through one sequence's store s (a store or a seq_view), n_batch rows at a time.
static int forward_store(rl_model *m, rl_store *s, const int32_t *ids, int n, float *logits, int all_logits) {
    const rl_model_params &p = m->p;
    RL_CK(cudaSetDevice(p.device));
    for (int start = 0; start < n; start += p.n_batch) {
        const int T = n - start < p.n_batch ? n - start : p.n_batch;
        const bool last = start + T == n;
        RL_CK(cudaMemcpyAsync(m->ids, ids + start, T * sizeof(int32_t), cudaMemcpyHostToDevice, m->stream));
        const int want = all_logits && logits ? 2 : (last ? 1 : 0);
        chunk(m, s, T, want, s->n_seen_host + start);
        RL_LAUNCHED("forward");
        if (want == 2)
            RL_CK(cudaMemcpyAsync(logits + (int64_t)start * p.n_vocab, m->logits, (size_t)T * p.n_vocab * sizeof(float),
                                  cudaMemcpyDeviceToHost, m->stream));
        else if (last && logits)
            RL_CK(cudaMemcpyAsync(logits, m->last_logits, (size_t)p.n_vocab * sizeof(float), cudaMemcpyDeviceToHost,
                                  m->stream));
        // the ids buffer is reused by the next chunk: wait for this one (also surfaces kernel faults)
        RL_CK(cudaStreamSynchronize(m->stream));
    }
    s->n_seen_host += n;
    return RL_OK;
}

static int set_pick_params(rl_model *m, float temperature, int top_k, float top_p, float u) {
    if (!(top_p > 0.0f) || top_p > 1.0f) return rl_fail(RL_ERR_ARG, "top_p must be in (0, 1], got %g", top_p);
    if (!(u >= 0.0f && u < 1.0f)) return rl_fail(RL_ERR_ARG, "u must be in [0, 1), got %g", u);
    const float prm[4] = {temperature, (float)top_k, top_p, u};
    RL_CK(cudaMemcpyAsync(m->pick_params, prm, sizeof prm, cudaMemcpyHostToDevice, m->stream));
    return RL_OK;
}

extern "C" int rl_pick(rl_model *m, float temperature, int top_k, float top_p, float u, int32_t *token) {
    if (!m || !token) return rl_fail(RL_ERR_ARG, "rl_pick: NULL argument");
    if (!m->last_logits) return rl_fail(RL_ERR_STATE, "rl_pick: no logits yet (call rl_forward first)");
    RL_CK(cudaSetDevice(m->p.device));
    RL_TRY(set_pick_params(m, temperature, top_k, top_p, u));
    launch_pick(m->token, m->last_logits, m->p.n_vocab, m->pick_params, 1, m->stream);
    RL_LAUNCHED("pick");
    RL_CK(cudaMemcpyAsync(token, m->token, sizeof(int32_t), cudaMemcpyDeviceToHost, m->stream));
    RL_CK(cudaStreamSynchronize(m->stream));
    return RL_OK;
}

// The decode body: one token already in m->ids[0], logits of it, next token into m->token.
static void decode_body(rl_model *m, rl_store *s) {
    chunk(m, s, 1, 1, s->n_seen_host);   // T = 1: token by token, whatever n_before (graph replays)
    launch_pick(m->token, m->last_logits, m->p.n_vocab, m->pick_params, 1, m->stream);
}

// Capture body (decode_body, or decode_batch_body for a batch store) into s->graph, once per store;
// on any failure, plain launches from then on.
static void try_capture(rl_model *m, rl_store *s, void (*body)(rl_model *, rl_store *)) {
    if (s->graph || s->graph_failed) return;
    cudaGraph_t g = nullptr;
    if (cudaStreamBeginCapture(m->stream, cudaStreamCaptureModeThreadLocal) != cudaSuccess) {
        s->graph_failed = 1;
        cudaGetLastError();
        return;
    }
    body(m, s);
    cudaError_t err = cudaStreamEndCapture(m->stream, &g);
    if (err == cudaSuccess && g) err = cudaGraphInstantiate(&s->graph, g, 0);
    if (g) cudaGraphDestroy(g);
    if (err != cudaSuccess) {
        s->graph = nullptr;
        s->graph_failed = 1;
        cudaGetLastError();
    }
}

extern "C" int rl_decode(rl_model *m, rl_store *s, int32_t token, float temperature, int top_k, float top_p, float u,
                         int32_t *next, float *logits) {
    RL_TRY(check_pair(m, s, "rl_decode"));
    const rl_model_params &p = m->p;
    if (s->batch > 1)
        return rl_fail(RL_ERR_STATE, "rl_decode: the store holds a batch of %d sequences; step them with "
                       "rl_decode_batch", s->batch);
    if (!next) return rl_fail(RL_ERR_ARG, "rl_decode: next is NULL");
    if (token < 0 || token >= p.n_vocab)
        return rl_fail(RL_ERR_ARG, "rl_decode: token id %d is outside [0, %d)", token, p.n_vocab);
    RL_CK(cudaSetDevice(p.device));
    RL_TRY(set_pick_params(m, temperature, top_k, top_p, u));
    RL_CK(cudaMemcpyAsync(m->ids, &token, sizeof(int32_t), cudaMemcpyHostToDevice, m->stream));
    if (m->use_graph) try_capture(m, s, decode_body);
    if (m->use_graph && s->graph) {
        RL_CK(cudaGraphLaunch(s->graph, m->stream));
        m->last_logits = m->logits;   // what chunk(T = 1, last row) sets
    } else {
        decode_body(m, s);
        RL_LAUNCHED("decode");
    }
    if (logits)
        RL_CK(cudaMemcpyAsync(logits, m->last_logits, (size_t)p.n_vocab * sizeof(float), cudaMemcpyDeviceToHost,
                              m->stream));
    RL_CK(cudaMemcpyAsync(next, m->token, sizeof(int32_t), cudaMemcpyDeviceToHost, m->stream));
    RL_CK(cudaStreamSynchronize(m->stream));
    s->n_seen_host += 1;
    return RL_OK;
}

// The batch step body: one token per sequence in m->ids[0..B), every row's logits, greedy tokens
// into m->token[0..B).
static void decode_batch_body(rl_model *m, rl_store *s) {
    chunk(m, s, s->batch, 2, 0, s->batch);
    launch_pick(m->token, m->logits, m->p.n_vocab, m->pick_params, s->batch, m->stream);
}

extern "C" int rl_decode_batch(rl_model *m, rl_store *s, const int32_t *tokens, int n, int32_t *next, float *logits) {
    RL_TRY(check_pair(m, s, "rl_decode_batch"));
    const rl_model_params &p = m->p;
    if (s->batch < 2) return rl_fail(RL_ERR_STATE, "rl_decode_batch: the store holds one sequence; use rl_decode");
    if (n != s->batch)
        return rl_fail(RL_ERR_ARG, "rl_decode_batch: %d tokens for a batch of %d sequences (one each)", n, s->batch);
    if (!next) return rl_fail(RL_ERR_ARG, "rl_decode_batch: next is NULL");
    RL_TRY(check_ids(m, tokens, n, "rl_decode_batch"));
    RL_CK(cudaSetDevice(p.device));
    RL_TRY(set_pick_params(m, 0.0f, 0, 1.0f, 0.0f));   // greedy on the device; sampling picks from logits
    RL_CK(cudaMemcpyAsync(m->ids, tokens, n * sizeof(int32_t), cudaMemcpyHostToDevice, m->stream));
    if (m->use_graph) try_capture(m, s, decode_batch_body);
    if (m->use_graph && s->graph) {
        RL_CK(cudaGraphLaunch(s->graph, m->stream));
    } else {
        decode_batch_body(m, s);
        RL_LAUNCHED("decode_batch");
    }
    m->last_logits = nullptr;   // rl_pick reads one sequence's logits: not a batch's
    if (logits)
        RL_CK(cudaMemcpyAsync(logits, m->logits, (size_t)n * p.n_vocab * sizeof(float), cudaMemcpyDeviceToHost,
                              m->stream));
    RL_CK(cudaMemcpyAsync(next, m->token, n * sizeof(int32_t), cudaMemcpyDeviceToHost, m->stream));
    RL_CK(cudaStreamSynchronize(m->stream));
    for (auto &c : s->seen_host) c += 1;
    return RL_OK;
}

// ==============================================================================================
// Single kernels (tests)
// ==============================================================================================

static int check_matrix_args(int qtype, int64_t n_rows, int64_t n_cols, int64_t row_bytes, const void *w) {
    int block, size;
    if (!w) return rl_fail(RL_ERR_ARG, "weights pointer is NULL");
    if (!rl_type_layout(qtype, &block, &size)) return rl_fail(RL_ERR_ARG, "unsupported GGML type %d", qtype);
    if (n_rows < 1 || n_cols < 1 || n_cols % block || row_bytes != n_cols / block * size)
        return rl_fail(RL_ERR_ARG, "matrix (%lld, %lld) with %lld bytes per row does not fit type %d",
                       (long long)n_rows, (long long)n_cols, (long long)row_bytes, qtype);
    return RL_OK;
}

extern "C" int rl_kernel_dequant(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w,
                                 int64_t row_bytes, float *out) {
    RL_TRY(check_matrix_args(qtype, n_rows, n_cols, row_bytes, w));
    if (!out) return rl_fail(RL_ERR_ARG, "rl_kernel_dequant: out is NULL");
    RL_TRY(use_device(device));
    DBuf dw, dout;
    RL_TRY(dw.alloc<uint8_t>(n_rows * row_bytes, w));
    RL_TRY(dout.alloc<float>(n_rows * n_cols));
    launch_dequant(dout.as<float>(), dw.as<uint8_t>(), qtype, n_rows, n_cols, row_bytes, 0);
    RL_LAUNCHED("dequant");
    RL_CK(cudaMemcpy(out, dout.p, (size_t)(n_rows * n_cols) * sizeof(float), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_kernel_matmul(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w,
                                int64_t row_bytes, const float *x, int T, float *out) {
    RL_TRY(check_matrix_args(qtype, n_rows, n_cols, row_bytes, w));
    if (!x || !out || T < 1) return rl_fail(RL_ERR_ARG, "rl_kernel_matmul: NULL x/out or T < 1");
    RL_TRY(use_device(device));
    DBuf dw, dx, dout;
    RL_TRY(dw.alloc<uint8_t>(n_rows * row_bytes, w));
    RL_TRY(dx.alloc<float>((int64_t)T * n_cols, x));
    RL_TRY(dout.alloc<float>((int64_t)T * n_rows));
    launch_matmul(dout.as<float>(), dw.as<uint8_t>(), dx.as<float>(), qtype, n_rows, n_cols, row_bytes, T, 0);
    RL_LAUNCHED("matmul");
    RL_CK(cudaMemcpy(out, dout.p, (size_t)T * n_rows * sizeof(float), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_kernel_norm(int device, int kind, const float *x, const float *w, const float *b, int rows, int n,
                              double eps, float *out) {
    if (!x || !w || !out || rows < 1 || n < 1 || (kind == RL_NORM_LAYER && !b) ||
        (kind != RL_NORM_RMS && kind != RL_NORM_LAYER))
        return rl_fail(RL_ERR_ARG, "rl_kernel_norm: bad arguments");
    RL_TRY(use_device(device));
    DBuf dx, dw, db, dout;
    RL_TRY(dx.alloc<float>((int64_t)rows * n, x));
    RL_TRY(dw.alloc<float>(n, w));
    if (b) RL_TRY(db.alloc<float>(n, b));
    RL_TRY(dout.alloc<float>((int64_t)rows * n));
    launch_norm(dout.as<float>(), dx.as<float>(), dw.as<float>(), db.as<float>(), kind, rows, n, eps, 0);
    RL_LAUNCHED("norm");
    RL_CK(cudaMemcpy(out, dout.p, (size_t)rows * n * sizeof(float), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_kernel_act(int device, int act, int gated, const float *gate, const float *up, int T, int n,
                             float *out) {
    if (!up || !out || (gated && !gate) || T < 1 || n < 1 || act < RL_ACT_SILU || act > RL_ACT_GELU_TANH)
        return rl_fail(RL_ERR_ARG, "rl_kernel_act: bad arguments");
    RL_TRY(use_device(device));
    DBuf dg, du, dout;
    if (gated) RL_TRY(dg.alloc<float>((int64_t)T * n, gate));
    RL_TRY(du.alloc<float>((int64_t)T * n, up));
    RL_TRY(dout.alloc<float>((int64_t)T * n));
    launch_act(dout.as<float>(), dg.as<float>(), du.as<float>(), act, gated, T, n, 0);
    RL_LAUNCHED("act");
    RL_CK(cudaMemcpy(out, dout.p, (size_t)T * n * sizeof(float), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_kernel_embed(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w,
                               int64_t row_bytes, const int32_t *ids, int n, float embed_scale, float *out) {
    RL_TRY(check_matrix_args(qtype, n_rows, n_cols, row_bytes, w));
    if (!ids || !out || n < 1) return rl_fail(RL_ERR_ARG, "rl_kernel_embed: bad arguments");
    for (int i = 0; i < n; i++)
        if (ids[i] < 0 || ids[i] >= n_rows) return rl_fail(RL_ERR_ARG, "rl_kernel_embed: id %d out of range", ids[i]);
    RL_TRY(use_device(device));
    DBuf dw, di, dout;
    RL_TRY(dw.alloc<uint8_t>(n_rows * row_bytes, w));
    RL_TRY(di.alloc<int32_t>(n, ids));
    RL_TRY(dout.alloc<float>((int64_t)n * n_cols));
    launch_embed(dout.as<float>(), dw.as<uint8_t>(), di.as<int32_t>(), qtype, n_cols, row_bytes, n, embed_scale, 0);
    RL_LAUNCHED("embed");
    RL_CK(cudaMemcpy(out, dout.p, (size_t)n * n_cols * sizeof(float), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_kernel_attend(int device, const float *q, const void *k, const void *v, int k_type, int v_type,
                                const int32_t *pos, const int32_t *count, int n_head, int n_kv, int P, int hd,
                                int rotary_dim, double rope_base, double rope_scale, float attn_scale, int q_pos,
                                int path, float *out, float *weights) {
    if (!q || !k || !v || !pos || !count || !out || !weights || n_kv < 1 || n_head % n_kv || P < 1 || hd < 1 ||
        rotary_dim % 2 || rotary_dim > hd || !(rope_base > 0) || !(rope_scale > 0))
        return rl_fail(RL_ERR_ARG, "rl_kernel_attend: bad arguments");
    RL_TRY(check_kv_type(k_type, "k_type", hd, "rl_kernel_attend"));
    RL_TRY(check_kv_type(v_type, "v_type", hd, "rl_kernel_attend"));
    if (path != RL_ATTEND_AUTO && path != RL_ATTEND_SINGLE && path != RL_ATTEND_SPLIT)
        return rl_fail(RL_ERR_ARG, "rl_kernel_attend: unknown path %d", path);
    if (path == RL_ATTEND_SPLIT && !attend_split_fits(n_head / n_kv, hd, P))
        return rl_fail(RL_ERR_ARG, "rl_kernel_attend: the split-K kernel cannot run %d query heads per kv head of "
                       "head_dim %d over %d slots", n_head / n_kv, hd, P);
    for (int h = 0; h < n_kv; h++)
        if (count[h] < 1 || count[h] > P) return rl_fail(RL_ERR_ARG, "rl_kernel_attend: count[%d] = %d", h, count[h]);
    RL_TRY(use_device(device));
    const int half = rotary_dim / 2;
    std::vector<double> inv(half + 1, 0.0);
    for (int i = 0; i < half; i++) inv[i] = pow(rope_base, -(i * 2.0) / rotary_dim);
    DBuf dq, dk, dv, dp, dc, dinv, dout, dw, dpart;
    const int64_t slots = (int64_t)n_kv * P;
    RL_TRY(dq.alloc<float>((int64_t)n_head * hd, q));
    RL_TRY(dk.alloc<uint8_t>(slots * kv_row_bytes(k_type, hd), (const uint8_t *)k));
    RL_TRY(dv.alloc<uint8_t>(slots * kv_row_bytes(v_type, hd), (const uint8_t *)v));
    RL_TRY(dp.alloc<int32_t>(slots, pos));
    RL_TRY(dc.alloc<int32_t>(n_kv, count));
    RL_TRY(dinv.alloc<double>(half + 1, inv.data()));
    RL_TRY(dout.alloc<float>((int64_t)n_head * hd));
    RL_TRY(dw.alloc<float>((int64_t)n_head * P, weights));
    RL_TRY(dpart.alloc<float>(attend_scratch_floats(n_head, hd, P)));
    launch_attend(dout.as<float>(), dw.as<float>(), dpart.as<float>(), dq.as<float>(), dk.as<uint8_t>(),
                  dv.as<uint8_t>(), k_type, v_type, dp.as<int32_t>(), dc.as<int32_t>(), nullptr, q_pos, RL_QPOS_FIXED,
                  n_head, n_kv, P, hd, rotary_dim, rope_scale, dinv.as<double>(), nullptr, 0, attn_scale, n_kv, path, 0);
    RL_LAUNCHED("attend");
    RL_CK(cudaMemcpy(out, dout.p, (size_t)n_head * hd * sizeof(float), cudaMemcpyDeviceToHost));
    RL_CK(cudaMemcpy(weights, dw.p, (size_t)n_head * P * sizeof(float), cudaMemcpyDeviceToHost));
    return RL_OK;
}

extern "C" int rl_kernel_pick(int device, const float *logits, int n, float temperature, int top_k, float top_p,
                              float u, int32_t *token) {
    if (!logits || !token || n < 1) return rl_fail(RL_ERR_ARG, "rl_kernel_pick: bad arguments");
    if (!(top_p > 0.0f) || top_p > 1.0f || !(u >= 0.0f && u < 1.0f))
        return rl_fail(RL_ERR_ARG, "rl_kernel_pick: top_p must be in (0, 1] and u in [0, 1)");
    RL_TRY(use_device(device));
    const float prm[4] = {temperature, (float)top_k, top_p, u};
    DBuf dl, dp, dt;
    RL_TRY(dl.alloc<float>(n, logits));
    RL_TRY(dp.alloc<float>(4, prm));
    RL_TRY(dt.alloc<int32_t>(1));
    launch_pick(dt.as<int32_t>(), dl.as<float>(), n, dp.as<float>(), 1, 0);
    RL_LAUNCHED("pick");
    RL_CK(cudaMemcpy(token, dt.p, sizeof(int32_t), cudaMemcpyDeviceToHost));
    return RL_OK;
}
