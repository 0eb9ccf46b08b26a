// The C API of include/ringllm_cuda.h, part one: errors, devices, and the single kernels the tests
// check against their oracles. The handles are in handles.cuh; model.cu, store.cu and forward.cu
// implement the rest.
#include "handles.cuh"

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

int use_device(int device) {
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
