"""`fuse_add_layer_norm_quant`: AddLayerNormCast whose bf16 output only an AscendQuant
reads (through Reshapes) ⇒ AddLayerNormQuant writing the uint8 tensor. A golden
before/expected graph of ≤ 10 nodes, the reasons it does not apply, and the kernel against
eager (bf16 and fp32 addends, random data, rows with NaN/±inf and overflow, γ/β with
inf/NaN, a second call, outputs independent of each other and of the inputs)."""
import pytest
import torch

from opencann.engine.options import complete
from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.ops.kernels import add_layer_norm_quant_cpu as alnq_cpu
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


def _eager(a, b, w, beta, eps=1e-12):
    """Eager's float32 chain: ATen's add (a bf16 addend promoted) and layer_norm."""
    return torch.nn.functional.layer_norm(torch.add(a, b), [a.shape[-1]], w, beta, eps)


def _exact(a, b, w, beta, eps=1e-12):
    """The float64 LayerNorm of the float32 sum: what both kernels round."""
    s = torch.add(a, b).double()
    return torch.nn.functional.layer_norm(s, [s.shape[-1]], None if w is None else w.double(),
                                          None if beta is None else beta.double(), eps)


def _bits(t):
    return t.view(torch.int32) if t.dtype == torch.float32 else t.view(torch.int16)


DTYPES = [(torch.bfloat16, torch.float32), (torch.float32, torch.bfloat16), (torch.float32, torch.float32)]


@pytest.mark.parametrize("dtypes", DTYPES, ids=["bf16+f32", "f32+bf16", "f32+f32"])
@pytest.mark.parametrize("rows,dim", [(1, 8), (7, 33), (128, 768)])
def test_one_pass_kernel_against_eager(rows, dim, dtypes, monkeypatch):
    """The numba pass: y within float32 rounding of eager's LayerNorm (no farther from the
    float64 value than ATen's own rounding allows), y_q the quantization of y itself (the
    bits quantize_u8 gives), within one uint8 step of quantizing eager's y and of the unfused
    bf16 chain; a second call gives the same bits; inputs untouched; outputs independent."""
    a = (torch.randn(rows, dim, generator=G) * 3 + 1).to(dtypes[0])
    b = (torch.randn(rows, dim, generator=G) * 10).to(dtypes[1])
    w, beta = torch.randn(dim, generator=G), torch.randn(dim, generator=G)
    a0, b0 = a.clone(), b.clone()
    step, off = 0.03, 120
    monkeypatch.setattr(alnq_cpu, "add_layer_norm_f32", None)   # the one pass, not ATen's chain
    want, exact = _eager(a, b, w, beta), _exact(a, b, w, beta)
    y, q = add_layer_norm_quant(a, b, w, beta, 1e-12, step, off)
    assert y.dtype == torch.float32 and q.dtype == torch.uint8 and q.shape == a.shape and y.shape == a.shape
    err, aten_err = (y.double() - exact).abs().max(), (want.double() - exact).abs().max()
    assert err <= 2 * aten_err + 1e-6 * exact.abs().max()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5)
    assert torch.equal(q, quantize_u8(y, step, off))
    assert (q.int() - quantize_u8(want, step, off).int()).abs().max() <= 1
    assert (q.int() - quantize_u8(want.bfloat16(), step, off).int()).abs().max() <= 1
    y2, q2 = add_layer_norm_quant(a, b, w, beta, 1e-12, step, off)      # a second call
    assert torch.equal(_bits(y2), _bits(y)) and torch.equal(q2, q)
    assert torch.equal(_bits(a), _bits(a0)) and torch.equal(_bits(b), _bits(b0))
    y.fill_(7.0)              # the outputs are their own memory
    assert torch.equal(q, q2) and y2.data_ptr() != y.data_ptr()


@pytest.mark.parametrize("dtypes", DTYPES, ids=["bf16+f32", "f32+bf16", "f32+f32"])
@pytest.mark.parametrize("case", ["nan_inf_rows", "overflow_row", "gamma_inf", "beta_nan", "fp16"])
def test_special_values_give_eager_values(case, dtypes):
    """Rows holding NaN / ±inf, a row whose sum of squares overflows ATen's float32 (|x|
    near 1e19: ATen returns β there), a γ or β holding inf / NaN, an fp16 addend: eager's
    values exactly (ATen's chain), NaN quantized to 0, ±inf rows to eager's NaN."""
    rows, dim = 6, 40
    a = (torch.randn(rows, dim, generator=G) * 3).to(dtypes[0])
    b = torch.randn(rows, dim, generator=G).to(dtypes[1])
    w, beta = torch.randn(dim, generator=G), torch.randn(dim, generator=G)
    if case == "nan_inf_rows":
        _special(b)
    elif case == "overflow_row":
        b[2] = torch.where(torch.arange(dim) % 2 == 0, 3e19, -3e19).to(b.dtype)
    elif case == "gamma_inf":
        w[5] = float("inf")
    elif case == "beta_nan":
        beta[0] = float("nan")
    else:
        a = a.half()
    want = _eager(a, b, w, beta)
    # the rows ATen's chain gives: all, or those out of range (the others: the one pass)
    redo = {"nan_inf_rows": [0, 1, 2], "overflow_row": [2]}.get(case, list(range(rows)))
    keep = [r for r in range(rows) if r not in redo]
    for _ in range(2):
        y, q = add_layer_norm_quant(a, b, w, beta, 1e-12, 0.05, 100)
        assert torch.equal(y.isnan(), want.isnan())
        assert torch.equal(_bits(y[redo].nan_to_num(0.0)), _bits(want[redo].nan_to_num(0.0)))
        assert torch.equal(q[redo], quantize_u8(want[redo], 0.05, 100))
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, equal_nan=True)
        assert torch.equal(q, quantize_u8(y, 0.05, 100))
    if case == "nan_inf_rows":
        assert y[:3].isnan().any(dim=1).all() and (q[:3][y[:3].isnan()] == 0).all()
        assert not y[3:].isnan().any()
    if keep:        # the other rows keep the values they have without the specials
        clean = b.clone()
        clean[redo] = 0.0
        yc, qc = add_layer_norm_quant(a, clean, w, beta, 1e-12, 0.05, 100)
        assert torch.equal(_bits(y[keep]), _bits(yc[keep])) and torch.equal(q[keep], qc[keep])


def test_without_gamma_and_beta_and_strided_inputs():
    """γ, β None: the plain normalization; a transposed (strided) addend: ATen's chain."""
    a, b = torch.randn(5, 24, generator=G).bfloat16(), torch.randn(5, 24, generator=G)
    y, q = add_layer_norm_quant(a, b, None, None, 1e-5, 0.02, 128)
    torch.testing.assert_close(y, _eager(a, b, None, None, 1e-5), rtol=1e-5, atol=1e-5)
    assert torch.equal(q, quantize_u8(y, 0.02, 128))
    at, bt = torch.randn(24, 5, generator=G).t(), torch.randn(5, 24, generator=G)
    y, q = add_layer_norm_quant(at, bt, None, None, 1e-5, 0.02, 128)
    assert torch.equal(_bits(y), _bits(_eager(at, bt, None, None, 1e-5)))


def test_kernel_rejects_a_broadcast():
    with pytest.raises(ValueError, match="must have one shape"):
        add_layer_norm_quant(torch.randn(2, 8).bfloat16(), torch.randn(8), None, None, 1e-5, 0.1, 0)


@pytest.mark.parametrize("special", [False, True])
def test_bound_kernel_writes_the_planned_buffers(special):
    """The node's kernel (constants γ, β prepared once) gives the function's values, into
    ``out`` (prefilled with garbage) when given and returns those buffers; a NaN row too;
    a second call with other data gives that data's values (nothing kept from the first)."""
    from opencann.ops.kernels.add_layer_norm_quant_cpu import make_add_layer_norm_quant_kernel
    g = block()
    node = next(n for n in g.nodes if n.op == "AddLayerNormCast")
    node.attrs.update(scale=1 / 0.03, offset=120)
    a, b = torch.randn(2, 8, generator=G).bfloat16(), torch.randn(2, 8, generator=G)
    w, beta = (v.const for v in node.inputs[2:])
    kernel = make_add_layer_norm_quant_kernel(node, [v.desc for v in node.inputs], [None, None, w, beta])
    for _ in range(2):
        if special:
            b[1, 3] = float("nan")
        want = add_layer_norm_quant(a, b, w, beta, 1e-5, 0.03, 120)
        y, q = kernel(a, b, w, beta)
        assert torch.equal(_bits(y), _bits(want[0])) and torch.equal(q, want[1])
        out = (torch.full((2, 8), 5.0), torch.full((2, 8), 9, dtype=torch.uint8))
        got = kernel(a, b, w, beta, out=out)
        assert got[0] is out[0] and got[1] is out[1]
        assert torch.equal(_bits(out[0]), _bits(want[0])) and torch.equal(out[1], want[1])
        assert torch.equal(out[0].isnan(), want[0].isnan()) and (not special or out[0][1].isnan().all())
        a, b = torch.randn(2, 8, generator=G).bfloat16(), torch.randn(2, 8, generator=G)


def test_zero_eps_and_a_constant_row_give_eager_nan():
    """eps = 0 and a constant row: variance 0, rstd = inf (no ZeroDivisionError in the
    kernel: numpy's error model), the row out of range, eager's NaN row quantized to 0."""
    a, b = torch.randn(3, 16, generator=G), torch.randn(3, 16, generator=G)
    a[1], b[1] = 2.0, 1.0
    want = _eager(a, b, None, None, 0.0)
    y, q = add_layer_norm_quant(a, b, None, None, 0.0, 0.1, 7)
    assert torch.equal(y.isnan(), want.isnan()) and y[1].isnan().all() and (q[1] == 0).all()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5, equal_nan=True)
