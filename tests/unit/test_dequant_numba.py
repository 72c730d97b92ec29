"""AscendDequant's CPU kernel (`make_ascend_dequant_kernel`; the numba pass of
`quant_numba.dequantize_dense` for dense uint8 / int8) against the eager spelling
``(x.float() - offset) * step`` in fp32: the same bits, for channels-last, contiguous and
non-dense inputs, a second call and output independence."""
import types

import pytest
import torch

from opencann.ops.kernels.int8_cpu import make_ascend_dequant_kernel


def _eager(x, step, offset):
    y = torch.empty_like(x, dtype=torch.float32)
    y.copy_(x)
    return y.sub_(offset).mul_(step)


@pytest.mark.parametrize("dtype, offset", [(torch.uint8, 131), (torch.int8, -7)])
@pytest.mark.parametrize("layout", ["channels_last", "contiguous", "strided"])
def test_same_bits_as_the_eager_spelling(dtype, offset, layout):
    g = torch.Generator().manual_seed(3)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-128, 128)
    x = torch.randint(lo, hi, (2, 6, 9, 7), generator=g, dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    elif layout == "strided":
        x = x[:, ::2]
    step = 0.0123456789
    run = make_ascend_dequant_kernel(types.SimpleNamespace(attrs={"scale": step, "offset": offset}), [], [])
    ref = _eager(x, step, offset)
    y1, y2 = run(x), run(x)
    assert y1.dtype == torch.float32 and y1.stride() == ref.stride()
    assert torch.equal(y1.view(torch.int32), ref.view(torch.int32))
    assert torch.equal(y2, y1) and y2.data_ptr() != y1.data_ptr() and y1.data_ptr() != x.data_ptr()
