"""The max-pool kernels against eager's ``max_pool2d``: MaxPool's
(`pool_cpu.make_max_pool_kernel`: `maxpool_numba` on channels-last fp32 / bf16) on random
inputs holding NaN, ±inf and -0.0 (fp32: the same bits; bf16: the same bits where eager's
is not NaN, NaN where it is), and QuantMaxPool's (`make_quant_max_pool_kernel`, uint8)
on the same integers in fp32 (exact: max commutes with the conversion); kernel / stride /
padding / dilation / ceil_mode cases, channels-last and NCHW inputs (ATen's kernel), a
second call and output independence."""
import types

import pytest
import torch

from opencann.ops.kernels.int8_cpu import make_quant_max_pool_kernel
from opencann.ops.kernels.maxpool_numba import max_pool_float, pooled_size
from opencann.ops.kernels.pool_cpu import make_max_pool_kernel

CASES = [  # (N, C, H, W), kernel, stride, padding, dilation, ceil_mode
    ((1, 64, 112, 112), [3, 3], [2, 2], [1, 1], [1, 1], False),   # ResNet-50's stem pool
    ((2, 5, 9, 11), [3, 3], [2, 2], [1, 1], [1, 1], True),
    ((2, 7, 10, 8), [2, 3], [2, 1], [1, 0], [1, 1], False),
    ((1, 3, 13, 13), [3, 3], [3, 2], [0, 1], [2, 2], True),
    ((3, 16, 4, 4), [4, 4], [4, 4], [0, 0], [1, 1], False),
]


def _kernel(k, s, p, d, ceil):
    node = types.SimpleNamespace(attrs=dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=ceil))
    return make_quant_max_pool_kernel(node, [], [])


@pytest.mark.parametrize("shape, k, s, p, d, ceil", CASES)
@pytest.mark.parametrize("channels_last", [True, False])
def test_kernel_matches_eager_max_pool(shape, k, s, p, d, ceil, channels_last):
    g = torch.Generator().manual_seed(sum(shape))
    x = torch.randint(0, 256, shape, generator=g, dtype=torch.uint8)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.max_pool2d(x.float(), k, s, p, d, ceil_mode=ceil).to(torch.uint8)
    run = _kernel(k, s, p, d, ceil)
    y1 = run(x)
    y2 = run(x)                       # a second call: same values, a fresh tensor
    assert y1.dtype == torch.uint8 and torch.equal(y1, ref) and torch.equal(y2, ref)
    assert y1.data_ptr() != y2.data_ptr() and y1.data_ptr() != x.data_ptr()
    if channels_last:
        assert y1.is_contiguous(memory_format=torch.channels_last)


def test_numba_path_only_for_channels_last_float_within_half_kernel_padding():
    x = torch.randn(1, 4, 6, 6)
    assert max_pool_float(x, [3, 3], [2, 2], [1, 1], [1, 1], False) is None            # NCHW
    cl = x.contiguous(memory_format=torch.channels_last)
    assert max_pool_float(cl.double(), [3, 3], [2, 2], [1, 1], [1, 1], False) is None  # fp64
    assert max_pool_float(cl, [2, 2], [2, 2], [2, 2], [1, 1], False) is None          # pad > k / 2
    assert max_pool_float(cl, [3, 3], [2, 2], [1, 1], [1, 1], False) is not None


@pytest.mark.parametrize("size, k, s, p, d, ceil", [(112, 3, 2, 1, 1, False), (9, 3, 2, 1, 1, True),
                                                     (13, 3, 3, 0, 2, True), (5, 2, 2, 1, 1, True)])
def test_pooled_size_is_torchs(size, k, s, p, d, ceil):
    want = torch.nn.functional.max_pool2d(torch.zeros(1, 1, size, size), k, s, p, d, ceil_mode=ceil).shape[-1]
    assert pooled_size(size, k, s, p, d, ceil) == want


def _float_input(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g)
    flat = x.view(-1)
    k = torch.randint(0, flat.numel(), (max(8, flat.numel() // 50),), generator=g)
    flat[k] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 0.0, -1e-40])[
        torch.arange(k.numel()) % 6]
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape, k, s, p, d, ceil", CASES)
@pytest.mark.parametrize("channels_last", [True, False])
def test_float_kernel_matches_eager_max_pool(dtype, shape, k, s, p, d, ceil, channels_last):
    x = _float_input(shape, dtype, seed=sum(shape))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.max_pool2d(x, k, s, p, d, ceil_mode=ceil)
    attrs = dict(kernel_size=k, stride=s, padding=p, dilation=d, ceil_mode=ceil)
    run = make_max_pool_kernel(types.SimpleNamespace(attrs=attrs), [], [])
    y1 = run(x)
    y2 = run(x)
    for y in (y1, y2):
        assert y.dtype == dtype and y.shape == ref.shape
        assert torch.equal(y.isnan(), ref.isnan())
        keep = ~ref.isnan()
        it = torch.int32 if dtype == torch.float32 else torch.int16
        assert torch.equal(y.contiguous().view(it)[keep.contiguous()], ref.contiguous().view(it)[keep.contiguous()])
    assert y1.data_ptr() != y2.data_ptr() and y1.data_ptr() != x.data_ptr()


def test_float_path_defaults_and_fallbacks():
    """ATen's defaults (stride = kernel, no padding) from the attributes; a 3-D input and
    fp16 run ATen's kernel."""
    run = make_max_pool_kernel(types.SimpleNamespace(attrs={"kernel_size": [2, 2]}), [], [])
    x = _float_input((1, 4, 6, 6), torch.float32, 5).contiguous(memory_format=torch.channels_last)
    ref = torch.nn.functional.max_pool2d(x, 2)
    assert torch.equal(run(x).isnan(), ref.isnan()) and torch.equal(run(x).nan_to_num(), ref.nan_to_num())
    assert max_pool_float(x.half(), [2, 2], [2, 2], [0, 0], [1, 1], False) is None
    h = x.half()[0]                                     # 3-D, fp16: ATen
    torch.testing.assert_close(run(h), torch.nn.functional.max_pool2d(h, 2), equal_nan=True, rtol=0, atol=0)
