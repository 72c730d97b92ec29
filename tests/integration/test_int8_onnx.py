"""ONNX QDQ models on the int8 kernels (``qdq_to_int8``): a small torch CNN and MLP
exported to ONNX and quantized by ONNX Runtime's ``quantize_static`` (QDQ format,
per-channel symmetric int8 weights, uint8 activations) compile to QuantConvBiasAct /
QuantConvAddAct / QuantLinearAct (the residual Add and the MaxPool between QDQ pairs to
QuantAdd / QuantMaxPool), and match ONNX Runtime on the same file within int8 rounding; a
second call gives the same bits; a pair in front of another op stays float emulation
(AscendQuant → AscendDequant); ``disable: ["qdq_to_int8", "qdq_eltwise_int8"]`` keeps the
emulation and agrees too (docs/guide/quantization.md)."""
import warnings

import pytest
import torch

import opencann
from opencann.devices.cpu import mkldnn_available, onednn_int8_exact

ort = pytest.importorskip("onnxruntime")
oq = pytest.importorskip("onnxruntime.quantization")
pytestmark = pytest.mark.skipif(not (mkldnn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
                                reason="no oneDNN int8 kernels in this torch")
#: ONNX Runtime's uint8 x int8 kernels (MLAS) add pairs of products in int16 with saturation
#: where oneDNN's do (x86 without VNNI; its quantization docs advise reduce_range there):
#: its QLinear* / MatMulInteger / ConvInteger outputs are then no reference for the exact
#: int8 arithmetic opencann runs (`opencann.ops.kernels.int8_emulated`); a QDQ file run
#: with its optimizations off (QuantizeLinear, DequantizeLinear and float ops) still is
EXACT_U8S8 = onednn_int8_exact()
needs_exact_u8s8 = pytest.mark.skipif(not EXACT_U8S8, reason="ONNX Runtime's u8 x s8 kernels saturate on "
                                      "this CPU (no VNNI): its integer ops are no exact reference")


class Cnn(torch.nn.Module):
    """conv-ReLU → conv + residual → ReLU → MaxPool → conv → global mean → Linear."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2, self.c3 = (torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 8, 3, padding=1),
                                     torch.nn.Conv2d(8, 16, 3))
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = torch.relu(self.c2(y) + y)
        y = torch.relu(self.c3(torch.nn.functional.max_pool2d(y, 2)))
        return self.fc(y.mean((2, 3)))


def _qdq_file(model, shape, tmp_path, n_cal=4, fmt="QDQ", act="QUInt8"):
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    cal = [torch.randn(*shape, generator=g) for _ in range(n_cal)]
    fp, qp = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(model.eval(), (cal[0],), fp, dynamo=False, opset_version=17)

    import onnx
    name = onnx.load(fp).graph.input[0].name

    class Reader(oq.CalibrationDataReader):
        def __init__(self):
            self.it = iter([{name: c.numpy()} for c in cal])

        def get_next(self):
            return next(self.it, None)
    oq.quantize_static(fp, qp, Reader(), quant_format=getattr(oq.QuantFormat, fmt), per_channel=True,
                       weight_type=oq.QuantType.QInt8, activation_type=getattr(oq.QuantType, act))
    return qp, name


def _ort(path, name, x):
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    if not EXACT_U8S8:   # QDQ pairs stay float ops instead of fusing into saturating kernels
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    return torch.from_numpy(ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
                            .run(None, {name: x.numpy()})[0])


def _within_int8_rounding(a, b):
    """Outputs of two int8 runs of one file: equal but for values one rounding apart
    somewhere upstream (a uint8 step of the last quantized tensor, then its effect)."""
    assert a.shape == b.shape and a.dtype == b.dtype
    cos = torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()
    assert cos >= 0.9995, cos
    assert (a - b).abs().max().item() <= 0.05 * b.abs().max().item()


@pytest.mark.parametrize("act", ["QUInt8", "QInt8"])
def test_qdq_cnn_runs_int8_kernels_and_matches_onnxruntime(tmp_path, act):
    """uint8 activations, and int8 ones (ONNX Runtime's default: taken as uint8 shifted by
    128, the same dequantized values)."""
    qp, name = _qdq_file(Cnn(), (1, 3, 20, 20), tmp_path, act=act)
    cm = opencann.compile(qp)
    ops = cm.report.op_counts_after
    assert ops.get("QuantConvBiasAct", 0) + ops.get("QuantConvAddAct", 0) == 3, ops
    assert ops.get("QuantLinearAct") == 1, ops
    assert not {"ConvBiasAct", "ConvAddAct", "LinearAct"} & set(ops), ops
    assert ops.get("QuantAdd") == 1 and ops.get("QuantMaxPool") == 1, ops   # qdq_eltwise_int8
    applied = [e for e in cm.report.applied if e["pass"] == "qdq_to_int8"]
    assert len(applied) == 4 and all("the file's int8 weights" in e["detail"] for e in applied)
    x = torch.randn(1, 3, 20, 20, generator=torch.Generator().manual_seed(5))
    y = cm(x)[0]
    _within_int8_rounding(y, _ort(qp, name, x))
    y2 = cm(x)[0]
    assert torch.equal(y, y2) and y.data_ptr() != y2.data_ptr()
    emu = opencann.compile(qp, options={"disable": ["qdq_to_int8", "qdq_eltwise_int8"]})
    assert "QuantConvBiasAct" not in emu.report.op_counts_after
    assert emu.report.op_counts_after.get("AscendDequant", 0) >= 4
    _within_int8_rounding(emu(x)[0], _ort(qp, name, x))


def test_qdq_pair_before_another_op_stays_float_emulation(tmp_path):
    """A QDQ pair on the model's output (no conv / linear after it) is run as AscendQuant →
    AscendDequant: the values of ONNX's QuantizeLinear → DequantizeLinear exactly."""
    m = torch.nn.Sequential(torch.nn.Linear(12, 6), torch.nn.Sigmoid()).eval()
    qp, name = _qdq_file(m, (3, 12), tmp_path)
    cm = opencann.compile(qp)
    ops = cm.report.op_counts_after
    assert ops.get("QuantLinearAct") == 1 and ops.get("AscendDequant", 0) >= 1
    x = torch.randn(3, 12)
    _within_int8_rounding(cm(x)[0], _ort(qp, name, x))


class Plain(torch.nn.Module):
    """conv-ReLU → conv(stride 2) → flatten → Linear: QLinearConv / QLinearMatMul in the
    QOperator format, with no com.microsoft op between them."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.Conv2d(8, 4, 3, stride=2)
        self.fc = torch.nn.Linear(4 * 4 * 4, 6, bias=False)

    def forward(self, x):
        return self.fc(self.c2(torch.relu(self.c1(x))).flatten(1))


@needs_exact_u8s8
def test_qoperator_qlinearconv_and_qlinearmatmul_run_int8_kernels(tmp_path):
    """ONNX Runtime's QOperator format (QLinearConv, QLinearMatMul): each becomes one int8
    kernel with a uint8 output at the node's y_scale; matches ONNX Runtime."""
    import onnx
    qp, name = _qdq_file(Plain(), (1, 3, 10, 10), tmp_path, fmt="QOperator")
    ops_in_file = {nd.op_type for nd in onnx.load(qp).graph.node}
    assert {"QLinearConv", "QLinearMatMul"} <= ops_in_file, ops_in_file
    cm = opencann.compile(qp)
    ops = cm.report.op_counts_after
    assert ops.get("QuantConvBiasAct") == 2 and ops.get("QuantLinearAct") == 1, ops
    assert "OnnxHostFallback" not in ops and "ConvBiasAct" not in ops
    x = torch.randn(1, 3, 10, 10)
    _within_int8_rounding(cm(x)[0], _ort(qp, name, x))


def _dynamic_mlp_file(tmp_path, **quantize_options):
    """(x [2, 5, 16], path): a 3-D MLP (16 → 32 → ReLU → 8) exported to ONNX and quantized by
    ONNX Runtime's ``quantize_dynamic`` (int8 weights, ``quantize_options`` added)."""
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    x = torch.randn(2, 5, 16)
    fp, qp = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (x,), fp, dynamo=False, opset_version=17)
    oq.quantize_dynamic(fp, qp, weight_type=oq.QuantType.QInt8, **quantize_options)
    return x, qp


@needs_exact_u8s8
def test_quantize_dynamic_matmuls_run_the_dynamic_int8_kernel(tmp_path):
    """``quantize_dynamic`` (DynamicQuantizeLinear → MatMulInteger → Cast → Mul) on a 3-D
    MLP: each MatMul becomes a dynamic QuantLinearAct with the file's int8 weights (no host
    fallback); matches ONNX Runtime; a second call gives the same bits."""
    import onnx
    x, qp = _dynamic_mlp_file(tmp_path)
    assert "MatMulInteger" in {nd.op_type for nd in onnx.load(qp).graph.node}
    cm = opencann.compile(qp)
    ops = cm.report.op_counts_after
    assert ops.get("QuantLinearAct") == 2 and "OnnxHostFallback" not in ops, ops
    rows = [e["detail"] for e in cm.report.applied if e["pass"] == "quantize_int8"]
    assert len(rows) == 2 and all("dynamic" in r and "the file's int8 weights" in r for r in rows)
    name = onnx.load(qp).graph.input[0].name
    y = cm(x)[0]
    _within_int8_rounding(y, _ort(qp, name, x))
    assert torch.equal(cm(x)[0], y)


@pytest.mark.parametrize("per_channel", [False, True])
def test_reduce_range_files_keep_their_7bit_weights_on_the_onednn_kernels(tmp_path, per_channel):
    """``quantize_dynamic(reduce_range=True)`` writes 7-bit weights (ONNX Runtime's advice
    for CPUs without VNNI): they are the file's int8 weights (not requantized), bound to
    oneDNN's kernels wherever they are exact (|w| <= 64 on a CPU without VNNI:
    `int8_weight_bound`), and match ONNX Runtime, whose kernels do not saturate on them."""
    import onnx
    from opencann.devices.cpu import int8_weight_bound
    from opencann.ops import get_op
    torch.manual_seed(0)
    x, qp = _dynamic_mlp_file(tmp_path, reduce_range=True, per_channel=per_channel)
    cm = opencann.compile(qp)
    rows = [e["detail"] for e in cm.report.applied if e["pass"] == "quantize_int8"]
    assert len(rows) == 2 and all("the file's int8 weights" in r for r in rows), rows
    nodes = [n for n in cm.graph.nodes if n.op == "QuantLinearAct"]
    assert all(int(n.arg("mat2").const.to(torch.int32).abs().max()) <= 64 for n in nodes)
    if int8_weight_bound() is not None:
        paths = {get_op(n.op).kernel_factory("cpu")(n, [v.desc for v in n.inputs],
                                                   [v.const for v in n.inputs]).int8_path for n in nodes}
        assert paths == {"onednn"}
    name = onnx.load(qp).graph.input[0].name
    y = cm(x)[0]
    _within_int8_rounding(y, _ort(qp, name, x))
    assert torch.equal(cm(x)[0], y)

class Blocks(torch.nn.Module):
    """conv-ReLU → conv + residual → x·sigmoid(x) → concat with a LeakyReLU branch → 1×1 conv →
    AvgPool → global mean → Linear: ``quantize_static``'s QOperator format writes the
    com.microsoft QLinearAdd, QLinearSigmoid, QLinearMul, QLinearLeakyRelu, QLinearConcat,
    QLinearAveragePool, QLinearGlobalAveragePool and QGemm for it."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 6, 3, padding=1), torch.nn.Conv2d(6, 6, 3, padding=1)
        self.c3, self.fc = torch.nn.Conv2d(12, 8, 1), torch.nn.Linear(8, 5)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        z = y + self.c2(y)
        z = torch.cat([z * torch.sigmoid(z), torch.nn.functional.leaky_relu(y, 0.1)], 1)
        z = torch.nn.functional.avg_pool2d(self.c3(z), 2)
        return self.fc(torch.nn.functional.adaptive_avg_pool2d(z, 1).flatten(1))


_MSFT = {"QLinearAdd", "QLinearSigmoid", "QLinearMul", "QLinearLeakyRelu", "QLinearConcat", "QLinearAveragePool",
         "QLinearGlobalAveragePool", "QGemm"}


@pytest.mark.parametrize("act", [pytest.param("QUInt8", marks=needs_exact_u8s8), "QInt8"])
def test_qoperator_com_microsoft_ops_run_on_onnxruntime(tmp_path, act):
    """The com.microsoft ops of a QOperator file run on ONNX Runtime (host fallback) with
    their output shapes from ONNX Runtime's own shape inference (onnx's does not know
    them). int8 activations: every node runs ONNX Runtime's kernels or the specification's
    QuantizeLinear, so the output equals ONNX Runtime's exactly; uint8: the convolutions
    run oneDNN's int8 kernels, within one step of the output's quantization (equal in the
    runs made while writing this). A saved and loaded model gives the same bits."""
    import onnx
    qp, name = _qdq_file(Blocks(), (2, 3, 8, 8), tmp_path, n_cal=3, fmt="QOperator", act=act)
    proto = onnx.load(qp)
    assert _MSFT <= {nd.op_type for nd in proto.graph.node if nd.domain == "com.microsoft"}
    cm = opencann.compile(qp)
    assert {f"onnx::{op}" for op in _MSFT} <= set(cm.report.host_fallbacks), cm.report.host_fallbacks
    last = next(nd for nd in proto.graph.node if nd.output[0] == proto.graph.output[0].name)
    step = float(onnx.numpy_helper.to_array(next(t for t in proto.graph.initializer if t.name == last.input[1])))
    path = str(tmp_path / "q.ocm")
    opencann.save(cm, path)
    loaded = opencann.load(path)
    for seed in range(3):
        x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(seed)) * 2
        y, ref = cm(x)[0], _ort(qp, name, x)
        assert y.shape == ref.shape and y.dtype == ref.dtype
        if act == "QInt8":
            assert torch.equal(y, ref), (y - ref).abs().max()
        else:
            assert (y - ref).abs().max().item() <= step * 1.0001, ((y - ref).abs().max(), step)
        assert torch.equal(loaded(x)[0], y)


@needs_exact_u8s8
def test_quantize_dynamic_file_runs_float_emulation_on_the_vnpu(tmp_path):
    """On the vnpu an ONNX ``quantize_dynamic`` file runs as float emulation (as QDQ /
    QOperator files do): each MatMul reads x through a DynamicQuantDequant (the uint8 levels
    of DynamicQuantizeLinear, range per call) and multiplies by the file's dequantized weight
    in fp32. Its values equal the CPU's dynamic int8 kernel's to fp32 rounding, NaN / ±inf
    in x included (both leave them out of x's range), and ONNX Runtime's within int8
    rounding; a saved and loaded model gives the same bits."""
    import onnx
    m = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()
    fp, qp = str(tmp_path / "f.onnx"), str(tmp_path / "q.onnx")
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(m, (torch.randn(2, 5, 16),), fp, dynamo=False, opset_version=17)
    oq.quantize_dynamic(fp, qp, weight_type=oq.QuantType.QInt8)
    name = onnx.load(qp).graph.input[0].name
    cpu, npu = opencann.compile(qp), opencann.compile(qp, device="vnpu:ascend910b")
    ops = npu.report.op_counts_after
    assert ops.get("DynamicQuantDequant") == 2 and "OnnxHostFallback" not in ops, ops
    from opencann.engine.quantize import quant_report
    rows = quant_report(npu)
    assert len(rows) == 2 and all(not r["int8"] and "float emulation" in r["reason"] for r in rows), rows
    path = str(tmp_path / "q.ocm")
    opencann.save(npu, path)
    loaded = opencann.load(path)
    g = torch.Generator().manual_seed(3)
    for special in (None, float("nan"), float("inf"), -float("inf")):
        x = torch.randn(2, 5, 16, generator=g) * 3
        if special is not None:
            x[0, 1, 2] = special
        y, c = npu(x)[0], cpu(x)[0]
        assert torch.isfinite(y).all() and torch.isfinite(c).all()
        assert (y - c).abs().max().item() <= 1e-5 * c.abs().max().item()
        if special is None:
            _within_int8_rounding(y, _ort(qp, name, x))
        assert torch.equal(loaded(x)[0], y)


def test_quant_report_lists_a_qdq_files_layers(tmp_path):
    """``quant_report`` on a QDQ file lists its layers (it listed none: only the
    ``quantize_int8`` pass's rows were read, not ``qdq_to_int8``'s): int8 with the file's
    scale, and a layer whose weight is not symmetric int8 as float emulation with the reason."""
    import onnx
    from onnx import numpy_helper
    from opencann.tools.quantize import quant_report
    qp, name = _qdq_file(Cnn(), (1, 3, 20, 20), tmp_path)
    rows = quant_report(opencann.compile(qp))
    assert len(rows) == 4 and all(r["int8"] and "the file's int8 weights" in r["detail"] for r in rows), rows
    model = onnx.load(qp)       # c1's weight: no value of channel 0 at 127 any more
    inits = {i.name: i for i in model.graph.initializer}
    wname = next(n.input[0] for n in model.graph.node if n.op_type == "DequantizeLinear"
                 and n.input[0] in inits and numpy_helper.to_array(inits[n.input[0]]).ndim == 4)
    w = numpy_helper.to_array(inits[wname]).copy()
    w[0][abs(w[0].astype(int)) == 127] = 100
    inits[wname].CopyFrom(numpy_helper.from_array(w, wname))
    bad = str(tmp_path / "bad.onnx")
    onnx.save(model, bad)
    cm = opencann.compile(bad)
    rows = quant_report(cm)
    kept = [r for r in rows if not r["int8"]]
    assert len(rows) == 4 and len(kept) == 1 and "not symmetric int8" in kept[0]["reason"], rows
    x = torch.randn(1, 3, 20, 20, generator=torch.Generator().manual_seed(5))
    _within_int8_rounding(cm(x)[0], _ort(bad, name, x))
