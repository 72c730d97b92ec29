"""`fuse_add_layer_norm_quant`, the float32 form: LayerNorm(Add(x1, x2)) whose output a
float32 reader and an AscendQuant (through Reshapes) both read ⇒ AddLayerNormQuant writing
the float32 norm and its uint8. A golden graph, the reasons it does not apply, and a small
int8 block end to end against the unfused graph and eager: random data, rows with NaN and
±inf, a second call, outputs independent of each other."""
import pytest
import torch

import opencann
from opencann.engine.options import complete
from opencann.engine.quantize import create_quant_config
from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.passes import FuseAddLayerNormQuant, PassContext, PassManager
from opencann.report import CompileReport

F, BF, U8 = DataType.FLOAT, DataType.BF16, DataType.UINT8
G = torch.Generator().manual_seed(0)
ATTRS = ("scale", "offset", "eps")
PASS = "fuse_add_layer_norm_quant"


def run(g, device="cpu"):
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device=device)
    PassManager([FuseAddLayerNormQuant()]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=ATTRS), ctx.report


def block(sum_read=False, stats_read=False, scales=(10.0,), dtype=F, direct=False):
    """Add(a, b) → LayerNorm → Reshape → AscendQuant (one per scale; ``direct``: also one
    reading the norm itself); outputs: the norm (a float32 reader) and each uint8."""
    g = Graph()
    a = g.add_input(TensorDesc((2, 8), dtype), "a")
    b = g.add_input(TensorDesc((2, 8), dtype), "b")
    gamma = g.add_const(torch.randn(8, generator=G).to(dtype.torch), "g")
    beta = g.add_const(torch.randn(8, generator=G).to(dtype.torch), "beta")
    x = g.create_node("Add", [a, b], {"self": TensorRef(0), "other": TensorRef(1)},
                      [TensorDesc((2, 8), dtype)], "add").output
    ln = g.create_node("LayerNorm", [x, gamma, beta],
                       {"input": TensorRef(0), "normalized_shape": [8], "weight": TensorRef(1),
                        "bias": TensorRef(2), "eps": 1e-5},
                       [TensorDesc((2, 8), dtype), TensorDesc((2, 1), F), TensorDesc((2, 1), F)], "ln")
    y = ln.outputs[0]
    r = g.create_node("Reshape", [y], {"self": TensorRef(0), "size": [16]},
                      [TensorDesc((16,), dtype)], "view").output
    g.outputs = [y] + ([x] if sum_read else []) + ([ln.outputs[1]] if stats_read else [])
    for k, s in enumerate(scales):
        g.outputs.append(g.create_node("AscendQuant", [r], {"self": TensorRef(0), "scale": s, "offset": 3},
                                       [TensorDesc((16,), U8)], f"q{k}").output)
    if direct:
        g.outputs.append(g.create_node("AscendQuant", [y], {"self": TensorRef(0), "scale": scales[0],
                                                            "offset": 3}, [TensorDesc((2, 8), U8)], "qd").output)
    return g


def test_golden():
    text, rep = run(block(direct=True))
    assert text == """graph(%a: float32[2,8], %b: float32[2,8]):
  %c0: float32[8] = const
  %c1: float32[8] = const
  %0: float32[2,8], %1: uint8[2,8] = AddLayerNormQuant(%a, %b, %c0, %c1; eps=1e-05, offset=3, scale=10.0)
  %2: uint8[16] = Reshape(%1)
  return %0, %2, %1"""
    assert [e["nodes"] for e in rep.applied] == ["add+ln"]


@pytest.mark.parametrize("case,reason", [
    (dict(sum_read=True), "the sum a + b is also read by the caller"),
    (dict(stats_read=True), "mean or rstd is read"),
    (dict(scales=(10.0, 20.0)), "its readers quantize it at 2 different scales"),
    (dict(dtype=BF), "the LayerNorm computes in bfloat16"),
])
def test_does_not_apply(case, reason):
    g = block(**case)
    before = to_text(g, attrs=ATTRS)
    text, rep = run(g)
    assert text == before
    assert any(reason in s["reason"] for s in rep.skipped if s["pass"] == PASS), rep.skipped


def test_without_a_quantizing_reader_nothing_is_said():
    g = block(scales=())
    before = to_text(g, attrs=ATTRS)
    text, rep = run(g)
    assert text == before and not [s for s in rep.skipped if s["pass"] == PASS]


def test_vnpu_keeps_the_chain():
    g = block()
    before = to_text(g, attrs=ATTRS)
    text, _ = run(g, device="vnpu")
    assert text == before


class Block(torch.nn.Module):
    """A transformer block's int8 shape: a Linear on the residual stream, Add + LayerNorm,
    a Linear reading the norm, and the norm itself returned (the float32 reader)."""

    def __init__(self, d=32):
        super().__init__()
        self.a, self.ln, self.b = torch.nn.Linear(d, d), torch.nn.LayerNorm(d), torch.nn.Linear(d, 24)
        with torch.no_grad():
            self.ln.weight.uniform_(0.5, 1.5)
            self.ln.bias.normal_(0, 0.1)

    def forward(self, x):
        h = self.ln(x + self.a(x))
        return self.b(h), h


def _compiled():
    torch.manual_seed(0)
    m = Block().eval()
    cal = [(torch.randn(2, 6, 32),) for _ in range(3)]
    cfg = create_quant_config([])
    fused = opencann.quantize(m, cal, config=cfg)
    plain = opencann.quantize(m, cal, config=cfg, options={"disable": [PASS]})
    return m, fused, plain


def _one_step(m, fused) -> float:
    """One uint8 step of the second Linear's input times its largest row of |W|: how far
    its output may move where the norm's rounding crosses a quantization boundary."""
    node = next(n for n in fused.executor.graph.nodes if n.op == "AddLayerNormQuant")
    return 1.01 * m.b.weight.abs().sum(1).max().item() / float(node.attrs["scale"])


def test_block_against_the_unfused_graph_and_eager():
    m, fused, plain = _compiled()
    ops = fused.executor.graph.op_counts()
    assert ops.get("AddLayerNormQuant") == 1 and "LayerNorm" not in ops and "Add" not in ops
    assert ops.get("AscendQuant") == 1     # the first Linear's input only
    assert plain.executor.graph.op_counts().get("AscendQuant") == 2
    x = torch.randn(2, 6, 32, generator=G)
    with torch.no_grad():
        out_e, h_e = m(x)
    out_f, h_f = fused(x)
    out_p, h_p = plain(x)
    # the norm: float32 rounding of eager's LayerNorm of the same int8 sum
    torch.testing.assert_close(h_f, h_p, rtol=0, atol=2e-6)
    # the second Linear's input differs by at most one uint8 step where the rounding
    # of the norm crosses a boundary: its output by at most one step times a row of |W|
    assert (out_f - out_p).abs().max().item() <= _one_step(m, fused)
    cos = torch.nn.functional.cosine_similarity(out_f.flatten(), out_e.flatten(), dim=0)
    assert cos > 0.999
    # a second call gives the same bits, and the first call's outputs stay as they were
    keep = (out_f.clone(), h_f.clone())
    out_2, h_2 = fused(x)
    assert torch.equal(out_2, keep[0]) and torch.equal(h_2, keep[1])
    fused(torch.randn(2, 6, 32, generator=G))
    assert torch.equal(out_f, keep[0]) and torch.equal(h_f, keep[1])


def test_block_nan_and_inf_rows_as_the_unfused_graph():
    m, fused, plain = _compiled()
    x = torch.randn(2, 6, 32, generator=G)
    x[0, 1, 3] = float("nan")
    x[1, 2, 5] = float("inf")
    x[1, 4, 0] = float("-inf")
    out_f, h_f = fused(x)
    out_p, h_p = plain(x)
    assert torch.equal(torch.isnan(h_f), torch.isnan(h_p)) and torch.isnan(h_f).any()
    assert torch.equal(torch.isnan(out_f), torch.isnan(out_p))
    fin = torch.isfinite(h_p)
    torch.testing.assert_close(h_f[fin], h_p[fin], rtol=0, atol=2e-6)
    rows = torch.isfinite(out_p).all(-1)
    assert rows.any()
    assert (out_f[rows] - out_p[rows]).abs().max().item() <= _one_step(m, fused)
