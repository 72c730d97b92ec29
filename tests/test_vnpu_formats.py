"""Round trips, padding and exact element order of the vnpu data formats."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from opencann.devices.vnpu.formats import (c0_for, format_shape, from_fractal_nz, from_fractal_z, from_nc1hwc0,
                                           to_fractal_nz, to_fractal_z, to_nc1hwc0, trans_data, valid_mask)

DTYPES = [torch.float32, torch.float16, torch.bfloat16, torch.int8]


def _rand(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.int8:
        return torch.randint(-128, 128, shape, generator=g, dtype=torch.int8)
    return (torch.randn(shape, generator=g) * 3 + 0.5).to(dtype)


dims = st.integers(1, 7)
chans = st.integers(1, 40)
dtypes = st.sampled_from(DTYPES)
seeds = st.integers(0, 2**16)


def test_c0_by_dtype():
    assert [c0_for(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8)] == \
        [16, 16, 8, 32, 32]


@settings(max_examples=40, deadline=None, database=None)
@given(n=dims, c=chans, h=dims, w=dims, dtype=dtypes, seed=seeds, nhwc=st.booleans())
def test_nc1hwc0_round_trip_and_zero_pad(n, c, h, w, dtype, seed, nhwc):
    x = _rand((n, c, h, w), dtype, seed)
    src = x.permute(0, 2, 3, 1).contiguous() if nhwc else x
    fmt = "NHWC" if nhwc else "NCHW"
    y = to_nc1hwc0(src, fmt)
    k = c0_for(dtype)
    assert tuple(y.shape) == format_shape(src.shape, "NC1HWC0", dtype, origin_format=fmt) == \
        (n, -(-c // k), h, w, k)
    assert torch.equal(from_nc1hwc0(y, src.shape, fmt), src)
    pad = y.permute(0, 1, 4, 2, 3).reshape(n, -1, h, w)[:, c:]
    assert pad.numel() == 0 or not pad.any()


@settings(max_examples=40, deadline=None, database=None)
@given(co=chans, ci=chans, kh=st.integers(1, 3), kw=st.integers(1, 3), dtype=dtypes, seed=seeds)
def test_fractal_z_round_trip_and_zero_pad(co, ci, kh, kw, dtype, seed):
    wt = _rand((co, ci, kh, kw), dtype, seed)
    y = to_fractal_z(wt)
    k = c0_for(dtype)
    assert tuple(y.shape) == (-(-ci // k) * kh * kw, -(-co // 16), 16, k)
    assert torch.equal(from_fractal_z(y, wt.shape), wt)
    mask = valid_mask(wt.shape, "FRACTAL_Z", dtype)
    assert not y[~mask].any()
    assert int(mask.sum()) == wt.numel()


@settings(max_examples=40, deadline=None, database=None)
@given(batch=st.lists(st.integers(1, 3), max_size=2), m=st.integers(1, 40), n=st.integers(1, 70),
       dtype=dtypes, seed=seeds)
def test_fractal_nz_round_trip_and_zero_pad(batch, m, n, dtype, seed):
    shape = (*batch, m, n)
    x = _rand(shape, dtype, seed)
    y = to_fractal_nz(x)
    k = c0_for(dtype)
    assert tuple(y.shape) == (*batch, -(-n // k), -(-m // 16), 16, k)
    assert torch.equal(from_fractal_nz(y, shape), x)
    mask = valid_mask(shape, "FRACTAL_NZ", dtype)
    assert not y[~mask].any()


def test_fractal_nz_rank1_is_one_row():
    x = _rand((20,), torch.float16, 1)
    y = to_fractal_nz(x)
    assert y.shape == (2, 1, 16, 16)
    assert torch.equal(from_fractal_nz(y, (20,)), x)


def test_nc1hwc0_hand_laid_out():
    # N=1, C=3, H=1, W=2, fp32 -> C0=8, C1=1: y[0,0,h,w,c] = x[0,c,h,w], c>=3 zero
    x = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]]])
    y = to_nc1hwc0(x)
    expected = torch.zeros(1, 1, 1, 2, 8)
    expected[0, 0, 0, 0, :3] = torch.tensor([1.0, 3.0, 5.0])
    expected[0, 0, 0, 1, :3] = torch.tensor([2.0, 4.0, 6.0])
    assert torch.equal(y, expected)


def test_fractal_nz_hand_laid_out():
    # fp32 (C0=8) matrix 2 x 10: fractal n1=0 holds columns 0..7, n1=1 columns 8..9 (+6 zero)
    x = torch.arange(20, dtype=torch.float32).reshape(2, 10)
    y = to_fractal_nz(x)
    assert y.shape == (2, 1, 16, 8)
    assert y[0, 0, 0].tolist() == [0, 1, 2, 3, 4, 5, 6, 7]
    assert y[0, 0, 1].tolist() == [10, 11, 12, 13, 14, 15, 16, 17]
    assert y[1, 0, 0].tolist() == [8, 9, 0, 0, 0, 0, 0, 0]
    assert y[1, 0, 1].tolist() == [18, 19, 0, 0, 0, 0, 0, 0]
    assert not y[:, :, 2:].any()
    # the flat memory order: fractal (n1=0) first, row-major inside ("N" outside, "Z" inside)
    assert y.flatten()[:10].tolist() == [0, 1, 2, 3, 4, 5, 6, 7, 10, 11]


def test_fractal_z_hand_laid_out():
    # fp16: Cout=2, Cin=2, 1x2 kernel -> (C1*KH*KW=2, N1=1, 16, C0=16); y[kw, 0, n, c] = w[n, c, 0, kw]
    w = torch.arange(8, dtype=torch.float16).reshape(2, 2, 1, 2)
    y = to_fractal_z(w)
    assert y.shape == (2, 1, 16, 16)
    assert y[0, 0, 0, :2].tolist() == [0, 2]     # w[0,0,0,0], w[0,1,0,0]
    assert y[0, 0, 1, :2].tolist() == [4, 6]     # w[1,0,0,0], w[1,1,0,0]
    assert y[1, 0, 0, :2].tolist() == [1, 3]     # kw = 1
    assert float(y.abs().sum()) == float(w.abs().sum())


@settings(max_examples=20, deadline=None, database=None)
@given(n=dims, c=chans, h=dims, w=dims, dtype=dtypes, seed=seeds)
def test_trans_data_dispatch(n, c, h, w, dtype, seed):
    x = _rand((n, c, h, w), dtype, seed)
    nhwc = trans_data(x, "NCHW", "NHWC")
    assert torch.equal(nhwc, x.permute(0, 2, 3, 1))
    y = trans_data(nhwc, "NHWC", "NC1HWC0")
    assert torch.equal(y, to_nc1hwc0(x))
    assert torch.equal(trans_data(y, "NC1HWC0", "NCHW", origin_shape=x.shape), x)
    assert torch.equal(trans_data(y, "NC1HWC0", "NHWC", origin_shape=nhwc.shape), nhwc)
    nz = trans_data(y, "NC1HWC0", "FRACTAL_NZ", origin_shape=x.shape)
    assert torch.equal(nz, to_fractal_nz(x))


def test_c0_override_gives_ge_legacy_fp32_layout():
    x = _rand((1, 20, 2, 2), torch.float32, 3)
    y = to_nc1hwc0(x, c0=16)
    assert y.shape == (1, 2, 2, 2, 16)
    assert torch.equal(from_nc1hwc0(y, x.shape, c0=16), x)


def test_errors_are_clear():
    with pytest.raises(ValueError, match="rank-4"):
        to_nc1hwc0(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="disagrees with origin shape"):
        from_nc1hwc0(torch.zeros(1, 1, 2, 2, 16, dtype=torch.float16), (1, 17, 2, 2))
    with pytest.raises(ValueError, match="disagrees with origin shape"):
        from_fractal_nz(torch.zeros(2, 1, 16, 16), (3, 40))
    with pytest.raises(ValueError, match="rank"):
        from_fractal_z(torch.zeros(4, 1, 16), (1, 1, 2, 2))
    with pytest.raises(ValueError, match="origin_shape is required"):
        trans_data(torch.zeros(1, 1, 1, 1, 16), "NC1HWC0", "NCHW")
    with pytest.raises(ValueError, match="unknown format"):
        trans_data(torch.zeros(1), "ND", "NC2HWC0")
