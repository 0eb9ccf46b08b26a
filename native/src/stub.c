/* The no-CUDA build of the C API (nvcc was not found when ringllm was installed).
 *
 * Every entry point of include/ringllm_cuda.h exists, so the cffi module imports and the Python
 * wrapper can raise a clear error at construction; each returns RL_ERR_NO_CUDA except
 * rl_last_error, rl_has_cuda (0) and rl_build_info. */
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#include "ringllm_cuda.h"

static const char *const NO_CUDA =
    "ringllm was built without CUDA: nvcc was not found when it was installed. Install the CUDA toolkit "
    "(or set CUDA_HOME / put nvcc on PATH) and reinstall ringllm (pip install -e .) to use backend='cuda'";

#define NOT_BUILT return RL_ERR_NO_CUDA

const char *rl_last_error(void) { return NO_CUDA; }
int rl_has_cuda(void) { return 0; }

int rl_build_info(char *buf, int buf_len) {
    if (!buf || buf_len < 1) return RL_ERR_ARG;
    snprintf(buf, (size_t)buf_len, "built without CUDA (nvcc not found at install)");
    return RL_OK;
}

int rl_device_count(int *n) { if (n) *n = 0; NOT_BUILT; }
int rl_device_info(int device, char *name, int name_len, int64_t *total_mem) { NOT_BUILT; }
int rl_model_init(rl_model **out, const rl_model_params *p) { if (out) *out = NULL; NOT_BUILT; }
int rl_model_free(rl_model *m) { return RL_OK; }
int rl_model_set_matrix(rl_model *m, int role, int il, int qtype, int64_t n_rows, int64_t n_cols,
                        const uint8_t *data, int64_t row_bytes) { NOT_BUILT; }
int rl_model_set_vector(rl_model *m, int role, int il, const float *data, int64_t n) { NOT_BUILT; }
int rl_model_set_rope(rl_model *m, int il, double base, double scale) { NOT_BUILT; }
int rl_model_ready(rl_model *m) { NOT_BUILT; }
int rl_model_weight_bytes(rl_model *m, int64_t *out) { NOT_BUILT; }
int rl_model_set_graph(rl_model *m, int enable) { NOT_BUILT; }
int rl_model_set_fused(rl_model *m, int enable) { NOT_BUILT; }
int rl_store_init(rl_store **out, rl_model *m, const rl_store_params *p) { if (out) *out = NULL; NOT_BUILT; }
int rl_store_free(rl_store *s) { return RL_OK; }
int rl_store_reset(rl_store *s) { NOT_BUILT; }
int rl_store_reset_seq(rl_store *s, int b) { NOT_BUILT; }
int rl_store_counts(rl_store *s, int64_t *held, int64_t *evicted, int64_t *n_seen) { NOT_BUILT; }
int rl_store_read_layer(rl_store *s, int il, void *k, void *v, int32_t *seq, int32_t *pos, double *score) { NOT_BUILT; }
int rl_store_bytes(rl_store *s, int64_t *out) { NOT_BUILT; }
int rl_forward(rl_model *m, rl_store *s, const int32_t *ids, int n, float *logits, int all_logits) { NOT_BUILT; }
int rl_forward_seq(rl_model *m, rl_store *s, int b, const int32_t *ids, int n, float *logits, int all_logits) {
    NOT_BUILT;
}
int rl_decode_batch(rl_model *m, rl_store *s, const int32_t *tokens, int n, int32_t *next, float *logits) {
    NOT_BUILT;
}
int rl_pick(rl_model *m, float temperature, int top_k, float top_p, float u, int32_t *token) { NOT_BUILT; }
int rl_decode(rl_model *m, rl_store *s, int32_t token, float temperature, int top_k, float top_p, float u,
              int32_t *next, float *logits) { NOT_BUILT; }
int rl_kernel_dequant(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w, int64_t row_bytes,
                      float *out) { NOT_BUILT; }
int rl_kernel_matmul(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w, int64_t row_bytes,
                     const float *x, int T, float *out) { NOT_BUILT; }
int rl_kernel_norm(int device, int kind, const float *x, const float *w, const float *b, int rows, int n, double eps,
                   float *out) { NOT_BUILT; }
int rl_kernel_act(int device, int act, int gated, const float *gate, const float *up, int T, int n, float *out) {
    NOT_BUILT;
}
int rl_kernel_embed(int device, int qtype, int64_t n_rows, int64_t n_cols, const uint8_t *w, int64_t row_bytes,
                    const int32_t *ids, int n, float embed_scale, float *out) { NOT_BUILT; }
int rl_kernel_attend(int device, const float *q, const void *k, const void *v, int k_type, int v_type,
                     const int32_t *pos, const int32_t *count, int n_head, int n_kv, int P, int hd, int rotary_dim,
                     double rope_base, double rope_scale, float attn_scale, int q_pos, int path, float *out,
                     float *weights) {
    NOT_BUILT;
}
int rl_kernel_pick(int device, const float *logits, int n, float temperature, int top_k, float top_p, float u,
                   int32_t *token) { NOT_BUILT; }
