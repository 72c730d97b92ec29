"""Golden pass tests (as TVM's before/expected pass tests): each pass runs alone, through
a `PassManager`, on a hand-built graph of at most 10 nodes; the result is compared with
the expected printed IR (`opencann.ir.dump.to_text`), and a second graph where the pass
does not apply checks the reason it records in the report (a `Skip`)."""
import pytest
import torch

from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.devices.cpu import mkldnn_available
from opencann.passes import (CommonSubexpressionElimination, ConstantFolding, DeadCodeElimination,
                             FoldBatchNorm, FuseConvAct, FuseConvAddAct, FuseFlashAttention,
                             FuseLinearAct, IdentityElimination, LayoutSelection, MemoryPlanning,
                             MixedPrecision, NpuLayoutSelection, PassContext, PassManager,
                             SingleStreamSchedule)
from opencann.engine.options import complete
from opencann.report import CompileReport

F = DataType.FLOAT
G = torch.Generator().manual_seed(0)


@pytest.fixture(autouse=True)
def _kernels_keep_special_values(monkeypatch):
    """Golden texts pin what the matchers rewrite, on any CPU: the probe of this CPU's
    activation kernels (NaN/±inf as the formula, tests/unit/test_cpu_special_values.py) is
    taken as passing here."""
    from opencann.passes.fusion import match
    monkeypatch.setattr(match, "_differ", lambda act, dtype: None)


def d(*shape, dtype=F):
    return TensorDesc(tuple(shape), dtype)


def rnd(*shape):
    return torch.randn(*shape, generator=G)


def run(p, g, device="cpu", **options):
    """Run pass ``p`` alone; returns (printed graph, report, context)."""
    ctx = PassContext(options=complete({"verify": True, **options}), report=CompileReport(), device=device)
    PassManager([p]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=("act", "inplace", "masked_rows", "dtype", "src_format",
                             "dst_format")), ctx.report, ctx


def unary(g, op, x, name=None, **attrs):
    return g.create_node(op, [x], {"self": TensorRef(0), **attrs}, [x.desc], name).output


def binary(g, op, a, b, name=None, **attrs):
    return g.create_node(op, [a, b], {"self": TensorRef(0), "other": TensorRef(1), **attrs},
                         [a.desc], name).output


def skipped(report):
    return [(s["pass"], s["reason"]) for s in report.skipped]


# -- prepare ----------------------------------------------------------------------------

def test_constant_folding():
    g = Graph()
    x = g.add_input(d(2, 3), "x")
    c = g.add_const(torch.ones(2, 3))
    g.outputs = [binary(g, "Add", x, unary(g, "Neg", c))]
    text, rep, _ = run(ConstantFolding(), g)
    assert text == """graph(%x: float32[2,3]):
  %c0: float32[2,3] = const
  %0: float32[2,3] = Add(%x, %c0)
  return %0"""
    assert torch.equal(g.constants[0].const, -torch.ones(2, 3))
    assert rep.passes[0].changed == 1


def test_constant_folding_does_not_apply_above_the_size_limit(monkeypatch):
    from opencann.passes.prepare import constant_folding
    monkeypatch.setattr(constant_folding, "FOLD_LIMIT_BYTES", 8)
    g = Graph()
    g.outputs = [unary(g, "Neg", g.add_const(torch.ones(2, 3)), "neg")]
    _, rep, _ = run(ConstantFolding(), g)
    assert skipped(rep) == [("constant_folding", "output larger than 0 MiB")]
    assert [n.op for n in g.nodes] == ["Neg"]


def test_constant_folding_folds_a_view_above_the_size_limit(monkeypatch):
    """A transpose of a constant allocates nothing: folded at any size (an LM head's Wᵀ)."""
    from opencann.passes.prepare import constant_folding
    monkeypatch.setattr(constant_folding, "FOLD_LIMIT_BYTES", 8)
    g = Graph()
    w = torch.randn(3, 2, generator=G)
    c = g.add_const(w)
    t = g.create_node("Transpose", [c], {"self": TensorRef(0), "dims": [1, 0]}, [d(2, 3)], "t").output
    g.outputs = [unary(g, "Neg", t, "neg")]
    text, rep, _ = run(ConstantFolding(), g)
    assert text == """graph():
  %c0: float32[2,3] = const
  %0: float32[2,3] = Neg(%c0)
  return %0"""
    assert skipped(rep) == [("constant_folding", "output larger than 0 MiB")]   # the Neg
    folded = g.nodes[0].inputs[0].const
    assert torch.equal(folded, w.t()) and folded.data_ptr() == w.data_ptr()   # a view


def test_dce_and_cse():
    g = Graph()
    x = g.add_input(d(4), "x")
    a, b = unary(g, "Relu", x), unary(g, "Relu", x)
    unary(g, "Neg", x)                                  # dead
    g.outputs = [binary(g, "Add", a, b)]
    text, _, _ = run(DeadCodeElimination(), g)
    assert "Neg" not in text
    text, rep, _ = run(CommonSubexpressionElimination(), g)
    assert text == """graph(%x: float32[4]):
  %0: float32[4] = Relu(%x)
  %1: float32[4] = Add(%0, %0)
  return %1"""
    assert not rep.skipped


def test_cse_does_not_merge_different_attributes():
    g = Graph()
    x = g.add_input(d(4), "x")
    g.outputs = [binary(g, "Add", unary(g, "Gelu", x, approximate="none"),
                        unary(g, "Gelu", x, approximate="tanh"))]
    before = to_text(g)
    text, rep, _ = run(CommonSubexpressionElimination(), g)
    assert to_text(g) == before and rep.passes[0].changed == 0


def test_identity_elimination():
    g = Graph()
    x = g.add_input(d(4), "x")
    g.outputs = [unary(g, "Relu", unary(g, "Identity", unary(g, "Neg", x)))]
    text, _, _ = run(IdentityElimination(), g)
    assert text == """graph(%x: float32[4]):
  %0: float32[4] = Neg(%x)
  %1: float32[4] = Relu(%0)
  return %1"""


def test_identity_elimination_keeps_a_returned_copy():
    g = Graph()
    x = g.add_input(d(4), "x")
    g.outputs = [unary(g, "Identity", x, "copy")]
    _, rep, _ = run(IdentityElimination(), g)
    assert skipped(rep) == [("identity_elimination", "the copy is a graph output (results "
                             "must not alias inputs or each other)")]


# -- fusion -----------------------------------------------------------------------------

def conv(g, x, cout=4, k=3, bias=True, name="conv"):
    w = g.add_const(rnd(cout, x.desc.shape[1], k, k))
    ins, attrs = [x, w], {"input": TensorRef(0), "weight": TensorRef(1), "bias": None}
    if bias:
        ins.append(g.add_const(rnd(cout)))
        attrs["bias"] = TensorRef(2)
    attrs.update(stride=[1, 1], padding=[1, 1], dilation=[1, 1], transposed=False,
                 output_padding=[0, 0], groups=1)
    n, _, h, wd = x.desc.shape
    return g.create_node("Conv2D", ins, attrs, [d(n, cout, h, wd)], name).output


def batchnorm(g, x, name="bn"):
    c = x.desc.shape[1]
    ps = [g.add_const(t) for t in (rnd(c), rnd(c), rnd(c), rnd(c).abs() + 0.5)]
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "bias": TensorRef(2),
             "running_mean": TensorRef(3), "running_var": TensorRef(4), "momentum": 0.1,
             "eps": 1e-5}
    return g.create_node("BatchNorm", [x] + ps, attrs, [x.desc, d(0), d(0)], name).outputs[0]


def test_fold_batchnorm():
    g = Graph()
    x = g.add_input(d(1, 3, 6, 6), "x")
    g.outputs = [batchnorm(g, conv(g, x, bias=False))]
    xs = rnd(1, 3, 6, 6)
    ref = torch.nn.functional.batch_norm(
        torch.nn.functional.conv2d(xs, g.constants[0].const, padding=1),
        g.constants[3].const, g.constants[4].const, g.constants[1].const,
        g.constants[2].const, eps=1e-5)
    text, rep, _ = run(FoldBatchNorm(), g)
    assert text == """graph(%x: float32[1,3,6,6]):
  %c0: float32[4,3,3,3] = const
  %c1: float32[4] = const
  %0: float32[1,4,6,6] = Conv2D(%x, %c0, %c1)
  return %0"""
    w, b = (c.const for c in g.constants)
    torch.testing.assert_close(torch.nn.functional.conv2d(xs, w, b, padding=1), ref,
                               rtol=1e-5, atol=1e-5)
    assert [(a["pass"], a["nodes"]) for a in rep.applied] == [("fold_batchnorm", "conv+bn")]


def test_fold_batchnorm_does_not_apply_to_a_graph_input():
    g = Graph()
    g.outputs = [batchnorm(g, g.add_input(d(1, 3, 6, 6), "x"))]
    _, rep, _ = run(FoldBatchNorm(), g)
    assert skipped(rep) == [("fold_batchnorm", "input is produced by a graph input, not Conv2D")]


needs_onednn = pytest.mark.skipif(not mkldnn_available(), reason="oneDNN not in this torch build")


@needs_onednn
def test_fuse_conv_act():
    g = Graph()
    x = g.add_input(d(1, 3, 6, 6), "x")
    g.outputs = [unary(g, "Relu", conv(g, x))]
    text, rep, _ = run(FuseConvAct(), g)
    assert text == """graph(%x: float32[1,3,6,6]):
  %c0: float32[4,3,3,3] = const
  %c1: float32[4] = const
  %0: float32[1,4,6,6] = ConvBiasAct(%x, %c0, %c1; act='relu')
  return %0"""
    assert [a["detail"] for a in rep.applied] == ["Conv+Relu"]


@needs_onednn
def test_fuse_conv_act_says_why_not_gelu_tanh():
    g = Graph()
    x = g.add_input(d(1, 3, 6, 6), "x")
    g.outputs = [unary(g, "Gelu", conv(g, x), approximate="tanh")]
    text, rep, _ = run(FuseConvAct(), g)
    assert "ConvBiasAct(%x, %c0, %c1; act='none')" in text and "Gelu(%0" in text
    assert skipped(rep) == [("fuse_conv_act", "Gelu(approximate='tanh'): the fused oneDNN "
                             "convolution here applies only the exact (erf) GELU")]


def conv_bias_act(g, x, name="cba"):
    w, b = g.add_const(rnd(3, 3, 3, 3)), g.add_const(rnd(3))
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "bias": TensorRef(2),
             "stride": [1, 1], "padding": [1, 1], "dilation": [1, 1], "groups": 1, "act": "none"}
    return g.create_node("ConvBiasAct", [x, w, b], attrs, [x.desc], name).output


@needs_onednn
def test_fuse_conv_add_act_in_place():
    g = Graph()
    x = g.add_input(d(1, 3, 6, 6), "x")
    r = unary(g, "Neg", x)                       # owns its memory, dies at the Add
    g.outputs = [unary(g, "Relu", binary(g, "Add", conv_bias_act(g, x), r, alpha=1))]
    text, rep, _ = run(FuseConvAddAct(), g)
    assert text == """graph(%x: float32[1,3,6,6]):
  %c0: float32[3,3,3,3] = const
  %c1: float32[3] = const
  %0: float32[1,3,6,6] = Neg(%x)
  %1: float32[1,3,6,6] = ConvAddAct(%x, %c0, %c1, %0; act='relu', inplace=True)
  return %1"""
    assert not rep.skipped and [a["detail"] for a in rep.applied] == ["Conv+Add+Relu"]


@needs_onednn
def test_fuse_conv_add_act_does_not_apply_to_a_broadcast_addend():
    g = Graph()
    x = g.add_input(d(1, 3, 6, 6), "x")
    r = g.add_input(d(1, 3, 1, 1), "r")
    g.outputs = [binary(g, "Add", conv_bias_act(g, x), r, alpha=1)]
    _, rep, _ = run(FuseConvAddAct(), g)
    assert skipped(rep) == [("fuse_conv_add_act", "addend float32[1,3,1,1] is broadcast (not "
                             "the conv's full output float32[1,3,6,6]); oneDNN's sum post-op "
                             "needs equal shapes")]


def addmm(g, x, nout=5, name="mm", **attrs):
    b, w = g.add_const(rnd(nout)), g.add_const(rnd(x.desc.shape[1], nout))
    a = {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2), **attrs}
    return g.create_node("MatMulV2", [b, x, w], a, [d(x.desc.shape[0], nout)], name).output


def test_fuse_linear_act():
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    g.outputs = [unary(g, "Gelu", addmm(g, x), approximate="tanh")]
    text, rep, _ = run(FuseLinearAct(), g)
    assert text == """graph(%x: float32[2,4]):
  %c0: float32[5] = const
  %c1: float32[4,5] = const
  %0: float32[2,5] = LinearAct(%c0, %x, %c1; act='gelu_tanh')
  return %0"""
    assert [a["detail"] for a in rep.applied] == ["Linear+bias+gelu_tanh"]


def mm_const(g, x, nout=5, name="mm", w=None):
    w = w if w is not None else g.add_const(rnd(nout, x.desc.shape[1]).t())
    return g.create_node("MatMul", [x, w], {"self": TensorRef(0), "mat2": TensorRef(1)},
                         [d(x.desc.shape[0], nout)], name).output


def test_fuse_linear_act_bias_free():
    """A bias-free Linear (MatMul with a constant weight) becomes a LinearAct without a
    bias input, with or without an activation after it."""
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    g.outputs = [unary(g, "Relu", mm_const(g, x, name="a")), mm_const(g, x, 3, name="b")]
    text, rep, _ = run(FuseLinearAct(), g)
    assert text == """graph(%x: float32[2,4]):
  %c0: float32[4,5] = const
  %c1: float32[4,3] = const
  %0: float32[2,5] = LinearAct(%x, %c0; act='relu')
  %1: float32[2,3] = LinearAct(%x, %c1; act='none')
  return %0, %1"""
    assert [a["detail"] for a in rep.applied] == ["Linear+relu", "bias-free Linear GEMM autotune"]
    assert all(n.attrs["mat1"] == TensorRef(0) and n.attrs["mat2"] == TensorRef(1)
               and "self" not in n.attrs for n in g.nodes)


def test_fuse_linear_act_bias_free_does_not_apply_to_a_weight_input():
    g = Graph()
    x, w = g.add_input(d(2, 4), "x"), g.add_input(d(4, 5), "w")
    g.outputs = [unary(g, "Neg", mm_const(g, x, w=w))]
    before = to_text(g)
    _, rep, _ = run(FuseLinearAct(), g)
    assert to_text(g) == before
    assert skipped(rep) == [("fuse_linear_act", "no activation follows and the weight is not a "
                             "constant fp32 or bf16 tensor for a prepacked GEMM: plain mm "
                             "already writes into the arena")]


def test_fuse_linear_act_does_not_apply_with_alpha():
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    g.outputs = [unary(g, "Relu", addmm(g, x, alpha=2.0))]
    _, rep, _ = run(FuseLinearAct(), g)
    assert skipped(rep) == [("fuse_linear_act", "addmm with alpha/beta != 1")]


def test_cpu_fusions_are_not_run_on_the_vnpu():
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    g.outputs = [unary(g, "Relu", addmm(g, x))]
    before = to_text(g)
    _, rep, _ = run(FuseLinearAct(), g, device="vnpu")
    assert to_text(g) == before
    assert rep.passes[0].note == "cpu-only fusion (oneDNN/BLAS kernels): skipped on vnpu"


def sdpa(g, q, k, v, **attrs):
    a = {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2), **attrs}
    return g.create_node("ScaledDotProductAttention", [q, k, v], a, [q.desc], "sdpa").output


def test_fuse_flash_attention():
    g = Graph()
    q, k, v = (g.add_input(d(1, 2, 8, 16), n) for n in "qkv")
    g.outputs = [sdpa(g, q, k, v, dropout_p=0.0)]
    text, rep, _ = run(FuseFlashAttention(), g, enable=["fuse_flash_attention"])
    assert text == """graph(%q: float32[1,2,8,16], %k: float32[1,2,8,16], %v: float32[1,2,8,16]):
  %0: float32[1,2,8,16] = FlashAttention(%q, %k, %v; masked_rows='zero')
  return %0"""
    assert [a["detail"] for a in rep.applied] == ["SDPA→FlashAttention"]


def test_fuse_flash_attention_does_not_apply_with_dropout():
    g = Graph()
    q, k, v = (g.add_input(d(1, 2, 8, 16), n) for n in "qkv")
    g.outputs = [sdpa(g, q, k, v, dropout_p=0.1)]
    _, rep, _ = run(FuseFlashAttention(), g, enable=["fuse_flash_attention"])
    assert skipped(rep) == [("fuse_flash_attention", "dropout_p=0.1 > 0 (dropout in training): "
                             "FlashAttention here has no dropout; use model.eval() or "
                             "dropout_p=0 for inference")]


def test_spelled_out_attention_says_why_a_scale_by_zero_is_not_attention():
    g = Graph()
    q, v = g.add_input(d(1, 2, 8, 16), "q"), g.add_input(d(1, 2, 8, 16), "v")
    kt = g.add_input(d(2, 16, 8), "kt")
    s = g.create_node("BatchMatMul", [unary(g, "Reshape", q, shape=[2, 8, 16]), kt],
                      {"self": TensorRef(0), "mat2": TensorRef(1)}, [d(2, 8, 8)]).output
    s4 = g.create_node("Reshape", [s], {"self": TensorRef(0), "shape": [1, 2, 8, 8]},
                       [d(1, 2, 8, 8)]).output
    p = g.create_node("SoftmaxV2", [unary(g, "Div", s4, other=0.0)],
                      {"self": TensorRef(0), "dim": -1, "half_to_float": False},
                      [d(1, 2, 8, 8)]).output
    p3 = g.create_node("Reshape", [p], {"self": TensorRef(0), "shape": [2, 8, 8]}, [d(2, 8, 8)]).output
    v3 = g.create_node("Reshape", [v], {"self": TensorRef(0), "shape": [2, 8, 16]}, [d(2, 8, 16)]).output
    o = g.create_node("BatchMatMul", [p3, v3], {"self": TensorRef(0), "mat2": TensorRef(1)},
                      [d(2, 8, 16)], "pv").output
    g.outputs = [g.create_node("Reshape", [o], {"self": TensorRef(0), "shape": [1, 2, 8, 16]},
                               [d(1, 2, 8, 16)]).output]
    assert len(g.nodes) == 9
    _, rep, _ = run(FuseFlashAttention(), g, enable=["fuse_flash_attention"])
    assert skipped(rep) == [("fuse_flash_attention", "the scores are divided by 0")]
    assert rep.skipped[0]["nodes"] == "pv"


# -- layout, precision, schedule, memory -------------------------------------------------

def mm(g, a, b, name="mm"):
    return g.create_node("MatMul", [a, b], {"self": TensorRef(0), "mat2": TensorRef(1)},
                         [d(a.desc.shape[0], b.desc.shape[1])], name).output


def test_cpu_layout_selection_records_its_decision():
    g = Graph()
    g.outputs = [unary(g, "Relu", g.add_input(d(4), "x"))]
    before = to_text(g)
    _, rep, _ = run(LayoutSelection(), g)
    assert to_text(g) == before
    assert rep.passes[0].note.startswith("cpu keeps ND/NCHW")


def test_npu_layout():
    # Atlas training (910): the Cube reads FRACTAL_NZ; fp16 C0 = 16 (GE's GetCubeSizeByDataType)
    g = Graph()
    x = g.add_input(d(16, 32, dtype=DataType.FLOAT16), "x")
    w = g.add_const(rnd(32, 16).half())
    g.outputs = [g.create_node("MatMul", [x, w], {"self": TensorRef(0), "mat2": TensorRef(1)},
                               [d(16, 16, dtype=DataType.FLOAT16)], "mm").output]
    text, rep, _ = run(NpuLayoutSelection(), g, device="vnpu:ascend910")
    assert text == """graph(%x: float16[16,32]):
  %c0: float16[1,2,16,16]@FRACTAL_NZ = const
  %0: float16[2,1,16,16]@FRACTAL_NZ = TransData(%x; dst_format='FRACTAL_NZ', src_format='ND')
  %1: float16[1,1,16,16]@FRACTAL_NZ = MatMul(%0, %c0)
  %2: float16[16,16] = TransData(%1; dst_format='ND', src_format='FRACTAL_NZ')
  return %2"""
    assert all(n.device == "vnpu:ascend910" for n in g.nodes)


def test_npu_layout_nd_direct_matmul_on_910b():
    g = Graph()
    x = g.add_input(d(16, 16), "x")
    g.outputs = [mm(g, x, g.add_const(rnd(16, 16)))]
    before = to_text(g)
    text, rep, _ = run(NpuLayoutSelection(), g, device="vnpu:ascend910b")
    assert text == before   # the 910B Cube loads ND operands itself: no TransData
    assert all(n.device == "vnpu:ascend910b" for n in g.nodes)


def test_npu_layout_says_why_a_view_runs_in_nd():
    h = DataType.FLOAT16
    g = Graph()
    x = g.add_input(d(16, 16, dtype=h), "x")
    y = g.create_node("MatMul", [x, g.add_const(rnd(16, 16).half())],
                      {"self": TensorRef(0), "mat2": TensorRef(1)}, [d(16, 16, dtype=h)], "mm").output
    g.outputs = [g.create_node("Transpose", [y], {"self": TensorRef(0), "dims": [1, 0]},
                               [d(16, 16, dtype=h)], "t").output]
    _, rep, _ = run(NpuLayoutSelection(), g, device="vnpu:ascend910")
    assert [(s["pass"], s["nodes"]) for s in rep.skipped] == [("npu_layout", "t")]
    assert "view of the logical (ND) layout" in rep.skipped[0]["reason"]


def test_mixed_precision():
    g = Graph()
    x = g.add_input(d(4, 4), "x")
    g.outputs = [mm(g, x, g.add_const(rnd(4, 4)))]
    text, _, _ = run(MixedPrecision(), g, precision_mode="allow_mix_precision")
    assert text == """graph(%x: float32[4,4]):
  %c0: float16[4,4] = const
  %0: float16[4,4] = Cast(%x; dtype=torch.float16)
  %1: float16[4,4] = MatMul(%0, %c0)
  %2: float32[4,4] = Cast(%1; dtype=torch.float32)
  return %2"""


def test_mixed_precision_does_nothing_without_a_mode():
    g = Graph()
    x = g.add_input(d(4, 4), "x")
    g.outputs = [mm(g, x, g.add_const(rnd(4, 4)))]
    before = to_text(g)
    _, rep, _ = run(MixedPrecision(), g)
    assert to_text(g) == before and rep.passes[0].changed == 0


def test_schedule_restores_a_topological_order():
    g = Graph()
    x = g.add_input(d(4), "x")
    late = g.create_node("Neg", [x], {"self": TensorRef(0)}, [d(4)], "late")
    early = g.create_node("Relu", [x], {"self": TensorRef(0)}, [d(4)], "early")
    late.set_input(0, early.output)         # late now reads a value defined after it
    g.outputs = [late.output]
    _, _, ctx = run(SingleStreamSchedule(), g, verify=False)
    assert [n.name for n in g.nodes] == ["early", "late"]
    assert ctx.artifacts["schedule"].order == ["early", "late"]


def test_memory_planning_stores_the_plan():
    g = Graph()
    x = g.add_input(d(256), "x")
    a = unary(g, "Neg", x)
    g.outputs = [unary(g, "Relu", unary(g, "Abs", a))]
    _, rep, ctx = run(MemoryPlanning(), g)
    plan = ctx.artifacts["memory_plan"]
    assert plan.arena_bytes == 1024 and rep.memory == plan.summary()
    assert rep.passes[0].name == "memory_plan"


def test_memory_planning_cannot_be_disabled():
    g = Graph()
    g.outputs = [unary(g, "Relu", g.add_input(d(4), "x"))]
    with pytest.raises(ValueError, match="cannot be disabled"):
        run(MemoryPlanning(), g, disable=["memory_plan"])


# -- pattern fusions (issue #16 item 2) -------------------------------------------------

from opencann.passes import (FuseGatedMLP, FuseGeluErf, FuseGeluTanh, FuseLayerNorm,  # noqa: E402
                             FuseRMSNorm, FuseSiLU)


def scal(g, op, x, c, name=None):
    return g.create_node(op, [x], {"self": TensorRef(0), "other": c}, [x.desc], name).output


def reduce_mean(g, x, dim=-1, keepdim=True, name=None):
    shape = list(x.desc.shape)
    shape[dim] = 1
    if not keepdim:
        del shape[dim]
    return g.create_node("ReduceMean", [x], {"self": TensorRef(0), "dim": [dim], "keepdim": keepdim},
                         [d(*shape)], name).output


def test_fuse_silu_either_order():
    for order in (0, 1):
        g = Graph()
        x = g.add_input(d(2, 3), "x")
        s = unary(g, "Sigmoid", x)
        g.outputs = [binary(g, "Mul", *((x, s) if order == 0 else (s, x)))]
        text, rep, _ = run(FuseSiLU(), g)
        assert text == """graph(%x: float32[2,3]):
  %0: float32[2,3] = Swish(%x)
  return %0"""
        assert rep.applied[0]["pass"] == "fuse_silu"


def test_fuse_silu_does_not_apply_to_sigmoid_of_another_tensor():
    g = Graph()
    x, y = g.add_input(d(2, 3), "x"), g.add_input(d(2, 3), "y")
    g.outputs = [binary(g, "Mul", x, unary(g, "Sigmoid", y, "sig"), "mul")]
    _, rep, _ = run(FuseSiLU(), g)
    assert skipped(rep) == [("fuse_silu", "multiplies sigmoid(%y) by %x, not by the sigmoid's own input")]


def gelu_tanh_graph(g, x, c=0.044715):
    cube = scal(g, "Mul", g.create_node("Pow", [x], {"self": TensorRef(0), "exponent": 3.0},
                                        [x.desc]).output, c)
    z = scal(g, "Mul", binary(g, "Add", x, cube), 0.7978845608028654)
    return binary(g, "Mul", scal(g, "Mul", x, 0.5), scal(g, "Add", unary(g, "Tanh", z), 1.0))


def test_fuse_gelu_tanh():
    g = Graph()
    x = g.add_input(d(2, 3), "x")
    g.outputs = [gelu_tanh_graph(g, x)]
    text, _, _ = run(FuseGeluTanh(), g)
    assert text == """graph(%x: float32[2,3]):
  %0: float32[2,3] = Gelu(%x)
  return %0"""
    assert g.nodes[0].attrs["approximate"] == "tanh"


def test_fuse_gelu_tanh_does_not_apply_with_another_cubic_coefficient():
    g = Graph()
    g.outputs = [gelu_tanh_graph(g, g.add_input(d(2, 3), "x"), c=0.05)]
    _, rep, _ = run(FuseGeluTanh(), g)
    assert [r for _, r in skipped(rep)] == ["the cubic coefficient is 0.05, GELU's is 0.044715"]


def gelu_erf_graph(g, x, scale=0.5):
    e = unary(g, "Erf", scal(g, "Div", x, 1.4142135623730951))
    return binary(g, "Mul", scal(g, "Mul", x, scale), scal(g, "Add", e, 1.0))


def test_fuse_gelu_erf():
    g = Graph()
    x = g.add_input(d(2, 3), "x")
    g.outputs = [gelu_erf_graph(g, x)]
    text, _, _ = run(FuseGeluErf(), g)
    assert text == """graph(%x: float32[2,3]):
  %0: float32[2,3] = Gelu(%x)
  return %0"""


def test_fuse_gelu_erf_does_not_apply_with_another_scale():
    g = Graph()
    g.outputs = [gelu_erf_graph(g, g.add_input(d(2, 3), "x"), scale=0.25)]
    _, rep, _ = run(FuseGeluErf(), g)
    assert [r for _, r in skipped(rep)] == ["x·(1 + erf(…)) is scaled by 0.25, GELU by 0.5"]


def rms_graph(g, x, w, dim=-1, eps=1e-6):
    p = g.create_node("Pow", [x], {"self": TensorRef(0), "exponent": 2}, [x.desc]).output
    r = unary(g, "Rsqrt", scal(g, "Add", reduce_mean(g, p, dim), eps))
    y = binary(g, "Mul", x, r)
    return g.create_node("Mul", [w, y], {"self": TensorRef(0), "other": TensorRef(1)}, [y.desc]).output


def test_fuse_rms_norm():
    g = Graph()
    x, w = g.add_input(d(2, 8), "x"), g.add_const(rnd(8), "w")
    g.outputs = [rms_graph(g, x, w)]
    text, rep, _ = run(FuseRMSNorm(), g)
    assert text == """graph(%x: float32[2,8]):
  %c0: float32[8] = const
  %0: float32[2,8] = RmsNorm(%x, %c0)
  return %0"""
    assert g.nodes[0].attrs["eps"] == 1e-6


def test_fuse_rms_norm_does_not_apply_over_another_axis():
    g = Graph()
    g.outputs = [rms_graph(g, g.add_input(d(2, 8), "x"), g.add_const(rnd(8), "w"), dim=0)]
    _, rep, _ = run(FuseRMSNorm(), g)
    assert [r for _, r in skipped(rep)] == ["the mean is over dims [0], RMSNorm's over the last axis"]


def ln_graph(g, x, gamma, beta, eps_after_root=False):
    mu = reduce_mean(g, x)
    xc = binary(g, "Sub", x, mu)
    var = reduce_mean(g, g.create_node("Pow", [xc], {"self": TensorRef(0), "exponent": 2},
                                       [x.desc]).output)
    den = scal(g, "Add", unary(g, "Sqrt", var), 1e-5) if eps_after_root else \
        unary(g, "Sqrt", scal(g, "Add", var, 1e-5))
    return binary(g, "Add", binary(g, "Mul", binary(g, "Div", xc, den), gamma), beta)


def test_fuse_layer_norm():
    g = Graph()
    x = g.add_input(d(2, 8), "x")
    g.outputs = [ln_graph(g, x, g.add_const(rnd(8), "g"), g.add_const(rnd(8), "b"))]
    text, _, _ = run(FuseLayerNorm(), g)
    assert text == """graph(%x: float32[2,8]):
  %c0: float32[8] = const
  %c1: float32[8] = const
  %0: float32[2,8] = LayerNormFormula(%x, %c0, %c1)
  return %0"""


def test_fuse_layer_norm_does_not_apply_with_eps_after_the_root():
    g = Graph()
    x = g.add_input(d(2, 8), "x")
    g.outputs = [ln_graph(g, x, g.add_const(rnd(8), "g"), g.add_const(rnd(8), "b"), True)]
    _, rep, _ = run(FuseLayerNorm(), g)
    assert [r for _, r in skipped(rep)] == [
        "ε is added after the square root, (x−μ)/(√σ² + ε); LayerNorm adds it under the root, √(σ² + ε)"]
    assert "LayerNormFormula" not in g.op_counts()


def test_fuse_layer_norm_keeps_a_gamma_of_another_shape():
    g = Graph()
    x = g.add_input(d(2, 8), "x")
    g.outputs = [ln_graph(g, x, g.add_const(rnd(2, 8), "g"), g.add_const(rnd(8), "b"))]
    _, rep, _ = run(FuseLayerNorm(), g)
    assert [n.op for n in g.nodes] == ["LayerNormFormula", "Mul", "Add"]
    assert [r for _, r in skipped(rep)] == [
        "γ %g has shape [2, 8], LayerNorm's is [8]: kept as a separate Mul"]


def gated_graph(g, x, w1, w3):
    def mm(w):
        return g.create_node("MatMul", [x, w], {"self": TensorRef(0), "mat2": TensorRef(1)},
                             [d(4, 6)]).output
    return binary(g, "Mul", unary(g, "Swish", mm(w1)), mm(w3))


def test_fuse_gated_mlp():
    g = Graph()
    x = g.add_input(d(4, 5), "x")
    g.outputs = [gated_graph(g, x, g.add_const(rnd(5, 6), "w1"), g.add_const(rnd(5, 6), "w3"))]
    text, _, _ = run(FuseGatedMLP(), g)
    assert text == """graph(%x: float32[4,5]):
  %c0: float32[5,6] = const
  %c1: float32[5,6] = const
  %0: float32[4,6] = GatedMLP(%x, %c0, %c1)
  return %0"""


def test_fuse_gated_mlp_does_not_apply_to_gemms_of_different_inputs():
    g = Graph()
    x, y = g.add_input(d(4, 5), "x"), g.add_input(d(4, 5), "y")
    w1, w3 = g.add_const(rnd(5, 6), "w1"), g.add_const(rnd(5, 6), "w3")
    a = g.create_node("MatMul", [x, w1], {"self": TensorRef(0), "mat2": TensorRef(1)}, [d(4, 6)]).output
    b = g.create_node("MatMul", [y, w3], {"self": TensorRef(0), "mat2": TensorRef(1)}, [d(4, 6)]).output
    g.outputs = [binary(g, "Mul", unary(g, "Swish", a), b)]
    _, rep, _ = run(FuseGatedMLP(), g)
    assert [r for _, r in skipped(rep)] == ["the two GEMMs read different inputs (%x, %y)"]


# -- fuse_elementwise (issue #16 item 1) ---------------------------------------------------------

from opencann.passes import FuseElementwise  # noqa: E402

EW = {"enable": ["fuse_elementwise"]}


def test_fuse_elementwise():
    g = Graph()
    x, y, b = g.add_input(d(4, 8), "x"), g.add_input(d(4, 8), "y"), g.add_input(d(8), "b")
    s = binary(g, "Mul", x, unary(g, "Sigmoid", y))
    t = binary(g, "Add", s, b)                          # b broadcasts
    r = g.create_node("ReduceMax", [t], {"self": TensorRef(0), "dim": [-1], "keepdim": False},
                      [d(4)]).output
    g.outputs = [t, r]
    text, rep, _ = run(FuseElementwise(), g, **EW)
    assert text == """graph(%x: float32[4,8], %y: float32[4,8], %b: float32[8]):
  %0: float32[4,8], %1: float32[4] = FusedElementwise(%y, %x, %b)
  return %0, %1"""
    (node,) = g.nodes
    assert node.attrs["program"] == [
        ["t0", "float32", "lit_float32(1.0) / (lit_float32(1.0) + exp(-(a0)))"],
        ["t1", "float32", "a1 * t0"], ["t2", "float32", "t1 + a2"]]
    assert node.attrs["outputs"] == ["t2", "r"] and node.attrs["reduce"] == ["amax", "t2", "float32", False]
    assert [a["detail"] for a in rep.applied] == ["Sigmoid+Mul+Add+ReduceMax"]


def test_fuse_elementwise_leaves_a_float_sum_to_aten():
    g = Graph()
    x, y = g.add_input(d(4, 8), "x"), g.add_input(d(4, 8), "y")
    t = binary(g, "Add", unary(g, "Exp", x), y)
    r = g.create_node("ReduceSum", [t], {"self": TensorRef(0), "dim": [-1], "keepdim": False},
                      [d(4)], "sum").output
    g.outputs = [r]
    text, rep, _ = run(FuseElementwise(), g, **EW)
    assert [n.op for n in g.nodes] == ["FusedElementwise", "ReduceSum"]
    assert ("fuse_elementwise", "ReduceSum of float32: eager adds in float32 in ATen's cascade "
            "order (set by the CPU's vector width), rounding every partial sum; a fused sum would "
            "round and overflow elsewhere, so it runs in ATen on the group's output") in skipped(rep)


def test_fuse_elementwise_does_not_cross_a_view_or_fuse_one_op():
    g = Graph()
    x = g.add_input(d(4, 8), "x")
    e = unary(g, "Exp", x, "exp")
    v = g.create_node("Reshape", [e], {"self": TensorRef(0), "size": [8, 4]}, [d(8, 4)], "view").output
    g.outputs = [unary(g, "Neg", v, "neg")]
    _, rep, _ = run(FuseElementwise(), g, **EW)
    assert [n.op for n in g.nodes] == ["Exp", "Reshape", "Neg"]
    single = ("fuse_elementwise", "single fusable op: ATen's kernel writes the planned buffer itself; "
                                  "a generated kernel pays off from 2 ops")
    assert skipped(rep) == [
        ("fuse_elementwise", "Reshape is a view (aliases its input): a group ends at views, the generated "
                             "code does not follow their strides"), single, single]
# -- fuse_qkv_linear ---------------------------------------------------------------------

from opencann.passes import FuseQKVLinear  # noqa: E402


def linear_act(g, x, nout, name, act="none", w=None, dtype=F):
    b = g.add_const(rnd(nout).to(dtype.torch), f"{name}_b")
    w = w if w is not None else g.add_const(rnd(nout, x.desc.shape[1]).to(dtype.torch).t(), f"{name}_w")
    a = {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2), "act": act}
    return g.create_node("LinearAct", [b, x, w], a, [d(x.desc.shape[0], nout, dtype=dtype)], name).output


def test_fuse_qkv_linear():
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    q, k, v = (linear_act(g, x, n, name) for n, name in ((4, "q"), (4, "k"), (6, "v")))
    g.outputs = [binary(g, "Add", q, k), unary(g, "Neg", v)]
    wq, wk, wv = (g.constants[i].const for i in (1, 3, 5))
    bq, bk, bv = (g.constants[i].const for i in (0, 2, 4))
    text, rep, _ = run(FuseQKVLinear(), g)
    assert text == """graph(%x: float32[2,4]):
  %c0: float32[4,14] = const
  %c1: float32[14] = const
  %0: float32[2,14] = LinearAct(%c1, %x, %c0; act='none')
  %1: float32[2,4] = StridedSlice(%0)
  %2: float32[2,4] = StridedSlice(%0)
  %3: float32[2,6] = StridedSlice(%0)
  %4: float32[2,4] = Add(%1, %2)
  %5: float32[2,6] = Neg(%3)
  return %4, %5"""
    assert torch.equal(g.constants[0].const, torch.cat([wq, wk, wv], dim=1))
    assert torch.equal(g.constants[1].const, torch.cat([bq, bk, bv]))
    assert g.constants[0].const.t().is_contiguous()   # the layout of the weights it replaces
    assert [(n.attrs["start"], n.attrs["end"]) for n in g.nodes if n.op == "StridedSlice"] == \
        [(0, 4), (4, 8), (8, 14)]
    assert [a["detail"] for a in rep.applied] == ["3 Linears on one input as one GEMM [.., 14]"]


def linear_no_bias(g, x, nout, name):
    w = g.add_const(rnd(nout, x.desc.shape[1]).t(), f"{name}_w")
    a = {"mat1": TensorRef(0), "mat2": TensorRef(1), "act": "none"}
    return g.create_node("LinearAct", [x, w], a, [d(x.desc.shape[0], nout)], name).output


def test_fuse_qkv_linear_bias_free():
    """Bias-free siblings (Llama's q, k, v) share one bias-free GEMM; a sibling with a bias
    is left out, with its reason."""
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    q, k = linear_no_bias(g, x, 4, "q"), linear_no_bias(g, x, 2, "k")
    v = linear_act(g, x, 3, "v")
    g.outputs = [unary(g, "Neg", o) for o in (q, k, v)]
    wq, wk = g.constants[0].const, g.constants[1].const
    text, rep, _ = run(FuseQKVLinear(), g)
    assert text == """graph(%x: float32[2,4]):
  %c0: float32[3] = const
  %c1: float32[4,3] = const
  %c2: float32[4,6] = const
  %0: float32[2,6] = LinearAct(%x, %c2; act='none')
  %1: float32[2,4] = StridedSlice(%0)
  %2: float32[2,2] = StridedSlice(%0)
  %3: float32[2,3] = LinearAct(%c0, %x, %c1; act='none')
  %4: float32[2,4] = Neg(%1)
  %5: float32[2,2] = Neg(%2)
  %6: float32[2,3] = Neg(%3)
  return %4, %5, %6"""
    assert torch.equal(g.constants[2].const, torch.cat([wq, wk], dim=1))
    assert skipped(rep) == [("fuse_qkv_linear", "left out of the merged GEMM: v: a bias where "
                             "the first sibling has none (eager adds no zeros to a bias-free GEMM)")]


def _three_linears_sharing(weights):
    """A graph of three bias-free Linears on one x whose constant weights are ``weights``
    (transposed views, as share_weights holds a module's)."""
    from opencann.ir import Graph as _G
    g = _G()
    x = g.add_input(d(2, 4), "x")
    outs = []
    for w, n in zip(weights, "qkv"):
        wv = g.add_const(w.t(), f"{n}_w")
        outs.append(g.create_node("LinearAct", [x, wv], {"mat1": TensorRef(0), "mat2": TensorRef(1),
                                                        "act": "none"},
                                  [d(2, int(w.shape[0]))], n).output)
    g.outputs = [unary(g, "Neg", o) for o in outs]
    return g


def test_fuse_qkv_linear_under_share_weights_makes_one_concatenation_for_every_graph():
    """Under share_weights the merged weight is made once for a set of weights: a second
    graph over the same module weights (another prefill bucket, the decode graph) holds
    the same tensor; other weights, or the same ones after an in-place change, get their
    own."""
    ws = [torch.randn(4, 4), torch.randn(2, 4), torch.randn(2, 4)]
    merged = []
    for _ in range(2):
        g = _three_linears_sharing(ws)
        _, rep, _ = run(FuseQKVLinear(), g, share_weights=True)
        assert [n.op for n in g.nodes][:3] == ["LinearAct", "StridedSlice", "StridedSlice"]
        merged.append(g.nodes[0].inputs[1].const)
    assert merged[0].data_ptr() == merged[1].data_ptr()   # one tensor's memory
    assert torch.equal(merged[0], torch.cat([w.t() for w in ws], dim=1))
    with torch.no_grad():
        ws[1].mul_(2.0)                      # a changed weight: a new concatenation
    g = _three_linears_sharing(ws)
    run(FuseQKVLinear(), g, share_weights=True)
    assert g.nodes[0].inputs[1].const.data_ptr() != merged[0].data_ptr()
    assert torch.equal(g.nodes[0].inputs[1].const, torch.cat([w.t() for w in ws], dim=1))
    g = _three_linears_sharing(ws)           # without the option: a copy of its own
    run(FuseQKVLinear(), g)
    assert g.nodes[0].inputs[1].const.data_ptr() != merged[0].data_ptr()


def test_fuse_qkv_linear_leaves_out_a_sibling_with_another_activation():
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    outs = [linear_act(g, x, 4, "q"), linear_act(g, x, 4, "k"), linear_act(g, x, 4, "v", act="relu")]
    g.outputs = [unary(g, "Neg", o) for o in outs]
    _, rep, _ = run(FuseQKVLinear(), g)
    assert [n.op for n in g.nodes] == ["LinearAct", "StridedSlice", "StridedSlice", "LinearAct",
                                       "Neg", "Neg", "Neg"]
    assert skipped(rep) == [("fuse_qkv_linear", "left out of the merged GEMM: v: activation "
                             "'relu', the first sibling's is 'none'")]


def test_fuse_qkv_linear_does_not_apply_to_different_inputs_dtypes_or_weights():
    g = Graph()
    x, y = g.add_input(d(2, 4), "x"), g.add_input(d(2, 4), "y")
    g.outputs = [unary(g, "Neg", linear_act(g, x, 4, "q")),
                 unary(g, "Neg", linear_act(g, y, 4, "k"))]   # different inputs
    before = to_text(g)
    _, rep, _ = run(FuseQKVLinear(), g)
    assert to_text(g) == before and skipped(rep) == []
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    g.outputs = [unary(g, "Neg", linear_act(g, x, 4, "q")),
                 unary(g, "Neg", linear_act(g, x, 4, "k", dtype=DataType.DOUBLE))]
    _, rep, _ = run(FuseQKVLinear(), g)
    assert skipped(rep) == [
        ("fuse_qkv_linear", "no sibling Linear of q on %x can share its GEMM: k: weight dtype "
                            "float64, the first sibling's is float32")]
    g = Graph()
    x, w = g.add_input(d(2, 4), "x"), g.add_input(d(4, 4), "w")
    g.outputs = [unary(g, "Neg", linear_act(g, x, 4, "q")),
                 unary(g, "Neg", linear_act(g, x, 4, "k", w=w))]   # a weight input
    _, rep, _ = run(FuseQKVLinear(), g)
    assert [n.op for n in g.nodes] == ["LinearAct", "Neg", "LinearAct", "Neg"]
    assert skipped(rep)[-1] == ("fuse_qkv_linear", "no sibling Linear of q on %x can share its "
                                "GEMM: k: its weight or bias is not a constant (the "
                                "concatenation is made once, at compile time)")
    g = Graph()
    x = g.add_input(d(2, 4), "x")
    g.outputs = [linear_act(g, x, 4, "q"), unary(g, "Neg", linear_act(g, x, 4, "k"))]
    _, rep, _ = run(FuseQKVLinear(), g)   # q is returned: eager gives it memory of its own
    assert [n.op for n in g.nodes] == ["LinearAct", "LinearAct", "Neg"]
    assert skipped(rep) == [("fuse_qkv_linear", "not merged with its sibling Linears on %x: q: "
                             "its result (or a view of it) is a graph output; eager returns "
                             "memory of its own, contiguous, not a column slice of a shared buffer")]


# -- fuse_add_layer_norm -----------------------------------------------------------------

from opencann.passes import FuseAddLayerNorm  # noqa: E402


def add_ln(g, a, b, stats_out=False, gamma=True, dtype=F):
    s = binary(g, "Add", a, b, "add")
    ins = [s] + ([g.add_const(rnd(8).to(dtype.torch), "g"), g.add_const(rnd(8), "b")] if gamma else [])
    attrs = {"input": TensorRef(0), "normalized_shape": [8], "eps": 1e-5,
             "weight": TensorRef(1) if gamma else None, "bias": TensorRef(2) if gamma else None}
    ln = g.create_node("LayerNorm", ins, attrs, [d(2, 8), d(2, 1), d(2, 1)], "ln")
    return s, ln


def test_fuse_add_layer_norm():
    g = Graph()
    a, b = g.add_input(d(2, 8), "a"), g.add_input(d(2, 8), "b")
    _, ln = add_ln(g, a, b)
    g.outputs = [ln.outputs[0]]
    text, rep, _ = run(FuseAddLayerNorm(), g, enable=["fuse_add_layer_norm"])
    assert text == """graph(%a: float32[2,8], %b: float32[2,8]):
  %c0: float32[8] = const
  %c1: float32[8] = const
  %0: float32[2,8] = AddLayerNorm(%a, %b, %c0, %c1)
  return %0"""
    assert [a["detail"] for a in rep.applied] == ["residual Add + LayerNorm"]


@pytest.mark.parametrize("case,reason", [
    ("sum_read", "the sum a + b is also read by neg; the fused node does not write it"),
    ("stats_read", "the LayerNorm's mean or rstd is read (training): the fused node returns "
                   "the normalized output only"),
    ("no_affine", "LayerNorm without γ or β (elementwise_affine=False)"),
    ("broadcast", "the Add broadcasts (float32[2,8] + float32[8]); the fused kernel adds two "
                  "tensors of the result's shape"),
])
def test_fuse_add_layer_norm_near_misses(case, reason):
    g = Graph()
    a = g.add_input(d(2, 8), "a")
    b = g.add_input(d(8) if case == "broadcast" else d(2, 8), "b")
    s, ln = add_ln(g, a, b, gamma=case != "no_affine")
    g.outputs = [ln.outputs[0]]
    if case == "sum_read":
        g.outputs.append(unary(g, "Neg", s, "neg"))
    if case == "stats_read":
        g.outputs.append(ln.outputs[1])
    _, rep, _ = run(FuseAddLayerNorm(), g, enable=["fuse_add_layer_norm"])
    assert skipped(rep) == [("fuse_add_layer_norm", reason)]
    assert "AddLayerNorm" not in g.op_counts()


def test_fuse_qkv_linear_under_share_weights_concatenates_again_after_a_write_through_data():
    """A write through ``.data`` keeps the version counter: the shared concatenation's key
    also holds the parts' probe bytes, so the next graph merges the new values."""
    ws = [torch.randn(64, 96), torch.randn(32, 96), torch.randn(32, 96)]   # > 16 KiB: sampled
    g = _three_linears_sharing(ws)
    run(FuseQKVLinear(), g, share_weights=True)
    first = g.nodes[0].inputs[1].const
    ws[2].data.mul_(3.0)
    g = _three_linears_sharing(ws)
    run(FuseQKVLinear(), g, share_weights=True)
    assert g.nodes[0].inputs[1].const.data_ptr() != first.data_ptr()
    assert torch.equal(g.nodes[0].inputs[1].const, torch.cat([w.t() for w in ws], dim=1))
