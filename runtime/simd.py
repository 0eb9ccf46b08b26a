"""Numba intrinsics for the CPU kernels: 256-bit SIMD values and operations, and the thread count.

f32x8 and i32x8 are Numba types lowered to LLVM <8 x float> / <8 x i32>, one ymm register each
(f32x16 and i32x16, <16 x float> / <16 x i32>, serve the float32 matmul's register tiles and the
16-lane matvec kernels: one zmm where the CPU has AVX-512, HAS_AVX512);
the intrinsics below build llvmlite IR on them, so a kernel written with them compiles to the AVX2 +
FMA + F16C instruction its docstring names (vfmadd, vbroadcastss, vcvtph2ps, vpmovsxbd, ...) and
nothing else: no bounds checks, no NumPy temporaries, no reliance on the auto-vectorizer. They are
usable only inside @njit code.

Conventions. Loads from a packed uint8 buffer take a byte offset (`ld_*(buf, off)`); loads and
stores on float32 arrays take an element index (`vload(arr, i)`, `vstore(arr, i, v)`). Nothing is
bounds-checked: callers own the offsets. Integer lanes hold packed fields; `andf` / `srlf` pick a
field and convert it to float in one step (see quant_tiles.py for the field layouts).

Portability. The x86 byte and 16-bit integer instructions (vpshufb, vpmaddubsw, vpmaddwd, vpsignb)
are called by name on x86-64 only; on other targets the same intrinsics emit their exact semantics
in generic LLVM IR, which LLVM lowers to that target's vector instructions (NEON: smull / umull,
saddlp, ...), except lut16, which calls NEON tbl by name on aarch64 and selects byte by byte
elsewhere: the kernels compute the same bits on every CPU. dpbusd has no portable form: its
callers take it only where the host has VNNI (quant_tiles_q8.HAS_VNNI). `TARGET_ARCH` is the
architecture Numba compiles for (the process's target triple).

`num_threads` is here because it is an intrinsic of the same kind: it calls the OpenMP layer's
get_num_threads by symbol name, which keeps every kernel that asks for the thread count cacheable
(Numba's own overload embeds a process-specific address).
"""
from llvmlite import binding, ir
from numba import types
from numba.core import cgutils, config
from numba.extending import intrinsic, models, register_model

__all__ = ["f32x8", "i32x8", "f32x16", "i32x16", "zzero", "zload", "zstore", "zbcast", "zfma", "zadd", "zfold",
           "zld_i32", "zpair", "zmul", "zlo", "zhi", "HAS_AVX512", "vzero", "vsplat", "vbcast", "vload", "vload_kv",
           "vstore", "ld_f32", "ld_f16", "ld_bf16", "ld_i8", "ld_u8", "ld_i32", "prefetch", "cpu_pause", "vfma",
           "vfnma", "vadd", "vsub", "vmax", "vhmax", "vmul", "isrl", "andf", "srlf", "vhsum", "vsum8x8",
           "num_threads", "ld_u8i", "iand", "lut16", "bc_i32", "maddubs", "add16", "hadd16", "iadd", "ior", "ishl",
           "itof", "abs8", "sign8", "vlane", "f16_round", "izero", "dpbusd", "ixor", "zizero", "zbc_i32",
           "zjoin_i32", "zcat", "zsplat", "zsub", "zfnma", "compiles_for", "TARGET_ARCH", "X86", "ld_u64", "st_u32",
           "st_u16"]


# ==================================================================================================
# Types: <8 x float> and <8 x i32> as Numba values, and the IR helpers the intrinsics share
# ==================================================================================================

class F32x8Type(types.Type):
    """Eight float32 lanes (an LLVM <8 x float>, one ymm register)."""

    def __init__(self):
        super().__init__(name="f32x8")


class I32x8Type(types.Type):
    """Eight 32-bit integer lanes (an LLVM <8 x i32>)."""

    def __init__(self):
        super().__init__(name="i32x8")


class F32x16Type(types.Type):
    """Sixteen float32 lanes (an LLVM <16 x float>: one zmm register where the CPU has AVX-512, two
    ymm registers elsewhere; the lanes compute the same bits either way)."""

    def __init__(self):
        super().__init__(name="f32x16")


class I32x16Type(types.Type):
    """Sixteen 32-bit integer lanes (an LLVM <16 x i32>), the packed fields of two 8-lane slots."""

    def __init__(self):
        super().__init__(name="i32x16")


f32x8 = F32x8Type()
i32x8 = I32x8Type()
f32x16 = F32x16Type()
i32x16 = I32x16Type()
_VF = ir.VectorType(ir.FloatType(), 8)
_VF16 = ir.VectorType(ir.FloatType(), 16)
_VI = ir.VectorType(ir.IntType(32), 8)
_VI16 = ir.VectorType(ir.IntType(32), 16)
_I32 = ir.IntType(32)

TARGET_ARCH = binding.get_process_triple().split("-")[0]     # "x86_64", "aarch64", ...
X86 = TARGET_ARCH in ("x86_64", "i386", "i686")


def compiles_for(*features: str) -> bool:
    """Whether Numba compiles for a CPU with every one of `features` (LLVM names: "avx512f",
    "avx512vnni", ...): the host's features, unless NUMBA_CPU_FEATURES names the features (then each
    "+feature" among them) or NUMBA_CPU_NAME names another CPU than the host (then no: a cache built
    for a CPU model, e.g. to ship, keeps the kernels that every x86-64 runs well)."""
    if config.CPU_FEATURES:
        named = config.CPU_FEATURES.split(",")
        return all("+" + f in named for f in features)
    if config.CPU_NAME and config.CPU_NAME != "host":
        return False
    host = binding.get_host_cpu_features()
    return all(host.get(f, False) for f in features)


# Numba compiles for a CPU with 512-bit vectors (AVX-512F): the kernels with 16-lane variants take them.
# Numba's cache is keyed by the target CPU's name and features, so a cache written for one kind of CPU
# is never loaded on another.
HAS_AVX512 = compiles_for("avx512f")


@register_model(F32x8Type)
class _F32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF)


@register_model(I32x8Type)
class _I32x8Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI)


@register_model(F32x16Type)
class _F32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VF16)


@register_model(I32x16Type)
class _I32x16Model(models.PrimitiveModel):
    def __init__(self, dmm, fe_type):
        super().__init__(dmm, fe_type, _VI16)


def _elem_ptr(context, builder, arrty, arr, idx, idxty):
    """Pointer to element idx of a 1-D array (in units of its dtype)."""
    ary = context.make_array(arrty)(context, builder, arr)
    i = context.cast(builder, idx, idxty, types.intp)
    return builder.gep(ary.data, [i], inbounds=True)


def _byte_ptr(context, builder, arrty, arr, off, offty, pointee):
    """Pointer to `pointee` at byte offset off of a uint8 array's data."""
    p = _elem_ptr(context, builder, arrty, arr, off, offty)
    return builder.bitcast(p, pointee.as_pointer())


def _call(builder, name, ret, args):
    """Call the function `name` (an LLVM intrinsic or a C symbol) returning `ret`, declared in the
    module with the types of `args` on first use."""
    fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(ret, [a.type for a in args]), name)
    return builder.call(fn, args)


def _splat(builder, scalar, vty):
    """vty (a vector type of any width) with `scalar` in every lane."""
    v = builder.insert_element(ir.Constant(vty, ir.Undefined), scalar, ir.Constant(_I32, 0))
    mask = ir.Constant(ir.VectorType(_I32, vty.count), [0] * vty.count)
    return builder.shuffle_vector(v, ir.Constant(vty, ir.Undefined), mask)


def _bcast_ir(context, builder, sig, args, vty):
    """Codegen of a broadcast: vty with arr[idx] (args = arr, idx; float32 1-D array) in every lane."""
    s = builder.load(_elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1]), align=4)
    return _splat(builder, s, vty)


def _load_ir(context, builder, sig, args, vty):
    """Codegen of a vector load: vty from arr[idx:idx + width] (args = arr, idx; float32 1-D array)."""
    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
    return builder.load(builder.bitcast(p, vty.as_pointer()), align=4)


def _store_ir(context, builder, sig, args, vty):
    """Codegen of a vector store: arr[idx:idx + width] = v (args = arr, idx, v; float32 1-D array)."""
    p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
    builder.store(args[2], builder.bitcast(p, vty.as_pointer()), align=4)
    return context.get_dummy_value()


def _splat_i32(context, builder, val, valty, vty=_VI):
    return _splat(builder, context.cast(builder, val, valty, types.int32), vty)


# ==================================================================================================
# Intrinsics: loads, stores, arithmetic, field extraction
# ==================================================================================================

@intrinsic
def vzero(typingctx):
    """f32x8 of zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF, [0.0] * 8)
    return f32x8(), codegen


@intrinsic
def vsplat(typingctx, x):
    """f32x8 with the scalar x in every lane."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF)
    return f32x8(x), codegen


@intrinsic
def vbcast(typingctx, arr, idx):
    """f32x8 with arr[idx] (float32 1-D array) in every lane (vbroadcastss)."""
    def codegen(context, builder, sig, args):
        return _bcast_ir(context, builder, sig, args, _VF)
    return f32x8(arr, idx), codegen


@intrinsic
def vload(typingctx, arr, idx):
    """f32x8 from arr[idx:idx + 8] (float32 1-D array)."""
    def codegen(context, builder, sig, args):
        return _load_ir(context, builder, sig, args, _VF)
    return f32x8(arr, idx), codegen


@intrinsic
def vload_kv(typingctx, arr, idx):
    """f32x8 from arr[idx:idx + 8] of a float32 1-D array, or of a uint16 1-D array of IEEE binary16
    bit patterns (an f16 KV store's rows: vcvtph2ps, exact, so the lanes are the decoded values)."""
    if not isinstance(arr, types.Array) or arr.dtype not in (types.float32, types.uint16):
        return None

    def codegen(context, builder, sig, args):
        if sig.args[0].dtype == types.float32:
            return _load_ir(context, builder, sig, args, _VF)
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        vh = ir.VectorType(ir.HalfType(), 8)
        return builder.fpext(builder.load(builder.bitcast(p, vh.as_pointer()), align=2), _VF)
    return f32x8(arr, idx), codegen


@intrinsic
def vstore(typingctx, arr, idx, v):
    """arr[idx:idx + 8] = v (float32 1-D array)."""
    def codegen(context, builder, sig, args):
        return _store_ir(context, builder, sig, args, _VF)
    return types.none(arr, idx, v), codegen


# Sixteen lanes (f32x16): the float32 matmul's register tiles, where a CPU with AVX-512 runs one zmm
# operation for two ymm ones; each lane's arithmetic is that of the eight-lane intrinsics above.

@intrinsic
def zzero(typingctx):
    """f32x16 of zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VF16, [0.0] * 16)
    return f32x16(), codegen


@intrinsic
def zbcast(typingctx, arr, idx):
    """f32x16 with arr[idx] (float32 1-D array) in every lane."""
    def codegen(context, builder, sig, args):
        return _bcast_ir(context, builder, sig, args, _VF16)
    return f32x16(arr, idx), codegen


@intrinsic
def zload(typingctx, arr, idx):
    """f32x16 from arr[idx:idx + 16] (float32 1-D array)."""
    def codegen(context, builder, sig, args):
        return _load_ir(context, builder, sig, args, _VF16)
    return f32x16(arr, idx), codegen


@intrinsic
def zstore(typingctx, arr, idx, v):
    """arr[idx:idx + 16] = v (float32 1-D array)."""
    def codegen(context, builder, sig, args):
        return _store_ir(context, builder, sig, args, _VF16)
    return types.none(arr, idx, v), codegen


@intrinsic
def zfma(typingctx, a, b, c):
    """a * b + c, fused, lane by lane (f32x16)."""
    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v16f32", _VF16, list(args))
    return f32x16(a, b, c), codegen


@intrinsic
def zpair(typingctx, arr, i, j):
    """f32x16 with arr[i] in lanes 0..7 and arr[j] in lanes 8..15 (two vbroadcastss and a
    vinsertf64x4): the x pair of the 16-lane tile kernels, built in registers."""
    def codegen(context, builder, sig, args):
        lo, hi = (_splat(builder, builder.load(_elem_ptr(context, builder, sig.args[0], args[0], args[k], sig.args[k]),
                                               align=4), _VF) for k in (1, 2))
        return builder.shuffle_vector(lo, hi, ir.Constant(_VI16, list(range(16))))
    return f32x16(arr, i, j), codegen


@intrinsic
def zadd(typingctx, a, b):
    """a + b (f32x16)."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x16(a, b), codegen


@intrinsic
def zmul(typingctx, a, b):
    """a * b (f32x16)."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x16(a, b), codegen


def _half(builder, v, k):
    """Lanes 8k..8k+7 of a 16-lane vector, as an 8-lane one."""
    return builder.shuffle_vector(v, v, ir.Constant(_VI, list(range(8 * k, 8 * k + 8))))


@intrinsic
def zlo(typingctx, a):
    """Lanes 0..7 of an f32x16, as f32x8."""
    def codegen(context, builder, sig, args):
        return _half(builder, args[0], 0)
    return f32x8(a), codegen


@intrinsic
def zhi(typingctx, a):
    """Lanes 8..15 of an f32x16, as f32x8 (vextractf64x4)."""
    def codegen(context, builder, sig, args):
        return _half(builder, args[0], 1)
    return f32x8(a), codegen


@intrinsic
def zfold(typingctx, a):
    """f32x8: lanes 0..7 of a plus lanes 8..15 (vextractf64x4 + vaddps): the two halves of a
    16-lane accumulator that held two column runs of the same 8 rows, summed."""
    def codegen(context, builder, sig, args):
        return builder.fadd(_half(builder, args[0], 0), _half(builder, args[0], 1))
    return f32x8(a), codegen


@intrinsic
def zld_i32(typingctx, buf, off):
    """i32x16 from 16 little-endian 32-bit words at byte offset off (two adjacent 8-lane slots)."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VI16), align=4)
    return i32x16(buf, off), codegen


@intrinsic
def ld_f32(typingctx, buf, off):
    """f32x8 from 8 little-endian float32 at byte offset off of a uint8 buffer."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VF), align=4)
    return f32x8(buf, off), codegen


@intrinsic
def ld_f16(typingctx, buf, off):
    """f32x8 from 8 IEEE binary16 at byte offset off (vcvtph2ps; exact)."""
    def codegen(context, builder, sig, args):
        vh = ir.VectorType(ir.HalfType(), 8)
        h = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vh), align=2)
        return builder.fpext(h, _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_bf16(typingctx, buf, off):
    """f32x8 from 8 bfloat16 at byte offset off (vpmovzxwd + vpslld 16; exact)."""
    def codegen(context, builder, sig, args):
        vw = ir.VectorType(ir.IntType(16), 8)
        h = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vw), align=2)
        bits = builder.shl(builder.zext(h, _VI), ir.Constant(_VI, [16] * 8))
        return builder.bitcast(bits, _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_i8(typingctx, buf, off):
    """f32x8 from 8 int8 at byte offset off (vpmovsxbd + vcvtdq2ps)."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 8)
        b = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vb), align=1)
        return builder.sitofp(builder.sext(b, _VI), _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_u8(typingctx, buf, off):
    """f32x8 from 8 uint8 at byte offset off (vpmovzxbd + vcvtdq2ps)."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 8)
        b = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vb), align=1)
        return builder.sitofp(builder.zext(b, _VI), _VF)
    return f32x8(buf, off), codegen


@intrinsic
def ld_u8i(typingctx, buf, off):
    """i32x8 from 8 uint8 at byte offset off, zero-extended (vpmovzxbd), for fields packed in bytes."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 8)
        b = builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], vb), align=1)
        return builder.zext(b, _VI)
    return i32x8(buf, off), codegen


@intrinsic
def ld_i32(typingctx, buf, off):
    """i32x8 from 8 little-endian 32-bit words at byte offset off."""
    def codegen(context, builder, sig, args):
        return builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], _VI), align=4)
    return i32x8(buf, off), codegen


def _scalar_ptr(context, builder, sig, args, bits):
    """Pointer to an integer of `bits` bits at byte offset args[1] of array args[0] (C-contiguous, any
    number of dimensions: the offset counts from its first byte)."""
    return _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.IntType(bits))


@intrinsic
def ld_u64(typingctx, buf, off):
    """uint64 from the 8 bytes at byte offset off of a uint8 array (one unaligned load; little-endian
    on every target ringllm builds for, x86-64 and aarch64, as GGUF files are)."""
    def codegen(context, builder, sig, args):
        return builder.load(_scalar_ptr(context, builder, sig, args, 64), align=1)
    return types.uint64(buf, off), codegen


def _store_low(bits):
    def codegen(context, builder, sig, args):
        value = context.cast(builder, args[2], sig.args[2], types.uint64)
        builder.store(builder.trunc(value, ir.IntType(bits)), _scalar_ptr(context, builder, sig, args, bits), align=1)
        return context.get_dummy_value()
    return codegen


@intrinsic
def st_u32(typingctx, buf, off, v):
    """The low 32 bits of integer v into the 4 bytes at byte offset off of a uint8 array (one unaligned
    store, little-endian as ld_u64)."""
    return types.none(buf, off, v), _store_low(32)


@intrinsic
def st_u16(typingctx, buf, off, v):
    """The low 16 bits of integer v into the 2 bytes at byte offset off of a uint8 array (as st_u32)."""
    return types.none(buf, off, v), _store_low(16)


def _prefetch_codegen(locality):
    """Codegen of a cache-line hint at byte offset args[1] of args[0], with LLVM's locality 0-3."""
    def codegen(context, builder, sig, args):
        p = _byte_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1], ir.IntType(8))
        _call(builder, "llvm.prefetch.p0i8", ir.VoidType(), [p, ir.Constant(_I32, 0), ir.Constant(_I32, locality),
                                                            ir.Constant(_I32, 1)])
        return context.get_dummy_value()
    return codegen


@intrinsic
def prefetch(typingctx, buf, off):
    """Hint the cache line at byte offset off of buf into L2 (prefetcht1); never faults. The weights and
    the KV rows are read once per token, but a non-temporal hint (prefetchnta) lets a line go before it
    is read: on Intel it bypasses L2 and the hardware's L2 streamer, and reading the hinted rows ran
    slower than with no hint at all (docs/many_rows.md, "On a 2-core Sapphire Rapids VM")."""
    return types.none(buf, off), _prefetch_codegen(2)


@intrinsic
def cpu_pause(typingctx):
    """x86's `pause` (the spin-wait hint libgomp's waiting threads issue between polls); x86-64 only."""
    def codegen(context, builder, sig, args):
        _call(builder, "llvm.x86.sse2.pause", ir.VoidType(), [])
        return context.get_dummy_value()
    return types.none(), codegen


@intrinsic
def vfma(typingctx, a, b, c):
    """a * b + c, fused (vfmadd)."""
    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v8f32", _VF, list(args))
    return f32x8(a, b, c), codegen


@intrinsic
def vfnma(typingctx, a, b, c):
    """c - a * b, fused (vfnmadd)."""
    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v8f32", _VF, [builder.fneg(args[0]), args[1], args[2]])
    return f32x8(a, b, c), codegen


@intrinsic
def vadd(typingctx, a, b):
    """a + b."""
    def codegen(context, builder, sig, args):
        return builder.fadd(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def vmax(typingctx, a, b):
    """Lane-wise maximum, a where a > b else b (one compare and select; maxps on x86)."""
    def codegen(context, builder, sig, args):
        return builder.select(builder.fcmp_ordered(">", args[0], args[1]), args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def vhmax(typingctx, v):
    """The largest of the 8 lanes, as float32 (lanes compared as vmax compares them)."""
    def codegen(context, builder, sig, args):
        m = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for k in range(1, 8):
            x = builder.extract_element(args[0], ir.Constant(_I32, k))
            m = builder.select(builder.fcmp_ordered(">", m, x), m, x)
        return m
    return types.float32(v), codegen


@intrinsic
def vsub(typingctx, a, b):
    """a - b."""
    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return f32x8(a, b), codegen


def _butterfly_ir(builder, v, k):
    """Lanes (i, i ^ k) of v -> (a + b, a - b) for bit k of i clear (a = v[i], b = v[i ^ k]): a lane
    swap (vpermilps / vpermps) and one fused v * (+-1) + swapped; exact for integer-valued lanes."""
    swapped = builder.shuffle_vector(v, v, ir.Constant(ir.VectorType(_I32, 8), [i ^ k for i in range(8)]))
    signs = ir.Constant(_VF, [-1.0 if i & k else 1.0 for i in range(8)])
    return _call(builder, "llvm.fma.v8f32", _VF, [v, signs, swapped])


@intrinsic
def vbfly1(typingctx, v):
    """The Walsh-Hadamard butterflies of span 1 inside an f32x8 (lane pairs 0-1, 2-3, ...)."""
    def codegen(context, builder, sig, args):
        return _butterfly_ir(builder, args[0], 1)
    return f32x8(v), codegen


@intrinsic
def vbfly2(typingctx, v):
    """The Walsh-Hadamard butterflies of span 2 inside an f32x8 (lanes 0-2, 1-3, 4-6, 5-7)."""
    def codegen(context, builder, sig, args):
        return _butterfly_ir(builder, args[0], 2)
    return f32x8(v), codegen


@intrinsic
def vbfly4(typingctx, v):
    """The Walsh-Hadamard butterflies of span 4 inside an f32x8 (lanes i and i + 4)."""
    def codegen(context, builder, sig, args):
        return _butterfly_ir(builder, args[0], 4)
    return f32x8(v), codegen


@intrinsic
def vmul(typingctx, a, b):
    """a * b."""
    def codegen(context, builder, sig, args):
        return builder.fmul(args[0], args[1])
    return f32x8(a, b), codegen


@intrinsic
def isrl(typingctx, v, n):
    """v >> n, logical, every lane (n: scalar 0..31), of an i32x8 or an i32x16."""
    def codegen(context, builder, sig, args):
        return builder.lshr(args[0], _splat_i32(context, builder, args[1], sig.args[1], args[0].type))
    return v(v, n), codegen


def _float_lanes(v):
    """The float vector type with v's lane count (f32x8 for an i32x8, f32x16 for an i32x16)."""
    return f32x16 if isinstance(v, I32x16Type) else f32x8


def _field_ir(context, builder, sig, args, op):
    """float32(int32(op(v, splat(n)))) per lane, at v's width (args = v, n)."""
    vty = args[0].type
    n = _splat_i32(context, builder, args[1], sig.args[1], vty)
    return builder.sitofp(op(args[0], n), ir.VectorType(ir.FloatType(), vty.count))


@intrinsic
def andf(typingctx, v, mask):
    """float32(int32(v & mask)) per lane (vpand + vcvtdq2ps), of an i32x8 or an i32x16."""
    def codegen(context, builder, sig, args):
        return _field_ir(context, builder, sig, args, builder.and_)
    return _float_lanes(v)(v, mask), codegen


@intrinsic
def srlf(typingctx, v, n):
    """float32(int32(v >> n)) per lane, logical shift (vpsrld + vcvtdq2ps), of an i32x8 or an i32x16."""
    def codegen(context, builder, sig, args):
        return _field_ir(context, builder, sig, args, builder.lshr)
    return _float_lanes(v)(v, n), codegen


@intrinsic
def iand(typingctx, v, mask):
    """v & mask, every lane (mask: scalar), of an i32x8 or an i32x16 (vpand / vpandd)."""
    def codegen(context, builder, sig, args):
        return builder.and_(args[0], _splat_i32(context, builder, args[1], sig.args[1], args[0].type))
    return v(v, mask), codegen


@intrinsic
def ixor(typingctx, v, mask):
    """v ^ mask, every lane (mask: scalar), of an i32x8 or an i32x16 (vpxor / vpxord)."""
    def codegen(context, builder, sig, args):
        return builder.xor(args[0], _splat_i32(context, builder, args[1], sig.args[1], args[0].type))
    return v(v, mask), codegen


@intrinsic
def lut16(typingctx, tab, idx):
    """Byte table lookup (vpshufb): byte j of the result is byte idx_j & 15 of tab's 128-bit half
    holding byte j, or 0 when bit 7 of idx_j is set. tab: i32x8 whose two halves hold the same 16
    bytes; idx: i32x8 of 4-bit indices, one per byte."""
    def codegen(context, builder, sig, args):
        vb = ir.VectorType(ir.IntType(8), 32)
        tab, idx = builder.bitcast(args[0], vb), builder.bitcast(args[1], vb)
        if X86:
            return builder.bitcast(_call(builder, "llvm.x86.avx2.pshuf.b", vb, [tab, idx]), _VI)
        return builder.bitcast(_lut16_portable(builder, tab, idx), _VI)
    return i32x8(tab, idx), codegen


def _lut16_portable(builder, tab, idx):
    """vpshufb's result on a <32 x i8> table and index vector without x86: on aarch64 one NEON tbl
    per 128-bit half (an index & 0x8F >= 16 reads 0 there, as bit 7 does for vpshufb), elsewhere
    byte by byte."""
    v16 = ir.VectorType(ir.IntType(8), 16)
    idx = builder.and_(idx, ir.Constant(idx.type, [0x8F] * 32))
    halves = []
    for h in range(2):
        lanes = ir.Constant(ir.VectorType(_I32, 16), list(range(16 * h, 16 * h + 16)))
        t = builder.shuffle_vector(tab, tab, lanes)
        i = builder.shuffle_vector(idx, idx, lanes)
        if TARGET_ARCH in ("aarch64", "arm64"):
            halves.append(_call(builder, "llvm.aarch64.neon.tbl1.v16i8", v16, [t, i]))
            continue
        out = ir.Constant(v16, [0] * 16)
        for j in range(16):
            k = builder.extract_element(i, ir.Constant(_I32, j))
            inside = builder.icmp_unsigned("<", k, ir.Constant(ir.IntType(8), 16))
            byte = builder.extract_element(t, builder.and_(builder.zext(k, _I32), ir.Constant(_I32, 15)))
            out = builder.insert_element(out, builder.select(inside, byte, ir.Constant(ir.IntType(8), 0)),
                                         ir.Constant(_I32, j))
        halves.append(out)
    return builder.shuffle_vector(halves[0], halves[1], ir.Constant(ir.VectorType(_I32, 32), list(range(32))))


@intrinsic
def vhsum(typingctx, v):
    """Sum of the 8 lanes, as float32."""
    def codegen(context, builder, sig, args):
        s = builder.extract_element(args[0], ir.Constant(_I32, 0))
        for k in range(1, 8):
            s = builder.fadd(s, builder.extract_element(args[0], ir.Constant(_I32, k)))
        return s
    return types.float32(v), codegen


def _pair_sums(builder, a, b):
    """Lanes [a0+a1, a2+a3, b0+b1, b2+b3 | a4+a5, a6+a7, b4+b5, b6+b7] (vhaddps)."""
    even = builder.shuffle_vector(a, b, ir.Constant(_VI, [0, 2, 8, 10, 4, 6, 12, 14]))
    odd = builder.shuffle_vector(a, b, ir.Constant(_VI, [1, 3, 9, 11, 5, 7, 13, 15]))
    return builder.fadd(even, odd)


@intrinsic
def vsum8x8(typingctx, a0, a1, a2, a3, a4, a5, a6, a7):
    """f32x8 whose lane r is the sum of the 8 lanes of a_r: eight dot products' partial sums
    reduced at once (six vhaddps, two vperm2f128, one vaddps instead of eight lane trees)."""
    def codegen(context, builder, sig, args):
        t0, t1 = _pair_sums(builder, args[0], args[1]), _pair_sums(builder, args[2], args[3])
        t2, t3 = _pair_sums(builder, args[4], args[5]), _pair_sums(builder, args[6], args[7])
        u0, u1 = _pair_sums(builder, t0, t1), _pair_sums(builder, t2, t3)     # [s0..s3 | s0'..s3'] halves
        lo = builder.shuffle_vector(u0, u1, ir.Constant(_VI, [0, 1, 2, 3, 8, 9, 10, 11]))
        hi = builder.shuffle_vector(u0, u1, ir.Constant(_VI, [4, 5, 6, 7, 12, 13, 14, 15]))
        return builder.fadd(lo, hi)
    return f32x8(*([f32x8] * 8)), codegen


# ==================================================================================================
# 8-bit integer dot products (the q8 activation kernels, quant_tiles_q8.py). An i32x8 also carries
# 32 bytes or 16 int16 lanes: the intrinsics below bitcast as their instruction needs.
# ==================================================================================================

_VB = ir.VectorType(ir.IntType(8), 32)
_VW = ir.VectorType(ir.IntType(16), 16)


@intrinsic
def bc_i32(typingctx, arr, idx):
    """i32x8 with the 4 bytes arr[idx:idx + 4] (int8 1-D array) in every 32-bit lane (vpbroadcastd)."""
    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        s = builder.load(builder.bitcast(p, _I32.as_pointer()), align=1)
        return _splat(builder, s, _VI)
    return i32x8(arr, idx), codegen


@intrinsic
def maddubs(typingctx, u, s):
    """vpmaddubsw: 16 int16 lanes, lane i = u[2i] s[2i] + u[2i+1] s[2i+1] with u's bytes unsigned and
    s's signed, saturated to int16 (the callers keep |sum| <= 32767 by their value ranges)."""
    def codegen(context, builder, sig, args):
        u, s = builder.bitcast(args[0], _VB), builder.bitcast(args[1], _VB)
        if X86:
            return builder.bitcast(_call(builder, "llvm.x86.avx2.pmadd.ub.sw", _VW, [u, s]), _VI)
        w32 = ir.VectorType(ir.IntType(16), 32)
        prod = builder.mul(builder.zext(u, w32), builder.sext(s, w32))     # exact: |u s| <= 32640
        even, odd = _pairs(builder, prod, 16)
        return builder.bitcast(_call(builder, "llvm.sadd.sat.v16i16", _VW, [even, odd]), _VI)
    return i32x8(u, s), codegen


def _pairs(builder, v, n):
    """(lanes 0, 2, 4, ... and lanes 1, 3, 5, ...) of a vector of 2n lanes, n lanes each."""
    even = ir.Constant(ir.VectorType(_I32, n), list(range(0, 2 * n, 2)))
    odd = ir.Constant(ir.VectorType(_I32, n), list(range(1, 2 * n, 2)))
    return builder.shuffle_vector(v, v, even), builder.shuffle_vector(v, v, odd)


@intrinsic
def dpbusd(typingctx, acc, u, s):
    """vpdpbusd (AVX512-VNNI / AVX-VNNI): acc + per 32-bit lane the sum of the 4 products of u's
    unsigned bytes with s's signed bytes, exact in int32; on 8 lanes (i32x8) or 16 (i32x16, AVX512-VNNI).
    Only on CPUs with the instruction (quant_tiles_q8.HAS_VNNI, quant_tiles_q8_wide.HAS_VNNI512):
    elsewhere LLVM cannot select it."""
    def codegen(context, builder, sig, args):
        vty = args[0].type
        return _call(builder, f"llvm.x86.avx512.vpdpbusd.{32 * vty.count}", vty, list(args))
    return acc(acc, u, s), codegen


@intrinsic
def izero(typingctx):
    """i32x8 of zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI, [0] * 8)
    return i32x8(), codegen


@intrinsic
def zizero(typingctx):
    """i32x16 of zeros."""
    def codegen(context, builder, sig, args):
        return ir.Constant(_VI16, [0] * 16)
    return i32x16(), codegen


@intrinsic
def zbc_i32(typingctx, arr, idx):
    """i32x16 with the 4 bytes arr[idx:idx + 4] (int8 1-D array) in every 32-bit lane (vpbroadcastd zmm)."""
    def codegen(context, builder, sig, args):
        p = _elem_ptr(context, builder, sig.args[0], args[0], args[1], sig.args[1])
        return _splat(builder, builder.load(builder.bitcast(p, _I32.as_pointer()), align=1), _VI16)
    return i32x16(arr, idx), codegen


@intrinsic
def zjoin_i32(typingctx, buf, off0, off1):
    """i32x16 from 8 little-endian 32-bit words at byte offset off0 (lanes 0..7) and 8 at off1 (lanes
    8..15): two 8-lane slots from anywhere in buf in one register (a load and a vinserti64x4)."""
    def codegen(context, builder, sig, args):
        lo, hi = (builder.load(_byte_ptr(context, builder, sig.args[0], args[0], args[k], sig.args[k], _VI), align=4)
                  for k in (1, 2))
        return builder.shuffle_vector(lo, hi, ir.Constant(_VI16, list(range(16))))
    return i32x16(buf, off0, off1), codegen


@intrinsic
def zcat(typingctx, lo, hi):
    """f32x16 with the lanes of the f32x8 lo, then those of hi."""
    def codegen(context, builder, sig, args):
        return builder.shuffle_vector(args[0], args[1], ir.Constant(_VI16, list(range(16))))
    return f32x16(lo, hi), codegen


@intrinsic
def zsplat(typingctx, x):
    """f32x16 with the scalar x in every lane."""
    def codegen(context, builder, sig, args):
        return _splat(builder, context.cast(builder, args[0], sig.args[0], types.float32), _VF16)
    return f32x16(x), codegen


@intrinsic
def zsub(typingctx, a, b):
    """a - b (f32x16)."""
    def codegen(context, builder, sig, args):
        return builder.fsub(args[0], args[1])
    return f32x16(a, b), codegen


@intrinsic
def zfnma(typingctx, a, b, c):
    """c - a * b, fused, lane by lane (f32x16)."""
    def codegen(context, builder, sig, args):
        return _call(builder, "llvm.fma.v16f32", _VF16, [builder.fneg(args[0]), args[1], args[2]])
    return f32x16(a, b, c), codegen


@intrinsic
def add16(typingctx, a, b):
    """a + b in 16 int16 lanes (vpaddw, wrapping: callers bound the sums)."""
    def codegen(context, builder, sig, args):
        r = builder.add(builder.bitcast(args[0], _VW), builder.bitcast(args[1], _VW))
        return builder.bitcast(r, _VI)
    return i32x8(a, b), codegen


@intrinsic
def hadd16(typingctx, v):
    """The 16 int16 lanes of v summed in pairs into 8 int32 lanes (vpmaddwd with ones; exact)."""
    def codegen(context, builder, sig, args):
        v = builder.bitcast(args[0], _VW)
        if X86:
            return _call(builder, "llvm.x86.avx2.pmadd.wd", _VI, [v, ir.Constant(_VW, [1] * 16)])
        even, odd = _pairs(builder, builder.sext(v, ir.VectorType(_I32, 16)), 8)
        return builder.add(even, odd)
    return i32x8(v), codegen


@intrinsic
def iadd(typingctx, a, b):
    """a + b in int32 lanes (vpaddd), of two i32x8 or two i32x16."""
    def codegen(context, builder, sig, args):
        return builder.add(args[0], args[1])
    return a(a, b), codegen


@intrinsic
def ior(typingctx, a, b):
    """a | b (vpor), of two i32x8 or two i32x16."""
    def codegen(context, builder, sig, args):
        return builder.or_(args[0], args[1])
    return a(a, b), codegen


@intrinsic
def ishl(typingctx, v, n):
    """v << n, every 32-bit lane (n: scalar 0..31), of an i32x8 or an i32x16."""
    def codegen(context, builder, sig, args):
        return builder.shl(args[0], _splat_i32(context, builder, args[1], sig.args[1], args[0].type))
    return v(v, n), codegen


@intrinsic
def itof(typingctx, v):
    """float32 of each int32 lane (vcvtdq2ps; exact below 2^24), of an i32x8 (-> f32x8) or an i32x16
    (-> f32x16)."""
    def codegen(context, builder, sig, args):
        return builder.sitofp(args[0], ir.VectorType(ir.FloatType(), args[0].type.count))
    return _float_lanes(v)(v), codegen


@intrinsic
def abs8(typingctx, v):
    """|v| of 32 int8 lanes (vpabsb; -128 stays bit pattern 0x80, i.e. 128 read as unsigned)."""
    def codegen(context, builder, sig, args):
        b = builder.bitcast(args[0], _VB)
        return builder.bitcast(_sign8(builder, b, b), _VI)
    return i32x8(v), codegen


def _sign8(builder, a, b):
    """vpsignb on <32 x i8>: a negated (wrapping) where b < 0, 0 where b == 0, a where b > 0."""
    if X86:
        return _call(builder, "llvm.x86.avx2.psign.b", _VB, [a, b])
    zero = ir.Constant(_VB, [0] * 32)
    kept = builder.select(builder.icmp_signed("<", b, zero), builder.sub(zero, a), a)
    return builder.select(builder.icmp_signed("==", b, zero), zero, kept)


@intrinsic
def sign8(typingctx, a, b):
    """vpsignb: byte a_i negated where b_i < 0, zeroed where b_i == 0, kept where b_i > 0."""
    def codegen(context, builder, sig, args):
        r = _sign8(builder, builder.bitcast(args[0], _VB), builder.bitcast(args[1], _VB))
        return builder.bitcast(r, _VI)
    return i32x8(a, b), codegen


@intrinsic
def vlane(typingctx, v, k):
    """Lane k (0..7) of an f32x8, as float32."""
    def codegen(context, builder, sig, args):
        return builder.extract_element(args[0], context.cast(builder, args[1], sig.args[1], types.int32))
    return types.float32(v, k), codegen


@intrinsic
def f16_round(typingctx, x):
    """float32 x rounded to the nearest IEEE binary16 (ties to even, as vcvtps2ph) and back."""
    def codegen(context, builder, sig, args):
        f = context.cast(builder, args[0], sig.args[0], types.float32)
        return builder.fpext(builder.fptrunc(f, ir.HalfType()), ir.FloatType())
    return types.float32(x), codegen


# ==================================================================================================
# Thread count
# ==================================================================================================

@intrinsic
def num_threads(typingctx):
    """numba.get_num_threads() by symbol name (the overload Numba ships bakes in a ctypes address,
    which makes a function uncacheable)."""
    from numba.np.ufunc.parallel import _launch_threads
    _launch_threads()

    def codegen(context, builder, sig, args):
        return _call(builder, "get_num_threads", cgutils.intp_t, [])
    return types.intp(), codegen

