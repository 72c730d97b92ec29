"""`opencann.ops.kernels.decode_attention_tile`: the decode-attention score block and P·V
block at both vector widths (16 lanes, AVX-512; 8, AVX2: forced here, so a host with
AVX-512 runs the AVX2 blocks too) against float64: scores and their NaN-propagating max
(NaN, +Inf and -Inf keys), P·V for head counts that are not a multiple of the block's
heads and head sizes that are not a multiple of its slices (the clamped repeats store the
same values); the transposition tree's masks; one clear error for a bad width. The
blocks inside the whole decode attention (against eager SDPA, NaN/Inf positions) are
tests/unit/test_decode_attention.py's D = 32, 48, 64 and 128 cases."""
import functools

import numba
import numpy as np
import pytest

from opencann.ops.kernels.decode_attention_tile import SLICES, pv_block_for, pv_heads, qk_block_for
from opencann.ops.kernels.gemv_tile import transpose_sum_masks


@functools.lru_cache(maxsize=None)
def _scores_runner(width):
    """A numba function running `qk_block` at ``width`` for every head (compiled once per
    width)."""
    qk = qk_block_for(width)

    @numba.njit
    def run(qg, kk, j0, scale, s):
        m = np.empty(qg.shape[0], np.float32)
        for g in range(qg.shape[0]):
            m[g] = qk(qg, g, kk, j0, scale, s)
        return m
    return run


def _scores(width, qg, kk, j0, scale):
    s = np.full((qg.shape[0], j0 + width + 3), -7.0, np.float32)
    return _scores_runner(width)(qg, kk, j0, np.float32(scale), s), s


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("d", [16, 64, 128])
def test_score_block_matches_float64(width, d):
    rng = np.random.default_rng(d + width)
    qg = rng.standard_normal((3, d)).astype(np.float32)
    kk = rng.standard_normal((50, d)).astype(np.float32)
    j0 = 5
    m, s = _scores(width, qg, kk, j0, 0.125)
    ref = 0.125 * (qg.astype(np.float64) @ kk[j0:j0 + width].T.astype(np.float64))
    mag = 0.125 * (np.abs(qg).astype(np.float64) @ np.abs(kk[j0:j0 + width]).T)
    assert (np.abs(s[:, j0:j0 + width] - ref) <= 1e-5 * mag).all()
    assert (s[:, :j0] == -7.0).all() and (s[:, j0 + width:] == -7.0).all()   # nothing else written
    assert np.array_equal(m, s[:, j0:j0 + width].max(axis=1))


@pytest.mark.parametrize("width", [8, 16])
def test_score_block_max_keeps_nan_and_inf(width):
    rng = np.random.default_rng(1)
    qg = np.abs(rng.standard_normal((3, 32))).astype(np.float32) + 0.1
    kk = rng.standard_normal((width, 32)).astype(np.float32)
    kk[2, 7] = np.nan                  # a NaN score in every head
    m, s = _scores(width, qg, kk, 0, 1.0)
    assert np.isnan(s[:, 2]).all() and np.isnan(m).all()
    kk[2, 7] = np.inf                  # +Inf score (positive q): the max is +Inf
    m, s = _scores(width, qg, kk, 0, 1.0)
    assert (m == np.inf).all()
    kk[2, 7] = -np.inf                 # -Inf score: the max is the largest finite one
    m, s = _scores(width, qg, kk, 0, 1.0)
    assert np.isfinite(m).all() and np.array_equal(m, s.max(axis=1))


@functools.lru_cache(maxsize=None)
def _pv_runner(width):
    """A numba function running `pv_block` at ``width`` over all heads and head dimensions
    (compiled once per width)."""
    pv = pv_block_for(width)
    heads = pv_heads(width)

    @numba.njit
    def run(s, vv, n, acc):
        for g0 in range(0, acc.shape[0], heads):
            for d0 in range(0, acc.shape[1], width * SLICES):
                pv(s, g0, vv, n, d0, acc)
    return run


@pytest.mark.parametrize("width", [8, 16])
@pytest.mark.parametrize("g,d", [(1, 64), (3, 64), (5, 48), (8, 128), (2, 16)])
def test_pv_block_matches_float64(width, g, d):
    if d % width:
        pytest.skip("D not a multiple of the width: the caller keeps numba's loop (fits)")
    run = _pv_runner(width)
    rng = np.random.default_rng(g * d)
    n = 37
    s = rng.random((g, n + 5)).astype(np.float32)
    vv = rng.standard_normal((60, d)).astype(np.float32)
    vv[n:] = np.nan                     # rows past n are never read
    acc = np.full((g, d), np.nan, np.float32)
    run(s, vv, n, acc)
    ref = s[:, :n].astype(np.float64) @ vv[:n].astype(np.float64)
    mag = s[:, :n].astype(np.float64) @ np.abs(vv[:n]).astype(np.float64)
    assert (np.abs(acc - ref) <= 1e-5 * mag).all()
    vv[3, 1] = np.inf                   # an Inf value reaches its column
    run(s, vv, n, acc)
    assert np.isinf(acc[:, 1]).all() and np.isfinite(np.delete(acc, 1, axis=1)).all()


@pytest.mark.parametrize("width", [8, 16])
def test_transposition_tree_sums_each_vector_into_its_lane(width):
    rng = np.random.default_rng(0)
    vs = [rng.standard_normal(width) for _ in range(width)]
    for lo, hi in transpose_sum_masks(width):
        vs = [np.concatenate([vs[p], vs[p + 1]])[lo] + np.concatenate([vs[p], vs[p + 1]])[hi]
              for p in range(0, len(vs), 2)]
    src = np.random.default_rng(0)
    expect = np.array([src.standard_normal(width).sum() for _ in range(width)])
    assert len(vs) == 1 and np.allclose(vs[0], expect)


def test_bad_width_is_one_clear_error():
    for make in (qk_block_for, pv_block_for):
        with pytest.raises(ValueError, match="width must be 8 or 16"):
            make(4)
