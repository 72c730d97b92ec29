"""The CPU layout stage (`opencann.passes.layout.cpu_layout`, ``layout_selection``):
NHWC activations between oneDNN convolutions, TransData NHWC→NCHW at views, at ops
without a channels-last kernel and at graph outputs. Every model is compared with eager
PyTorch (relative 1e-4, NaN/Inf positions included), called twice, its outputs must be
independent of the next call and laid out as eager's (a caller's ``.view`` works)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from opencann.ops.kernels import conv_choice

torch.manual_seed(0)


@pytest.fixture(autouse=True)
def onednn_convs(monkeypatch):
    """Every convolution here on oneDNN's channels-last kernel, however small: these tests
    check the NHWC machinery on small shapes; the size rule that keeps small convolutions
    on eager's NCHW kernel is tested in tests/unit/test_conv_choice.py."""
    monkeypatch.setattr(conv_choice, "MAX_ATEN_MACS_POINTWISE", 0)
    monkeypatch.setattr(conv_choice, "MAX_ATEN_MACS_BATCH1", 0)


def _compile(model, x, **options):
    return opencann.compile(model.eval(), (x,), options=options or None)


def _outs(r):
    return list(r) if isinstance(r, (tuple, list)) else [r]


def _check_same(got, ref):
    for g, r in zip(_outs(got), _outs(ref)):
        assert g.shape == r.shape and g.dtype == r.dtype
        assert g.stride() == r.stride(), f"strides {g.stride()} vs eager's {r.stride()}"
        scale = r[torch.isfinite(r)].abs().max().item() if torch.isfinite(r).any() else 1.0
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-4 * max(scale, 1e-6), equal_nan=True)
        assert torch.equal(torch.isnan(g), torch.isnan(r))
        assert torch.equal(torch.isposinf(g), torch.isposinf(r))


def _check_model(model, x, specials=True):
    """Compile, compare with eager (twice, and with NaN/Inf written into the input),
    check output independence and that ``.view`` works on every output; returns the
    compiled model."""
    model = model.eval()
    cm = _compile(model, x)
    with torch.no_grad():
        for inp in [x, torch.randn_like(x)]:
            got, ref = cm(inp), model(inp)
            _check_same(got, ref)
        first = [o.clone() for o in _outs(cm(x))]
        kept = _outs(cm(x))
        cm(torch.randn_like(x))            # a later call must not change earlier outputs
        for k, f, r in zip(kept, first, _outs(model(x))):
            torch.testing.assert_close(k, f, equal_nan=True)
            if r.is_contiguous():
                k.view(-1)                  # eager's layout: a caller's view works
        if specials:
            y = x.clone()
            y[0, 0, 1, 2] = float("nan")
            y[0, 1, 3, 3] = float("inf")
            y[-1, -1, -2, -1] = float("-inf")
            _check_same(cm(y), model(y))
    return cm


def _entries(cm, kind="applied"):
    return [e for e in getattr(cm.report, kind) if e["pass"] == "layout_selection"]


def _note(cm):
    return next(p.note for p in cm.report.passes if p.name == "layout_selection")


class SmallCNN(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, 1, 1)
        self.bn = nn.BatchNorm2d(16)
        self.c2 = nn.Conv2d(16, 16, 3, 1, 1)
        self.fc = nn.Linear(16 * 4 * 4, 10)

    def forward(self, x):
        y = F.max_pool2d(torch.relu(self.bn(self.c1(x))), 2)
        y = F.hardswish(self.c2(y)) + y          # unfused elementwise ops between convs
        y = F.avg_pool2d(y, 2)
        return self.fc(torch.flatten(y, 1))


class Bottleneck(nn.Module):
    def __init__(self, cin, mid, cout, stride):
        super().__init__()
        self.c1, self.b1 = nn.Conv2d(cin, mid, 1, bias=False), nn.BatchNorm2d(mid)
        self.c2, self.b2 = nn.Conv2d(mid, mid, 3, stride, 1, bias=False), nn.BatchNorm2d(mid)
        self.c3, self.b3 = nn.Conv2d(mid, cout, 1, bias=False), nn.BatchNorm2d(cout)
        self.down = None
        if stride != 1 or cin != cout:
            self.down = nn.Sequential(nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x):
        y = torch.relu(self.b1(self.c1(x)))
        y = torch.relu(self.b2(self.c2(y)))
        y = self.b3(self.c3(y))
        return torch.relu(y + (x if self.down is None else self.down(x)))


class ResNetish(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Sequential(nn.Conv2d(3, 16, 7, 2, 3, bias=False), nn.BatchNorm2d(16), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        self.blocks = nn.Sequential(Bottleneck(16, 8, 32, 1), Bottleneck(32, 8, 32, 1),
                                    Bottleneck(32, 16, 64, 2))
        self.fc = nn.Linear(64, 5)

    def forward(self, x):
        y = self.blocks(self.stem(x))
        return y, self.fc(torch.flatten(F.adaptive_avg_pool2d(y, 1), 1))


def _randomize_bn(model):
    for m in model.modules():
        if isinstance(m, nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    return model


def test_small_cnn_matches_eager_and_reports_regions():
    cm = _check_model(_randomize_bn(SmallCNN()), torch.randn(2, 3, 16, 16))
    regions = [e for e in _entries(cm) if e["detail"].startswith("NHWC for")]
    assert regions and "ConvBiasAct" in regions[0]["detail"]
    trans = [e for e in _entries(cm) if e["detail"].startswith("TransData NHWC→NCHW")]
    assert any("view of its input" in e["detail"] for e in trans), trans   # the flatten
    assert "NHWC (channels-last)" in _note(cm)
    # the values between the convolutions are planned channels-last
    strides = [n.meta["strides"][0] for n in cm.graph.nodes if n.op in ("Add", "Mul", "ClipByValue")
               and n.meta.get("strides")]
    assert strides and all(st[1] == 1 for st in strides), strides


def test_resnetish_residual_adds_and_intermediate_output():
    # the first output IS a channels-last intermediate (the last block's result)
    cm = _check_model(_randomize_bn(ResNetish()), torch.randn(2, 3, 32, 32))
    assert any("graph output" in e["detail"] for e in _entries(cm))
    skipped = _entries(cm, "skipped")
    assert any("stays NCHW" in e["reason"] for e in skipped)
    assert any(n.op == "ConvAddAct" for n in cm.graph.nodes)


class Grouped(nn.Module):
    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 16, 3, 1, 1)
        self.dw = nn.Conv2d(16, 16, 3, 1, 1, groups=16)
        self.g = nn.Conv2d(16, 32, 3, 2, 1, groups=4)
        self.pw = nn.Conv2d(32, 32, 1)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        y = y * torch.sigmoid(self.dw(y))        # SE-like gate, elementwise on NHWC
        y = F.silu(self.g(y))
        return self.pw(y) + y


def test_grouped_and_depthwise_convs():
    cm = _check_model(Grouped(), torch.randn(2, 3, 12, 12))
    assert _entries(cm)


class Boundary(nn.Module):
    """A convolution followed by ops with no channels-last kernel (softmax over
    channels) and a view (permute): TransData at each."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(4, 8, 3, 1, 1)
        self.c2 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = torch.relu(self.c(x))
        s = torch.softmax(self.c2(y), dim=1)
        return s + 1, y.permute(0, 2, 3, 1) * 2


def test_transdata_at_ops_without_a_channels_last_kernel():
    cm = _check_model(Boundary(), torch.randn(2, 4, 6, 6))
    details = [e["detail"] for e in _entries(cm)]
    assert any("no channels-last kernel" in d for d in details), details
    assert any("view of its input" in d for d in details), details
    assert sum(1 for n in cm.graph.nodes if n.op == "TransData") >= 2


def test_switched_off_keeps_nchw():
    model, x = _randomize_bn(SmallCNN()).eval(), torch.randn(2, 3, 16, 16)
    cm = _compile(model, x, disable=["layout_selection"])
    assert not any(n.op == "TransData" for n in cm.graph.nodes)
    with torch.no_grad():
        _check_same(cm(x), model(x))


def test_no_convolution_no_change():
    class Plain(nn.Module):
        def forward(self, x):
            return torch.relu(x) * 2

    cm = _compile(Plain(), torch.randn(2, 3, 4, 4))
    assert _note(cm).startswith("cpu keeps ND/NCHW")
    assert not any(n.op == "TransData" for n in cm.graph.nodes)


@pytest.mark.parametrize("batch", [1, 3])
def test_model_file_round_trip(tmp_path, batch):
    model, x = Grouped().eval(), torch.randn(batch, 3, 8, 8)
    cm = _compile(model, x)
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    loaded = opencann.load(path)
    with torch.no_grad():
        _check_same(loaded(x), model(x))


class MixedInPlace(nn.Module):
    """An NCHW intermediate (``z``) dies at an Add whose result is NHWC: the memory plan
    must not write that result in place over ``z`` (other element order)."""

    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(8, 8, 3, 1, 1)
        self.c2 = nn.Conv2d(8, 8, 1)

    def forward(self, x):
        z = torch.sigmoid(x)
        y = torch.relu(self.c(x)) + z
        return self.c2(y).sum(dim=(2, 3))


def test_no_in_place_reuse_across_layouts():
    cm = _check_model(MixedInPlace(), torch.randn(2, 8, 5, 7))
    adds = [n for n in cm.graph.nodes if n.op == "Add" and n.meta.get("strides")
            and n.meta["strides"][0][1] == 1]
    assert adds, "the residual Add runs NHWC"
    assert not any(name == adds[0].name for name, _ in cm.plan.inplace)


class UserChannelsLast(nn.Module):
    """A model that asks for channels-last itself: eager's own result is NHWC, so no
    TransData is needed, and the output keeps eager's channels-last strides."""

    def __init__(self):
        super().__init__()
        self.c, self.c2 = nn.Conv2d(4, 8, 3, 1, 1), nn.Conv2d(8, 8, 3, 1, 1)

    def forward(self, x):
        y = torch.relu(self.c(x)).contiguous(memory_format=torch.channels_last)
        return self.c2(y) + y


def test_model_already_channels_last_needs_no_transdata():
    model, x = UserChannelsLast().eval(), torch.randn(2, 4, 6, 6)
    cm = _check_model(model, x)
    with torch.no_grad():
        assert model(x).is_contiguous(memory_format=torch.channels_last)
    assert not any(n.op == "TransData" for n in cm.graph.nodes)


class Concats(nn.Module):
    """cat of NHWC convolution outputs with an NCHW graph input along C, H and W, then a
    pool, a view and the concatenations themselves returned (Inception's join)."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(4, 6, 1)

    def forward(self, x):
        u, v = self.a(x), self.b(x)
        c = torch.cat([u, v, x], 1)
        h = torch.cat([u, u.relu()], 2)
        w = torch.cat([u, v[:, :4].repeat(1, 2, 1, 1)], 3)
        return F.max_pool2d(c, 3, 1, 1), h.flatten(1), w, c


@pytest.mark.parametrize("batch", [1, 2])
def test_concat_keeps_nhwc(batch):
    """ConcatD writes into its NHWC planned buffer (an .out kernel keeps the buffer's
    strides), so the pool after Inception's join reads NHWC; values and strides as eager's."""
    cm = _check_model(Concats(), torch.randn(batch, 4, 7, 9))
    regions = " ".join(e["detail"] for e in _entries(cm) if "NHWC for" in e["detail"])
    assert "ConcatD" in regions and "MaxPool" in regions
