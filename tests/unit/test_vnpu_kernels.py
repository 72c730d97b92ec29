"""vnpu kernels computed in NPU formats agree with torch's eager CPU result."""

import pytest
import torch
import torch.nn.functional as F

from opencann.devices.vnpu.formats import (from_fractal_nz, from_nc1hwc0, to_fractal_nz, to_fractal_z,
                                           to_nc1hwc0, valid_mask)
from opencann.devices.vnpu.kernels import conv2d_nc1hwc0, elementwise, matmul_nz, trans_data

TOL = {torch.float32: (1e-5, 1e-5), torch.float16: (2e-2, 2e-2), torch.bfloat16: (5e-2, 5e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("cfg", [
    dict(n=2, ci=5, co=7, h=9, w=8, k=3, s=1, p=1, d=1),
    dict(n=1, ci=19, co=33, h=7, w=6, k=3, s=2, p=0, d=1),
    dict(n=1, ci=3, co=4, h=10, w=10, k=3, s=1, p=2, d=2),
    dict(n=2, ci=16, co=16, h=5, w=5, k=1, s=1, p=0, d=1),
])
def test_conv2d_matches_torch(dtype, cfg):
    g = torch.Generator().manual_seed(7)
    x = torch.randn(cfg["n"], cfg["ci"], cfg["h"], cfg["w"], generator=g)
    wt = torch.randn(cfg["co"], cfg["ci"], cfg["k"], cfg["k"], generator=g) / cfg["k"]
    b = torch.randn(cfg["co"], generator=g)
    x, wt, b = x.to(dtype), wt.to(dtype), b.to(dtype)
    ref = F.conv2d(x.double(), wt.double(), b.double(), stride=cfg["s"], padding=cfg["p"], dilation=cfg["d"])
    y = conv2d_nc1hwc0(to_nc1hwc0(x), to_fractal_z(wt), in_channels=cfg["ci"], out_channels=cfg["co"],
                       kernel_size=cfg["k"], stride=cfg["s"], padding=cfg["p"], dilation=cfg["d"], bias=b)
    assert y.dtype == dtype
    mask = valid_mask(ref.shape, "NC1HWC0", dtype)
    assert not y[~mask].any(), "padding channels must stay zero"
    out = from_nc1hwc0(y, ref.shape)
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(out.double(), ref, rtol=rtol, atol=atol * ref.abs().max().item())


def test_conv2d_nonzero_garbage_in_pad_channels_contributes_nothing():
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, 5, 6, 6, generator=g)
    wt = torch.randn(6, 5, 3, 3, generator=g)
    x5 = to_nc1hwc0(x)
    x5[:, -1, :, :, 5:] = 1e3    # corrupt the padding of the activations
    y = conv2d_nc1hwc0(x5, to_fractal_z(wt), in_channels=5, out_channels=6, kernel_size=3)
    torch.testing.assert_close(from_nc1hwc0(y, (1, 6, 4, 4)), F.conv2d(x, wt), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("shapes", [((20, 37), (37, 18)), ((2, 3, 17, 33), (3, 33, 40)), ((5, 16, 16), (16, 1))])
def test_matmul_nz_matches_torch(dtype, shapes):
    g = torch.Generator().manual_seed(11)
    sa, sb = shapes
    a, b = torch.randn(sa, generator=g).to(dtype), torch.randn(sb, generator=g).to(dtype)
    ref = torch.matmul(a.double(), b.double())
    c = matmul_nz(to_fractal_nz(a), to_fractal_nz(b), sa, sb)
    assert c.dtype == dtype
    assert not c[~valid_mask(ref.shape, "FRACTAL_NZ", dtype)].any()
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(from_fractal_nz(c, ref.shape).double(), ref, rtol=rtol, atol=atol * 10)


def test_matmul_nz_int8_exact_int32():
    g = torch.Generator().manual_seed(5)
    a = torch.randint(-128, 128, (19, 45), generator=g, dtype=torch.int8)
    b = torch.randint(-128, 128, (45, 23), generator=g, dtype=torch.int8)
    c = matmul_nz(to_fractal_nz(a), to_fractal_nz(b), a.shape, b.shape)
    assert c.dtype == torch.int32
    assert torch.equal(from_fractal_nz(c, (19, 23)), a.int() @ b.int())


def test_matmul_nz_rejects_mismatch():
    a = to_fractal_nz(torch.randn(4, 5))
    b = to_fractal_nz(torch.randn(6, 3))
    with pytest.raises(ValueError, match="inner dimensions"):
        matmul_nz(a, b, (4, 5), (6, 3))
    with pytest.raises(ValueError, match="disagrees"):
        matmul_nz(a, to_fractal_nz(torch.randn(5, 3)), (4, 5), (5, 40))


@pytest.mark.parametrize("fmt,shape", [("NC1HWC0", (2, 5, 3, 4)), ("FRACTAL_NZ", (3, 17, 20))])
@pytest.mark.parametrize("fn,ref", [
    (torch.sigmoid, torch.sigmoid),
    (lambda a: a + 1.0, lambda a: a + 1.0),
    (torch.exp, torch.exp),
    (torch.log, torch.log),          # log(0) = -inf in the pad must be re-zeroed
])
def test_elementwise_unary_rezeroes_pad(fmt, shape, fn, ref):
    g = torch.Generator().manual_seed(2)
    x = torch.rand(shape, generator=g) + 0.1
    xs = trans_data(x, "NCHW" if fmt == "NC1HWC0" else "ND", fmt)
    y = elementwise(fn, xs, fmt=fmt, origin_shape=shape)
    mask = valid_mask(shape, fmt, x.dtype)
    assert not y[~mask].any()
    back = trans_data(y, fmt, "NCHW" if fmt == "NC1HWC0" else "ND", origin_shape=shape)
    torch.testing.assert_close(back, ref(x))


def test_elementwise_binary_with_channel_bias():
    g = torch.Generator().manual_seed(4)
    x, z = torch.randn(2, 5, 3, 3, generator=g), torch.randn(2, 5, 3, 3, generator=g)
    bias = torch.randn(5, generator=g)
    b5 = to_nc1hwc0(bias.reshape(1, 5, 1, 1))        # (1, C1, 1, 1, C0) broadcasts
    y = elementwise(lambda a, c, b: torch.relu(a + c) + b, to_nc1hwc0(x), to_nc1hwc0(z), b5,
                    fmt="NC1HWC0", origin_shape=x.shape)
    torch.testing.assert_close(from_nc1hwc0(y, x.shape), torch.relu(x + z) + bias.reshape(1, 5, 1, 1))


def test_elementwise_shape_error():
    with pytest.raises(ValueError, match="does not broadcast"):
        elementwise(torch.sigmoid, torch.zeros(2, 1, 3, 3, 7), fmt="NC1HWC0", origin_shape=(2, 5, 3, 3))
