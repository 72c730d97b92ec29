"""`opencann.ops.kernels.relu_numba.relu_` against eager's ``torch.relu`` on random bf16
and fp32 tensors holding NaN (both signs), ±inf, -0.0 and denormals: the same bits
wherever eager's result is not NaN, NaN exactly where eager's is, in place; the numba
pass below `SERIAL_MAX` and eager's above it, channels-last and non-dense inputs; and a
bf16 convolution kernel's ReLU (`make_conv_kernel`) against eager's ReLU on the same
convolution's result."""
import types

import pytest
import torch

from opencann.ir import TensorDesc
from opencann.ops.kernels.relu_numba import SERIAL_MAX, relu_

INT = {torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _specials(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g).to(dtype)
    flat = x.view(-1)
    k = torch.randint(0, flat.numel(), (64,), generator=g)
    vals = torch.tensor([float("nan"), -float("nan"), float("inf"), -float("inf"), -0.0, 0.0,
                         -1e-40, 1e-40], dtype=torch.float32).to(dtype)
    flat[k] = vals.repeat(8)
    return x


def _assert_relu(y, x_before):
    ref = torch.relu(x_before.clone())
    assert torch.equal(y.isnan(), ref.isnan())
    keep = ~ref.isnan()
    it = INT[y.dtype]
    assert torch.equal(y.view(it)[keep], ref.view(it)[keep])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape, channels_last", [((2, 16, 9, 7), True), ((3, 5, 11, 13), False),
                                                  ((4097,), False)])
def test_same_bits_as_eager_relu(dtype, shape, channels_last):
    x = _specials(shape, dtype, seed=sum(shape))
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    before = x.clone()
    y = relu_(x)
    assert y is x and y.stride() == before.stride()
    _assert_relu(y, before)
    again = relu_(x)          # a second call: ReLU is idempotent
    _assert_relu(again, before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_eagers_relu_above_serial_max(dtype):
    x = _specials((SERIAL_MAX + 12345,), dtype, seed=7)
    before = x.clone()
    _assert_relu(relu_(x), before)


def test_non_dense_and_other_dtypes_fall_back_to_eager():
    x = _specials((8, 6), torch.bfloat16, seed=3).t()[:, ::2]     # not dense
    before = x.clone()
    _assert_relu(relu_(x), before)
    h = torch.randn(33, dtype=torch.float16)
    torch.testing.assert_close(relu_(h.clone()), torch.relu(h), rtol=0, atol=0)


def test_bf16_conv_kernel_relu_is_eagers_relu_of_the_convolution():
    """The bound bf16 ConvBiasAct kernel with ReLU gives eager's ``relu`` of oneDNN's
    convolution (the same kernel bound without it), NaN / inf pre-activations included;
    a second call gives the same and a fresh tensor."""
    from opencann.ops.kernels.cpu import make_conv_kernel
    from opencann.devices.cpu import onednn_bf16_available
    if not hasattr(torch.ops.mkldnn, "_convolution_pointwise") or not onednn_bf16_available():
        pytest.skip("no oneDNN bf16 convolution in this torch / on this CPU")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1, 16, 10, 10, generator=g).bfloat16().contiguous(memory_format=torch.channels_last)
    x[0, 3, 2, 2], x[0, 5, 7, 1], x[0, 1, 4, 4] = float("nan"), float("inf"), -float("inf")
    w = torch.randn(32, 16, 3, 3, generator=g).bfloat16()
    b = torch.randn(32, generator=g).bfloat16()
    attrs = dict(padding=[1, 1], stride=[1, 1], dilation=[1, 1], groups=1)
    descs = [TensorDesc.of(x), TensorDesc.of(w), TensorDesc.of(b)]
    with_relu = make_conv_kernel(types.SimpleNamespace(op="ConvBiasAct", attrs=dict(attrs, act="relu"), meta={}),
                                 descs, [None, w, b])
    bare = make_conv_kernel(types.SimpleNamespace(op="ConvBiasAct", attrs=dict(attrs, act="none"), meta={}),
                            descs, [None, w, b])
    with torch.no_grad():
        pre = bare(x, w, b)
        y1 = with_relu(x, w, b)
        y2 = with_relu(x, w, b)
    assert pre.isnan().any() and (pre < 0).any()
    assert y2.data_ptr() != y1.data_ptr()    # the second call did not write into the first's
    _assert_relu(y1, pre)
    _assert_relu(y2, pre)
