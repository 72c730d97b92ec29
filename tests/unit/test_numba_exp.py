"""`opencann.ops.kernels.numba_exp.exp_shifted` against float64 exp of the float32
difference: relative error < 3e-7 + 1e-7·|x - m| over a softmax's domain (x - m in
[-87, 0]), 0 for -inf and far below
the float32 normal range, NaN for NaN and inf - inf, the returned sum, only the first n
elements touched."""
import math

import numpy as np
import torch

from opencann.ops.kernels.numba_cache import njit
from opencann.ops.kernels.numba_exp import exp_f32, exp_shifted


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


@njit(cache=False)
def _exp_all(x, y):
    for i in range(x.size):
        y[i] = exp_f32(x[i])


def test_exp_f32_against_float64_exp_and_ieee_special_values():
    """`exp_f32`: within 2 ulp of float64 exp (1 measured) over the whole normal range (random and at
    the overflow/underflow edges), IEEE's inf above ln(FLT_MAX), 0 below ln(FLT_MIN) and
    for -inf, NaN for NaN."""
    g = torch.Generator().manual_seed(1)
    edges = torch.tensor([88.72, 88.7228, 88.0, -87.3, -87.33, 0.0, -0.0, 1e-8, -1e-8, 0.5, -0.5,
                          0.34657359, -0.34657359])
    x = torch.cat([torch.rand(20000, generator=g) * 176.0 - 87.3, torch.randn(2000, generator=g), edges])
    y = np.empty(x.numel(), np.float32)
    _exp_all(x.numpy(), y)
    want = torch.exp(x.double())
    ulp = (torch.nextafter(want.float(), torch.tensor(math.inf)) - want.float()).double()
    assert ((torch.from_numpy(y).double() - want).abs() <= 2 * ulp).all()
    special = np.array([math.nan, math.inf, 88.73, 89.0, 1000.0, -math.inf, -87.34, -88.0, -104.0],
                       np.float32)
    ys = np.empty(special.size, np.float32)
    _exp_all(special, ys)
    assert math.isnan(ys[0]) and list(ys[1:5]) == [math.inf] * 4
    assert list(ys[5:]) == [0.0] * 4
