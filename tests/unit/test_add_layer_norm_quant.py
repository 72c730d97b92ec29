"""`fuse_add_layer_norm_quant`: AddLayerNormCast whose bf16 output only an AscendQuant
reads (through Reshapes) ⇒ AddLayerNormQuant writing the uint8 tensor. A golden
before/expected graph of ≤ 10 nodes, the reasons it does not apply, and the kernel against
the unfused chain (random data with NaN/±inf rows, a second call, outputs independent of
each other and of the inputs)."""
import pytest
import torch

from opencann.engine.options import complete
from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.ops.kernels.add_layer_norm_cast_cpu import add_layer_norm_cast
from opencann.ops.kernels.add_layer_norm_quant_cpu import add_layer_norm_quant
from opencann.ops.kernels.int8_cpu import quantize_u8
from opencann.passes import FuseAddLayerNormQuant, PassContext, PassManager
from opencann.report import CompileReport

F, BF, U8 = DataType.FLOAT, DataType.BF16, DataType.UINT8
G = torch.Generator().manual_seed(0)
ATTRS = ("scale", "offset", "eps")


def run(g, device="cpu"):
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device=device)
    PassManager([FuseAddLayerNormQuant()]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=ATTRS), ctx.report


def block(second_reader=None, scales=(10.0,)):
    """AddLayerNormCast(a bf16, b fp32) → Reshape → AscendQuant (one per scale); outputs:
    the fp32 norm and each AscendQuant's uint8."""
    g = Graph()
    a = g.add_input(TensorDesc((2, 8), BF), "a")
    b = g.add_input(TensorDesc((2, 8), F), "b")
    gamma, beta = g.add_const(torch.randn(8, generator=G), "g"), g.add_const(torch.randn(8, generator=G), "beta")
    n = g.create_node("AddLayerNormCast", [a, b, gamma, beta],
                      {"x1": TensorRef(0), "x2": TensorRef(1), "weight": TensorRef(2), "bias": TensorRef(3),
                       "eps": 1e-5, "dtype": torch.bfloat16},
                      [TensorDesc((2, 8), F), TensorDesc((2, 8), BF)], "ln_add_cast")
    r = g.create_node("Reshape", [n.outputs[1]], {"self": TensorRef(0), "size": [16]},
                      [TensorDesc((16,), BF)], "view").output
    g.outputs = [n.outputs[0]]
    for k, s in enumerate(scales):
        g.outputs.append(g.create_node("AscendQuant", [r], {"self": TensorRef(0), "scale": s, "offset": 3},
                                       [TensorDesc((16,), U8)], f"q{k}").output)
    if second_reader == "output":
        g.outputs.append(r)
    return g


def test_golden():
    text, rep = run(block())
    assert text == """graph(%a: bfloat16[2,8], %b: float32[2,8]):
  %c0: float32[8] = const
  %c1: float32[8] = const
  %0: float32[2,8], %1: uint8[2,8] = AddLayerNormQuant(%a, %b, %c0, %c1; eps=1e-05, offset=3, scale=10.0)
  %2: uint8[16] = Reshape(%1)
  return %0, %2"""
    assert [e["nodes"] for e in rep.applied] == ["ln_add_cast"]


@pytest.mark.parametrize("case,reason", [
    (dict(second_reader="output"), "its bfloat16 output: the value is a graph output"),
    (dict(scales=(10.0, 20.0)), "its readers quantize it at 2 different scales"),
    (dict(scales=()), "no AscendQuant reads its low output"),
])
def test_does_not_apply(case, reason):
    g = block(**case)
    before = to_text(g, attrs=ATTRS)
    text, rep = run(g)
    assert text == before
    assert any(reason in s["reason"] for s in rep.skipped if s["pass"] == "fuse_add_layer_norm_quant")


def test_vnpu_keeps_the_chain():
    g = block()
    before = to_text(g, attrs=ATTRS)
    text, _ = run(g, device="vnpu")
    assert text == before


def _special(t):
    flat = t.view(-1)
    flat[3] = float("nan")
    flat[t.shape[-1] + 1] = float("inf")
    flat[2 * t.shape[-1] + 2] = -float("inf")
    return t


@pytest.mark.parametrize("rows,dim", [(1, 8), (7, 33), (300, 257)])
def test_kernel_against_the_unfused_chain(rows, dim):
    """y: AddLayerNormCast's bits; y_q: the quantization of y itself, within one uint8 step
    of the unfused chain's (which quantizes y's bf16 rounding) and equal to it where the
    bf16 rounding does not cross a boundary; NaN/inf rows give NaN rows, quantized to 0."""
    a = (torch.randn(rows, dim, generator=G) * 3 + 1).to(torch.bfloat16)
    b = torch.randn(rows, dim, generator=G) * 10
    w, beta = torch.randn(dim, generator=G), torch.randn(dim, generator=G)
    if rows >= 3:
        _special(b)
    a0, b0 = a.clone(), b.clone()
    step, off = 0.03, 120
    y0, lo = add_layer_norm_cast(a, b, w, beta, 1e-12, torch.bfloat16)
    chain = quantize_u8(lo, step, off)
    for _ in range(2):       # a second call: nothing cached from the first
        y, q = add_layer_norm_quant(a, b, w, beta, 1e-12, step, off)
        assert y.dtype == torch.float32 and q.dtype == torch.uint8 and q.shape == a.shape
        assert torch.equal(y.view(torch.int32), y0.view(torch.int32))
        assert torch.equal(q, quantize_u8(y, step, off))
        assert (q.int() - chain.int()).abs().max() <= 1
        assert (q == chain).float().mean() > 0.9
    if rows >= 3:
        assert y[:3].isnan().any(dim=1).all() and (q[:3][y[:3].isnan()] == 0).all()
    assert torch.equal(a.view(torch.int16), a0.view(torch.int16)) and torch.equal(b.view(torch.int32), b0.view(torch.int32))
    y.fill_(7.0)             # the outputs are their own memory
    assert torch.equal(q, quantize_u8(y0, step, off))


def test_kernel_rejects_a_broadcast():
    with pytest.raises(ValueError, match="must have one shape"):
        add_layer_norm_quant(torch.randn(2, 8).bfloat16(), torch.randn(8), None, None, 1e-5, 0.1, 0)
