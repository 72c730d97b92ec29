"""vnpu int8 (``vnpu_quantize_int8``, CANN's AscendQuant → int8 Cube op → AscendDequant):
the golden rewrite of a hand-built graph and the pass's does-not-apply reasons; values
against the CPU int8 path (same records: equal to fp32 rounding), a float64 reference of
the quantized arithmetic, and eager fp32 (cosine); NaN/Inf inputs as the CPU path
documents (saturation); a second call; int8 formats (C0 = 32); the estimate's int8 costs;
the one-line errors (a Cube without int8, dynamic mode); `quant_report` rows."""
import json

import pytest
import torch
from torch import nn

import opencann
from opencann.engine.options import complete
from opencann.engine.quantize import VNPU_TARGETS, calibrate, quant_report
from opencann.devices import parse_device
from opencann.devices.cpu import onednn_int8_exact
from opencann.devices.vnpu import conv2d_cost
from opencann.ir import DataType, Format, Graph, TensorDesc, TensorRef, verify
from opencann.ir.dump import to_text
from opencann.passes import PassContext, PassManager, VnpuQuantizeInt8
from opencann.passes.fusion import quantize_int8
from opencann.passes.fusion.quantize_int8 import quantize_weight
from opencann.report import CompileReport
from opencann.tools.estimate import estimate_compiled

F = DataType.FLOAT
DEV = "vnpu:ascend910b"
G = torch.Generator().manual_seed(0)


class Net(nn.Module):
    """conv → relu → conv (+ residual) → relu → flatten → linear: every int8 layer kind."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(3, 16, 3, padding=1), nn.Conv2d(16, 16, 3, padding=1)
        self.fc = nn.Linear(16 * 8 * 8, 10)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return self.fc(torch.flatten(torch.relu(self.c2(y) + y), 1))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = Net().eval()
    cal = [(torch.randn(1, 3, 8, 8, generator=G),) for _ in range(4)]
    return m, cal


@pytest.fixture(scope="module")
def quantized(model):
    m, cal = model
    # the CPU path at the vnpu's quantization points: without fuse_requant, which moves
    # requantizations into the layers and keeps residual chains uint8 (test_int8.py covers it),
    # and with the vnpu's 8-bit weights (a CPU without VNNI takes 7 bits, int8_weight_qmax)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(quantize_int8, "int8_weight_qmax", lambda: 127)
        cpu = opencann.quantize(m, cal, device="cpu", options={"disable": ["fuse_requant"]})
    return {"cpu": cpu, **{dev: opencann.quantize(m, cal, device=dev) for dev in (DEV, "vnpu:ascend910")}}


def cos(a, b):
    return float(torch.nn.functional.cosine_similarity(a.detach().flatten().double(), b.detach().flatten().double(), 0))


# -- the pass on a hand-built graph ------------------------------------------------------

def conv_graph(record=True, groups=1):
    g = Graph("g")
    x = g.add_input(TensorDesc((1, 4, 6, 6), F), "x")
    w = g.add_const(torch.randn(8, 4 // groups, 3, 3, generator=G), "w")
    b = g.add_const(torch.randn(8, generator=G), "b")
    attrs = {"input": TensorRef(0), "weight": TensorRef(1), "bias": TensorRef(2), "stride": [1, 1],
             "padding": [1, 1], "dilation": [1, 1], "transposed": False, "output_padding": [0, 0],
             "groups": groups}
    c = g.create_node("Conv2D", [x, w, b], attrs, [TensorDesc((1, 8, 6, 6), F)], "conv")
    r = g.create_node("Relu", [c.output], {"self": TensorRef(0)}, [TensorDesc((1, 8, 6, 6), F)], "relu")
    g.outputs = [r.output]
    cfg = {"layers": {"conv": {"scale_d": 0.05, "offset_d": 100}} if record else {}, "skip_layers": []}
    return g, cfg


def run_pass(g, cfg, device=DEV):
    ctx = PassContext(options=complete({"verify": True, "quant_config": cfg}), report=CompileReport(),
                      device=parse_device(device))
    PassManager([VnpuQuantizeInt8()]).run(g, ctx)
    verify(g)
    return to_text(g, attrs=("scale", "offset", "offset_x", "axis")), ctx.report


def test_conv_becomes_quant_int8_conv_dequant():
    g, cfg = conv_graph()
    w = g.nodes[0].arg("weight").const.clone()
    text, rep = run_pass(g, cfg)
    ops = [n.op for n in g.nodes]
    assert ops == ["AscendQuant", "Conv2D", "AscendDequant", "Relu"]
    q, conv, dq, _ = g.nodes
    assert q.attrs["offset"] == 100 - 128 and q.attrs["scale"] == pytest.approx(1 / 0.05)
    assert q.outputs[0].desc.dtype == DataType.INT8 and conv.outputs[0].desc.dtype == DataType.INT32
    assert conv.attrs["offset_x"] == -28
    wq, ws = quantize_weight(w, 0)
    assert torch.equal(conv.arg("weight").const, wq)                         # ARQ, as the CPU pass
    assert torch.equal(conv.arg("bias").const, (28 * wq.long().sum((1, 2, 3))).int())   # -offset_x * sum(w)
    assert torch.equal(dq.arg("deq_scale").const, torch.tensor(0.05, dtype=torch.float32) * ws)
    assert dq.attrs["axis"] == 1 and dq.inputs[2].name == "b" and dq.outputs[0].desc.dtype == F
    assert "AscendQuant" in text and [e["nodes"] for e in rep.applied] == ["conv"]


def test_no_record_grouped_and_skip_layers_keep_the_graph_with_reasons():
    for kwargs, cfg_edit, reason in (({"record": False}, None, "no calibration record"),
                                     ({"groups": 2}, None, "grouped"),
                                     ({}, {"skip_layers": ["conv"]}, "skip_layers")):
        g, cfg = conv_graph(**kwargs)
        if cfg_edit:
            cfg.update(cfg_edit)
        before = to_text(g)
        text, rep = run_pass(g, cfg)
        assert to_text(g) == before
        assert reason in rep.skipped[0]["reason"]


def test_keep_dtype_mark_keeps_the_convolution_with_reason():
    """A node the option keep_dtype named (the precision pass's meta["keep_dtype"]) stays
    in its dtype on the vnpu too."""
    g, cfg = conv_graph()
    next(n for n in g.nodes if n.name == "conv").meta["keep_dtype"] = True
    before = to_text(g)
    text, rep = run_pass(g, cfg)
    assert to_text(g) == before and "keep_dtype" in rep.skipped[0]["reason"]


# -- values -----------------------------------------------------------------------------

def reference_int8(m, x, rec):
    """The quantized arithmetic in float64: x quantized at (scale_d, offset_d), weights by
    ARQ, sum((x_q - offset) * w_q) * scale_d * scale_w + bias, layer by layer."""
    def q(t, r):
        s, o = r["scale_d"], r["offset_d"]
        return (torch.round(t.float() * (1 / s)).double() + o).clamp(0, 255), s, o

    def conv(t, layer, r):
        xq, s, o = q(t, r)
        wq, ws = quantize_weight(layer.weight, 0)
        acc = torch.nn.functional.conv2d(xq - o, wq.double(), padding=1)
        return acc * (s * ws.double()).view(1, -1, 1, 1) + layer.bias.double().view(1, -1, 1, 1)
    y = torch.relu(conv(x, m.c1, rec["convolution"]))
    z = torch.relu(conv(y, m.c2, rec["convolution_1"]) + y)
    xq, s, o = q(torch.flatten(z, 1), rec["addmm"])
    wq, ws = quantize_weight(m.fc.weight, 0)
    return ((xq - o) @ wq.double().t()) * (s * ws.double()) + m.fc.bias.double()


def test_values_match_the_cpu_int8_path_float64_reference_and_eager(model, quantized):
    m, cal = model
    x = torch.randn(1, 3, 8, 8, generator=G)
    eager, cpu = m(x).detach(), quantized["cpu"](x)
    fp32 = opencann.compile(m, cal[0], device="cpu")
    rec = calibrate(opencann.compile(m, cal[0], device="cpu", options={"disable": [
        "fuse_conv_act", "fuse_conv_add_act", "fuse_linear_act"]}), cal, VNPU_TARGETS)
    ref = reference_int8(m, x, rec)
    assert cos(fp32(x), eager) > 0.99999
    for dev in (DEV, "vnpu:ascend910"):
        y = quantized[dev](x)
        assert y.dtype == torch.float32 and y.shape == eager.shape
        torch.testing.assert_close(y, cpu, rtol=1e-5, atol=1e-5)          # same records, same weights
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
        assert cos(y, eager) > 0.99
        assert cos(quantized[dev](cal[1][0]), m(cal[1][0])) > 0.99        # a calibration-like input


def test_second_call_and_output_independence(model, quantized):
    m, _ = model
    q = quantized[DEV]
    x1, x2 = torch.randn(1, 3, 8, 8, generator=G), torch.randn(1, 3, 8, 8, generator=G)
    y1 = q(x1)
    keep = y1.clone()
    y2 = q(x2)
    torch.testing.assert_close(y1, keep, rtol=0, atol=0)       # not overwritten by the second call
    torch.testing.assert_close(q(x1), keep, rtol=0, atol=0)
    assert not torch.equal(y1, y2)


def test_nan_and_inf_saturate_as_the_cpu_path_documents(model, quantized):
    """The CPU path documents: NaN → 0 in uint8 (the range's bottom), ±inf → its ends; the
    vnpu quantizes to the same levels (int8 = uint8 - 128), so both give the same finite
    output where eager gives NaN/Inf."""
    x = torch.randn(1, 3, 8, 8, generator=G)
    x[0, 0, 2, 3], x[0, 1, 5, 5], x[0, 2, 0, 0] = float("nan"), float("inf"), -float("inf")
    y, cpu = quantized[DEV](x), quantized["cpu"](x)
    assert torch.isfinite(y).all()
    torch.testing.assert_close(y, cpu, rtol=1e-5, atol=1e-5)


def test_int8_formats_c0_32_and_report_rows(quantized):
    q = quantized["vnpu:ascend910"]           # its Cube reads NZ: both formats at C0 = 32
    ops = q.graph.op_counts()
    assert ops["AscendQuant"] == 3 and ops["AscendDequant"] == 3 and "ConvBiasAct" not in ops
    qs = [n for n in q.graph.nodes if n.op == "AscendQuant"]
    fmts = {n.outputs[0].desc.format: n.outputs[0].desc for n in qs}
    assert set(fmts) == {Format.NC1HWC0, Format.FRACTAL_NZ}
    assert all(d.dtype == DataType.INT8 and d.shape[-1] == 32 for d in fmts.values())
    convs = [n for n in q.graph.nodes if n.op == "Conv2D"]
    assert all(c.outputs[0].desc.dtype == DataType.INT32 and c.outputs[0].desc.shape[-1] == 16 for c in convs)
    rows = quant_report(q)
    assert [r["layer"] for r in rows] == ["convolution", "convolution_1", "addmm"]
    assert all(r["int8"] and "int8 on the Cube" in r["detail"] for r in rows)


# -- costs --------------------------------------------------------------------------------

def test_estimate_costs_int8_layers_at_the_cube_int8_rate():
    """ascend910b (FixPipe dequant): conv1 + dequant + relu + requant writes int8, conv2 +
    dequant writes fp32 (the graph's dtype); both at the Cube's int8 rate, the bytes of
    what they read and write."""
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(64, 64, 3, padding=1), nn.ReLU(), nn.Conv2d(64, 64, 3, padding=1)).eval()
    cal = [(torch.randn(1, 64, 56, 56, generator=G),)]
    q = opencann.quantize(m, cal, device=DEV)
    f16 = opencann.compile(m.half(), (cal[0][0].half(),), device=DEV)
    rq, rf = estimate_compiled(q, "int8"), estimate_compiled(f16, "fp16")
    i8 = [r for r in rq.rows if r.op == "CubeEpilogue"]
    f = [r for r in rf.rows if r.op in ("Conv2D", "CubeEpilogue")]
    assert len(i8) == len(f) == 2 and not [r for r in rq.rows if r.op == "AscendDequant"]
    spec = parse_device(DEV).spec
    requant = conv2d_cost(1, 64, 56, 56, 64, 3, 1, 1, "int8", spec, epilogue=("relu",), out_dtype="int8")
    to_fp32 = conv2d_cost(1, 64, 56, 56, 64, 3, 1, 1, "int8", spec, out_dtype="float32")
    assert i8[0].time_us == pytest.approx(requant.time_us) and i8[0].hbm_bytes == pytest.approx(requant.hbm_bytes)
    assert i8[1].hbm_bytes == pytest.approx(to_fp32.hbm_bytes)
    out, w = 64 * 56 * 56, 64 * 64 * 9
    assert i8[0].hbm_bytes == out + w + out                  # int8 in, int8 weights, int8 out
    assert i8[0].time_us < f[0].time_us and i8[0].hbm_bytes < f[0].hbm_bytes
    qt = [r for r in rq.rows if r.op == "AscendQuant"]
    assert len(qt) == 1 and qt[0].hbm_bytes == 4 * out + out  # fp32 read, int8 write


# -- errors -------------------------------------------------------------------------------

def test_cube_without_int8_and_dynamic_mode_raise_one_line(model, tmp_path):
    m, cal = model
    spec = tmp_path / "no_int8.json"
    spec.write_text(json.dumps({"base": "ascend910b", "name": "no_int8",
                                "cube_dtypes": ["float16", "bfloat16", "float32"]}))
    with pytest.raises(ValueError, match=r"no int8\)\. Fix: quantize for a preset with an int8 Cube") as e:
        opencann.quantize(m, cal, device=f"vnpu:{spec}")
    assert "\n" not in str(e.value)
    g, cfg = conv_graph()
    with pytest.raises(ValueError, match="no int8"):
        run_pass(g, cfg, device=f"vnpu:{spec}")
    from opencann.tools.quantize import create_quant_config
    with pytest.raises(ValueError, match="dynamic int8 quantization .* has no vnpu kernel") as e:
        opencann.quantize(m, cal, device=DEV, config=create_quant_config(mode="dynamic"))
    assert "\n" not in str(e.value)


def test_tune_int8_on_the_vnpu_refuses_instead_of_running_fp32(model):
    from opencann.tools.tune import tune
    m, cal = model
    with pytest.raises(ValueError, match="int8 candidate of tune is not searched on vnpu") as e:
        tune(m, cal[0], device=DEV, candidates=("fp32", "int8"))
    assert "\n" not in str(e.value)


# -- FixPipe dequant / requant fused into the int8 Cube op (ascend910b) -------------------

class Block(nn.Module):
    """A ResNet basic block: conv → relu → conv → + x → relu."""

    def __init__(self, c=16):
        super().__init__()
        self.c1, self.c2 = nn.Conv2d(c, c, 3, padding=1), nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        return torch.relu(self.c2(torch.relu(self.c1(x))) + x)


@pytest.fixture(scope="module")
def block16():
    torch.manual_seed(0)
    m = Block().eval().half()
    cal = [(torch.randn(1, 16, 8, 8, generator=G).half(),) for _ in range(2)]
    fused = opencann.quantize(m, cal, device=DEV)
    unfused = opencann.quantize(m, cal, device=DEV, options={"disable": ["vnpu_ub_epilogue"]})
    return m, cal, fused, unfused


def test_fixpipe_golden_graph_of_the_fused_int8_block(block16):
    _, _, q, u = block16
    assert [n.op for n in q.graph.nodes] == ["TransData", "AscendQuant", "CubeEpilogue", "CubeEpilogue", "TransData"]
    c1, c2 = [n for n in q.graph.nodes if n.op == "CubeEpilogue"]
    assert [r for r, _ in c1.attrs["epilogue"]] == ["dequant", "deq_bias", "relu", "quant"]
    assert [r for r, _ in c2.attrs["epilogue"]] == ["dequant", "deq_bias", "add", "relu"]
    o1, o2 = c1.outputs[0].desc, c2.outputs[0].desc
    assert o1.dtype == DataType.INT8 and o1.format == Format.NC1HWC0 and o1.shape[-1] == 32   # requantized
    assert o2.dtype == DataType.FLOAT16 and o2.shape[-1] == 16                                 # DEQF16
    assert c1.attrs["cube"] == "Conv2D" and c1.attrs["acc_format"] == "NC1HWC0"
    assert c1.attrs["quant_offset"] == next(n for n in u.graph.nodes if n.name == "convolution_1_quant").attrs["offset"]
    applied = [e["detail"] for e in q.report.applied if e["pass"] == "vnpu_ub_epilogue"]
    assert applied == ["Conv2D + fixpipe(dequant, quant) + epilogue(relu)",
                       "Conv2D + fixpipe(dequant) + epilogue(add, relu)"]
    assert [n.op for n in u.graph.nodes].count("AscendDequant") == 2           # the unfused chain


def test_fixpipe_needs_the_preset_flag():
    """ascend910 (no fixpipe_quant): the dequant stays a Vector kernel, with the reason."""
    torch.manual_seed(0)
    m = Block().eval()
    q = opencann.quantize(m, [(torch.randn(1, 16, 8, 8, generator=G),)], device="vnpu:ascend910")
    ops = q.graph.op_counts()
    assert ops["AscendDequant"] == 2 and "CubeEpilogue" not in ops
    assert not parse_device("vnpu:ascend910").spec.fixpipe_quant and parse_device(DEV).spec.fixpipe_quant
    assert "FIXPIPE-A2" in parse_device(DEV).spec.sources["fixpipe_quant"]


def test_fixpipe_values_bit_equal_to_the_unfused_chain(block16):
    m, cal, q, u = block16
    x = torch.randn(1, 16, 8, 8, generator=G).half()
    x[0, 0, 1, 1], x[0, 3, 2, 2], x[0, 5, 7, 7] = float("nan"), float("inf"), -float("inf")
    for inp in (x, cal[0][0], torch.randn(1, 16, 8, 8, generator=G).half()):
        y = q(inp)
        keep = y.clone()
        assert y.dtype == torch.float16
        torch.testing.assert_close(y, u(inp), rtol=0, atol=0, equal_nan=True)   # same bits, NaN/Inf included
        torch.testing.assert_close(q(inp), keep, rtol=0, atol=0, equal_nan=True)  # second call
        torch.testing.assert_close(y, keep, rtol=0, atol=0, equal_nan=True)       # output not overwritten
    assert torch.isnan(q(x)[0, 0, 1, 1]) and torch.isinf(q(x)[0, 3, 2, 2])       # the residual's NaN / inf
    y = q(cal[1][0])
    assert cos(y.float(), m(cal[1][0]).float()) > 0.99


def test_fixpipe_fp32_model_matches_unfused_and_cpu(model, quantized):
    """The fp32 Net (conv, residual conv, linear) on ascend910b: every dequant fused, values
    bit-equal to the unfused chain (and to the CPU int8 path to fp32 rounding, test above)."""
    m, cal = model
    q = quantized[DEV]
    assert q.graph.op_counts().get("AscendDequant", 0) == 0 and q.graph.op_counts()["CubeEpilogue"] == 3
    u = opencann.quantize(m, cal, device=DEV, options={"disable": ["vnpu_ub_epilogue"]})
    x = torch.randn(1, 3, 8, 8, generator=G)
    assert torch.equal(q(x), u(x))


def test_fixpipe_block_costs_fewer_bytes_than_fp16():
    """64 → 64 3×3 at 56×56 (the issue's layer): the requantizing int8 Cube op moves int8
    in/out (438,272 B) against fp16's 876,544 B and is faster; the whole block (its input's
    AscendQuant included) moves fewer bytes than the fp16 block."""
    torch.manual_seed(0)
    m = Block(64).eval().half()
    x = torch.randn(1, 64, 56, 56, generator=G).half()
    rq = estimate_compiled(opencann.quantize(m, [(x,)], device=DEV), "int8")
    rf = estimate_compiled(opencann.compile(m, (x,), device=DEV), "fp16")
    qi = [r for r in rq.rows if r.op == "CubeEpilogue"]
    fi = [r for r in rf.rows if r.op == "CubeEpilogue"]
    out, w = 64 * 56 * 56, 64 * 64 * 9
    assert qi[0].hbm_bytes == out + w + out and fi[0].hbm_bytes == 2 * out + 2 * w + 2 * out
    assert qi[1].hbm_bytes == out + w + 2 * out + 2 * out                   # int8 in, fp16 residual and out
    assert all(a.time_us < b.time_us and a.hbm_bytes < b.hbm_bytes for a, b in zip(qi, fi))
    assert sum(r.hbm_bytes for r in rq.rows) < sum(r.hbm_bytes for r in rf.rows)


def test_onnx_qdq_on_the_vnpu_is_float_emulation_with_a_report_note(tmp_path):
    """Not lowered to the int8 Cube path (open work): the float emulation runs, and says so;
    its values agree with ONNX Runtime on the same file within int8 rounding."""
    import warnings
    ort = pytest.importorskip("onnxruntime")
    oq = pytest.importorskip("onnxruntime.quantization")
    import onnx
    torch.manual_seed(0)
    m = nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3)).eval()
    cal = [torch.randn(1, 3, 8, 8, generator=G) for _ in range(3)]
    fp, qp = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (cal[0],), fp, dynamo=False, opset_version=17)
    name = onnx.load(fp).graph.input[0].name

    class Reader(oq.CalibrationDataReader):
        def __init__(self):
            self.it = iter([{name: c.numpy()} for c in cal])

        def get_next(self):
            return next(self.it, None)
    oq.quantize_static(fp, qp, Reader(), quant_format=oq.QuantFormat.QDQ, per_channel=True,
                       weight_type=oq.QuantType.QInt8, activation_type=oq.QuantType.QUInt8)
    cm = opencann.compile(qp, device=DEV)
    notes = [n for n in cm.report.notes if "float emulation" in n]
    assert len(notes) == 1 and "Fix: quantize the float model" in notes[0] and "\n" not in notes[0]
    x = torch.randn(1, 3, 8, 8, generator=G)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not onednn_int8_exact():   # its fused u8 x s8 kernels saturate without VNNI: QDQ as float ops
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    ref = torch.from_numpy(ort.InferenceSession(qp, so, providers=["CPUExecutionProvider"]).run(None, {name: x.numpy()})[0])
    y = cm(x)
    y = y[0] if isinstance(y, (list, tuple)) else y
    assert cos(y, ref) > 0.99
    assert (y - ref).abs().max().item() <= 0.05 * ref.abs().max().item()
