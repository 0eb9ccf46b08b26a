// The C API, model handles (rl_model, handles.cuh): init and free, weights and vectors uploaded in
// their GGUF blocks, RoPE per layer and its table, the CUDA-graph and fused-launch switches.
#include "handles.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

// ==============================================================================================
// Model
// ==============================================================================================


static bool is_matrix_role(int role) {
    return role == RL_TOKEN_EMBD || role == RL_OUTPUT || role == RL_ATTN_Q || role == RL_ATTN_K || role == RL_ATTN_V ||
           role == RL_ATTN_OUT || role == RL_FFN_GATE || role == RL_FFN_UP || role == RL_FFN_DOWN;
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
int upload(rl_model *m, void *dst, const void *src, size_t bytes) {
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

