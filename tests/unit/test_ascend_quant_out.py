"""AscendQuant's CPU kernel writing into a given buffer (`make_ascend_quant_kernel`'s
``out=``: the op is ``out_capable`` on the CPU, so the executor passes the planned arena
buffer): the same bits as the fresh result and as eager ops quantizing by the same fp32
rule, for fp32 and bf16, contiguous, channels-last and non-dense inputs, NaN/±inf, a
buffer of other strides (copied into), a second call, and in a compiled int8 graph
against the kernel with no ``out`` (the executor's copy-out)."""
import types

import pytest
import torch

import opencann
from opencann.devices.cpu import mkldnn_available
from opencann.ops import get_op
from opencann.ops.kernels.int8_cpu import make_ascend_quant_kernel


def _ref(x: torch.Tensor, step: float, offset: int) -> torch.Tensor:
    """saturate(round_half_even(x / step) + offset) computed as the kernel does (fp32
    multiply by the reciprocal), NaN → 0."""
    y = torch.round(x.float() * torch.tensor(1.0 / step, dtype=torch.float32)) + offset
    return torch.nan_to_num(y, nan=0.0).clamp(0, 255).to(torch.uint8)


def _x(shape, dtype, layout, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    f = x.view(-1)
    f[::31], f[3::37], f[5::41] = float("nan"), float("inf"), -float("inf")
    x = x.to(dtype)
    if layout == "channels_last":
        return x.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        return x[:, ::2]
    return x


def _kernel(step, offset):
    return make_ascend_quant_kernel(types.SimpleNamespace(attrs={"scale": 1.0 / step, "offset": offset}), [], [])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last", "strided"])
def test_out_gets_the_bits_of_the_fresh_result(dtype, layout):
    x = _x((2, 8, 9, 7), dtype, layout, seed=len(layout))
    step, offset = 0.037, 119
    run = _kernel(step, offset)
    fresh = run(x)
    out = torch.empty_like(x, dtype=torch.uint8)
    out.fill_(7)
    got = run(x, out=out)
    assert got is out
    assert torch.equal(got, fresh) and torch.equal(got, _ref(x, step, offset))
    x2 = _x((2, 8, 9, 7), dtype, layout, seed=99)           # a second call into the same buffer
    assert run(x2, out=out) is out and torch.equal(out, _ref(x2, step, offset))
    assert not torch.equal(out, fresh)                      # the earlier result did not stay


def test_out_of_other_strides_is_copied_into():
    x = _x((4, 6, 5, 3), torch.bfloat16, "channels_last", seed=5)
    out = torch.empty(x.shape, dtype=torch.uint8)            # contiguous: x is channels-last
    got = _kernel(0.1, 3)(x, out=out)
    assert got is out and torch.equal(out, _ref(x, 0.1, 3))


@pytest.mark.skipif(not (mkldnn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
                    reason="no oneDNN int8 kernels in this torch")
def test_int8_graph_same_outputs_with_and_without_out():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Linear(32, 48), torch.nn.GELU(), torch.nn.Linear(48, 16)).eval()
    x = torch.randn(8, 32)
    op = get_op("AscendQuant")
    keep = op.out_capable
    cal = [x, torch.randn(8, 32)]
    q = opencann.quantize(m, cal)
    try:
        op.out_capable = None
        fresh = opencann.quantize(m, cal)
    finally:
        op.out_capable = keep
    assert any(n.op == "AscendQuant" for n in q.graph.nodes)
    with torch.no_grad():
        xs = x.clone()
        xs[0, 0], xs[1, 3], xs[2, 5] = float("nan"), float("inf"), -float("inf")
        for inp in (x, xs, torch.randn(8, 32)):
            a, b = q(inp), fresh(inp)
            assert torch.equal(a, b)
        y1 = q(x)
        y2 = q(x)
        assert torch.equal(y1, y2) and y1.data_ptr() != y2.data_ptr()
        cos = torch.nn.functional.cosine_similarity(y1.flatten(), m(x).flatten(), dim=0)
        assert cos > 0.99
