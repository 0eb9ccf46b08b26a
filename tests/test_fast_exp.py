"""exp_f32 (runtime/fast_exp.py) against np.exp in float64, and the softmax that uses it."""
import numpy as np
from numba import njit

from ringllm.runtime.attention import softmax_inplace
from ringllm.runtime.fast_exp import exp_f32


@njit(cache=False, fastmath=True)
def _exp_all(x, y):
    for i in range(x.shape[0]):
        y[i] = exp_f32(x[i])


@njit(cache=False)
def _softmax(sc, n):
    softmax_inplace(sc, n)


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
