"""QuantMaxPool's CPU kernel (`make_quant_max_pool_kernel`, the numba pass of
`maxpool_u8_numba` for channels-last uint8) against eager's ``max_pool2d`` of the same
integers in fp32 (exact: max commutes with the conversion), over kernel / stride /
padding / dilation / ceil_mode cases, channels-last and NCHW inputs, a second call and
output independence."""
import types

import pytest
import torch

from opencann.ops.kernels.int8_cpu import make_quant_max_pool_kernel
from opencann.ops.kernels.maxpool_u8_numba import max_pool_u8, pooled_size

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


def test_numba_path_only_for_channels_last_uint8_within_half_kernel_padding():
    x = torch.randint(0, 256, (1, 4, 6, 6), dtype=torch.uint8)
    assert max_pool_u8(x, [3, 3], [2, 2], [1, 1], [1, 1], False) is None            # NCHW
    cl = x.contiguous(memory_format=torch.channels_last)
    assert max_pool_u8(cl.float(), [3, 3], [2, 2], [1, 1], [1, 1], False) is None  # not uint8
    assert max_pool_u8(cl, [2, 2], [2, 2], [2, 2], [1, 1], False) is None          # pad > k / 2
    assert max_pool_u8(cl, [3, 3], [2, 2], [1, 1], [1, 1], False) is not None


@pytest.mark.parametrize("size, k, s, p, d, ceil", [(112, 3, 2, 1, 1, False), (9, 3, 2, 1, 1, True),
                                                     (13, 3, 3, 0, 2, True), (5, 2, 2, 1, 1, True)])
def test_pooled_size_is_torchs(size, k, s, p, d, ceil):
    want = torch.nn.functional.max_pool2d(torch.zeros(1, 1, size, size), k, s, p, d, ceil_mode=ceil).shape[-1]
    assert pooled_size(size, k, s, p, d, ceil) == want
