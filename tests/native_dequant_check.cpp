// Host check of native/src/dequant.cuh: the GPU's block decoding compiled as plain C++, so that a
// machine without a GPU checks it bit for bit against runtime/dequant.py (tests/test_native.py).
//
//   native_dequant_check QTYPE N_ROWS N_COLS ROW_BYTES IN OUT rows|lanes
//
// IN holds N_ROWS rows of ROW_BYTES raw GGUF bytes; OUT gets N_ROWS x N_COLS float32 values, each
// row decoded 8 values at a time (dq1 for a float row's tail): "rows" with dq8 at every multiple of
// 8, as the dequant and embedding kernels; "lanes" with LaneBlocks, as each lane of a decode
// matvec's warp walks the row. The rows lie in one 256-byte aligned buffer, as cudaMalloc's would.
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>

extern "C" {
#include "ringllm_cuda.h"
}

#include "dequant.cuh"

using namespace rl_dequant;

template <int QT> static void decode(float *out, const uint8_t *w, long n_rows, long n_cols, long row_bytes,
                                     bool lanes) {
    for (long r = 0; r < n_rows; r++) {
        const uint8_t *row = w + r * row_bytes;
        float *o = out + r * n_cols;
        const long n8 = n_cols & ~7L;
        if (lanes) {   // as a decode matvec's warp: lane l walks values l * 8 + 256 s
            for (int lane = 0; lane < 32; lane++) {
                LaneBlocks<QT> blocks(row, lane);
                for (long i0 = lane * 8; i0 < n8; i0 += 256, blocks.next()) blocks.decode(o + i0);
            }
        } else {       // as the dequant and embedding kernels: dq8 at each multiple of 8
            for (long i0 = 0; i0 < n8; i0 += 8) dq8<QT>(row, (int)i0, o + i0);
        }
        for (long i = n8; i < n_cols; i++) o[i] = dq1<QT>(row, (int)i);
    }
}

int main(int argc, char **argv) {
    if (argc != 8) {
        fprintf(stderr, "usage: %s QTYPE N_ROWS N_COLS ROW_BYTES IN OUT rows|lanes\n", argv[0]);
        return 2;
    }
    const bool lanes = argv[7][0] == 'l';
    const int qtype = atoi(argv[1]);
    const long n_rows = atol(argv[2]), n_cols = atol(argv[3]), row_bytes = atol(argv[4]);
    const size_t n_in = (size_t)(n_rows * row_bytes);
    uint8_t *w = (uint8_t *)aligned_alloc(256, (n_in + 255) / 256 * 256);
    float *out = (float *)malloc(sizeof(float) * (size_t)(n_rows * n_cols));
    FILE *f = fopen(argv[5], "rb");
    if (!w || !out || !f || fread(w, 1, n_in, f) != n_in) {
        fprintf(stderr, "cannot read %zu bytes from %s\n", n_in, argv[5]);
        return 1;
    }
    fclose(f);
    bool known = false;   // the device kernels' type list (dispatch_type), so both cover the same types
    dispatch_type(qtype, [&](auto tag) {
        decode<decltype(tag)::value>(out, w, n_rows, n_cols, row_bytes, lanes);
        known = true;
    });
    if (!known) {
        fprintf(stderr, "unknown type %d\n", qtype);
        return 2;
    }
    f = fopen(argv[6], "wb");
    if (!f || fwrite(out, sizeof(float), (size_t)(n_rows * n_cols), f) != (size_t)(n_rows * n_cols)) return 1;
    fclose(f);
    return 0;
}
