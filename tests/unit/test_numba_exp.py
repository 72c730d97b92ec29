"""`opencann.ops.kernels.numba_exp.exp_shifted` against float64 exp of the float32
difference: relative error < 3e-7 + 1e-7·|x - m| over a softmax's domain (x - m in
[-87, 0]), 0 for -inf and far below
the float32 normal range, NaN for NaN and inf - inf, the returned sum, only the first n
elements touched."""
import math

import numpy as np
import torch

from opencann.ops.kernels.numba_cache import njit
from opencann.ops.kernels.numba_exp import exp_shifted


@njit(cache=False)
def _call(x, n, m):
    return exp_shifted(x, n, m)


def test_exp_shifted_against_float64_exp():
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.rand(4000, generator=g) * -87.0 + 3.0, torch.tensor([3.0, 0.0, -1e-8])])
    m = np.float32(3.0)
    t = (x - 3.0).double()                            # the float32 difference, exactly
    want = torch.exp(t)
    a = x.numpy().copy()
    tot = _call(a, a.size, m)
    got = torch.from_numpy(a).double()
    assert ((got - want).abs() <= (3e-7 + 1e-7 * t.abs()) * want).all()
    assert math.isclose(tot, float(got.sum()), rel_tol=1e-5)      # a float32 sum of 4003


def test_exp_shifted_special_values_and_length():
    a = np.array([-np.inf, -200.0, np.nan, 0.0, np.inf, 5.0], np.float32)
    tot = _call(a, 5, np.float32(0.0))
    assert a[0] == 0.0 and a[1] == 0.0 and np.isnan(a[2]) and a[3] == 1.0 and a[5] == 5.0
    assert np.isnan(tot)
    b = np.array([np.inf, 1.0], np.float32)
    _call(b, 2, np.float32(np.inf))                  # inf - inf: NaN, finite - inf: 0
    assert np.isnan(b[0]) and b[1] == 0.0
    c = np.array([1.0], np.float32)
    assert _call(c, 0, np.float32(0.0)) == 0.0 and c[0] == 1.0
