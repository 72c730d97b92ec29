"""int8 on CPUs without VNNI: 7-bit weights on oneDNN's kernels.

oneDNN's uint8 x int8 kernels add pairs of products in int16 with saturation on x86
without VNNI / AMX-int8, exact for |w| <= 64 (255 x 64 x 2 = 32 640 <= 32 767:
`opencann.devices.cpu.int8_weight_bound`). There `opencann.quantize` gives weights in
[-64, 64] and the int8 ops bind oneDNN (`int8_cpu.onednn_takes`, checked on the weight at
bind time); a weight beyond the bound (8-bit, quantized on a VNNI host) runs the fp32
emulation. Checked here: the probe, the weight range and the bound path per bound
(127 / 64 / None, monkeypatched), the oneDNN results against a float64 re-computation of
the integer arithmetic and against the emulation, and a small MLP and CNN against eager
(docs/guide/quantization.md, "CPUs without VNNI")."""
import pytest
import torch

import opencann
import opencann.devices.cpu as cpu_dev
import opencann.ops.kernels.int8_cpu as int8_cpu
from opencann.devices.cpu import int8_weight_bound, int8_weight_qmax, mkldnn_available, onednn_int8_exact
from opencann.ops import get_op
from opencann.passes.fusion import quantize_int8
from opencann.tools.doctor import _int8_check
from opencann.tools.quantize import create_quant_config, quant_report

pytestmark = pytest.mark.skipif(not (mkldnn_available() and hasattr(torch.ops.onednn, "qlinear_pointwise")),
                                reason="no oneDNN int8 kernels in this torch")
INT8_OPS = ("QuantLinearAct", "QuantConvBiasAct", "QuantConvAddAct")


class Cnn(torch.nn.Module):
    """conv-ReLU, conv + residual → ReLU, global mean, Linear: every int8 kernel."""

    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 16, 3, padding=1), torch.nn.Conv2d(16, 16, 3, padding=1)
        self.fc = torch.nn.Linear(16, 10)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return self.fc(torch.relu(self.c2(y) + y).mean((2, 3)))


def _mlp():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(48, 96), torch.nn.GELU(), torch.nn.Linear(96, 32),
                               torch.nn.ReLU(), torch.nn.Linear(32, 8)).eval()


def _cnn():
    torch.manual_seed(0)
    return Cnn().eval()


def _batches(shape, n=3, seed=1):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g) for _ in range(n)]


def _cos(a, b):
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()


def _int8_nodes(cm):
    return [n for n in cm.graph.nodes if n.op in INT8_OPS]


def _weight(n):
    return n.arg("mat2" if n.op == "QuantLinearAct" else "weight").const


def _paths(cm):
    """The arithmetic each int8 node of ``cm`` binds to ("onednn" / "emulated"), bound
    again here as the runtime binds it."""
    return [get_op(n.op).kernel_factory("cpu")(n, [v.desc for v in n.inputs], [v.const for v in n.inputs]).int8_path
            for n in _int8_nodes(cm)]


def _no_emulation(monkeypatch):
    def fail(*a, **k):
        raise AssertionError("the fp32 emulation was bound")
    monkeypatch.setattr(int8_cpu, "emulated_quant_linear", fail)
    monkeypatch.setattr(int8_cpu, "emulated_quant_conv", fail)


def _set_bound(monkeypatch, bound):
    """Both readers of the bound: the weight range (`int8_weight_qmax`) and the kernels."""
    monkeypatch.setattr(cpu_dev, "int8_weight_bound", lambda: bound)
    monkeypatch.setattr(quantize_int8, "int8_weight_qmax", cpu_dev.int8_weight_qmax)
    monkeypatch.setattr(int8_cpu, "int8_weight_bound", lambda: bound)


def _onednn_linear(x_u8, w_nk, k):
    n = w_nk.shape[0]
    wp = torch.ops.onednn.qlinear_prepack(w_nk, [x_u8.shape[0], k])
    return torch.ops.onednn.qlinear_pointwise(x_u8, 1.0, 0, wp, torch.ones(n), torch.zeros(n, dtype=torch.int64),
                                              None, 1.0, 0, torch.float32, "none", [], "")


def test_the_probe_gives_the_largest_exact_weight():
    """127 with exact 8-bit products; else 64 exactly when pairs of 255 x 64 sum exactly
    and 255 x 65 do not (int16 saturation); the quantization range follows."""
    bound = int8_weight_bound()
    assert bound in (127, 64, None) and int8_weight_qmax() == (bound or 127)
    assert (bound == 127) == onednn_int8_exact()
    k = 256
    x = torch.full((2, k), 255, dtype=torch.uint8)
    for v in (64, 65):
        y = _onednn_linear(x, torch.full((4, k), v, dtype=torch.int8), k)
        exact = bool((y == 255 * v * k).all())
        if bound is not None:
            assert exact == (v <= bound)


def test_onednn_takes_follows_the_bound_and_the_weight(monkeypatch):
    w64 = torch.tensor([[64, -64, 3]], dtype=torch.int8)
    w127, w_128 = torch.tensor([[127, 0]], dtype=torch.int8), torch.tensor([[-128, 0]], dtype=torch.int8)
    for bound, want in ((127, (True, True, True)), (64, (True, False, False)), (None, (False, False, False))):
        monkeypatch.setattr(int8_cpu, "int8_weight_bound", lambda b=bound: b)
        assert tuple(int8_cpu.onednn_takes(w) for w in (w64, w127, w_128)) == want, bound


@pytest.mark.parametrize("bound", [127, 64, None])
def test_bounds_choose_the_weight_range_the_path_and_the_note(monkeypatch, bound):
    _set_bound(monkeypatch, bound)
    q = opencann.quantize(_mlp(), _batches((4, 48)))
    nodes = _int8_nodes(q)
    assert len(nodes) == 3
    want = bound or 127
    assert all(int(_weight(n).abs().max()) == want for n in nodes)    # ARQ: the channel max lands on qmax
    assert _paths(q) == ["onednn" if bound else "emulated"] * 3
    note = next(p.note for p in q.report.passes if p.name == "quantize_int8")
    rows = [r["detail"] for r in quant_report(q)]
    if bound == 64:
        assert "3 with 7-bit weights in [-64, 64]" in note and "\n" not in note
        assert all("7-bit weights [-64, 64]" in r for r in rows)
    else:
        assert "7-bit" not in note and not any("7-bit" in r for r in rows)


def test_doctor_row_per_bound():
    assert _int8_check(127).status == "ok" and "VNNI" in _int8_check(127).value
    row = _int8_check(64)
    assert row.status == "ok" and "7-bit weights [-64, 64]" in row.value and "\n" not in row.value
    assert _int8_check(None).status == "warning" and "fp32" in _int8_check(None).advice


needs_7bit = pytest.mark.skipif(int8_weight_bound() is None, reason="oneDNN's int8 products are not exact "
                                "even at 7 bits on this CPU")


def _ref_linear(q, x):
    """float64 re-computation of a one-layer QuantLinearAct model: x quantized as its
    AscendQuant does, the exact integer sum, the scales, the bias."""
    aq = next(n for n in q.graph.nodes if n.op == "AscendQuant")
    node = _int8_nodes(q)[0]
    xq = int8_cpu.quantize_u8(x, 1.0 / float(aq.attrs["scale"]), int(aq.attrs["offset"]))
    step, off = float(node.attrs["x_scale"]), int(node.attrs["x_offset"])
    acc = (xq.double() - off) @ _weight(node).double()
    return acc * (step * node.arg("w_scale").const.double()) + node.inputs[node.attrs["self"].index].const.double()


@needs_7bit
def test_onednn_linear_matches_the_integer_arithmetic_and_the_emulation(monkeypatch):
    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 64).eval()
    cal = _batches((16, 256))
    with monkeypatch.context() as mp:
        _no_emulation(mp)
        q = opencann.quantize(lin, cal)
    assert _paths(q) == ["onednn"]
    assert int(_weight(_int8_nodes(q)[0]).abs().max()) <= int8_weight_qmax()
    monkeypatch.setattr(int8_cpu, "int8_weight_bound", lambda: None)
    emulated = opencann.quantize(lin, cal)
    assert _paths(emulated) == ["emulated"]
    for x in _batches((16, 256), n=2, seed=5):
        y, ref = q(x), _ref_linear(q, x)
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))
        torch.testing.assert_close(y, emulated(x), rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_7bit
def test_onednn_conv_matches_the_integer_arithmetic(monkeypatch):
    torch.manual_seed(4)
    conv = torch.nn.Sequential(torch.nn.Conv2d(32, 24, 3, padding=1), torch.nn.ReLU()).eval()
    cal = _batches((2, 32, 10, 10))
    _no_emulation(monkeypatch)
    q = opencann.quantize(conv, cal)
    assert _paths(q) == ["onednn"]
    aq, node = next(n for n in q.graph.nodes if n.op == "AscendQuant"), _int8_nodes(q)[0]
    step, off = float(node.attrs["x_scale"]), int(node.attrs["x_offset"])
    bias = node.inputs[node.attrs["bias"].index].const.double()
    for x in _batches((2, 32, 10, 10), n=2, seed=6):
        xq = int8_cpu.quantize_u8(x, 1.0 / float(aq.attrs["scale"]), int(aq.attrs["offset"]))
        acc = torch.nn.functional.conv2d(xq.double() - off, _weight(node).double(), padding=1)
        ref = torch.relu(acc * (step * node.arg("w_scale").const.double()).view(1, -1, 1, 1) + bias.view(1, -1, 1, 1))
        torch.testing.assert_close(q(x).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


@needs_7bit
def test_an_8bit_weight_still_takes_the_emulation_here(monkeypatch):
    """A model quantized at 8 bits (as on a VNNI host) binds oneDNN only where its 8-bit
    products are exact; elsewhere the emulation, with the same values as the float64 sum."""
    torch.manual_seed(3)
    lin = torch.nn.Linear(256, 64).eval()
    monkeypatch.setattr(quantize_int8, "int8_weight_qmax", lambda: 127)
    q = opencann.quantize(lin, _batches((16, 256)))
    assert int(_weight(_int8_nodes(q)[0]).abs().max()) == 127
    assert _paths(q) == ["onednn" if onednn_int8_exact() else "emulated"]
    x = _batches((16, 256), n=1, seed=5)[0]
    ref = _ref_linear(q, x)
    torch.testing.assert_close(q(x).double(), ref, rtol=1e-5, atol=1e-5 * float(ref.abs().max()))


def _second_call_and_independence(q, xs):
    y1 = q(xs[0])
    keep = y1.clone()
    y2 = q(xs[1])
    assert torch.equal(y1, keep) and torch.equal(q(xs[0]), keep) and not torch.equal(y1, y2)


@needs_7bit
@pytest.mark.parametrize("dynamic", [False, True])
def test_mlp_quantized_here_runs_onednn_close_to_eager(monkeypatch, dynamic):
    m = _mlp()
    _no_emulation(monkeypatch)
    cfg = create_quant_config(mode="dynamic") if dynamic else None
    q = opencann.quantize(m, _batches((4, 48)), config=cfg)
    assert _paths(q) == ["onednn"] * 3
    xs = _batches((4, 48), n=2, seed=9)
    with torch.no_grad():
        for x in xs:
            assert _cos(q(x), m(x)) >= 0.999
    _second_call_and_independence(q, xs)


@needs_7bit
def test_cnn_quantized_here_runs_onednn_close_to_eager(monkeypatch):
    m = _cnn()
    _no_emulation(monkeypatch)
    q = opencann.quantize(m, _batches((2, 3, 12, 12)))
    ops = q.report.op_counts_after
    assert ops.get("QuantConvBiasAct") == 1 and ops.get("QuantConvAddAct") == 1 and ops.get("QuantLinearAct") == 1
    assert _paths(q) == ["onednn"] * 3
    xs = _batches((2, 3, 12, 12), n=2, seed=9)
    with torch.no_grad():
        for x in xs:
            assert _cos(q(x), m(x)) >= 0.999
    _second_call_and_independence(q, xs)
