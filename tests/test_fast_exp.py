"""exp_f32 (runtime/fast_exp.py) against np.exp in float64, and the softmax that uses it: its values, and
the one order its denominator is summed in whatever kernel it is compiled into."""
import numpy as np
from numba import njit

from ringllm.runtime.attention import exp_shifted, row_max, softmax_inplace, sum_in_order
from ringllm.runtime.fast_exp import exp_f32
from ringllm.runtime.numba_flags import FASTMATH


@njit(cache=False, fastmath=True)
def _exp_all(x, y):
    for i in range(x.shape[0]):
        y[i] = exp_f32(x[i])


@njit(cache=False)
def _softmax(sc, n):
    softmax_inplace(sc, n)


@njit(cache=False, fastmath=True)
def _exp_shifted_fast(sc, n):
    """exp_shifted inlined into a kernel of full fastmath (approximate functions too), where LLVM
    vectorizes whatever it may as it sees fit."""
    return exp_shifted(sc, n)


@njit(cache=False, fastmath=FASTMATH)
def _exp_shifted_kernel_flags(sc, n):
    """exp_shifted under the attention kernels' flags (numba_flags.FASTMATH), alone."""
    return exp_shifted(sc, n)


@njit(cache=False, fastmath=FASTMATH)
def _exp_shifted_rows(sc, n, out):
    """exp_shifted under the same flags, inlined into a loop over the rows of out (a caller of another
    shape); returns the last row's total."""
    total = np.float32(0.0)
    for r in range(out.shape[0]):
        out[r, :n] = sc[:n]
        _, total = exp_shifted(out[r], n)
    return total


def _in_order(x, n):
    """sum_in_order's order in NumPy float32: four eight-lane accumulators over chunks of 32, the chunks
    of eight after them into the first, (a0 + a1) + (a2 + a3), lanes 0..7 in turn, the tail one by one."""
    acc = np.zeros((4, 8), np.float32)
    j = 0
    while j + 32 <= n:
        acc += x[j:j + 32].reshape(4, 8)
        j += 32
    while j + 8 <= n:
        acc[0] += x[j:j + 8]
        j += 8
    lanes = (acc[0] + acc[1]) + (acc[2] + acc[3])
    total = lanes[0]
    for v in list(lanes[1:]) + list(x[j:n]):
        total = np.float32(total + v)
    return total


def test_exp_f32_relative_error_over_its_range():
    x = np.linspace(-87.3, 88.3, 1_000_001).astype(np.float32)
    x = np.concatenate([x, np.float32([0.0, -0.0, 1e-30, -1e-30, np.log(2.0), -np.log(2.0)])])
    y = np.empty_like(x)
    _exp_all(x, y)
    ref = np.exp(x.astype(np.float64))
    assert np.all(np.isfinite(y))
    assert np.max(np.abs(y - ref) / ref) <= 5e-7
    assert y[-6] == 1.0 and y[-5] == 1.0


def test_exp_f32_clamps_outside_its_range():
    x = np.float32([-1e4, -104.0, -88.0, 89.0, 1e4, -np.inf, np.inf])
    y = np.empty_like(x)
    _exp_all(x, y)
    assert np.all(np.isfinite(y)) and np.all(y > 0)
    assert np.all(y[:3] < 1e-37)
    assert np.all(y[3:5] > 1e38) and y[5] < 1e-37 and y[6] > 1e38


def test_softmax_matches_float64():
    rng = np.random.default_rng(0)
    for n in (1, 7, 256, 1000):
        sc = (rng.standard_normal(n) * 20).astype(np.float32)
        want = np.exp(sc.astype(np.float64) - sc.max())
        want /= want.sum()
        got = sc.copy()
        _softmax(got, n)
        np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)
        assert abs(float(got.astype(np.float64).sum()) - 1.0) < 1e-5


def test_softmax_denominator_is_summed_in_one_order_in_every_kernel():
    """The denominator's last bits do not depend on the kernel the softmax is compiled into (the stored
    layouts' serial and threaded attention must give the same bits): sum_in_order follows its stated
    order, exp_shifted's total is sum_in_order of its exponentials even under full fastmath, and two
    kernels of the attention's flags give the same exponentials and total."""
    rng = np.random.default_rng(1)
    for n in list(range(0, 70)) + [255, 256, 257, 1000, 4099]:
        x = (rng.standard_normal(n + 8) * 3).astype(np.float32)
        assert sum_in_order(x, n) == _in_order(x, n), n
        if n == 0:
            continue
        fast = x.copy()
        m, total = _exp_shifted_fast(fast, n)
        assert m == x[:n].max() and total == _in_order(fast, n), n
        alone = x.copy()
        _, total = _exp_shifted_kernel_flags(alone, n)
        rows = np.zeros((3, n + 8), np.float32)
        assert _exp_shifted_rows(x, n, rows) == total == _in_order(alone, n), n
        np.testing.assert_array_equal(rows[2, :n], alone[:n])


@njit(cache=True)
def _row_max(x, n):
    return row_max(x, n)


def test_row_max_finds_the_largest_wherever_it_sits():
    """row_max (eight lanes, the last eight loaded overlapping) returns max(x[:n]) with the largest value
    at every position, among values all below zero, and never reads past n."""
    for n in list(range(1, 42)) + [511, 512, 513]:
        for at in sorted({0, n // 2, n - 1, max(0, n - 3)}):
            x = np.full(n + 8, np.float32(100.0))           # past n: larger, so a read past n would show
            x[:n] = -np.arange(1, n + 1, dtype=np.float32)
            x[at] = np.float32(-0.5)
            assert _row_max(x, n) == np.float32(-0.5), (n, at)
