// GGUF block decoding, 8 values at a time: dq8_block<QT>(block, j, v), dq8<QT>(row, i0, v) and
// dq1<QT>(row, i) for the matmul, dequant and embedding kernels of quant.cu. The same source also
// compiles as plain C++ on the host (tests/native_dequant_check.cpp), so that a machine without a
// GPU checks the decoding bit for bit against runtime/dequant.py: the intrinsics go through the
// rl_* shims below, whose host versions implement the CUDA semantics.
//
// Block layouts follow ggml-common.h (block_q4_0 ... block_q6_K) and the value order of
// ggml-quants.c's dequantize_row_*, exactly as runtime/dequant.py documents them. Where a multiply
// is followed by an add, rl_fmul / rl_fadd / rl_fsub keep them two rounded operations (nvcc would
// fuse them into an FMA), so the values are bit-identical to runtime/dequant.py and gguf.quants.
//
// A decode matvec is bound by this arithmetic, not by memory, so it is written for few
// instructions per value:
//  * packed fields are extracted four values at a time with word masks ((w >> 4) & 0x0F0F0F0F);
//  * a small integer q becomes a float without a conversion instruction (a quarter of the FP32
//    rate): the bits 0x4B000000 | q are the float 2^23 + q, so subtracting 2^23 + bias gives
//    q - bias exactly (both operands lie in [2^23, 2^24), where floats are the integers). A byte
//    permute (rl_byte_perm) puts byte k of a packed word under the exponent in one instruction;
//  * weights are read in aligned words. Contract: a row starts at a multiple of its byte length
//    from an allocation of its own (cudaMalloc: 256-byte aligned), and every block size is even,
//    so half-width fields are 2-byte aligned. Q4_1 blocks (20 bytes) keep their quants 4-byte
//    aligned, Q5_1 / Q4_K / Q5_K blocks (24, 144, 176 bytes) 8-byte aligned; the others (18, 22,
//    34, 210 bytes) only 2-byte aligned, read by ld8's funnel shift.
#pragma once

#include <stdint.h>
#include <string.h>

// the RL_TYPE_* codes: ringllm_cuda.h, which has no include guard (cffi's cdef reads it as is), so
// its includer (common.cuh, or the host check) brings it in first
#ifndef RL_TYPE_Q6_K
#error "include ringllm_cuda.h (common.cuh) before dequant.cuh"
#endif

#ifdef __CUDACC__
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define RL_HD __host__ __device__ __forceinline__
#else   // plain C++ (the host check): CUDA's vector types, as laid out by vector_types.h
#define RL_HD inline
struct alignas(8) uint2 { uint32_t x, y; };
struct alignas(16) uint4 { uint32_t x, y, z, w; };
struct alignas(16) float4 { float x, y, z, w; };
inline uint2 make_uint2(uint32_t x, uint32_t y) { return {x, y}; }
inline uint4 make_uint4(uint32_t x, uint32_t y, uint32_t z, uint32_t w) { return {x, y, z, w}; }
#endif

namespace rl_dequant {

constexpr int QK_K = 256;

// ---------------------------------------------------------------------------------------------
// Intrinsic shims: CUDA's on the device, the same semantics on the host
// ---------------------------------------------------------------------------------------------

template <typename T> RL_HD T rl_ldg(const T *p) {
#ifdef __CUDA_ARCH__
    return __ldg(p);
#else
    return *p;
#endif
}

RL_HD float rl_bits_float(uint32_t u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    float f;
    memcpy(&f, &u, 4);
    return f;
#endif
}

// result byte n = byte s<4n+2:4n> of the 8 bytes {y:x} (x bytes 0-3, y bytes 4-7): __byte_perm
RL_HD uint32_t rl_byte_perm(uint32_t x, uint32_t y, uint32_t s) {
#ifdef __CUDA_ARCH__
    return __byte_perm(x, y, s);
#else
    const uint64_t v = ((uint64_t)y << 32) | x;
    uint32_t r = 0;
    for (int n = 0; n < 4; n++) r |= (uint32_t)((v >> (8 * ((s >> (4 * n)) & 7))) & 0xFFu) << (8 * n);
    return r;
#endif
}

// low 32 bits of the 64-bit {hi:lo} shifted right by sh & 31: __funnelshift_r
RL_HD uint32_t rl_funnel_r(uint32_t lo, uint32_t hi, uint32_t sh) {
#ifdef __CUDA_ARCH__
    return __funnelshift_r(lo, hi, sh);
#else
    return (uint32_t)((((uint64_t)hi << 32) | lo) >> (sh & 31));
#endif
}

// Rounded float operations that are never fused (the host check is compiled with -ffp-contract=off).
RL_HD float rl_fmul(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fmul_rn(a, b);
#else
    return a * b;
#endif
}

RL_HD float rl_fadd(float a, float b) {
#ifdef __CUDA_ARCH__
    return __fadd_rn(a, b);
#else
    return a + b;
#endif
}

// a - b is a + (-b) exactly (IEEE subtraction)
RL_HD float rl_fsub(float a, float b) { return rl_fadd(a, -b); }

// IEEE binary16 bits -> float32, exact (subnormals, signed zeros, inf/NaN), like NumPy's cast
RL_HD float rl_half_float(uint32_t h) {
#ifdef __CUDA_ARCH__
    return __half2float(__ushort_as_half((unsigned short)h));
#else
    const uint32_t sign = (h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 1023;
    if (e == 31) return rl_bits_float(sign | 0x7F800000u | (m << 13));
    if (e != 0) return rl_bits_float(sign | ((e + 112) << 23) | (m << 13));
    const float f = (float)m * 5.9604644775390625e-08f;   // m * 2^-24: exact
    return sign ? -f : f;
#endif
}

// ---------------------------------------------------------------------------------------------
// Loads and small-integer conversion
// ---------------------------------------------------------------------------------------------

RL_HD uint32_t ld_u16(const uint8_t *p) { return rl_ldg(reinterpret_cast<const unsigned short *>(p)); }

RL_HD uint32_t ld_u32_2aligned(const uint8_t *p) { return ld_u16(p) | (ld_u16(p + 2) << 16); }

RL_HD float f16_at(const uint8_t *p) { return rl_half_float(ld_u16(p)); }

// Bytes p[0..7] as two little-endian words (x: bytes 0-3), p 8-byte aligned: one load.
RL_HD uint2 ld8_aligned8(const uint8_t *p) { return rl_ldg(reinterpret_cast<const uint2 *>(p)); }

// ... p 4-byte aligned: two loads.
RL_HD uint2 ld8_aligned4(const uint8_t *p) {
    const uint32_t *w = reinterpret_cast<const uint32_t *>(p);
    return make_uint2(rl_ldg(w), rl_ldg(w + 1));
}

// ... any p: 2 or 3 aligned 32-bit loads and a funnel shift. The third word is read only when p is
// not 4-aligned; it then holds byte p[7], so it lies inside the allocation.
RL_HD uint2 ld8(const uint8_t *p) {
    const uintptr_t a = reinterpret_cast<uintptr_t>(p);
    const uint32_t *w = reinterpret_cast<const uint32_t *>(a & ~(uintptr_t)3);
    const uint32_t sh = (uint32_t)(a & 3) * 8;
    const uint32_t w0 = rl_ldg(w), w1 = rl_ldg(w + 1), w2 = sh ? rl_ldg(w + 2) : 0u;
    return make_uint2(rl_funnel_r(w0, w1, sh), rl_funnel_r(w1, w2, sh));
}

// (float)(q - BIAS) for the integer q < 2^23 held in bits 0..22 (exact; see the file comment)
template <int BIAS> RL_HD float small_int_float(uint32_t q) {
    return rl_bits_float(0x4B000000u | q) - (8388608.0f + (float)BIAS);
}

// (float)(byte k of w - BIAS), k a compile-time constant after unrolling: one permute, one add
template <int BIAS> RL_HD float byte_float(uint32_t w, int k) {
    return rl_bits_float(rl_byte_perm(w, 0x4B000000u, 0x7440u | (uint32_t)k)) - (8388608.0f + (float)BIAS);
}

// byte k (0..7) of a pair of words
template <int BIAS> RL_HD float byte_float(uint2 q, int k) { return byte_float<BIAS>(k < 4 ? q.x : q.y, k & 3); }

// get_scale_min_k4 of ggml-quants.c: 6-bit scale and min of sub-block j from 12 packed bytes
RL_HD void scale_min_k4(const uint8_t *q, int j, uint32_t *sc, uint32_t *mn) {
    if (j < 4) {
        *sc = q[j] & 63;
        *mn = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *mn = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// Nibble half sh (0 or 4) of each byte of a pair of words, and bit pairs / single bits moved to
// bits 4-5 / bit 4: the packed quants of four values per word.
RL_HD uint2 nibbles(uint2 q, int sh) { return make_uint2((q.x >> sh) & 0x0F0F0F0Fu, (q.y >> sh) & 0x0F0F0F0Fu); }

RL_HD uint2 with_high(uint2 lo, uint2 hi, int sh, uint32_t mask) {
    return make_uint2(lo.x | (((hi.x >> sh) & mask) << 4), lo.y | (((hi.y >> sh) & mask) << 4));
}

// ---------------------------------------------------------------------------------------------
// dq8_block<QT>(b, j, v): values j .. j + 7 (j % 8 == 0) of the block at b into v[8]
// ---------------------------------------------------------------------------------------------

// Values per block and bytes per block of each type (float types: blocks of one value).
template <int QT> struct BlockShape;
template <> struct BlockShape<RL_TYPE_F32> { static constexpr int values = 1, bytes = 4; };
template <> struct BlockShape<RL_TYPE_F16> { static constexpr int values = 1, bytes = 2; };
template <> struct BlockShape<RL_TYPE_BF16> { static constexpr int values = 1, bytes = 2; };
template <> struct BlockShape<RL_TYPE_Q4_0> { static constexpr int values = 32, bytes = 18; };
template <> struct BlockShape<RL_TYPE_Q4_1> { static constexpr int values = 32, bytes = 20; };
template <> struct BlockShape<RL_TYPE_Q5_0> { static constexpr int values = 32, bytes = 22; };
template <> struct BlockShape<RL_TYPE_Q5_1> { static constexpr int values = 32, bytes = 24; };
template <> struct BlockShape<RL_TYPE_Q8_0> { static constexpr int values = 32, bytes = 34; };
template <> struct BlockShape<RL_TYPE_Q4_K> { static constexpr int values = QK_K, bytes = 144; };
template <> struct BlockShape<RL_TYPE_Q5_K> { static constexpr int values = QK_K, bytes = 176; };
template <> struct BlockShape<RL_TYPE_Q6_K> { static constexpr int values = QK_K, bytes = 210; };

// A kernel whose lane reads values lane * 8 + 256 s (s = 0, 1, ...) of a row keeps j fixed and
// moves b by a constant: everything derived from j (shifts, offsets, scale indices) is computed
// once per row, not once per step.
template <int QT> RL_HD void dq8_block(const uint8_t *b, int j, float v[8]);

template <> RL_HD void dq8_block<RL_TYPE_F32>(const uint8_t *b, int, float v[8]) {
    const float *p = reinterpret_cast<const float *>(b);
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) {
        const float4 *p4 = reinterpret_cast<const float4 *>(p);
        const float4 a = rl_ldg(p4), b = rl_ldg(p4 + 1);
        v[0] = a.x; v[1] = a.y; v[2] = a.z; v[3] = a.w; v[4] = b.x; v[5] = b.y; v[6] = b.z; v[7] = b.w;
        return;
    }
    for (int k = 0; k < 8; k++) v[k] = p[k];
}

// 8 half-width values as four words (one 16-byte load when aligned): element k is half k & 1 of word k / 2
RL_HD uint4 ld16_halves(const unsigned short *p) {
    if ((reinterpret_cast<uintptr_t>(p) & 15) == 0) return rl_ldg(reinterpret_cast<const uint4 *>(p));
    return make_uint4((uint32_t)p[0] | ((uint32_t)p[1] << 16), (uint32_t)p[2] | ((uint32_t)p[3] << 16),
                      (uint32_t)p[4] | ((uint32_t)p[5] << 16), (uint32_t)p[6] | ((uint32_t)p[7] << 16));
}

RL_HD uint32_t half_of(uint4 q, int k) {
    const uint32_t w = k < 2 ? q.x : k < 4 ? q.y : k < 6 ? q.z : q.w;
    return (w >> (16 * (k & 1))) & 0xFFFFu;
}

template <> RL_HD void dq8_block<RL_TYPE_F16>(const uint8_t *b, int, float v[8]) {
    const uint4 q = ld16_halves(reinterpret_cast<const unsigned short *>(b));
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = rl_half_float(half_of(q, k));
}

template <> RL_HD void dq8_block<RL_TYPE_BF16>(const uint8_t *b, int, float v[8]) {
    const uint4 q = ld16_halves(reinterpret_cast<const unsigned short *>(b));
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = rl_bits_float(half_of(q, k) << 16);
}

// Legacy 32-value blocks: value j < 16 is the low nibble of qs[j], value j + 16 its high nibble.
template <> RL_HD void dq8_block<RL_TYPE_Q4_0>(const uint8_t *b, int j0, float v[8]) {
    const float d = f16_at(b);
    const uint2 q = nibbles(ld8(b + 2 + (j0 & 15)), j0 >= 16 ? 4 : 0);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * byte_float<8>(q, k);
}

template <> RL_HD void dq8_block<RL_TYPE_Q4_1>(const uint8_t *b, int j0, float v[8]) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint2 q = nibbles(ld8_aligned4(b + 4 + (j0 & 15)), j0 >= 16 ? 4 : 0);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = rl_fadd(rl_fmul(d, byte_float<0>(q, k)), m);
}

// Q5_0 / Q5_1: bit j of the 32-bit qh is value j's fifth bit. Value k of 8: its nibble (byte k of
// the masked pair) with bit k of qh (already shifted to the first value) above it.
RL_HD uint32_t nibble_with_bit(uint2 q, uint32_t qh, int k) {
    return (((k < 4 ? q.x : q.y) >> (8 * (k & 3))) & 15) | ((qh >> k) & 1) << 4;
}

template <> RL_HD void dq8_block<RL_TYPE_Q5_0>(const uint8_t *b, int j0, float v[8]) {
    const float d = f16_at(b);
    const uint32_t qh = ld_u32_2aligned(b + 2) >> j0;
    const uint2 q = nibbles(ld8(b + 6 + (j0 & 15)), j0 >= 16 ? 4 : 0);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = d * small_int_float<16>(nibble_with_bit(q, qh, k));
}

template <> RL_HD void dq8_block<RL_TYPE_Q5_1>(const uint8_t *b, int j0, float v[8]) {
    const float d = f16_at(b), m = f16_at(b + 2);
    const uint32_t qh = ld_u32_2aligned(b + 4) >> j0;
    const uint2 q = nibbles(ld8_aligned8(b + 8 + (j0 & 15)), j0 >= 16 ? 4 : 0);
#pragma unroll
    for (int k = 0; k < 8; k++)
        v[k] = rl_fadd(rl_fmul(d, small_int_float<0>(nibble_with_bit(q, qh, k))), m);
}

// Q8_0: signed bytes; s ^ 0x80 is s + 128 as an unsigned byte.
template <> RL_HD void dq8_block<RL_TYPE_Q8_0>(const uint8_t *b, int j, float v[8]) {
    const float d = f16_at(b);
    const uint2 raw = ld8(b + 2 + j);
    const uint2 q = make_uint2(raw.x ^ 0x80808080u, raw.y ^ 0x80808080u);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = byte_float<128>(q, k) * d;
}

// K-quants: chunk c = j / 64 of a super-block holds sub-blocks 2c (low nibbles of qs[32c..]) and
// 2c + 1 (high nibbles); y = (d * sc) * q - dmin * m.
template <> RL_HD void dq8_block<RL_TYPE_Q4_K>(const uint8_t *b, int j, float v[8]) {
    const int c = j >> 6, hi = (j >> 5) & 1, l0 = j & 31;
    uint32_t sc, mn;
    scale_min_k4(b + 4, 2 * c + hi, &sc, &mn);
    const float d1 = rl_fmul(f16_at(b), small_int_float<0>(sc)), dm = rl_fmul(f16_at(b + 2), small_int_float<0>(mn));
    const uint2 q = nibbles(ld8_aligned8(b + 16 + 32 * c + l0), 4 * hi);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = rl_fsub(rl_fmul(d1, byte_float<0>(q, k)), dm);
}

template <> RL_HD void dq8_block<RL_TYPE_Q5_K>(const uint8_t *b, int j, float v[8]) {
    const int c = j >> 6, hi = (j >> 5) & 1, l0 = j & 31;
    uint32_t sc, mn;
    scale_min_k4(b + 4, 2 * c + hi, &sc, &mn);
    const float d1 = rl_fmul(f16_at(b), small_int_float<0>(sc)), dm = rl_fmul(f16_at(b + 2), small_int_float<0>(mn));
    const uint2 q = with_high(nibbles(ld8_aligned8(b + 48 + 32 * c + l0), 4 * hi), ld8_aligned8(b + 16 + l0),
                              2 * c + hi, 0x01010101u);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = rl_fsub(rl_fmul(d1, byte_float<0>(q, k)), dm);
}

// Q6_K: per 128-value half n, quarter qd = (j % 128) / 32, l = j % 32:
// q = (ql[64n + l + 32(qd & 1)] >> 4(qd >> 1)) & 15 | ((qh[32n + l] >> 2qd) & 3) << 4, minus 32;
// y = (d * scales[8n + l/16 + 2qd]) * q.
template <> RL_HD void dq8_block<RL_TYPE_Q6_K>(const uint8_t *b, int j, float v[8]) {
    const int n = j >> 7, qd = (j >> 5) & 3, l0 = j & 31;
    const float d = f16_at(b + 208);
    const float ds = d * (float)(int8_t)b[192 + 8 * n + (l0 >> 4) + 2 * qd];
    const uint2 q = with_high(nibbles(ld8(b + 64 * n + 32 * (qd & 1) + l0), 4 * (qd >> 1)), ld8(b + 128 + 32 * n + l0),
                              2 * qd, 0x03030303u);
#pragma unroll
    for (int k = 0; k < 8; k++) v[k] = ds * byte_float<32>(q, k);
}

// Values i0 .. i0 + 7 of one row (i0 % 8 == 0) into v[8].
template <int QT> RL_HD void dq8(const uint8_t *row, int i0, float v[8]) {
    constexpr int BV = BlockShape<QT>::values;
    dq8_block<QT>(row + (int64_t)(i0 / BV) * BlockShape<QT>::bytes, i0 % BV, v);
}

// The blocks one lane of a warp reads along a row when the warp covers 256 values per step (lane l:
// values l * 8 + 256 s, s = 0, 1, ...): j stays, the block pointer moves by a constant.
template <int QT> struct LaneBlocks {
    static constexpr int BV = BlockShape<QT>::values;
    static constexpr int64_t STEP = (int64_t)(256 / BV) * BlockShape<QT>::bytes;
    const uint8_t *blk;
    int j;
    RL_HD LaneBlocks(const uint8_t *row, int lane)
        : blk(row + (int64_t)(lane * 8 / BV) * BlockShape<QT>::bytes), j((lane * 8) % BV) {}
    RL_HD void decode(float v[8]) const { dq8_block<QT>(blk, j, v); }
    RL_HD void next() { blk += STEP; }
};

// Dispatch over the GGML type: F(QT) is a generic lambda called with an integral constant.
template <int QT> struct TypeTag { static constexpr int value = QT; };

template <typename F> void dispatch_type(int qtype, F &&f) {
    switch (qtype) {
        case RL_TYPE_F32: f(TypeTag<RL_TYPE_F32>()); break;
        case RL_TYPE_F16: f(TypeTag<RL_TYPE_F16>()); break;
        case RL_TYPE_BF16: f(TypeTag<RL_TYPE_BF16>()); break;
        case RL_TYPE_Q4_0: f(TypeTag<RL_TYPE_Q4_0>()); break;
        case RL_TYPE_Q4_1: f(TypeTag<RL_TYPE_Q4_1>()); break;
        case RL_TYPE_Q5_0: f(TypeTag<RL_TYPE_Q5_0>()); break;
        case RL_TYPE_Q5_1: f(TypeTag<RL_TYPE_Q5_1>()); break;
        case RL_TYPE_Q8_0: f(TypeTag<RL_TYPE_Q8_0>()); break;
        case RL_TYPE_Q4_K: f(TypeTag<RL_TYPE_Q4_K>()); break;
        case RL_TYPE_Q5_K: f(TypeTag<RL_TYPE_Q5_K>()); break;
        case RL_TYPE_Q6_K: f(TypeTag<RL_TYPE_Q6_K>()); break;
        default: break;   // callers validated the type (quant.cu's rl_type_layout)
    }
}

// One value (tails of float rows whose length is not a multiple of 8): floats only.
template <int QT> RL_HD float dq1(const uint8_t *row, int i) {
    if (QT == RL_TYPE_F32) return reinterpret_cast<const float *>(row)[i];
    if (QT == RL_TYPE_F16) return rl_half_float(reinterpret_cast<const unsigned short *>(row)[i]);
    return rl_bits_float((uint32_t)reinterpret_cast<const unsigned short *>(row)[i] << 16);
}

}  // namespace rl_dequant
