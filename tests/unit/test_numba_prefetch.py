"""`opencann.ops.kernels.numba_prefetch.prefetch`: compiles into a numba kernel, changes
no result (a prefetch is only a hint), and is typed for 2-D arrays with integer indices
only (anything else is a numba typing error naming ``prefetch``)."""
import numba
import numpy as np
import pytest

from opencann.ops.kernels.numba_prefetch import prefetch


@numba.njit(cache=False)
def _row_sums_prefetching(a):
    out = np.zeros(a.shape[0], np.float64)
    for i in range(a.shape[0]):
        nxt = min(i + 1, a.shape[0] - 1)
        for j in range(0, a.shape[1], 16):
            prefetch(a, nxt, j)
        s = 0.0
        for j in range(a.shape[1]):
            s += a[i, j]
        out[i] = s
    return out


@numba.njit(cache=False)
def _row_sums(a):
    out = np.zeros(a.shape[0], np.float64)
    for i in range(a.shape[0]):
        s = 0.0
        for j in range(a.shape[1]):
            s += a[i, j]
        out[i] = s
    return out


def test_prefetch_changes_no_result():
    a = np.random.default_rng(0).standard_normal((37, 101)).astype(np.float32)
    a[3, 5] = np.nan
    r = _row_sums_prefetching(a)
    assert np.array_equal(r, _row_sums(a), equal_nan=True)
    assert np.isnan(r[3]) and np.isfinite(np.delete(r, 3)).all()


def test_prefetch_is_typed_for_2d_arrays_only():
    @numba.njit(cache=False)
    def one_d(v):
        prefetch(v, 0, 0)

    with pytest.raises(numba.core.errors.TypingError, match="prefetch"):
        one_d(np.zeros(4, np.float32))
