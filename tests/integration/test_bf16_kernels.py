"""``allow_mix_precision_bf16`` on CPU runs oneDNN's native bf16 kernels: BatchNorm folded
before the convolution is lowered, Conv(+BN)(+Add)(+ReLU) as ConvBiasAct / ConvAddAct and
Linears as LinearAct in bf16 on weights cast and reordered once (no reorder in oneDNN's
verbose log of a call), activations bf16 from op to op (no Cast reads a Cast), outputs
cast back to fp32; values within bf16's rounding of eager fp32 (cosine >= 0.999), NaN
and ±inf where eager fp32 puts them (docs/guide/precision.md)."""
import pytest
import torch

import opencann
from opencann.devices.cpu import mkldnn_available, onednn_bf16_available, onednn_linear_available
from opencann.ops import get_op
from opencann.passes.prepare.precision import precision_summary

pytestmark = pytest.mark.skipif(not (mkldnn_available() and onednn_linear_available()),
                                reason="no oneDNN convolutions / inner products in this torch")
BF16 = {"precision_mode": "allow_mix_precision_bf16"}
#: the fused oneDNN bf16 kernels exist only where oneDNN has bf16 on this CPU; elsewhere the
#: bf16 nodes run ATen's kernels (test_bf16_without_onednn_runs_aten_kernels)
needs_onednn_bf16 = pytest.mark.skipif(not onednn_bf16_available(),
                                       reason="no oneDNN bf16 kernels on this CPU (AVX2 only)")


class Net(torch.nn.Module):
    """Conv-BN-ReLU, max pooling, a residual block (conv-BN-ReLU, conv-BN + x, ReLU),
    then Linear-GELU-Linear on the flattened features: every bf16 CPU kernel of the
    precision mode. 3x3 convolutions at batch 2 run oneDNN's kernel (conv_choice).
    ``features``: return the residual block's output [N, 16, 8, 8] too, where a NaN or
    inf input reaches some positions only (the logits mix every position)."""

    def __init__(self, features=False):
        super().__init__()
        self.features = features
        c = 16
        self.stem = torch.nn.Sequential(torch.nn.Conv2d(4, c, 3, padding=1),
                                        torch.nn.BatchNorm2d(c), torch.nn.ReLU(),
                                        torch.nn.MaxPool2d(2))
        self.a, self.bn_a = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)
        self.b, self.bn_b = torch.nn.Conv2d(c, c, 3, padding=1), torch.nn.BatchNorm2d(c)
        self.fc1, self.fc2 = torch.nn.Linear(c * 8 * 8, 64), torch.nn.Linear(64, 10)
        for bn in (self.stem[1], self.bn_a, self.bn_b):
            with torch.no_grad():
                bn.running_mean.normal_()
                bn.running_var.uniform_(0.5, 2.0)
                bn.weight.uniform_(0.5, 1.5)
                bn.bias.normal_()

    def forward(self, x):
        x = self.stem(x)
        y = torch.relu(self.bn_a(self.a(x)))
        x = torch.relu(self.bn_b(self.b(y)) + x)
        logits = self.fc2(torch.nn.functional.gelu(self.fc1(x.flatten(1))))
        return (x, logits) if self.features else logits


def _net(features=False):
    torch.manual_seed(0)
    return Net(features).eval(), torch.randn(2, 4, 16, 16)


def _cosine(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return (a @ b / (a.norm() * b.norm())).item()


@needs_onednn_bf16
def test_batchnorm_folds_and_every_conv_and_linear_runs_fused_in_bf16():
    m, x = _net()
    cm = opencann.compile(m, (x,), options=BF16)
    summ = precision_summary(cm.graph)
    assert "BatchNorm" not in summ and "Conv2D" not in summ and "MatMulV2" not in summ, summ
    assert summ["ConvBiasAct"] == {"bfloat16": 2} and summ["ConvAddAct"] == {"bfloat16": 1}
    assert summ["LinearAct"] == {"bfloat16": 2} and summ["MaxPool"] == {"bfloat16": 1}
    applied = {a["pass"] for a in cm.report.applied}
    assert {"fold_batchnorm", "fuse_conv_act", "fuse_conv_add_act", "fuse_linear_act"} <= applied
    assert all(n.meta.get("kernel") == "onednn_packed" for n in cm.graph.nodes if n.op == "LinearAct")


def test_activations_stay_bf16_between_low_ops():
    """The only casts are the input's (fp32 -> bf16) and the output's (bf16 -> fp32): no
    Cast reads a Cast, none sits between two ops that both run in bf16."""
    m, x = _net()
    cm = opencann.compile(m, (x,), options=BF16)
    casts = [n for n in cm.graph.nodes if n.op == "Cast"]
    assert not [c for c in casts if c.inputs[0].producer is not None
                and c.inputs[0].producer.op == "Cast"]
    assert [(c.inputs[0].desc.dtype.value, c.outputs[0].desc.dtype.value) for c in casts] == \
        [("float32", "bfloat16"), ("bfloat16", "float32")]
    assert cm.graph.outputs[0].producer.op == "Cast"


@needs_onednn_bf16
def test_a_call_reorders_no_weight_and_runs_native_bf16_kernels(capfd):
    """oneDNN's verbose log of a call after the first: bf16 convolutions and inner
    products on blocked (prepacked) weights, no reorder, no matmul on a plain weight."""
    m, x = _net()
    cm = opencann.compile(m, (x,), options=BF16)
    cm(x)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        cm(x)
    log = [ln for ln in capfd.readouterr().out.splitlines() if ",exec," in ln]
    convs = [ln for ln in log if ",convolution," in ln]
    ips = [ln for ln in log if ",inner_product," in ln]
    assert len(convs) == 3 and len(ips) == 2, "\n".join(log)
    assert all("src:bf16" in ln and "wei:bf16" in ln for ln in convs + ips), "\n".join(log)
    assert not [ln for ln in log if ",reorder," in ln or ",matmul," in ln], "\n".join(log)


def test_values_match_eager_fp32_within_bf16_rounding():
    m, x = _net()
    with torch.no_grad():
        ref = m(x)
    cm = opencann.compile(m, (x,), options=BF16)
    first = cm(x)
    second = cm(x)
    assert first.dtype == torch.float32 and first.shape == ref.shape
    assert _cosine(first, ref) >= 0.999
    assert torch.equal(first, second)
    assert first.data_ptr() != second.data_ptr()   # each call returns memory of its own
    first.add_(1)
    assert torch.equal(cm(x), second)


def test_nan_and_inf_land_where_eager_fp32_puts_them():
    """bf16 keeps fp32's exponent range: a NaN or ±inf input gives NaN / ±inf at eager
    fp32's positions (ReLU keeps NaN: it runs as eager's op after oneDNN's convolution)."""
    m, x = _net(features=True)
    x = x.clone()
    x[0, 0, 3, 3], x[0, 1, 12, 13], x[1, 2, 7, 12] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        ref = m(x)
    cm = opencann.compile(m, (x,), options=BF16)
    for _ in range(2):
        out = cm(x)
        for o, r in zip(out, ref):
            assert o.dtype == r.dtype == torch.float32
            for special in (torch.isnan, torch.isposinf, torch.isneginf):
                assert torch.equal(special(o), special(r)), special.__name__
    feat, fin = ref[0], ref[0].isfinite()
    assert feat.isnan().any() and fin.float().mean() > 0.25   # the specials stay local
    assert _cosine(out[0][fin], feat[fin]) >= 0.999


def test_a_value_beyond_bf16_range_becomes_inf_as_under_autocast():
    """A finite fp32 value above bf16's largest (3.39e38) rounds to inf when cast to bf16,
    as eager's autocast does: the documented difference from eager fp32."""
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(2, 4, 3, padding=1), torch.nn.ReLU()).eval()
    with torch.no_grad():
        m[0].weight.uniform_(1e-3, 2e-3)       # positive: a huge input stays huge
    x = torch.rand(2, 2, 8, 8)
    x[0, 0, 4, 4] = 3.4e38
    with torch.no_grad():
        ref = m(x)
        with torch.autocast("cpu", dtype=torch.bfloat16):
            ref_bf16 = m(x).float()
    out = opencann.compile(m, (x,), options=BF16)(x)
    assert ref.isfinite().all() and out.isposinf().any()
    assert torch.equal(out.isposinf(), ref_bf16.isposinf()) and not out.isnan().any()


def test_keep_fp32_on_a_fused_conv_keeps_the_fp32_kernel():
    """keep_fp32=["ConvBiasAct"] keeps every convolution in fp32 (its pre-fusion type
    Conv2D); the Linears stay bf16."""
    m, x = _net()
    cm = opencann.compile(m, (x,), options={**BF16, "keep_fp32": ["ConvBiasAct"]})
    summ = precision_summary(cm.graph)
    assert set(summ["ConvBiasAct"]) == {"float32"} and set(summ["LinearAct"]) == {"bfloat16"}
    assert get_op("ConvBiasAct").fused_from == ("Conv2D",)


@needs_onednn_bf16
def test_a_bf16_model_file_loads_with_the_same_kernels_and_bits(tmp_path):
    m, x = _net()
    cm = opencann.compile(m, (x,), options=BF16)
    path = str(tmp_path / "net_bf16.ocm")
    opencann.save(cm, path)
    loaded = opencann.load(path)
    assert torch.equal(loaded(x), cm(x))
    assert precision_summary(loaded.graph) == precision_summary(cm.graph)
    assert [n.meta.get("kernel") for n in loaded.graph.nodes if n.op == "LinearAct"] == \
        ["onednn_packed", "onednn_packed"]


class _NewGeluMlp(torch.nn.Module):
    """GPT-2's MLP: Linear, GELU spelled out with tanh and ``pow`` (transformers'
    NewGELUActivation), Linear."""

    def __init__(self):
        super().__init__()
        self.fc, self.proj = torch.nn.Linear(32, 128), torch.nn.Linear(128, 32)

    def forward(self, x):
        h = self.fc(x)
        h = 0.5 * h * (1.0 + torch.tanh(0.7978845608028654 * (h + 0.044715 * torch.pow(h, 3.0))))
        return self.proj(h)


def test_a_spelled_out_gelu_fuses_before_precision_and_runs_bf16():
    """The GELU formula holds ``pow`` (kept in fp32): recognised before ``precision``, it
    becomes the Linear's activation in bf16 instead of a chain split by Casts."""
    torch.manual_seed(0)
    m, x = _NewGeluMlp().eval(), torch.randn(4, 16, 32)
    x[0, 1, 2], x[1, 3, 4], x[2, 5, 6] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        ref = m(x)
    cm = opencann.compile(m, (x,), options=BF16)
    summ = precision_summary(cm.graph)
    assert summ["LinearAct"] == {"bfloat16": 2} and not {"Pow", "Tanh", "Mul"} & set(summ), summ
    assert [n.attrs["act"] for n in cm.graph.nodes if n.op == "LinearAct"] == ["gelu_tanh", "none"]
    assert sum(n.op == "Cast" for n in cm.graph.nodes) == 2
    out = cm(x)
    assert torch.equal(out.isnan(), ref.isnan()) and torch.equal(out.isinf(), ref.isinf())
    fin = ref.isfinite()
    assert fin.float().mean() > 0.5 and _cosine(out[fin], ref[fin]) >= 0.999


def test_bf16_without_onednn_runs_aten_kernels(monkeypatch):
    """Where oneDNN has no bf16 kernels, no GEMM or convolution binds one in bf16: the
    bf16 LinearActs race only ATen's addmm, and the model runs (values as eager's bf16)."""
    import opencann.ops.kernels.cpu as cpu
    monkeypatch.setattr(cpu, "onednn_bf16_available", lambda: False)
    assert not cpu._available("onednn_packed", 8, None, 4, torch.bfloat16)
    assert cpu._available("addmm", 8, None, 4, torch.bfloat16)
    m, x = _net()
    cm = opencann.compile(m, x, options=BF16)
    kernels = {n.meta.get("kernel") for n in cm.graph.nodes if n.op == "LinearAct"}
    assert kernels <= {"addmm", None}, kernels
    with torch.no_grad():
        ref = m(x)
    assert _cosine(cm(x), ref) > 0.999
