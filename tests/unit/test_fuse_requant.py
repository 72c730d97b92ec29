"""`fuse_requant` and `qdq_to_int8` golden tests (as test_pass_golden.py): on a hand-built
int8 graph the first layer writes uint8 at its reader's scale and the AscendQuant between
goes, through a MaxPool and a residual sum too; where a reader needs fp32 (or readers
disagree on the scale) the graph must not change and the report says why. A QDQ pair
before a conv becomes the int8 conv with the exact int8 weight; a weight that is not
symmetric int8 keeps the emulation, with the reason. End-to-end numerics:
tests/integration/test_int8.py, test_int8_onnx.py."""
import torch

from opencann.ir import DataType, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.engine.options import complete
from opencann.passes import FuseRequant, PassContext, PassManager
from opencann.report import CompileReport

F, U8 = DataType.FLOAT, DataType.UINT8
G = torch.Generator().manual_seed(0)


def run(g):
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device="cpu")
    PassManager([FuseRequant()]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=("scale", "offset", "out_scale", "out_offset")), ctx.report


def quant(g, x, scale, offset, name):
    return g.create_node("AscendQuant", [x], {"self": TensorRef(0), "scale": scale, "offset": offset},
                         [TensorDesc(x.desc.shape, U8)], name).output


def qconv(g, x, name, act="relu"):
    w = g.add_const(torch.randint(-127, 128, (4, 4, 1, 1), generator=G, dtype=torch.int8))
    s = g.add_const(torch.rand(4, generator=G) + 0.01)
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "w_scale": TensorRef(2), "stride": [1, 1],
             "padding": [0, 0], "dilation": [1, 1], "groups": 1, "act": act, "x_scale": 0.1, "x_offset": 0}
    return g.create_node("QuantConvBiasAct", [x, w, s], attrs, [TensorDesc((1, 4, 4, 4), F)], name).output


def pool(g, x, name):
    return g.create_node("MaxPool", [x], {"self": TensorRef(0), "kernel_size": [2, 2], "stride": [2, 2]},
                         [TensorDesc((1, 4, 2, 2), x.desc.dtype)], name).output


def test_layer_writes_uint8_for_its_int8_reader_through_a_maxpool():
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    y = qconv(g, quant(g, x, 10.0, 0, "q0"), "conv1")
    p = pool(g, y, "pool")
    z = qconv(g, quant(g, p, 20.0, 3, "q1"), "conv2")
    g.outputs = [z]
    text, rep = run(g)
    assert text == """graph(%x: float32[1,4,4,4]):
  %c0: int8[4,4,1,1] = const
  %c1: float32[4] = const
  %c2: int8[4,4,1,1] = const
  %c3: float32[4] = const
  %0: uint8[1,4,4,4] = AscendQuant(%x; offset=0, scale=10.0)
  %1: uint8[1,4,4,4] = QuantConvBiasAct(%0, %c0, %c1; out_offset=3, out_scale=0.05)
  %2: uint8[1,4,2,2] = QuantMaxPool(%1)
  %3: float32[1,4,4,4] = QuantConvBiasAct(%2, %c2, %c3)
  return %3"""
    assert [e["nodes"] for e in rep.applied] == ["conv1"]
    assert any("graph output" in s["reason"] for s in rep.skipped)


def test_fp32_reader_or_two_scales_keep_the_graph():
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    y = qconv(g, quant(g, x, 10.0, 0, "q0"), "conv1")
    a = qconv(g, quant(g, y, 20.0, 3, "qa"), "conv_a")
    b = qconv(g, quant(g, y, 30.0, 3, "qb"), "conv_b")      # another scale
    c = qconv(g, quant(g, a, 20.0, 0, "qc"), "conv_c", act="sigmoid")
    g.outputs = [b, c, a]                                    # a: also read by the caller
    before = to_text(g, attrs=("scale", "offset", "out_scale", "out_offset"))
    text, rep = run(g)
    assert text == before
    reasons = {s["nodes"]: s["reason"] for s in rep.skipped}
    assert reasons["conv1"] == "its readers quantize it at 2 different scales"
    assert "graph output" in reasons["conv_a"]
    assert reasons["conv_c"] == "activation 'sigmoid' runs after the kernel in fp32"


def qconv_add(g, x, other, name):
    w = g.add_const(torch.randint(-127, 128, (4, 4, 1, 1), generator=G, dtype=torch.int8))
    s = g.add_const(torch.rand(4, generator=G) + 0.01)
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "w_scale": TensorRef(2), "other": TensorRef(3),
             "stride": [1, 1], "padding": [0, 0], "dilation": [1, 1], "groups": 1, "act": "relu",
             "x_scale": 0.1, "x_offset": 0, "inplace": True, "inplace_input": 3}
    return g.create_node("QuantConvAddAct", [x, w, s, other], attrs, [TensorDesc((1, 4, 4, 4), F)], name).output


def test_residual_sum_takes_the_uint8_addend_and_writes_uint8():
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    y = qconv(g, quant(g, x, 10.0, 0, "q0"), "conv1")
    z = qconv_add(g, quant(g, y, 20.0, 3, "q1"), y, "block")     # y: the next conv's input and the addend
    g.outputs = [qconv(g, quant(g, z, 40.0, 0, "q2"), "head")]
    text, rep = run(g)
    assert text == """graph(%x: float32[1,4,4,4]):
  %c0: int8[4,4,1,1] = const
  %c1: float32[4] = const
  %c2: int8[4,4,1,1] = const
  %c3: float32[4] = const
  %c4: int8[4,4,1,1] = const
  %c5: float32[4] = const
  %0: uint8[1,4,4,4] = AscendQuant(%x; offset=0, scale=10.0)
  %1: uint8[1,4,4,4] = QuantConvBiasAct(%0, %c0, %c1; out_offset=3, out_scale=0.05)
  %2: uint8[1,4,4,4] = QuantConvAddAct(%1, %c2, %c3, %1; out_offset=0, out_scale=0.025)
  %3: float32[1,4,4,4] = QuantConvBiasAct(%2, %c4, %c5)
  return %3"""
    block = next(n for n in g.nodes if n.op == "QuantConvAddAct")
    assert (block.attrs["accum_scale"], block.attrs["accum_offset"]) == (0.05, 3)
    # its addend is also its input here: the sum goes into a copy, not in place
    assert block.attrs["inplace"] is False and "inplace_input" not in block.attrs
    assert sorted(e["nodes"] for e in rep.applied) == ["block", "conv1"]


def test_residual_sum_into_a_uint8_addend_the_conv_does_not_read_runs_in_place():
    # ResNet's identity block: the block input feeds conv_a and is the addend of the
    # conv + add that reads conv_a's output; nothing reads the addend after the sum, so
    # oneDNN's sum post-op writes into it (no copy per call). The fused node takes the
    # addend as an input itself: only its activation input may forbid in place.
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    y = qconv(g, quant(g, x, 10.0, 0, "q0"), "conv1")
    a = qconv(g, quant(g, y, 20.0, 3, "qa"), "conv_a")
    z = qconv_add(g, quant(g, a, 30.0, 1, "qb"), y, "block")
    g.outputs = [qconv(g, quant(g, z, 40.0, 0, "q2"), "head")]
    run(g)
    block = next(n for n in g.nodes if n.op == "QuantConvAddAct")
    assert block.outputs[0].desc.dtype == U8
    assert block.inputs[block.attrs["other"].index].desc.dtype == U8
    assert block.attrs["inplace"] is True and block.attrs["inplace_input"] == block.attrs["other"].index


def _chain_end_graph(out_record=(0.5, 0), accum_record=None):
    """ResNet's last block: conv1 → conv_a → block (conv_a's result + conv1's as the
    addend), whose result only an fp32 ReduceMean (the global average pool) reads."""
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    y = qconv(g, quant(g, x, 10.0, 0, "q0"), "conv1")
    a = qconv(g, quant(g, y, 20.0, 3, "qa"), "conv_a")
    z = qconv_add(g, quant(g, a, 25.0, 1, "qb"), y, "block")
    block = z.producer
    if out_record is not None:
        block.attrs["out_record"] = list(out_record)
    if accum_record is not None:
        block.attrs["accum_record"] = list(accum_record)
    m = g.create_node("ReduceMean", [z], {"self": TensorRef(0), "dim": [2, 3], "keepdim": False},
                      [TensorDesc((1, 4), F)], "pool").output
    g.outputs = [m]
    return g


def test_a_residual_chain_ending_in_an_fp32_reader_stays_uint8_to_its_end():
    """The last block writes uint8 at its calibrated result range (out_record), one
    AscendDequant feeds the fp32 ReduceMean, and the chain before it (conv1, the addend)
    writes uint8 too: no AscendQuant is left between int8 layers."""
    g = _chain_end_graph()
    text, rep = run(g)
    assert text == """graph(%x: float32[1,4,4,4]):
  %c0: int8[4,4,1,1] = const
  %c1: float32[4] = const
  %c2: int8[4,4,1,1] = const
  %c3: float32[4] = const
  %c4: int8[4,4,1,1] = const
  %c5: float32[4] = const
  %0: uint8[1,4,4,4] = AscendQuant(%x; offset=0, scale=10.0)
  %1: uint8[1,4,4,4] = QuantConvBiasAct(%0, %c0, %c1; out_offset=3, out_scale=0.05)
  %2: uint8[1,4,4,4] = QuantConvBiasAct(%1, %c2, %c3; out_offset=1, out_scale=0.04)
  %3: uint8[1,4,4,4] = QuantConvAddAct(%2, %c4, %c5, %1; out_offset=0, out_scale=0.5)
  %4: float32[1,4,4,4] = AscendDequant(%3; offset=0, scale=0.5)
  %5: float32[1,4] = ReduceMean(%4)
  return %5""", text
    block = next(n for n in g.nodes if n.op == "QuantConvAddAct")
    assert (block.attrs["accum_scale"], block.attrs["accum_offset"]) == (0.05, 3)
    assert any(e["nodes"] == "block" and "residual chain's end" in e.get("detail", "") for e in rep.applied)


def test_a_chain_end_without_a_result_record_keeps_the_graph():
    """No calibrated result range (out_record): the last block and its addend stay fp32,
    and no quantize / dequantize pair is left behind."""
    g = _chain_end_graph(out_record=None)
    before = to_text(g, attrs=("scale", "offset", "out_scale", "out_offset"))
    text, rep = run(g)
    assert "AscendDequant" not in text
    block = next(n for n in g.nodes if n.op == "QuantConvAddAct")
    assert block.outputs[0].desc.dtype == F and "accum_scale" not in block.attrs
    assert text.count("AscendQuant") == before.count("AscendQuant") - 1   # only qb went into conv_a
    assert any(e["nodes"] == "block" and "fp32" in e["reason"] for e in rep.skipped)


# -- qdq_to_int8 (the ONNX QDQ rewrite that feeds fuse_requant) -----------------------------
def run_qdq(g):
    from opencann.passes import QdqToInt8
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device="cpu")
    PassManager([QdqToInt8()]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=("scale", "offset", "x_scale", "x_offset")), ctx.report


def conv_bias_act(g, x, w, name):
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "stride": [1, 1], "padding": [0, 0],
             "dilation": [1, 1], "groups": 1, "act": "relu"}
    return g.create_node("ConvBiasAct", [x, g.add_const(w)], attrs, [TensorDesc((1, 4, 4, 4), F)], name).output


def dequant(g, u, scale, offset, name):
    return g.create_node("AscendDequant", [u], {"self": TensorRef(0), "scale": scale, "offset": offset},
                         [TensorDesc(u.desc.shape, F)], name).output


def test_qdq_pair_before_a_conv_becomes_the_int8_conv():
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    q = torch.randint(-127, 128, (4, 4, 1, 1), generator=G).float()
    q[:, 0] = 127                                       # max |q| = 127 per channel: exact
    g.outputs = [conv_bias_act(g, dequant(g, quant(g, x, 10.0, 3, "q"), 0.1, 3, "dq"), q * 0.02, "conv")]
    text, rep = run_qdq(g)
    assert text == """graph(%x: float32[1,4,4,4]):
  %c0: int8[4,4,1,1] = const
  %c1: float32[4] = const
  %0: uint8[1,4,4,4] = AscendQuant(%x; offset=3, scale=10.0)
  %1: float32[1,4,4,4] = QuantConvBiasAct(%0, %c0, %c1; x_offset=3, x_scale=0.1)
  return %1"""
    assert torch.equal(g.constants[0].const.float(), q)
    assert "the file's int8 weights" in rep.applied[0]["detail"]


def test_qdq_weight_not_symmetric_int8_keeps_the_emulation():
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    w = torch.rand(4, 4, 1, 1, generator=G)             # not q * s for any symmetric int8 q
    g.outputs = [conv_bias_act(g, dequant(g, quant(g, x, 10.0, 3, "q"), 0.1, 3, "dq"), w, "conv")]
    before = to_text(g, attrs=("scale", "offset", "x_scale", "x_offset"))
    text, rep = run_qdq(g)
    assert text == before
    assert "not symmetric int8" in rep.skipped[0]["reason"] and "float emulation kept" in rep.skipped[0]["reason"]


def test_qdq_add_between_dequantized_tensors_runs_on_uint8():
    from opencann.passes import QdqEltwiseToInt8
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    y = g.add_input(TensorDesc((1, 4, 4, 4), F), "y")
    a, b = dequant(g, quant(g, x, 10.0, 3, "qa"), 0.1, 3, "da"), dequant(g, quant(g, y, 20.0, 0, "qb"), 0.05, 0, "db")
    s = g.create_node("Add", [a, b], {"self": TensorRef(0), "other": TensorRef(1)}, [a.desc], "add").output
    g.outputs = [quant(g, s, 5.0, 7, "qs")]
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device="cpu")
    PassManager([QdqEltwiseToInt8()]).run(g, ctx)
    verify(g)
    assert to_text(g, attrs=("scale", "offset", "a_scale", "b_scale")) == """graph(%x: float32[1,4,4,4], %y: float32[1,4,4,4]):
  %0: uint8[1,4,4,4] = AscendQuant(%x; offset=3, scale=10.0)
  %1: uint8[1,4,4,4] = AscendQuant(%y; offset=0, scale=20.0)
  %2: uint8[1,4,4,4] = QuantAdd(%0, %1; a_scale=0.1, b_scale=0.05, offset=7, scale=0.2)
  return %2"""


def test_qdq_maxpool_requantized_differently_keeps_the_emulation():
    from opencann.passes import QdqEltwiseToInt8
    g = Graph()
    x = g.add_input(TensorDesc((1, 4, 4, 4), F), "x")
    p = pool(g, dequant(g, quant(g, x, 10.0, 3, "q"), 0.1, 3, "d"), "pool")
    g.outputs = [quant(g, p, 20.0, 3, "q2")]          # another scale after the pool
    ctx = PassContext(options=complete({"verify": True}), report=CompileReport(), device="cpu")
    before = to_text(g)
    PassManager([QdqEltwiseToInt8()]).run(g, ctx)
    assert to_text(g) == before
    assert ctx.report.skipped[0]["reason"] == "QDQ: the MaxPool's output is quantized differently from its input"


BF = DataType.BF16


def qlinear(g, x, name, act="gelu", out=BF, n=6):
    w = g.add_const(torch.randint(-127, 128, (x.desc.shape[-1], n), generator=G, dtype=torch.int8))
    s = g.add_const(torch.rand(n, generator=G) + 0.01)
    attrs = {"mat1": TensorRef(0), "mat2": TensorRef(1), "w_scale": TensorRef(2), "act": act,
             "x_scale": 0.1, "x_offset": 3}
    return g.create_node("QuantLinearAct", [x, w, s], attrs, [TensorDesc((x.desc.shape[0], n), out)], name).output


def reshape(g, x, shape, name):
    return g.create_node("Reshape", [x], {"self": TensorRef(0), "shape": list(shape)},
                         [TensorDesc(tuple(shape), x.desc.dtype)], name).output


def test_bf16_linear_writes_uint8_through_reshapes():
    """A transformer FFN in a bf16 graph: up-projection (GELU, bf16 out) → Reshape to
    [B, S, H] → Reshape back → AscendQuant → down-projection ⇒ the up-projection writes
    uint8, the Reshapes carry it."""
    g = Graph()
    x = g.add_input(TensorDesc((4, 5), BF), "x")
    up = qlinear(g, quant(g, x, 10.0, 3, "q0"), "up")
    r = reshape(g, reshape(g, up, (1, 4, 6), "view_a"), (4, 6), "view_b")
    y = qlinear(g, quant(g, r, 20.0, 7, "q1"), "down", act="none")
    g.outputs = [y]
    text, rep = run(g)
    assert text == """graph(%x: bfloat16[4,5]):
  %c0: int8[5,6] = const
  %c1: float32[6] = const
  %c2: int8[6,6] = const
  %c3: float32[6] = const
  %0: uint8[4,5] = AscendQuant(%x; offset=3, scale=10.0)
  %1: uint8[4,6] = QuantLinearAct(%0, %c0, %c1; out_offset=7, out_scale=0.05)
  %2: uint8[1,4,6] = Reshape(%1)
  %3: uint8[4,6] = Reshape(%2)
  %4: bfloat16[4,6] = QuantLinearAct(%3, %c2, %c3)
  return %4"""
    assert [e["nodes"] for e in rep.applied] == ["up"]


def test_reshape_read_in_bf16_keeps_the_graph():
    g = Graph()
    x = g.add_input(TensorDesc((4, 5), BF), "x")
    up = qlinear(g, quant(g, x, 10.0, 3, "q0"), "up")
    r = reshape(g, up, (1, 4, 6), "view_a")
    y = qlinear(g, quant(g, reshape(g, r, (4, 6), "view_b"), 20.0, 7, "q1"), "down", act="none")
    g.outputs = [y, r]                        # the Reshape's bf16 value is also returned
    before = to_text(g, attrs=("scale", "offset", "out_scale", "out_offset"))
    text, rep = run(g)
    assert text == before
    reasons = {s["nodes"]: s["reason"] for s in rep.skipped}
    assert reasons["up"] == "after view_a (Reshape): the value is a graph output (the caller reads it as it is)"
