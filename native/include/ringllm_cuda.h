/* ringllm_cuda.h: the C API of ringllm's CUDA backend (libringllm_cuda.so).
 *
 * Plain C, no #include: cffi's cdef reads this file as is (native/_cffi_build.py), and C/CUDA
 * sources include <stdint.h> and <stddef.h> before it. Shape of the API (llama.h's):
 *   - opaque handles with init/free pairs: rl_model (weights on one device, run buffers),
 *     rl_store (one sequence's KV store on that device);
 *   - every function returns an int status, RL_OK (0) on success; on failure rl_last_error()
 *     returns a message (thread-local, valid until the next failing call on the same thread)
 *     naming the call and, for CUDA failures, the CUDA error name and text;
 *   - arrays are host pointers, row-major, dtype and shape given in each comment; the library
 *     copies what it needs, and never keeps a host pointer after the call returns.
 *
 * Numerics follow the CPU engine (runtime/engine.py): weights stay in their GGUF blocks on the
 * device and are dequantized in registers, every accumulation is float32 (norm statistics float64),
 * RoPE angles are computed in float64 and rounded to float32, keys are stored before RoPE and
 * rotated by their slot's logical position when read. K and V rows are held in the store's element
 * types (rl_store_params k_type / v_type: f32, f16 or q8_0, the row layouts of runtime/kv_types.py),
 * encoded once when their token is written and decoded in registers when read.
 *
 * Threads: one handle must not be used by two threads at once; distinct handles may.
 */

/* ---------------------------------------------------------------------------------------------
 * Status codes
 * ------------------------------------------------------------------------------------------- */
#define RL_OK 0
#define RL_ERR_NO_CUDA 1      /* the library was built without CUDA (nvcc absent at install) */
#define RL_ERR_NO_DEVICE 2    /* no CUDA device, no driver, or a driver too old for the runtime */
#define RL_ERR_CUDA 3         /* any other CUDA runtime error (launch failure, illegal address...) */
#define RL_ERR_ARG 4          /* an invalid argument (NULL handle, size out of range, bad type) */
#define RL_ERR_OOM 5          /* device memory exhausted */
#define RL_ERR_STATE 6        /* a call out of order (a required tensor never set, store of another model) */

/* GGML tensor types (values of ggml_type, as in runtime/quant_types.py) */
#define RL_TYPE_F32 0
#define RL_TYPE_F16 1
#define RL_TYPE_Q4_0 2
#define RL_TYPE_Q4_1 3
#define RL_TYPE_Q5_0 6
#define RL_TYPE_Q5_1 7
#define RL_TYPE_Q8_0 8
#define RL_TYPE_Q4_K 12
#define RL_TYPE_Q5_K 13
#define RL_TYPE_Q6_K 14
#define RL_TYPE_BF16 30

/* Norm kinds, activations (runtime/ops.py ACT_CODES) */
#define RL_NORM_RMS 0
#define RL_NORM_LAYER 1
#define RL_ACT_SILU 0
#define RL_ACT_GELU 1
#define RL_ACT_GELU_TANH 2

/* Tensor roles: the GGUF-style names of ModelSpec; `il` is the layer for the blk.il.* roles.
 * Matrices (rl_model_set_matrix) stay quantized; vectors (rl_model_set_vector) are float32. */
#define RL_TOKEN_EMBD 0        /* token_embd.weight (n_vocab, n_embd) matrix */
#define RL_OUTPUT 1            /* output.weight (n_vocab, n_embd) matrix; absent when tied */
#define RL_OUTPUT_NORM 2       /* output_norm.weight (n_embd,) */
#define RL_OUTPUT_NORM_B 3     /* output_norm.bias (n_embd,) (layer norm) */
#define RL_ATTN_NORM 4         /* blk.il.attn_norm.weight (n_embd,) */
#define RL_ATTN_NORM_B 5
#define RL_ATTN_Q 6            /* blk.il.attn_q.weight (n_head*head_dim, n_embd) matrix */
#define RL_ATTN_Q_B 7          /* its bias (n_head*head_dim,) */
#define RL_ATTN_K 8            /* (n_head_kv*head_dim, n_embd) matrix */
#define RL_ATTN_K_B 9
#define RL_ATTN_V 10           /* (n_head_kv*head_dim, n_embd) matrix */
#define RL_ATTN_V_B 11
#define RL_ATTN_OUT 12         /* attn_output.weight (n_embd, n_head*head_dim) matrix */
#define RL_ATTN_OUT_B 13
#define RL_ATTN_Q_NORM 14      /* (head_dim,) when qk_norm */
#define RL_ATTN_K_NORM 15
#define RL_POST_ATTN_NORM 16   /* (n_embd,) when sandwich_norm */
#define RL_FFN_NORM 17
#define RL_FFN_NORM_B 18
#define RL_FFN_GATE 19         /* (n_ff, n_embd) matrix when gated_ffn */
#define RL_FFN_GATE_B 20
#define RL_FFN_UP 21           /* (n_ff, n_embd) matrix */
#define RL_FFN_UP_B 22
#define RL_FFN_DOWN 23         /* (n_embd, n_ff) matrix */
#define RL_FFN_DOWN_B 24
#define RL_POST_FFW_NORM 25    /* (n_embd,) when sandwich_norm */
#define RL_N_ROLES 26

/* Device eviction policies (DESIGN.md "Eviction policies"; staged eviction applies to each) */
#define RL_POLICY_FULL 0       /* no eviction: the store is the context (ring layers only) */
#define RL_POLICY_STREAMING 1  /* oldest non-sink token */
#define RL_POLICY_H2O 2        /* lowest attention mass accumulated since insertion */
#define RL_POLICY_TOVA 3       /* lowest attention of the latest query, mean over all query heads */
#define RL_POLICY_KNORM 4      /* largest L2 norm of the pre-RoPE key (1/256-octave log grid) */
#define RL_POLICY_LSH 5        /* largest Hamming distance of SimHash codes, query vs key */
#define RL_POLICY_SCISSORHANDS 6  /* most steps unimportant (weight below 1/n) over the history window */
#define RL_POLICY_RANDOM 7     /* lowest splitmix64 draw of (seed, layer, kv head, new token, token) */
#define RL_POLICY_SNAPKV 8     /* lowest attention mass of the last `window` queries, max-pooled over `pool`
                                  neighbouring tokens (1/4096-octave log grid) */
#define RL_POLICY_PYRAMIDKV 8  /* snapkv's scores; its per-layer budgets are the caller's layer_capacity */
#define RL_POLICY_RKV 9        /* lowest lambda * importance - (1 - lambda) * redundancy (R-KV) */
#define RL_POLICY_ADAKV 10     /* snapkv's scores, one layer-wide choice over all kv heads (heads hold
                                  different numbers of tokens; each keeps at least head_floor) */
#define RL_POLICY_GVOTE 11     /* adaptive budget (the new query's top-p nucleus), fewest votes of
                                  gvote_samples synthetic queries from the last `window` queries */

/* ---------------------------------------------------------------------------------------------
 * Library and devices
 * ------------------------------------------------------------------------------------------- */

/* Message of the last failing call on this thread ("" when none). Never NULL. */
const char *rl_last_error(void);

/* 1 when the library was compiled with nvcc, 0 for the no-CUDA build (every other call then
 * returns RL_ERR_NO_CUDA). */
int rl_has_cuda(void);

/* Build description, e.g. "CUDA 13.0, sm_80 sm_90 + PTX compute_90", written NUL-terminated into
 * buf (truncated to buf_len - 1 characters). RL_ERR_ARG when buf is NULL or buf_len < 1. */
int rl_build_info(char *buf, int buf_len);

/* Number of CUDA devices into *n. No driver or no device: RL_ERR_NO_DEVICE with the CUDA text
 * (and *n = 0). */
int rl_device_count(int *n);

/* Name and total memory (bytes) of device `device`; RL_ERR_ARG when out of range. */
int rl_device_info(int device, char *name, int name_len, int64_t *total_mem);

/* ---------------------------------------------------------------------------------------------
 * Model: weights on the device, run buffers for chunks of up to n_batch tokens
 * ------------------------------------------------------------------------------------------- */

typedef struct rl_model rl_model;

/* Prefill modes (rl_model_params.prefill_mode): how rl_forward takes a chunk of T > 1 tokens.
 * Chunk: on a ring layer where no token of the chunk evicts (tokens fed before it + T <= the
 * layer's C_l), the chunk's K/V rows are written in one launch and its T queries attend causally
 * (token t over the slots of tokens 0..t) in one more; the outputs differ from token by token only
 * in the order of float32 sums. Policy layers, a chunk that crosses C_l and single tokens
 * (rl_decode) always go token by token (write with eviction, attend, observe). */
#define RL_PREFILL_DEFAULT 0   /* chunk, unless the environment has RINGLLM_CUDA_PREFILL=token (read by
                                  rl_model_init, for comparisons) */
#define RL_PREFILL_CHUNK 1
#define RL_PREFILL_TOKEN 2     /* every layer token by token */

typedef struct {
    int n_vocab, n_embd, n_layer, n_head, n_head_kv, head_dim, n_ff;
    int rotary_dim;           /* even, <= head_dim: RoPE (rotate-half) over the first rotary_dim dims */
    int norm_kind;            /* RL_NORM_* */
    int act;                  /* RL_ACT_* */
    int gated_ffn;            /* down(act(gate x) * up x) when 1, down(act(up x)) when 0 */
    int qk_norm;              /* RMSNorm over head_dim on q and k before RoPE */
    int sandwich_norm;        /* post-attention and post-FFN norms */
    int parallel_residual;    /* x + attn(ln1 x) + ffn(ln2 x) */
    int tied_output;          /* output projection reuses RL_TOKEN_EMBD */
    double norm_eps;          /* added to the mean square / variance, in float64 as the CPU engine */
    float embed_scale, attn_scale, final_logit_softcap;  /* softcap 0 = none */
    int n_batch;              /* rows per prefill chunk, >= 1 */
    int device;               /* CUDA device index */
    int prefill_mode;         /* RL_PREFILL_* (0 in a zeroed struct: the default) */
} rl_model_params;

/* Allocate a model on p->device (weights are added next). *out = NULL on failure.
 * RL_ERR_NO_DEVICE: no device/driver (message has the CUDA text); RL_ERR_ARG: inconsistent sizes,
 * an unknown prefill_mode. */
int rl_model_init(rl_model **out, const rl_model_params *p);

/* Release everything the model owns on the device. NULL is a no-op (RL_OK). Stores made for the
 * model must be freed first. */
int rl_model_free(rl_model *m);

/* Upload one matrix in its GGUF blocks: data is n_rows rows of row_bytes bytes (row stride
 * row_bytes, rows contiguous), row_bytes = n_cols / values-per-block * bytes-per-block.
 * RL_ERR_ARG: unknown role or type, il out of range, a shape other than the role's (see roles),
 * row_bytes inconsistent with qtype and n_cols. Setting a role twice replaces it. */
int rl_model_set_matrix(rl_model *m, int role, int il, int qtype, int64_t n_rows, int64_t n_cols,
                        const uint8_t *data, int64_t row_bytes);

/* Upload one float32 vector (norm weight or bias) of n values; RL_ERR_ARG on a wrong length. */
int rl_model_set_vector(rl_model *m, int role, int il, const float *data, int64_t n);

/* RoPE of layer il: angle of dim pair i at position p = p / scale * base^(-2i/rotary_dim).
 * Default 10000, 1. RL_ERR_ARG: base <= 0 or scale <= 0. */
int rl_model_set_rope(rl_model *m, int il, double base, double scale);

/* Check every tensor the params require was set (RL_ERR_STATE naming the first missing one).
 * Required before rl_store_init. */
int rl_model_ready(rl_model *m);

/* Bytes of device memory held by the weights. */
int rl_model_weight_bytes(rl_model *m, int64_t *out);

/* 1: decode steps (rl_decode) run as a captured CUDA graph, replayed per token; 0: plain
 * launches (default). Capture failures fall back to plain launches silently. */
int rl_model_set_graph(rl_model *m, int enable);

/* 1 (default): fused launches: q, k, v in one grouped matmul; FFN gate and up in one with the
 * activation in its epilogue; biases, and the residual adds of the attention output and FFN down
 * projections (no sandwich norm, no parallel residual), in the matmuls' epilogues. 0: one launch
 * per operation. Both run the same float operations in the same order: outputs are bit-identical.
 * RL_ERR_STATE once stores of the model exist (set it before rl_store_init). */
int rl_model_set_fused(rl_model *m, int enable);

/* ---------------------------------------------------------------------------------------------
 * KV store of one sequence (DESIGN.md "KV store contract"), on the model's device
 * ------------------------------------------------------------------------------------------- */

typedef struct rl_store rl_store;

typedef struct {
    int policy;               /* RL_POLICY_* of the policy layers */
    int reindexed;            /* 1: position = rank among held tokens; 0: sequence index */
    int recent;               /* newest held tokens protected from score-based eviction */
    int lazy, slack, max_drop;  /* staged eviction R, sigma, delta (KVConfig.keep_after) */
    int lsh_bits;             /* SimHash bits c, 1..64 (RL_POLICY_LSH) */
    int history;              /* steps of the history window, 1..64 (RL_POLICY_SCISSORHANDS) */
    uint64_t seed;            /* seed of the draws (RL_POLICY_RANDOM) */
    int batch;                /* sequences held (0 or 1: one; B > 1, at most n_batch: a batch store,
                                 fed per sequence by rl_forward_seq and stepped together by
                                 rl_decode_batch; per-head arrays and counts then hold B x n_head_kv
                                 heads, sequence b's heads b * n_head_kv ...) */
    int shift;                /* 1: the shift-and-append baseline (KVConfig update "shift": slots kept in
                                 sequence order, survivors copied down over the victims); 0: in place */
    /* per layer (n_layer entries each): */
    const int *layer_capacity;  /* C_l: tokens kept after pruning, the new token included */
    const int *layer_physical;  /* P_l >= C_l: slots allocated (more than C_l with staging) */
    const int *layer_sinks;     /* first tokens never evicted */
    const int *layer_ring;      /* 1: ring layer (full/streaming without staging, sliding window):
                                   victim = slot sinks + evictions mod (C_l - sinks), P_l = C_l */
    const float *lsh_proj;      /* (n_layer, lsh_bits, head_dim) float32 projections, or NULL
                                   unless policy is RL_POLICY_LSH */
    int k_type, v_type;         /* element types of the K and V rows, GGML codes: RL_TYPE_F32 (0: a
                                   zeroed struct), RL_TYPE_F16 (IEEE half per value), RL_TYPE_Q8_0
                                   (block_q8_0 along head_dim, head_dim a multiple of 32); a row of
                                   head_dim values takes 4 * head_dim, 2 * head_dim or
                                   head_dim / 32 * 34 bytes */
    int window;                 /* observation window w (snapkv, pyramidkv, rkv, adakv: a slot's score is the mass
                                   the last w queries gave it, summed over the GQA group, w x group <= 16384;
                                   gvote: the queries its Gaussian is fitted to, 1..4096) */
    int pool;                   /* odd max-pooling kernel over neighbouring tokens (snapkv, pyramidkv, adakv) */
    double rkv_lambda;          /* weight of importance against redundancy in [0, 1] (rkv) */
    int head_floor;             /* tokens each kv head keeps at least (adakv), >= sinks + recent + 1 */
    int gvote_samples;          /* synthetic queries S, 1..64 (gvote) */
    double gvote_p;             /* nucleus mass p in (0, 1] (gvote) */
} rl_store_params;

/* Allocate an empty store for model m (rl_model_ready must have succeeded).
 * Under adakv a head may hold up to P_l slots while the layer as a whole keeps C_l per head on average
 * (the caller sizes P_l: runtime/policies/adakv.py head_slots).
 * RL_ERR_ARG: C_l < 1, P_l < C_l, sinks_l >= C_l on a ring layer, sinks_l + recent >= C_l on a policy
 * layer, lsh_proj missing, a k_type / v_type other than f32, f16, q8_0 (the message names them),
 * q8_0 with head_dim % 32 != 0, ... */
int rl_store_init(rl_store **out, rl_model *m, const rl_store_params *p);

/* Release the store. NULL is a no-op. */
int rl_store_free(rl_store *s);

/* Empty the store (all slots free, counters zero) without reallocating. */
int rl_store_reset(rl_store *s);

/* Empty sequence b of a batch store (a sequence leaves; the next one starts there from nothing). */
int rl_store_reset_seq(rl_store *s, int b);

/* Counters: held (n_layer, H) and evicted (n_layer, H) int64, H = n_head_kv x batch (one sequence:
 * n_head_kv), and tokens seen (batch,) (one entry for one sequence). */
int rl_store_counts(rl_store *s, int64_t *held, int64_t *evicted, int64_t *n_seen);

/* Copy layer il's slots to the host for inspection: k, v (H, P_l) rows as the store holds them
 * (keys before RoPE), each of the k_type / v_type row bytes (rl_store_params), seq, pos (H, P_l)
 * int32 (-1 / 0 for empty slots), score (H, P_l) float64; H = n_head_kv x batch. Any pointer may be
 * NULL (skipped). */
int rl_store_read_layer(rl_store *s, int il, void *k, void *v, int32_t *seq, int32_t *pos, double *score);

/* Device bytes of the store (K, V and slot metadata). */
int rl_store_bytes(rl_store *s, int64_t *out);

/* ---------------------------------------------------------------------------------------------
 * Running the model
 * ------------------------------------------------------------------------------------------- */

/* Feed n token ids (int32, each in [0, n_vocab)) through the store, in chunks of n_batch rows;
 * token by token inside a chunk for the KV writes, evictions and attention (decode semantics),
 * except on the ring layers a chunk fills without evicting (rl_model_params.prefill_mode).
 * logits: NULL (kept on the device only), or (n, n_vocab) float32 when all_logits = 1, or
 * (n_vocab,) float32 of the last token when all_logits = 0. The last token's logits stay on the
 * device for rl_pick. RL_ERR_ARG: n < 1 or an id out of range (checked before any launch). */
int rl_forward(rl_model *m, rl_store *s, const int32_t *ids, int n, float *logits, int all_logits);

/* rl_forward into sequence b of a batch store (a prompt, or a step of one sequence alone). */
int rl_forward_seq(rl_model *m, rl_store *s, int b, const int32_t *ids, int n, float *logits, int all_logits);

/* Choose the next token from the last logits on the device: greedy (first argmax) when
 * temperature <= 0; else softmax(logits / temperature) restricted to the top_k most likely
 * (top_k <= 0: all) and to the smallest set of most likely tokens whose mass reaches top_p
 * (1 = all), sampled by inverse CDF in token order with the caller's uniform u in [0, 1).
 * RL_ERR_STATE before any rl_forward. */
int rl_pick(rl_model *m, float temperature, int top_k, float top_p, float u, int32_t *token);

/* One decode step in one call: feed `token`, then choose the next one as rl_pick does.
 * logits: NULL or (n_vocab,) float32 receiving the step's logits. */
int rl_decode(rl_model *m, rl_store *s, int32_t token, float temperature, int top_k, float top_p, float u,
              int32_t *next, float *logits);

/* One decode step of every sequence of a batch store in one pass: tokens (n = batch) one per
 * sequence; each layer's projections run over the n rows as one matrix product and each KV write,
 * attention step and observation over all sequences in one launch. next (n,) receives each row's
 * greedy token (first argmax); logits NULL or (n, n_vocab) float32 (sample from these on the host).
 * Replayed as a CUDA graph when rl_model_set_graph is on. RL_ERR_STATE on a one-sequence store. */
int rl_decode_batch(rl_model *m, rl_store *s, const int32_t *tokens, int n, int32_t *next, float *logits);

/* ---------------------------------------------------------------------------------------------
 * Single kernels, for tests against the NumPy oracles (upload, one launch, download, free)
 * ------------------------------------------------------------------------------------------- */

/* out (n_rows, n_cols) float32 = the values of w's blocks (n_rows rows of row_bytes bytes). */
int rl_kernel_dequant(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w, int64_t row_bytes,
                      float *out);

/* out (T, n_rows) = x (T, n_cols) @ W.T, W in its blocks; T = 1 is the decode matvec. */
int rl_kernel_matmul(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w, int64_t row_bytes,
                     const float *x, int T, float *out);

/* out (rows, n) = norm of x (rows, n) with weight w (n,) and, for RL_NORM_LAYER, bias b (n,). */
int rl_kernel_norm(int device, int kind, const float *x, const float *w, const float *b, int rows, int n, double eps,
                   float *out);

/* out (T, n) = act(gate) * up when gated (gate, up (T, n)), else act(up); gate ignored then. */
int rl_kernel_act(int device, int act, int gated, const float *gate, const float *up, int T, int n, float *out);

/* out (n, n_cols) = embed_scale * rows ids (n,) int32 of the matrix w (n_rows, n_cols) in its blocks. */
int rl_kernel_embed(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w, int64_t row_bytes,
                    const int32_t *ids, int n, float embed_scale, float *out);

/* Attention of one query over one layer's slots (runtime/attention.py attend()):
 * q (n_head, hd) float32 before RoPE; k, v (n_kv, P) rows of types k_type, v_type (as
 * rl_store_params: RL_TYPE_F32, RL_TYPE_F16, RL_TYPE_Q8_0), keys before RoPE; pos (n_kv, P) int32
 * logical positions; count (n_kv,) int32 occupied slots (each >= 1, <= P); q_pos the query's
 * position; path one of RL_ATTEND_* below. out (n_head, hd); weights (n_head, P) float32 softmax
 * weights (columns past count untouched). RL_ERR_ARG (before any device call) on another type, an
 * unknown path, or RL_ATTEND_SPLIT where the split-K kernel cannot run (hd > 256, more than 40 KiB
 * of shared memory for group * (hd + 64) floats with group = n_head / n_kv, or P > 65535 * 64). */
int rl_kernel_attend(int device, const float *q, const void *k, const void *v, int k_type, int v_type,
                     const int32_t *pos, const int32_t *count, int n_head, int n_kv, int P, int hd, int rotary_dim,
                     double rope_base, double rope_scale, float attn_scale, int q_pos, int path, float *out,
                     float *weights);

/* Paths of the attention step. The forward pass uses RL_ATTEND_AUTO: split-K (flash-decoding: a
 * block per kv head and 64 consecutive slots for all the group's query heads, then a merge per
 * query head) for layers with more than RL_ATTEND_SPLIT_MIN_P slots, else one block per query
 * head walking all its slots (the kernel of the small-store parity tests). */
#define RL_ATTEND_AUTO 0
#define RL_ATTEND_SINGLE 1
#define RL_ATTEND_SPLIT 2
#define RL_ATTEND_SPLIT_MIN_P 256

/* rl_pick over a host logits row (n,) float32. */
int rl_kernel_pick(int device, const float *logits, int n, float temperature, int top_k, float top_p, float u,
                   int32_t *token);
