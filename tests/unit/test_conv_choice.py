"""The size rule choosing a CPU convolution's kernel and layout
(`opencann.ops.kernels.conv_choice`, applied by ``layout_selection``): a small
convolution stays NCHW on eager's kernel with its reason in the compile report; a
ResNet-sized one goes NHWC on oneDNN's. Values against eager with NaN/±inf planted,
a second call, output independence, and a model file round trip."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from opencann.devices.cpu import onednn_bf16_available
from helpers import save_and_load
from opencann.ops.kernels.conv_choice import choose_for_shape

torch.manual_seed(0)


class TwoConv(nn.Module):
    """bench/guards.py's CNN: conv 3->8, relu, conv 8->8 (3x3, padding 1)."""

    def __init__(self, cin=3):
        super().__init__()
        self.c1 = nn.Conv2d(cin, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


class Residual(nn.Module):
    """Small conv + residual add + relu (a ConvAddAct on eager's kernel)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = torch.relu(self.c1(x))
        return torch.relu(self.c2(y) + y)


class SmallAndBig(nn.Module):
    """A 1x1 conv 3->8 on 64x64 (0.1 M multiply-adds: eager's kernel, NCHW), a 3x3 conv
    8->64 (18.9 M: oneDNN, NHWC), then a 1x1 conv 64->8 (2.1 M, but its input is already
    NHWC: it stays on oneDNN inside the region)."""

    def __init__(self):
        super().__init__()
        self.small = nn.Conv2d(3, 8, 1)
        self.big = nn.Conv2d(8, 64, 3, padding=1)
        self.inner = nn.Conv2d(64, 8, 1)

    def forward(self, x):
        return self.inner(torch.relu(self.big(torch.relu(self.small(x)))))


class ResNetSized(nn.Module):
    """Two of ResNet-50's layer-1 3x3 convolutions (64->64 at 56x56, 116 M multiply-adds)."""

    def __init__(self):
        super().__init__()
        self.c1 = nn.Conv2d(64, 64, 3, padding=1)
        self.c2 = nn.Conv2d(64, 64, 3, padding=1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x)))


def _layout_entries(cm, kind):
    return [e for e in getattr(cm.report, kind) if e["pass"] == "layout_selection"]


def _convs(cm):
    return [n for n in cm.graph.nodes if n.op in ("ConvBiasAct", "ConvAddAct")]


def _check_values(model, x):
    """Compiled vs eager: same values bit for bit where eager's kernel runs (else 1e-4),
    NaN/±inf positions equal, twice, with specials planted, and the first output left
    unchanged by a later call. Returns the compiled model."""
    model = model.eval()
    cm = opencann.compile(model, (x,))
    y = x.clone()
    y[0, 0, 1, 2], y[0, 1, 3, 3], y[0, -1, -2, -1] = float("nan"), float("inf"), float("-inf")
    with torch.no_grad():
        exact = all(n.meta.get("kernel") == "aten" for n in _convs(cm))
        tol = dict(rtol=0, atol=0) if exact else dict(rtol=1e-4, atol=1e-4)
        for inp in (x, torch.randn_like(x), y, y):
            got, ref = cm(inp), model(inp)
            assert got.stride() == ref.stride()
            torch.testing.assert_close(got, ref, equal_nan=True, **tol)
            assert torch.equal(torch.isnan(got), torch.isnan(ref))
            assert torch.equal(torch.isposinf(got), torch.isposinf(ref))
            assert torch.equal(torch.isneginf(got), torch.isneginf(ref))
        kept = cm(x)
        first = kept.clone()
        cm(torch.randn_like(x))
        torch.testing.assert_close(kept, first, rtol=0, atol=0)
    return cm


def test_rule_golden():
    kernel, why = choose_for_shape(1, 3, 8, 3, 3, 32, 32, 1)   # the CNN's first conv
    assert kernel == "aten"
    assert why == ("a batch-1 3x3 convolution of 0.22 M multiply-adds (< 1 M) runs faster on "
                   "eager's NCHW kernel than on oneDNN's channels-last one on this CPU "
                   "(measured: bench/cpu_layout.py sizes)")
    assert choose_for_shape(1, 64, 8, 1, 1, 64, 64, 1)[0] == "aten"     # 1x1, 2.1 M
    # ResNet-50 at batch 1, 224x224: its smallest convolutions stay on oneDNN
    assert choose_for_shape(1, 64, 64, 1, 1, 56, 56, 1) == ("onednn", "")   # 12.8 M, 1x1
    assert choose_for_shape(1, 64, 64, 3, 3, 56, 56, 1) == ("onednn", "")
    assert choose_for_shape(1, 512, 512, 3, 3, 7, 7, 1) == ("onednn", "")
    assert choose_for_shape(1, 3, 64, 7, 7, 112, 112, 1) == ("onednn", "")  # the stem
    # batch > 1 with a 3x3 kernel: oneDNN's NHWC measured faster at every size
    assert choose_for_shape(8, 3, 8, 3, 3, 8, 8, 1) == ("onednn", "")
    # grouped / depthwise: not measured, oneDNN as before
    assert choose_for_shape(1, 8, 8, 3, 3, 8, 8, 8) == ("onednn", "")


def test_tiny_cnn_stays_nchw_with_reason():
    cm = _check_values(TwoConv(), torch.randn(1, 3, 32, 32))
    convs = _convs(cm)
    assert len(convs) == 2 and all(n.meta["kernel"] == "aten" for n in convs)
    assert not any(n.op == "TransData" for n in cm.graph.nodes)
    assert not _layout_entries(cm, "applied")
    skips = [e for e in _layout_entries(cm, "skipped") if e["detail"] == "NHWC"]
    assert len(skips) == 2
    assert all("stays NCHW on eager's convolution kernel: a batch-1 3x3 convolution" in e["reason"]
               for e in skips), skips
    note = next(p.note for p in cm.report.passes if p.name == "layout_selection")
    assert note.startswith("cpu keeps ND/NCHW: 2 convolution(s) too small")


def test_tiny_residual_on_eagers_kernel():
    cm = _check_values(Residual(), torch.randn(1, 3, 16, 16))
    assert any(n.op == "ConvAddAct" and n.meta["kernel"] == "aten" for n in cm.graph.nodes)


def test_small_conv_on_nchw_input_only():
    cm = _check_values(SmallAndBig(), torch.randn(1, 3, 64, 64))
    small, big, inner = _convs(cm)
    assert small.meta["kernel"] == "aten"
    assert "kernel" not in big.meta and "kernel" not in inner.meta
    details = [e["detail"] for e in _layout_entries(cm, "applied")]
    assert any(d.startswith("NHWC for") and "ConvBiasAct" in d for d in details), details
    skips = [e["reason"] for e in _layout_entries(cm, "skipped") if e["detail"] == "NHWC"]
    assert len(skips) == 1 and "a 1x1 convolution of 0.10 M" in skips[0], skips


def test_small_conv_inside_a_region_stays_onednn():
    # a max-pool between a big and a small conv keeps NHWC: the small conv reads it there
    cm = _check_values(nn.Sequential(nn.Conv2d(3, 64, 3, padding=1), nn.MaxPool2d(2),
                                     nn.Conv2d(64, 8, 1)), torch.randn(1, 3, 32, 32))
    assert all("kernel" not in n.meta for n in _convs(cm))
    assert not [e for e in _layout_entries(cm, "skipped") if e["detail"] == "NHWC"]


def test_resnet_sized_conv_goes_nhwc():
    cm = _check_values(ResNetSized(), torch.randn(1, 64, 56, 56))
    assert all("kernel" not in n.meta for n in _convs(cm))
    details = [e["detail"] for e in _layout_entries(cm, "applied")]
    assert any(d.startswith("NHWC for 2 nodes") for d in details), details
    assert not [e for e in _layout_entries(cm, "skipped") if e["detail"] == "NHWC"]


def test_model_file_keeps_the_choice(tmp_path):
    model, x = TwoConv().eval(), torch.randn(1, 3, 32, 32)
    cm = opencann.compile(model, (x,))
    loaded, _ = save_and_load(cm, tmp_path)
    assert [n.meta.get("kernel") for n in _convs(loaded)] == ["aten", "aten"]
    with torch.no_grad():
        torch.testing.assert_close(loaded(x), model(x), rtol=0, atol=0)


@pytest.mark.skipif(not onednn_bf16_available(), reason="no oneDNN bf16 kernels on this CPU (AVX2 only): "
                    "bf16 convolutions run ATen's")
def test_the_size_rule_is_fp32s_a_bf16_conv_keeps_onednn(capfd):
    """In bf16 eager's NCHW convolution reorders its plain weight on every call; the tiny
    CNN kept on eager's kernel in fp32 runs oneDNN's prepacked bf16 convolutions, NHWC,
    and a call reorders no weight (4 input channels: an odd count keeps the first fp32 in
    bf16, test_bf16_conv_specials)."""
    model, x = TwoConv(cin=4).eval(), torch.randn(1, 4, 32, 32)
    cm = opencann.compile(model, (x,), options={"precision_mode": "allow_mix_precision_bf16"})
    convs = _convs(cm)
    assert len(convs) == 2 and all(n.meta.get("kernel") != "aten" for n in convs)
    assert all(n.outputs[0].desc.dtype.value == "bfloat16" for n in convs)
    with torch.no_grad():
        ref = model(x)
    cm(x)
    capfd.readouterr()
    with torch.backends.mkldnn.verbose(torch.backends.mkldnn.VERBOSE_ON):
        got = cm(x)
    log = [ln for ln in capfd.readouterr().out.splitlines() if ",exec," in ln]
    assert sum(",convolution," in ln for ln in log) == 2 and not any(",reorder," in ln for ln in log)
    a, b = got.double().flatten(), ref.double().flatten()
    assert got.dtype == torch.float32 and (a @ b / (a.norm() * b.norm())).item() >= 0.999
