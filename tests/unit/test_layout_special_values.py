"""Rewrites that change the layout or the kernel an elementwise op runs at keep eager's
result, which is eager's kernel at eager's layout (`opencann.ops.parity.layout_probe`,
`opencann.ops.parity.layout_node`): on AVX-512, ATen's exact GELU gives NaN for +inf on a
contiguous tensor (oneDNN, pytorch/pytorch#185770) and +inf on a channels-last one, so
the CPU layout stage must not move it to NHWC, the executor must not hand it oneDNN's
channels-last convolution output, and `fuse_conv_act` must not fuse it as a oneDNN
post-op where eager's conv output is channels-last. Checked against eager on THIS CPU
(NaN, ±inf, ±1.7e38 at the head, body and tail; fp32 and bf16; a second call)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from opencann.ops.parity.layout_probe import LAYOUTS, Operand, at_layout, layout_differs, probe_tensor
import opencann.ops.parity.layout_node as layout_values
import opencann.passes.fusion.conv_add_act as conv_add_act
from opencann.ops.kernels import conv_choice

torch.manual_seed(0)
aten = torch.ops.aten


@pytest.fixture(autouse=True)
def onednn_convs(monkeypatch):
    """Every convolution here on oneDNN's channels-last kernel, however small: these tests
    check the NHWC machinery on small shapes; the size rule that keeps small convolutions
    on eager's NCHW kernel is tested in tests/unit/test_conv_choice.py."""
    monkeypatch.setattr(conv_choice, "MAX_ATEN_MACS_POINTWISE", 0)
    monkeypatch.setattr(conv_choice, "MAX_ATEN_MACS_BATCH1", 0)


class ConvGelu(nn.Module):
    """conv → GELU (a `fuse_conv_act` candidate), conv → mul → GELU → conv (a GELU
    inside an NHWC region) and a conv read by GELU and ReLU (not fused: GELU reads the
    oneDNN convolution's own output); the identity depthwise convs carry NaN/±inf/1.7e38
    to GELU."""

    def __init__(self, c=16):
        super().__init__()
        self.id1 = nn.Conv2d(c, c, 1, groups=c, bias=False)
        self.id2 = nn.Conv2d(c, c, 1, groups=c, bias=False)
        self.id3 = nn.Conv2d(c, c, 1, groups=c, bias=False)
        for m in (self.id1, self.id2, self.id3):
            m.weight.data.fill_(1.0)
        self.c2 = nn.Conv2d(c, c, 3, padding=1)

    def forward(self, x):
        g = F.gelu(self.id2(x) * 1.0)
        h = self.id3(x)
        return F.gelu(self.id1(x)), g, self.c2(g), F.gelu(h), torch.relu(h)


def _specials(x: torch.Tensor, shift: int) -> torch.Tensor:
    """``x`` with NaN, ±inf, ±1.7e38 at the head, body and tail of its memory order."""
    y = x.clone()
    flat = y.permute(0, 2, 3, 1) if y.is_contiguous(memory_format=torch.channels_last) \
        and not y.is_contiguous() else y
    flat = flat.reshape(-1) if flat.is_contiguous() else None
    vals = [float("nan"), float("inf"), -float("inf"), 1.7e38, -1.7e38]
    n = y.numel()
    at = [0, 1, 2, 3, 4, n // 2 - 2, n // 2, n // 2 + 3, n - 5, n - 3, n - 1]
    view = flat if flat is not None else y.view(-1)
    for k, i in enumerate(at):
        view[(i + shift) % n] = vals[(k + shift) % len(vals)]
    return y


def _same(got, ref, dtype):
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for g, r in zip(got, ref):
        assert g.dtype == r.dtype and g.shape == r.shape
        assert torch.equal(g.isnan(), r.isnan()), "NaN positions differ from eager's"
        assert torch.equal(g.isposinf(), r.isposinf()) and torch.equal(g.isneginf(), r.isneginf())
        fin = torch.isfinite(r)
        torch.testing.assert_close(g[fin].float(), r[fin].float(), rtol=tol,
                                   atol=tol * max(1.0, r[fin].float().abs().max().item()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("layout", ["contiguous", "channels_last"])
@pytest.mark.parametrize("stage", [True, False])
def test_conv_gelu_matches_eager_special_values(dtype, layout, stage):
    model = ConvGelu().eval().to(dtype)
    x = torch.randn(2, 16, 6, 7, dtype=dtype)
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
    opts = None if stage else {"disable": ["layout_selection"]}
    cm = opencann.compile(model, (x,), options=opts)
    with torch.no_grad():
        for shift in (0, 3):                      # a second call, other places
            y = _specials(torch.randn_like(x), shift)
            _same(cm(y), model(y), dtype)


def _entries(cm, kind):
    return [e for e in getattr(cm.report, kind)]


def test_fuse_conv_act_keeps_eager_gelu_where_the_post_op_differs():
    """On a channels-last input eager's conv output is channels-last and eager's GELU runs
    ATen's channels-last loop; the oneDNN post-op is fused only where it gives the same."""
    model = ConvGelu().eval()
    x = torch.randn(2, 16, 6, 7).contiguous(memory_format=torch.channels_last)
    cm = opencann.compile(model, (x,))
    from opencann.ops.parity import conv_post_op_differs
    why = conv_post_op_differs("gelu", torch.float32, "channels_last")
    fused = [n for n in cm.graph.nodes if n.op == "ConvBiasAct" and n.attrs["act"] == "gelu"]
    if why:
        assert not fused
        reasons = [e["reason"] for e in _entries(cm, "skipped") if e["pass"] == "fuse_conv_act"]
        assert any("eager's layout" in r and "gelu" in r for r in reasons), reasons
    else:
        assert fused


class ConvMulSigmoid(nn.Module):
    """conv → mul → sigmoid → conv → relu → mul → conv: both activations between
    convolutions, not fused into them."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Conv2d(4, 8, 3, padding=1), nn.Conv2d(8, 8, 1), nn.Conv2d(8, 8, 1)

    def forward(self, x):
        y = self.b(torch.sigmoid(self.a(x) * 2.0))
        return self.c(torch.relu(y * 0.5))


def test_simulated_layout_dependent_kernel_stays_at_eagers_layout(monkeypatch):
    real = layout_differs

    def fake(overload, args, kwargs=(), layouts=None):
        if overload == aten.sigmoid.default:
            return "simulated: sigmoid differs at channels-last"
        return real(overload, args, kwargs, layouts)
    monkeypatch.setattr(layout_values, "layout_differs", fake)
    model, x = ConvMulSigmoid().eval(), torch.randn(2, 4, 6, 6)
    cm = opencann.compile(model, (x,))
    sig = next(n for n in cm.graph.nodes if n.op == "Sigmoid")
    assert sig.inputs[0].producer.op == "TransData"
    st = sig.meta.get("strides", [None])[0]
    assert st is None or st[-1] == 1, st               # eager's (NCHW) layout
    details = [e["detail"] for e in cm.report.applied if e["pass"] == "layout_selection"]
    assert any("simulated: sigmoid differs" in d and "eager's layout" in d for d in details), details
    relu = next(n for n in cm.graph.nodes if n.op == "Relu")   # layout-independent: still NHWC
    assert relu.meta["strides"][0][1] == 1
    assert relu.inputs[0].producer.op != "TransData"
    with torch.no_grad():
        for shift in (0, 2):
            y = _specials(torch.randn_like(x), shift)
            _same([cm(y)], [model(y)], torch.float32)


def test_simulated_conv_sum_difference_is_skipped(monkeypatch):
    monkeypatch.setattr(conv_add_act, "conv_sum_differs", lambda *a: "simulated sum difference")

    class Res(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Conv2d(8, 8, 3, padding=1), nn.Conv2d(8, 8, 1)

        def forward(self, x):
            y = torch.relu(self.a(x))
            return torch.relu(self.b(y) + y)
    model, x = Res().eval(), torch.randn(2, 8, 5, 5)
    cm = opencann.compile(model, (x,))
    assert not any(n.op == "ConvAddAct" for n in cm.graph.nodes)
    reasons = [e["reason"] for e in cm.report.skipped if e["pass"] == "fuse_conv_add_act"]
    assert any("simulated sum difference" in r for r in reasons), reasons
    with torch.no_grad():
        _same([cm(x)], [model(x)], torch.float32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_probe_agrees_with_atens_gelu_on_this_cpu(dtype):
    """The probe's answer is what ATen's GELU does here at the two layouts."""
    x = probe_tensor(dtype, (2, 20, 5, 5))
    a = F.gelu(x)
    b = F.gelu(at_layout(x, "channels_last")).contiguous()
    differs = not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.isinf(), b.isinf())
    why = layout_differs(aten.gelu.default, (Operand(dtype),), ())
    if differs:
        assert why and "channels_last" in why
    assert layout_differs(aten.relu.default, (Operand(dtype),), ()) is None
    assert layout_differs(aten.add.Tensor, (Operand(dtype), Operand(dtype, (1, 20, 1, 1))), ()) is None
    assert set(LAYOUTS) == {"contiguous", "channels_last", "strided"}


def test_model_file_refused_where_a_moved_kernel_is_layout_dependent(tmp_path, monkeypatch):
    """Compiled where Sigmoid is layout-independent (moved to NHWC), loaded where it is
    not: refused in one line naming the node; loaded where it is: same values."""
    model, x = ConvMulSigmoid().eval(), torch.randn(2, 4, 6, 6)
    cm = opencann.compile(model, (x,))
    path = str(tmp_path / "m.ocm")
    opencann.save(cm, path)
    with torch.no_grad():
        _same([opencann.load(path)(x)], [model(x)], torch.float32)
    real = layout_differs
    monkeypatch.setattr(layout_values, "layout_differs", lambda ov, a, k=(), lays=None: (
        "simulated sigmoid difference" if ov == aten.sigmoid.default else real(ov, a, k, lays)))
    with pytest.raises(opencann.ModelFileError, match="simulated sigmoid difference.*recompile"):
        opencann.load(path)


class ConvMean(nn.Module):
    """conv → global mean over H·W (ResNet's pool) and an H/W sum: ATen's sum over a
    plane of 1.7e38/3e38 overflows in one layout's order and not in another's."""

    def __init__(self, c=32):
        super().__init__()
        self.id = nn.Conv2d(c, c, 1, groups=c, bias=False)
        self.id.weight.data.fill_(1.0)

    def forward(self, x):
        y = self.id(x)
        return F.adaptive_avg_pool2d(y, 1), y.sum((2, 3)), F.max_pool2d(y, 3, 2, 1)


@pytest.mark.parametrize("hw", [(7, 7), (9, 11)])
def test_reductions_keep_eagers_overflow(hw):
    """On this AVX-512 CPU a [9, 11] plane of columns of ±1.7e38 sums to -inf contiguous
    and stays finite channels-last: the pool and the sums stay at eager's layout there."""
    model = ConvMean().eval()
    x = torch.randn(2, 32, *hw)
    cm = opencann.compile(model, (x,))
    with torch.no_grad():
        for plane in (3, 17):                     # a second call, another plane
            y = _specials(torch.randn_like(x), plane)
            y[1, plane] = -1.7e38
            y[0, plane + 1] = 3e38
            y[0, plane + 2] = -1.7e38
            y[0, plane + 2, ..., ::2] = 1.7e38    # columns of ±1.7e38: cancels in one order
            _same(cm(y), model(y), torch.float32)
