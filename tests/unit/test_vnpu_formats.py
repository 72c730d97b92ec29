"""Round trips, padding and exact element order of the vnpu data formats.

Shape vectors are those of CANN metadef's transformer unit test
(``TransformerTransferShapeUT``); element order is checked against plain loops written from
GE's format-transfer index formulas (format_transfer_nchw_nc1hwc0.cc,
format_transfer_fractal_z.cc incl. the grouped transfer, format_transfer_fractal_nz.cc)."""

import math

import pytest
import torch
from hypothesis import given, settings, strategies as st

from opencann.devices.vnpu.formats import (c0_for, format_shape, from_fractal_nz, from_fractal_z, from_nc1hwc0,
                                           fz_groups, to_fractal_nz, to_fractal_z, to_nc1hwc0, trans_data,
                                           valid_mask)

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
    # GE GetCubeSizeByDataType: 32 for 1-byte types, 16 for every other (fp32 included)
    assert [c0_for(d) for d in (torch.float16, torch.bfloat16, torch.float32, torch.int8, torch.uint8,
                                torch.int32)] == [16, 16, 16, 32, 32, 16]


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
    # N=1, C=3, H=1, W=2, fp32 -> C0=16, C1=1: y[0,0,h,w,c] = x[0,c,h,w], c>=3 zero
    x = torch.tensor([[[[1.0, 2.0]], [[3.0, 4.0]], [[5.0, 6.0]]]])
    y = to_nc1hwc0(x)
    expected = torch.zeros(1, 1, 1, 2, 16)
    expected[0, 0, 0, 0, :3] = torch.tensor([1.0, 3.0, 5.0])
    expected[0, 0, 0, 1, :3] = torch.tensor([2.0, 4.0, 6.0])
    assert torch.equal(y, expected)


def test_fractal_nz_hand_laid_out():
    # fp32 (C0=16) matrix 2 x 20: fractal n1=0 holds columns 0..15, n1=1 columns 16..19 (+12 zero)
    x = torch.arange(40, dtype=torch.float32).reshape(2, 20)
    y = to_fractal_nz(x)
    assert y.shape == (2, 1, 16, 16)
    assert y[0, 0, 0].tolist() == list(range(16))
    assert y[0, 0, 1].tolist() == list(range(20, 36))
    assert y[1, 0, 0].tolist() == [16, 17, 18, 19] + [0] * 12
    assert y[1, 0, 1].tolist() == [36, 37, 38, 39] + [0] * 12
    assert not y[:, :, 2:].any()
    # the flat memory order: fractal (n1=0) first, row-major inside ("N" outside, "Z" inside)
    assert y.flatten()[:18].tolist() == list(range(16)) + [20, 21]


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


def test_c0_override_gives_32_byte_fp32_layout():
    # c0=8 gives the 32-byte fp32 blocks (CANN's explicit FRACTAL_NZ_C0_8 style), not the default
    x = _rand((1, 20, 2, 2), torch.float32, 3)
    y = to_nc1hwc0(x, c0=8)
    assert y.shape == (1, 3, 2, 2, 8)
    assert torch.equal(from_nc1hwc0(y, x.shape, c0=8), x)


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


# ---------------------------------------------------------------------------------------
# CANN metadef transformer unit-test shape vectors (TransformerTransferShapeUT)
# ---------------------------------------------------------------------------------------

GE_SHAPE_VECTORS = [
    # (origin format, origin shape, format, dtype, groups, storage shape)
    ("NCHW", (8, 512, 5, 5), "NC1HWC0", torch.uint8, 1, (8, 16, 5, 5, 32)),
    ("NCHW", (8, 512, 5, 5), "NC1HWC0", torch.int8, 1, (8, 16, 5, 5, 32)),
    ("NCHW", (8, 512, 5, 5), "NC1HWC0", torch.int16, 1, (8, 32, 5, 5, 16)),
    ("NCHW", (8, 512, 5, 5), "NC1HWC0", torch.int32, 1, (8, 32, 5, 5, 16)),
    ("NCHW", (8, 512, 5, 5), "NC1HWC0", torch.float32, 1, (8, 32, 5, 5, 16)),
    ("NCHW", (8, 512, 5, 5), "NC1HWC0", torch.float16, 1, (8, 32, 5, 5, 16)),
    ("NCHW", (48, 512, 5, 5), "FRACTAL_Z", torch.int8, 1, (400, 3, 16, 32)),
    ("NCHW", (48, 512, 5, 5), "FRACTAL_Z", torch.float32, 1, (800, 3, 16, 16)),
    ("NCHW", (48, 512, 5, 5), "FRACTAL_Z", torch.float16, 1, (800, 3, 16, 16)),
    ("NCHW", (48, 512, 5, 5), "FRACTAL_Z", torch.int8, 16, (6400, 3, 16, 32)),
    ("NCHW", (48, 512, 5, 5), "FRACTAL_Z", torch.float32, 16, (12800, 3, 16, 16)),
    ("NCHW", (48, 512, 5, 5), "FRACTAL_Z", torch.float16, 16, (12800, 3, 16, 16)),
    ("ND", (18, 34), "FRACTAL_Z", torch.int8, 1, (1, 3, 16, 32)),
    ("ND", (18, 34), "FRACTAL_Z", torch.float32, 1, (2, 3, 16, 16)),
    ("ND", (18, 34), "FRACTAL_Z", torch.float16, 1, (2, 3, 16, 16)),
    ("ND", (18, 34), "FRACTAL_NZ", torch.float32, 1, (3, 2, 16, 16)),
    ("ND", (1, 18, 34), "FRACTAL_NZ", torch.int8, 1, (1, 2, 2, 16, 32)),
    ("ND", (1, 18, 34), "FRACTAL_NZ", torch.float32, 1, (1, 3, 2, 16, 16)),
    ("ND", (1, 18, 34), "FRACTAL_NZ", torch.float16, 1, (1, 3, 2, 16, 16)),
    ("ND", (8, 1000), "FRACTAL_NZ", torch.float16, 1, (63, 1, 16, 16)),
]


@pytest.mark.parametrize("of, shape, fmt, dtype, groups, storage", GE_SHAPE_VECTORS)
def test_storage_shapes_match_ge_unit_tests(of, shape, fmt, dtype, groups, storage):
    assert format_shape(shape, fmt, dtype, origin_format=of, groups=groups) == storage
    if math.prod(shape) <= 100_000:   # the data path gives the same shape
        x = _rand(shape, dtype if dtype in DTYPES else torch.int8, 0).to(dtype)
        y = trans_data(x, of, fmt, groups=groups)
        assert tuple(y.shape) == storage
        assert torch.equal(trans_data(y, fmt, of, origin_shape=shape, groups=groups), x)


def test_issue_17_fp32_example():
    # issue 17: NCHW fp32 {8,512,5,5} -> NC1HWC0 {8,32,5,5,16} in CANN (we used to give {8,64,5,5,8})
    x = torch.zeros(8, 512, 5, 5)
    assert tuple(to_nc1hwc0(x).shape) == (8, 32, 5, 5, 16)


def test_fz_groups_packing_factor():
    # TransShapeToFzWithGroups: Cin_g=512, Cout_g=3, g=16, C0=16 -> e = min(lcm(1, 16), 16) = 16
    assert fz_groups(512, 3, 16, 16) == (16, 8192, 48, 1)
    # depthwise 32 channels fp16: Cin_g=Cout_g=1 -> 16 groups per block, two blocks
    assert fz_groups(1, 1, 32, 16) == (16, 16, 16, 2)
    assert fz_groups(1, 1, 32, 32) == (32, 32, 32, 1)   # int8: e = min(lcm(32, 16), 32) = 32
    with pytest.raises(ValueError, match="dividing Cout"):
        format_shape((10, 3, 3, 3), "FRACTAL_Z", groups=4)


# ---------------------------------------------------------------------------------------
# plain-loop re-implementations of GE's transfer order (flat memory offsets)
# ---------------------------------------------------------------------------------------

def _loop_nc1hwc0(x, c0):
    n, c, h, w = x.shape
    c1 = -(-c // c0)
    flat = x.flatten().tolist()
    out = [0] * (n * c1 * h * w * c0)
    for ni in range(n):
        for c1i in range(c1):
            for hi in range(h):
                for wi in range(w):
                    for c0i in range(c0):
                        ci = c1i * c0 + c0i
                        dst = (((ni * c1 + c1i) * h + hi) * w + wi) * c0 + c0i
                        if ci < c:
                            out[dst] = flat[((ni * c + ci) * h + hi) * w + wi]
    return out


def _loop_fz(x, c0):
    """TransFormatFromNchwToFz: vertical fractals vfi over C1*H*W, horizontal hfi over N/16;
    dst index gfi * (16*c0) + col * c0 + row."""
    n, c, h, w = x.shape
    hw, chw = h * w, c * h * w
    c1, hf = -(-c // c0), -(-n // 16)
    flat = x.flatten().tolist()
    out = [0] * (c1 * hw * hf * 16 * c0)
    for vfi in range(c1 * hw):
        for hfi in range(hf):
            gfi = vfi * hf + hfi
            src_f = hfi * chw * 16 + vfi % hw + vfi // hw * hw * c0
            for row in range(c0):
                src_ci = vfi // hw * c0 + row
                for col in range(16):
                    src_ni = hfi * 16 + col
                    src = src_f + row * hw + chw * col
                    if src_ni < n and src_ci < c and src < n * chw:
                        out[gfi * 16 * c0 + col * c0 + row] = flat[src]
    return out


def _loop_fz_groups(x, groups, c0):
    """TransFormatHwcnToFzWithGroups's index formula, reading the NCHW weight."""
    n_dim, cin, h_dim, w_dim = x.shape
    cout = n_dim // groups
    e, cin_opt, cout_opt, g_dim = fz_groups(cin, cout, groups, c0)
    c1 = cin_opt // c0
    out = [0] * (g_dim * c1 * h_dim * w_dim * cout_opt * c0)
    for g in range(groups):
        for c in range(cin):
            for h in range(h_dim):
                for w in range(w_dim):
                    for n in range(cout):
                        ev = g % e
                        dst_ci, dst_co = ev * cin + c, ev * cout + n
                        dst = ((g // e) * c1 * h_dim * w_dim * cout_opt * c0
                               + (dst_ci // c0) * h_dim * w_dim * cout_opt * c0
                               + h * w_dim * cout_opt * c0 + w * cout_opt * c0 + dst_co * c0 + dst_ci % c0)
                        out[dst] = x[g * cout + n, c, h, w].item()
    return out


def _loop_nz(x, c0):
    *batch, m, n = x.shape
    b = math.prod(batch)
    m1, n1 = -(-m // 16), -(-n // c0)
    xs = x.reshape(b, m, n)
    out = [0] * (b * n1 * m1 * 16 * c0)
    for bi in range(b):
        for w1 in range(n1):
            for h1 in range(m1):
                for h0 in range(16):
                    for w0 in range(c0):
                        r, col = h1 * 16 + h0, w1 * c0 + w0
                        if r < m and col < n:
                            out[(((bi * n1 + w1) * m1 + h1) * 16 + h0) * c0 + w0] = xs[bi, r, col].item()
    return out


LOOP_DTYPES = st.sampled_from([torch.float16, torch.float32, torch.int8])


def _flat(y):
    return y.flatten().tolist()


@settings(max_examples=15, deadline=None, database=None)
@given(n=st.integers(1, 2), c=st.integers(1, 40), h=st.integers(1, 3), w=st.integers(1, 3), dtype=LOOP_DTYPES,
       seed=seeds)
def test_nc1hwc0_matches_ge_loop(n, c, h, w, dtype, seed):
    x = _rand((n, c, h, w), dtype, seed)
    assert _flat(to_nc1hwc0(x)) == _loop_nc1hwc0(x, c0_for(dtype))


@settings(max_examples=15, deadline=None, database=None)
@given(co=st.integers(1, 36), ci=st.integers(1, 40), kh=st.integers(1, 2), kw=st.integers(1, 3), dtype=LOOP_DTYPES,
       seed=seeds)
def test_fractal_z_matches_ge_loop(co, ci, kh, kw, dtype, seed):
    x = _rand((co, ci, kh, kw), dtype, seed)
    assert _flat(to_fractal_z(x)) == _loop_fz(x, c0_for(dtype))


@settings(max_examples=20, deadline=None, database=None)
@given(groups=st.integers(1, 8), cout_g=st.integers(1, 5), cin_g=st.integers(1, 6), kh=st.integers(1, 2),
       dtype=LOOP_DTYPES, seed=seeds)
def test_grouped_fractal_z_matches_ge_loop_and_round_trips(groups, cout_g, cin_g, kh, dtype, seed):
    x = _rand((groups * cout_g, cin_g, kh, 2), dtype, seed)
    y = to_fractal_z(x, groups=groups)
    assert tuple(y.shape) == format_shape(x.shape, "FRACTAL_Z", dtype, groups=groups)
    assert _flat(y) == _loop_fz_groups(x, groups, c0_for(dtype))
    assert torch.equal(from_fractal_z(y, x.shape, groups=groups), x)
    mask = valid_mask(x.shape, "FRACTAL_Z", dtype, groups=groups)
    assert int(mask.sum()) == x.numel() and not y[~mask].any()


@settings(max_examples=15, deadline=None, database=None)
@given(k=st.integers(1, 40), n=st.integers(1, 40), dtype=LOOP_DTYPES, seed=seeds)
def test_matrix_fractal_z_element_positions(k, n, dtype, seed):
    x = _rand((k, n), dtype, seed)
    y = trans_data(x, "ND", "FRACTAL_Z")
    c0 = c0_for(dtype)
    assert tuple(y.shape) == (-(-k // c0), -(-n // 16), 16, c0)
    # y[k1, n1, n0, k0] = x[k1*C0 + k0, n1*16 + n0]
    for (ki, ni) in [(0, 0), (k - 1, n - 1), (k // 2, n // 3)]:
        assert y[ki // c0, ni // 16, ni % 16, ki % c0] == x[ki, ni]
    assert _flat(y) == _loop_fz(x.t()[:, :, None, None], c0)
    assert torch.equal(trans_data(y, "FRACTAL_Z", "ND", origin_shape=(k, n)), x)


@settings(max_examples=15, deadline=None, database=None)
@given(batch=st.lists(st.integers(1, 2), max_size=1), m=st.integers(1, 35), n=st.integers(1, 40), dtype=LOOP_DTYPES,
       seed=seeds)
def test_fractal_nz_matches_ge_loop(batch, m, n, dtype, seed):
    x = _rand((*batch, m, n), dtype, seed)
    assert _flat(to_fractal_nz(x)) == _loop_nz(x, c0_for(dtype))
