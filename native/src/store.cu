// The C API, KV stores (rl_store, handles.cuh; DESIGN.md "KV store contract"): init and free, reset
// (a whole store or one sequence of a batch), one sequence's view, counters and inspection.
#include "handles.cuh"

#include <math.h>
#include <stdlib.h>
#include <string.h>

#include <vector>

// ==============================================================================================
// Store
// ==============================================================================================


static void store_release(rl_store *s) {
    for (auto &L : s->layers) {
        dev_free(L.k); dev_free(L.v); dev_free(L.seq); dev_free(L.rank); dev_free(L.score); dev_free(L.aux);
        dev_free(L.count); dev_free(L.evicted); dev_free(L.victims); dev_free(L.taken); dev_free(L.scratch);
        dev_free(L.hist); dev_free(L.ksum); dev_free(L.work); dev_free(L.drops); dev_free(L.qhist);
    }
    dev_free(s->gv_w);
    dev_free(s->gv_i);
    dev_free(s->proj);
    dev_free(s->weights);
    dev_free(s->att_part);
    dev_free(s->n_seen);
    if (s->graph) cudaGraphExecDestroy(s->graph);
    s->graph = nullptr;
}

// RL_ERR_ARG unless `type` is a KV store element type the device holds (kv_rows.cuh) for head_dim hd.
int check_kv_type(int type, const char *what, int hd, const char *fn) {
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
        if (L.hist) RL_CK(cudaMemsetAsync(L.hist, 0, slots * s->pol.window * sizeof(float), s->m->stream));
        if (L.ksum) RL_CK(cudaMemsetAsync(L.ksum, 0, heads * s->m->p.head_dim * sizeof(int64_t), s->m->stream));
        if (L.drops) RL_CK(cudaMemsetAsync(L.drops, 0, heads * sizeof(int32_t), s->m->stream));
        if (L.qhist) {   // heads kv heads: heads / n_head_kv sequences of n_head query rows each
            const int64_t rows = heads / s->m->p.n_head_kv * s->m->p.n_head;
            RL_CK(cudaMemsetAsync(L.qhist, 0, rows * s->pol.window * s->m->p.head_dim * sizeof(float), s->m->stream));
        }
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
rl_store seq_view(const rl_store *s, int b) {
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
        if (L.hist) L.hist += slots * s->pol.window;
        if (L.ksum) L.ksum += h0 * s->m->p.head_dim;
        if (L.work) L.work += 2 * slots;
        if (L.drops) L.drops += h0;
        if (L.qhist) L.qhist += (int64_t)b * s->m->p.n_head * s->pol.window * s->m->p.head_dim;
        if (L.gv_w) {
            const int64_t blocks = (int64_t)b * s->m->p.n_head * (s->pol.gv_samples + 1);
            L.gv_w += blocks * L.gv_p2;
            L.gv_i += blocks * L.gv_p2;
        }
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
    if (sp->policy < RL_POLICY_FULL || sp->policy > RL_POLICY_GVOTE)
        return rl_fail(RL_ERR_ARG, "rl_store_init: unknown policy %d", sp->policy);
    if (sp->policy == RL_POLICY_SCISSORHANDS && (sp->history < 1 || sp->history > 64))
        return rl_fail(RL_ERR_ARG, "rl_store_init: scissorhands needs history in 1..64, got %d", sp->history);
    if (sp->recent < 0 || sp->lazy < 0 || sp->slack < 0 || sp->max_drop < 0)
        return rl_fail(RL_ERR_ARG, "rl_store_init: recent, lazy, slack, max_drop must be >= 0");
    if (sp->batch < 0 || sp->batch > p.n_batch || sp->batch > 1024)
        return rl_fail(RL_ERR_ARG, "rl_store_init: batch %d must be in 0..min(n_batch %d, 1024)", sp->batch, p.n_batch);
    if (sp->policy == RL_POLICY_LSH && (!sp->lsh_proj || sp->lsh_bits < 1 || sp->lsh_bits > 64))
        return rl_fail(RL_ERR_ARG, "rl_store_init: lsh needs lsh_proj and lsh_bits in 1..64");
    if (window_policy(sp->policy)) {
        const int group = p.n_head / p.n_head_kv;
        if (sp->window < 1 || (int64_t)sp->window * group > 16384)   // the fixed-point totals must fit int64
            return rl_fail(RL_ERR_ARG, "rl_store_init: window %d must be in 1..%d (window x GQA group <= 16384)",
                           sp->window, 16384 / group);
        if (sp->pool < 1 || sp->pool % 2 == 0)
            return rl_fail(RL_ERR_ARG, "rl_store_init: pool must be an odd integer >= 1, got %d", sp->pool);
    }
    if (sp->policy == RL_POLICY_GVOTE) {
        if (sp->window < 1 || sp->window > 4096)
            return rl_fail(RL_ERR_ARG, "rl_store_init: gvote's window must be in 1..4096, got %d", sp->window);
        if (sp->gvote_samples < 1 || sp->gvote_samples > 64)
            return rl_fail(RL_ERR_ARG, "rl_store_init: gvote_samples must be in 1..64, got %d", sp->gvote_samples);
        if (!(sp->gvote_p > 0.0 && sp->gvote_p <= 1.0))
            return rl_fail(RL_ERR_ARG, "rl_store_init: gvote_p must be in (0, 1], got %g", sp->gvote_p);
    }
    if ((sp->policy == RL_POLICY_RKV || sp->policy == RL_POLICY_GVOTE) && p.head_dim > MAX_HEAD_DIM)
        return rl_fail(RL_ERR_ARG, "rl_store_init: rkv and gvote take head_dim up to %d, the model has %d",
                       MAX_HEAD_DIM, p.head_dim);
    if (sp->policy == RL_POLICY_RKV && !(sp->rkv_lambda >= 0.0 && sp->rkv_lambda <= 1.0))
        return rl_fail(RL_ERR_ARG, "rl_store_init: rkv_lambda must be in [0, 1], got %g", sp->rkv_lambda);
    if (sp->policy == RL_POLICY_ADAKV) {
        if (p.n_head_kv > ADAKV_MAX_HEADS)
            return rl_fail(RL_ERR_ARG, "rl_store_init: adakv takes at most %d kv heads, the model has %d",
                           ADAKV_MAX_HEADS, p.n_head_kv);
    }
    RL_TRY(check_kv_type(sp->k_type, "k_type", p.head_dim, "rl_store_init"));
    RL_TRY(check_kv_type(sp->v_type, "v_type", p.head_dim, "rl_store_init"));
    for (int il = 0; il < p.n_layer; il++) {
        const int C = sp->layer_capacity[il], P = sp->layer_physical[il], S = sp->layer_sinks[il];
        if (C < 1 || P < C || S < 0 || S >= C || (sp->layer_ring[il] && P != C))
            return rl_fail(RL_ERR_ARG, "rl_store_init: layer %d: capacity %d, physical %d, sinks %d are inconsistent",
                           il, C, P, S);
        if (!sp->layer_ring[il] && sp->policy == RL_POLICY_FULL)
            return rl_fail(RL_ERR_ARG, "rl_store_init: policy full needs ring layers");
        if (!sp->layer_ring[il] && S + sp->recent >= C)   // else a write could find no victim and overflow
            return rl_fail(RL_ERR_ARG, "rl_store_init: layer %d: sinks %d + recent %d must be below the capacity %d",
                           il, S, sp->recent, C);
        if (!sp->layer_ring[il] && sp->policy == RL_POLICY_ADAKV && sp->head_floor <= S + sp->recent)
            return rl_fail(RL_ERR_ARG, "rl_store_init: layer %d: adakv head_floor %d must exceed sinks %d + recent %d",
                           il, sp->head_floor, S, sp->recent);
    }
    RL_CK(cudaSetDevice(p.device));
    rl_store *s = new rl_store();
    s->m = m;
    s->pol = StorePolicy{sp->policy, sp->reindexed ? 1 : 0, sp->recent, sp->lazy, sp->slack, sp->max_drop,
                         sp->lsh_bits, sp->history, sp->seed, sp->shift ? 1 : 0,
                         window_policy(sp->policy) || sp->policy == RL_POLICY_GVOTE ? sp->window : 0, sp->pool,
                         sp->head_floor, sp->rkv_lambda, sp->gvote_samples, sp->gvote_p};
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
        if (!L.ring && window_policy(s->pol.policy)) {   // the window masses, the pooling / keys scratch
            if (st == RL_OK) st = dev_alloc(&L.hist, slots * s->pol.window, "cudaMalloc (window masses)");
            if (st == RL_OK) st = dev_alloc(&L.work, 2 * slots, "cudaMalloc (policy scratch)");
        }
        if (!L.ring && s->pol.policy == RL_POLICY_RKV && st == RL_OK)
            st = dev_alloc(&L.ksum, nkv * hd, "cudaMalloc (key sums)");
        if (!L.ring && layer_choice_policy(s->pol.policy) && st == RL_OK)
            st = dev_alloc(&L.drops, nkv, "cudaMalloc (layer choice counts)");
        if (!L.ring && s->pol.policy == RL_POLICY_GVOTE) {   // votes (a row per kv head), the query history
            if (st == RL_OK) st = dev_alloc(&L.work, 2 * slots, "cudaMalloc (gvote votes)");
            if (st == RL_OK)
                st = dev_alloc(&L.qhist, (int64_t)s->batch * p.n_head * s->pol.window * hd, "cudaMalloc (gvote queries)");
        }
    }
    if (st == RL_OK && s->pol.policy == RL_POLICY_GVOTE) {   // one nucleus scratch row per block of gvote.cu
        int p2 = 1;
        while (p2 < s->max_p) p2 <<= 1;
        const int64_t n = (int64_t)s->batch * p.n_head * (s->pol.gv_samples + 1) * p2;
        st = dev_alloc(&s->gv_w, n, "cudaMalloc (gvote scratch)");
        if (st == RL_OK) st = dev_alloc(&s->gv_i, n, "cudaMalloc (gvote scratch)");
        for (LayerStore &L : s->layers) {
            L.gv_w = s->gv_w;
            L.gv_i = s->gv_i;
            L.gv_p2 = p2;
        }
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
        if (L.hist) t += slots * s->pol.window * 4 + 2 * slots * 8;
        if (L.ksum) t += heads * p.head_dim * 8;
        if (L.drops) t += heads * 4;
        if (L.qhist) t += heads / p.n_head_kv * p.n_head * s->pol.window * p.head_dim * 4;
        if (L.work && !L.hist) t += 2 * slots * 8;
    }
    if (s->gv_w) t += (int64_t)s->batch * p.n_head * (s->pol.gv_samples + 1) * s->layers[0].gv_p2 * 12;
    *out = t;
    return RL_OK;
}

