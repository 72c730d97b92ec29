"""`opencann.ops.kernels.gemv_tile`: the decode GEMV's register tile at both vector widths
(16 lanes, AVX-512, and 8, AVX2: forced here, so a host with AVX-512 runs the AVX2 tile
too) against float64, every (mr, rw) the kernels use, K with and without a scalar tail,
w rows clamped past N, NaN/Inf reaching exactly the products they take part in; the
register budget `rows_for` gives; one clear error for bad tile parameters."""
import functools

import numba
import numpy as np
import pytest

from opencann.ops.kernels.gemv_tile import dot_tile, rows_for, vector_width


@functools.lru_cache(maxsize=None)
def _runner(mr: int, rw: int, width: int):
    """A numba function running ``dot_tile(mr, rw, width)`` over all N outputs (compiled
    once per tile: each shape of a test reuses it)."""
    tile = dot_tile(mr, rw, width)

    @numba.njit
    def run(x, w, out):
        n = w.shape[0]
        h = (n + rw - 1) // rw
        for t in range(h):
            s = tile(x, w, t, h)
            for q in range(rw):
                if t + q * h < n:
                    for m in range(mr):
                        out[m, t + q * h] = s[q * mr + m]
    return run


def _run_tile(mr: int, rw: int, width: int, x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """All N outputs for x's rows through ``dot_tile(mr, rw, width)``: [mr, N]."""
    out = np.full((mr, w.shape[0]), np.nan, np.float32)
    _runner(mr, rw, width)(x, w, out)
    return out


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("mr", [1, 4, 8])
@pytest.mark.parametrize("k,n", [(5, 3), (64, 7), (771, 37)])
def test_tile_matches_float64(width, mr, k, n):
    rng = np.random.default_rng(k * 10 + mr)
    m = max(1, mr - 1)                      # x with fewer rows than the tile: the last repeats
    x = rng.standard_normal((m, k)).astype(np.float32)
    w = rng.standard_normal((n, k)).astype(np.float32)
    rw = rows_for(mr, width)
    out = _run_tile(mr, rw, width, x, w)
    ref = x.astype(np.float64) @ w.T.astype(np.float64)
    mag = np.abs(x).astype(np.float64) @ np.abs(w).T.astype(np.float64)
    xm = np.minimum(np.arange(mr), m - 1)   # the tile's row m is x's row min(m, M - 1)
    assert (np.abs(out - ref[xm]) <= 1e-5 * mag[xm]).all()
    out2 = _run_tile(mr, rw, width, x, w)
    assert np.array_equal(out, out2)        # a second call: the same bits


@pytest.mark.parametrize("width", [8, 16])
def test_nan_and_inf_reach_their_products(width):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 40)).astype(np.float32)
    w = rng.standard_normal((9, 40)).astype(np.float32)
    x[2, 17] = np.nan                        # in the vector part
    w[4, 38] = np.inf                        # in the scalar tail (40 = 32 + 8 at width 16)
    out = _run_tile(8, rows_for(8, width), width, x, w)
    with np.errstate(invalid="ignore", over="ignore"):
        ref = x.astype(np.float64) @ w.T.astype(np.float64)
    assert np.array_equal(np.isnan(out), np.isnan(ref))
    assert np.array_equal(np.isinf(out), np.isinf(ref))
    assert np.array_equal(np.sign(out[np.isinf(ref)]), np.sign(ref[np.isinf(ref)]))


def test_register_budget():
    assert [rows_for(mr, 16) for mr in (1, 4, 8)] == [8, 6, 3]
    assert [rows_for(mr, 8) for mr in (1, 4, 8)] == [7, 3, 1]
    for mr in range(1, 9):     # accumulators + one x vector + the w vectors fit the file
        for width, regs in ((16, 32), (8, 16)):
            rw = rows_for(mr, width)
            assert mr * rw + 1 + rw <= regs or rw == 1
    assert vector_width() in (8, 16)


@pytest.mark.parametrize("args,match", [((0, 1), "mr and rw must be 1..8"),
                                        ((8, 9), "mr and rw must be 1..8"),
                                        ((1, 1, 4), "width 8 or 16")])
def test_bad_tile_parameters_are_one_clear_error(args, match):
    with pytest.raises(ValueError, match=match):
        dot_tile(*args)
    with pytest.raises(ValueError, match="mr must be 1..8"):
        rows_for(9)
