"""Entry kernels of the packed matvec, one per GGML type, generated from one table.

matvec_<type>(out, buf, x, scratch): out (n_rows,) float32 = W @ x.

  buf:     uint8 records from pack (PackedMatrix.buf), layout in quant_tiles.py.
  x:       (n_cols,) float32; read once, into scratch, before any output is written (so out may
           alias x).
  scratch: float32 (56 + n_cols // 16 + n_cols,): x scale table (32, x_scales), last partial tile
           (24), block sums of x, pre-scaled x (see _split; PackedMatrix.scratch is set up by pack).

Every entry kernel does the same four steps, and the types differ only in the tile kernel, its
record size, its block size, its rows per tile and how x is prepared: prep_x (a pre-scaled copy of x
and its block sums, for the packed-field types) or copy_x (x as is, for Q8_0 and the float types);
then the full tiles, in prange over tiles when more than one thread is set, the matrix has at least
two tiles and PAR_MIN_WEIGHTS weights (below that fork/join costs more than it saves); then the last,
partial tile into scratch and from there into out. So the kernels are written once, as the source
template _ENTRY_SOURCE, and one row of _ENTRIES per type fills it in, the first time a matrix of that
type is packed (KERNELS and the other mappings below make each kernel on first use).

Why source text and not a factory function: Numba's on-disk cache (cache=True) keys a closure by a
pickle of its free variables, and a jitted function pickles with a per-process random id, so a
closure over its tile kernel would compile again in every process (and grow the cache each time).
A function compiled from source text at module level is an ordinary module function to Numba: it is
cached under its own name (matvec_q4_0, ...) and stamped with this file, and the runtime package's
cache directory is named by a hash of all its sources (runtime/__init__.py), so an edit to a tile
kernel in another file also starts a fresh cache. The generated code gets this file's line numbers
of the template, so tracebacks and Numba's error messages point at _ENTRY_SOURCE.
"""
import functools
import threading
from collections.abc import MutableMapping

import numpy as np
from numba import njit, prange  # noqa: F401 (prange: named by the generated entry kernels)

# the tile kernels and record sizes are named by the generated source (_ENTRIES), not by Python code here
from ringllm.runtime.quant_tiles import (QK, QK_K, REC_F16, REC_F32, REC_IQ4_NL, REC_IQ4_XS, REC_Q2_K,  # noqa: F401
                                         REC_Q3_K, REC_Q4_0, REC_Q4_1, REC_Q4_K, REC_Q5_0, REC_Q5_1, REC_Q5_K,
                                         REC_Q6_K, REC_Q8_0, TILE, TILE3, tile_bf16, tile_f16, tile_f32,
                                         tile_iq4_nl, tile_iq4_xs, tile_q2_k, tile_q3_k, tile_q4_0, tile_q4_1,
                                         tile_q4_k, tile_q5_0, tile_q5_1, tile_q5_k, tile_q6_k, tile_q8_0,
                                         tile_rows, PAIR_TYPES, tile_q4_0_pairs, tile_q4_1_pairs, tile_q4_k_pairs,
                                         tile_q6_k_pairs)
from ringllm.runtime.quant_tile_pairs import (tile2_bf16, tile2_f16, tile2_f32, tile2_q4_0, tile2_q4_1,  # noqa: F401
                                              tile2_q4_k, tile2_q5_0, tile2_q5_1, tile2_q5_k, tile2_q6_k,
                                              tile2_q8_0, tile2_q4_0_pairs, tile2_q4_1_pairs, tile2_q4_k_pairs,
                                              tile2_q6_k_pairs)
from ringllm.runtime.quant_types import BLOCK_LAYOUT, GGMLType
from ringllm.runtime.simd import HAS_AVX512, num_threads, vadd, vhsum, vload, vmul, vstore  # noqa: F401 (ditto)

__all__ = ["KERNELS", "ROWS_KERNELS", "NARROW_KERNELS", "NARROW_ROWS_KERNELS", "PAIR_KERNELS", "PAIR_ROWS_KERNELS",
           "PAIR_TYPES", "PAR_MIN_WEIGHTS", "x_scales"]

PAR_MIN_WEIGHTS = 65536  # matrices with fewer weights run on the calling thread only (fork/join costs more)


# ==================================================================================================
# x preparation: pre-scaled copies of x and per-block sums, once per call, shared by all rows
# ==================================================================================================

@njit(cache=True, nogil=True, fastmath=False)
def prep_x(xs, xsum, x, tab, sub):
    """xs (n,) float32 = x * tab[c % 32] (the power-of-two pre-scaling of each column's field, see
    x_scales); xsum (n // sub,) float32 = sums of x over runs of sub = 32 or 16 values. n % 32 == 0."""
    t0 = vload(tab, 0)
    t1 = vload(tab, 8)
    t2 = vload(tab, 16)
    t3 = vload(tab, 24)
    for b in range(x.shape[0] // 32):
        c = 32 * b
        v0 = vload(x, c)
        v1 = vload(x, c + 8)
        v2 = vload(x, c + 16)
        v3 = vload(x, c + 24)
        vstore(xs, c, vmul(v0, t0))
        vstore(xs, c + 8, vmul(v1, t1))
        vstore(xs, c + 16, vmul(v2, t2))
        vstore(xs, c + 24, vmul(v3, t3))
        if sub == 32:
            xsum[b] = vhsum(vadd(vadd(v0, v1), vadd(v2, v3)))
        else:
            xsum[2 * b] = vhsum(vadd(v0, v1))
            xsum[2 * b + 1] = vhsum(vadd(v2, v3))


def x_scales(qtype: GGMLType) -> np.ndarray:
    """float32 (32,): the factor 2^(-w i) of column c % 32 of a block whose q sits at bits w i of its
    dword (1 for the top field, which the kernels read with a shift instead of a mask).

    4-bit types (and Q3_K's 3-bit values in nibbles): column 8s + i at field i (w = 4, i = 7 top).
    5-bit: column 6m + i (m < 5), 30 + i (w = 5, i = 5 top). Q6_K: column 16h + 5m + i at field i
    (w = 6, no top field); columns 15 and 31, split in 2-bit pieces, are read with a shift (1).
    Q2_K: column 16h + i at field i (w = 2, i = 15 top). IQ4_NL / IQ4_XS: after the table lookup,
    column 8s + k and 8s + 4 + k at byte k (w = 8, k = 3 top). Other types: ones.
    """
    c = np.arange(32)
    if qtype in (GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q4_K, GGMLType.Q3_K):
        i = c % 8
        e = np.where(i == 7, 0, 4 * i)
    elif qtype in (GGMLType.Q5_0, GGMLType.Q5_1, GGMLType.Q5_K):
        i = np.where(c < 30, c % 6, c - 30)
        e = np.where(i == 5, 0, 5 * i)
    elif qtype == GGMLType.Q2_K:
        i = c % 16
        e = np.where(i == 15, 0, 2 * i)
    elif qtype in (GGMLType.IQ4_NL, GGMLType.IQ4_XS):
        k = c % 4
        e = np.where(k == 3, 0, 8 * k)
    elif qtype == GGMLType.Q6_K:
        e = np.where(c % 16 == 15, 0, 6 * ((c % 16) % 5))
    else:
        e = np.zeros(32, np.int64)
    return (2.0 ** -e.astype(np.float64)).astype(np.float32)


# ==================================================================================================
# Entry kernels: one source template, one row per type
# ==================================================================================================

@njit(cache=True, nogil=True, inline="always")
def _split(out, x, scratch):
    """(n_rows, n_cols, xs, xsum, tab) views of the scratch layout
    [tab (32) | tail (24) | xsum (n_cols // 16) | xs (n_cols)]."""
    n_cols = x.shape[0]
    o = 56 + n_cols // 16
    return out.shape[0], n_cols, scratch[o:o + n_cols], scratch[56:o], scratch[:32]


@njit(cache=True, nogil=True, fastmath=False)
def copy_x(xs, x):
    """xs[:] = x (float types and Q8_0 use x as is)."""
    for c in range(x.shape[0]):
        xs[c] = x[c]


@njit(cache=True, nogil=True, fastmath=False)
def _finish_tail(out, tail, r0):
    """out[r0:] = tail[:n_rows - r0] (rows of the last, partial tile)."""
    for r in range(r0, out.shape[0]):
        out[r] = tail[r - r0]


# The body every entry kernel shares. {tile}, {rec}, {rows} and {nb} are filled in with the names of
# quant_tiles' kernels and constants, so the generated code reads (and compiles) as a hand-written
# kernel would: Numba freezes the constants as it freezes any global. The tail's row offset is
# np.int64(0), not 0: a literal would compile the tile kernel a second time, for Literal[int](0).
_ENTRY_SOURCE = '''
def matvec_{name}(out, buf, x, scratch):
    """{type}: out (n_rows,) float32 = W @ x; buf from pack()."""
    n_rows, n_cols, xs, xsum, tab = _split(out, x, scratch)
    {prep}
    nb = {nb}
    stride = nb * {rec}
    n_full = n_rows // {rows}
    if num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            {tile}(out, t * {rows}, buf, t * stride, nb, {x_args})
    else:
        for t in prange(n_full):
            {tile}(out, t * {rows}, buf, t * stride, nb, {x_args})
    if n_full * {rows} < n_rows:
        tail = scratch[32:56]
        {tile}(tail, np.int64(0), buf, n_full * stride, nb, {x_args})
        _finish_tail(out, tail, n_full * {rows})
'''

# The few-row product, for types with a two-row tile kernel (quant_tile_pairs.py): out (T, n_rows) =
# X @ W.T for X (T, n_cols), T >= 2. Each row of X is prepared into its own row of scratch (T, 56 +
# n_cols // 16 + n_cols), laid out as matvec's; then per tile, the rows go through the tile in pairs
# (an odd last row through the one-row kernel) while its records are hot in L1, so each weight is
# read from memory once per call and decoded once per pair of rows. The partial last tile goes into
# a (T, rows) temporary and from there into out.
_ROWS_SOURCE = '''
def rowtile_{name}(out, d0, buf, base, nb, scratch, o, n_cols):
    """Tile at byte base of buf -> out[:, d0:d0 + {rows}] for every row of the prepared scratch."""
    T = out.shape[0]
    j = 0
    while j + 1 < T:
        {tile2}(out[j], out[j + 1], d0, buf, base, nb, {x_args2})
        j += 2
    if j < T:
        {tile}(out[j], d0, buf, base, nb, {x_args1})


def rows_{name}(out, buf, X, scratch):
    """{type}: out (T, n_rows) float32 = X @ W.T for X (T, n_cols), T <= scratch.shape[0]."""
    T = X.shape[0]
    n_rows = out.shape[1]
    n_cols = X.shape[1]
    o = 56 + n_cols // 16
    for j in range(T):
        {prep_rows}
    nb = {nb}
    stride = nb * {rec}
    n_full = n_rows // {rows}
    if num_threads() == 1 or n_full < 2 or n_rows * n_cols < PAR_MIN_WEIGHTS:
        for t in range(n_full):
            rowtile_{name}(out, t * {rows}, buf, t * stride, nb, scratch, o, n_cols)
    else:
        for t in prange(n_full):
            rowtile_{name}(out, t * {rows}, buf, t * stride, nb, scratch, o, n_cols)
    if n_full * {rows} < n_rows:
        tail = np.empty((T, {rows}), np.float32)
        rowtile_{name}(tail, np.int64(0), buf, n_full * stride, nb, scratch, o, n_cols)
        for j in range(T):
            _finish_tail(out[j], tail[j], n_full * {rows})
'''

# One row per type: its tile kernel, its two-row tile kernel (None: few-row products run one matvec
# per row), that kernel's record size (bytes per tile and block), the runs of x its block sums cover
# (32 or 16: prep_x, the tile takes xs and xsum; 0: copy_x, the tile takes x as is), and the
# (family, kind) that names its tile decoder in gemm.py. Rows per tile come from
# quant_tiles.tile_rows and values per block from quant_types.BLOCK_LAYOUT.
_ENTRIES = (
    # type            tile           two-row tile   record        x sums  unpack
    (GGMLType.Q4_0,   "tile_q4_0",   "tile2_q4_0",  "REC_Q4_0",   32,     (0, 0)),
    (GGMLType.Q4_1,   "tile_q4_1",   "tile2_q4_1",  "REC_Q4_1",   32,     (0, 1)),
    (GGMLType.Q5_0,   "tile_q5_0",   "tile2_q5_0",  "REC_Q5_0",   32,     (0, 2)),
    (GGMLType.Q5_1,   "tile_q5_1",   "tile2_q5_1",  "REC_Q5_1",   32,     (0, 3)),
    (GGMLType.Q8_0,   "tile_q8_0",   "tile2_q8_0",  "REC_Q8_0",   0,      (0, 4)),
    (GGMLType.Q4_K,   "tile_q4_k",   "tile2_q4_k",  "REC_Q4_K",   32,     (1, 0)),
    (GGMLType.Q5_K,   "tile_q5_k",   "tile2_q5_k",  "REC_Q5_K",   32,     (1, 1)),
    (GGMLType.Q6_K,   "tile_q6_k",   "tile2_q6_k",  "REC_Q6_K",   16,     (1, 2)),
    (GGMLType.F16,    "tile_f16",    "tile2_f16",   "REC_F16",    0,      (2, 0)),
    (GGMLType.F32,    "tile_f32",    "tile2_f32",   "REC_F32",    0,      (2, 1)),
    (GGMLType.BF16,   "tile_bf16",   "tile2_bf16",  "REC_F16",    0,      (2, 2)),
    (GGMLType.Q2_K,   "tile_q2_k",   None,          "REC_Q2_K",   16,     (3, 0)),
    (GGMLType.Q3_K,   "tile_q3_k",   None,          "REC_Q3_K",   16,     (3, 1)),
    (GGMLType.IQ4_NL, "tile_iq4_nl", None,          "REC_IQ4_NL", 32,     (3, 2)),
    (GGMLType.IQ4_XS, "tile_iq4_xs", None,          "REC_IQ4_XS", 32,     (3, 3)),
)
_ENTRY_OF = {entry[0]: entry for entry in _ENTRIES}
_BLOCK_NAMES = {QK: "QK", QK_K: "QK_K"}
_ROWS_NAMES = {TILE: "TILE", TILE3: "TILE3"}


@functools.lru_cache(maxsize=None)
def _template_line(template: str) -> int:
    """Lines of this file before the template's text (0 when the source cannot be read)."""
    try:
        with open(__file__, encoding="utf-8") as f:
            text = f.read()
    except OSError:
        return 0
    at = text.find(template)
    return text.count("\n", 0, at) if at >= 0 else 0


def _compile(template: str, names: tuple, **fields):
    """Compile the filled-in template into this module's namespace (with the template's line numbers)
    and decorate its functions `names` like hand-written kernels; the entry kernel, names[-1], runs
    in parallel. Returns the entry kernel."""
    exec(compile("\n" * _template_line(template) + template.format(**fields), __file__, "exec"), globals())
    for i, fn in enumerate(names):
        globals()[fn] = njit(cache=True, nogil=True, parallel=i == len(names) - 1, fastmath=False)(globals()[fn])
    return globals()[names[-1]]


def _fields(qtype: GGMLType, pairs: bool) -> tuple[dict, int, int, int]:
    """(template fields, x sums, unpack family, unpack kind) of qtype's kernels (16-lane ones with
    `pairs`, a type of PAIR_TYPES): its row of _ENTRIES."""
    _, tile, tile2, rec, x_sums, (family, kind) = _ENTRY_OF[qtype]
    name = qtype.name.lower()
    if pairs:
        name, tile, tile2 = name + "_pairs", tile + "_pairs", tile2 + "_pairs"
    block = BLOCK_LAYOUT[qtype][0]
    fields = dict(name=name, type=qtype.name, tile=tile, tile2=tile2, rec=rec, rows=_ROWS_NAMES[tile_rows(qtype)],
                  nb=f"n_cols // {_BLOCK_NAMES[block]}" if block > 1 else "n_cols")
    return fields, x_sums, family, kind


def _entry_kernel(qtype: GGMLType, pairs: bool):
    """(matvec entry kernel, unpack family, unpack kind) of qtype, compiled from _ENTRY_SOURCE into this
    module's namespace as matvec_<type>[_pairs]."""
    f, x_sums, family, kind = _fields(qtype, pairs)
    kernel = _compile(_ENTRY_SOURCE, ("matvec_" + f["name"],),
                      prep=f"prep_x(xs, xsum, x, tab, {x_sums})" if x_sums else "copy_x(xs, x)",
                      x_args="xs, xsum" if x_sums else "xs", **f)
    return kernel, family, kind


def _rows_kernel(qtype: GGMLType, pairs: bool):
    """The few-row entry kernel of qtype, compiled from _ROWS_SOURCE as rows_<type>[_pairs]."""
    f, x_sums, _, _ = _fields(qtype, pairs)
    row = "scratch[{j}, o:o + n_cols]" + (", scratch[{j}, 56:o]" if x_sums else "")
    return _compile(
        _ROWS_SOURCE, ("rowtile_" + f["name"], "rows_" + f["name"]),
        prep_rows=(f"prep_x(scratch[j, o:o + n_cols], scratch[j, 56:o], X[j], scratch[j, :32], {x_sums})"
                   if x_sums else "copy_x(scratch[j, o:o + n_cols], X[j])"),
        x_args1=row.format(j="j"), x_args2=row.format(j="j") + ", " + row.format(j="j + 1"), **f)


class _OnFirstUse(MutableMapping):
    """GGMLType -> kernel, each made (compiled from its template into this module's namespace, which
    defines its Numba dispatcher) the first time it is asked for: a process defines the kernels of its
    model's types only, not the few dozen of every type at import. A key set here (a test's
    monkeypatch) replaces the made value."""

    def __init__(self, makers: dict):
        self._makers = makers            # type -> function making its value
        self._made: dict = {}

    def __getitem__(self, qtype):
        made = self._made.get(qtype)
        if made is None:
            make = self._makers[qtype]   # KeyError for a type without one
            with _MAKING:
                made = self._made.get(qtype)
                if made is None:
                    made = self._made[qtype] = make()
        return made

    def __setitem__(self, qtype, value):
        self._makers.setdefault(qtype, None)
        self._made[qtype] = value

    def __delitem__(self, qtype):
        del self._makers[qtype]
        self._made.pop(qtype, None)

    def __contains__(self, qtype) -> bool:
        return qtype in self._makers

    def __iter__(self):
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


_MAKING = threading.RLock()           # one kernel made at a time (exec into the module's namespace)


def _kernels(pairs: bool) -> tuple[_OnFirstUse, _OnFirstUse]:
    """({GGMLType: (matvec entry kernel, unpack family, unpack kind)}, {GGMLType: few-row entry kernel}),
    made on first use; with `pairs`, those of the types of PAIR_TYPES only, with the 16-lane tile kernels
    (matvec_q4_0_pairs, rows_q4_0_pairs, ...)."""
    types_ = [q for q, *_ in _ENTRIES if not pairs or q in PAIR_TYPES]
    entries = {q: functools.partial(_entry_kernel, q, pairs) for q in types_}
    rows = {q: functools.partial(_rows_kernel, q, pairs) for q, _, tile2, *_ in _ENTRIES
            if q in types_ and tile2 is not None}
    return _OnFirstUse(entries), _OnFirstUse(rows)


def _host(narrow: _OnFirstUse, pair: _OnFirstUse) -> _OnFirstUse:
    """The host's choice per type: the 16-lane kernel where the CPU has 512-bit SIMD and the type has one
    (the same object as pair's), else the 8-lane one."""
    use_pair = HAS_AVX512
    return _OnFirstUse({q: functools.partial(pair.__getitem__ if use_pair and q in pair else narrow.__getitem__, q)
                        for q in narrow})


# type -> (matvec entry kernel, unpack family, unpack kind); type -> few-row entry kernel (the types
# with a two-row tile kernel). Where the CPU has 512-bit SIMD (simd.HAS_AVX512) the 4-bit types and
# Q6_K (PAIR_TYPES) take the 16-lane tile kernels (PAIR_KERNELS, PAIR_ROWS_KERNELS); the NARROW_
# mappings hold the 8-lane ones of every type. Both kinds exist on every CPU (the tests check both).
# Every kernel is made on first use (_OnFirstUse).
NARROW_KERNELS, NARROW_ROWS_KERNELS = _kernels(pairs=False)
PAIR_KERNELS, PAIR_ROWS_KERNELS = _kernels(pairs=True)
KERNELS = _host(NARROW_KERNELS, PAIR_KERNELS)
ROWS_KERNELS = _host(NARROW_ROWS_KERNELS, PAIR_ROWS_KERNELS)
