// The C API, running the model: the forward pass (runtime/engine.py's _chunk/_layer/_ffn, in the
// same order), token choice on the device, decode steps of one sequence and of a batch store, and
// their CUDA-graph capture.
#include "handles.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

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

// Before a policy layer's write of token t (q: its query rows, nseq sequences): what is chosen for the
// whole layer at once (adakv's victims, gvote's budget and votes).
static void before_write(rl_model *m, rl_store *s, int il, const float *q, int t, int nseq) {
    const rl_model_params &p = m->p;
    LayerStore &L = s->layers[il];
    if (s->pol.policy == RL_POLICY_GVOTE)
        launch_gvote_votes(L, s->pol, q, s->n_seen, t, p.n_head * nseq, p.n_head_kv * nseq, nseq, p.head_dim,
                           p.rotary_dim, m->rope_scale[il], m->d_inv_freq + (int64_t)il * (p.rotary_dim / 2 + 1),
                           m->rope_tab[il], ROPE_TABLE_POSITIONS, (double)p.attn_scale, m->stream);
    else
        launch_select(L, s->pol, p.n_head_kv * nseq, nseq, m->stream);
}

// After a policy layer's attention step: the policy's record of it (the weights in s->weights; gvote
// keeps the query rows instead).
static void after_attend(rl_model *m, rl_store *s, int il, const float *q, int t, int nseq) {
    const rl_model_params &p = m->p;
    LayerStore &L = s->layers[il];
    if (s->pol.policy == RL_POLICY_GVOTE)
        launch_gvote_record(L, s->pol, q, s->n_seen, t, p.n_head * nseq, nseq, p.head_dim, m->stream);
    else
        launch_observe(L, s->pol, s->weights, s->n_seen, t, p.n_head * nseq, p.n_head_kv * nseq, nseq, m->stream);
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
        if (policy_layer) before_write(m, s, il, m->q, 0, nseq);
        launch_kv_write(L, s->pol, m->k, m->v, m->q, proj, s->n_seen, 0, nkv * nseq, nh * nseq, hd, nkv, st);
        launch_attend(m->att, s->weights, s->att_part, m->q, L.k, L.v, L.k_type, L.v_type, pos, L.count, s->n_seen, 0,
                      qpos_mode, nh * nseq, nkv * nseq, L.P, hd, p.rotary_dim, m->rope_scale[il], inv_freq,
                      m->rope_tab[il], ROPE_TABLE_POSITIONS, p.attn_scale, nkv, RL_ATTEND_AUTO, st);
        if (policy_layer) after_attend(m, s, il, m->q, 0, nseq);
    }
    if (chunk_mode) {
        launch_kv_append(L, m->k, m->v, (int)n_before, T, nkv, hd, st);
        launch_prefill_attend(m->att, m->pf_part, m->pf_part_floats, m->q, L.k, L.v, L.k_type, L.v_type,
                              (int)n_before, T, nh, nkv, L.P, hd, p.rotary_dim, m->rope_tab[il], p.attn_scale, st);
    }
    for (int t = 0; nseq == 1 && !chunk_mode && t < T; t++) {   // decode semantics: write (evicting first), attend, observe
        if (policy_layer) before_write(m, s, il, m->q + t * nq, t, 1);
        launch_kv_write(L, s->pol, m->k + t * nk, m->v + t * nk, m->q + t * nq, proj, s->n_seen, t, nkv, nh, hd, nkv, st);
        launch_attend(m->att + t * nq, s->weights, s->att_part, m->q + t * nq, L.k, L.v, L.k_type, L.v_type, pos,
                      L.count, s->n_seen, t, qpos_mode, nh, nkv, L.P, hd, p.rotary_dim, m->rope_scale[il], inv_freq,
                      m->rope_tab[il], ROPE_TABLE_POSITIONS, p.attn_scale, nkv, RL_ATTEND_AUTO, st);
        if (policy_layer) after_attend(m, s, il, m->q + t * nq, t, 1);
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

