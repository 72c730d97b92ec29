"""vnpu layout: grouped / depthwise Conv2D in NC1HWC0 x grouped FRACTAL_Z, and FRACTAL_NZ kept
through elementwise ops with a last-axis (bias [N]) broadcast operand; values against eager."""
import pytest
import torch

import opencann
from opencann.devices.vnpu import conv2d_cost, fz_groups, to_fractal_z, to_nc1hwc0
from opencann.devices.vnpu.kernels import conv2d_nc1hwc0
from opencann.devices.vnpu.formats import from_nc1hwc0
from opencann.ir import Format
from opencann.tools.estimate import estimate

# the vnpu's tolerances (tests/unit/test_vnpu_kernels.py TOL): fp32 1e-5, fp16 2e-2 of max|ref|
TOL = {torch.float32: 1e-5, torch.float16: 2e-2}


def _check(out, ref, dtype):
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.equal(torch.isnan(out), torch.isnan(ref))
    ok = ~torch.isnan(ref)
    err = (out[ok].double() - ref[ok].double()).abs().max()
    assert err <= TOL[dtype] * ref[ok].double().abs().max() + 1e-6, float(err)


def _is_conv(n):
    """A Conv2D, alone or with its epilogue (a CubeEpilogue of a Conv2D, vnpu_ub_epilogue)."""
    return n.op == "Conv2D" or (n.op == "CubeEpilogue" and n.attrs["cube"] == "Conv2D")


def _conv_node(cm):
    return next(n for n in cm.graph.nodes if _is_conv(n))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("groups,cin,cout", [(2, 8, 12), (4, 16, 32), (24, 24, 24), (3, 6, 6)])
def test_grouped_conv_nc1hwc0_matches_eager(groups, cin, cout, dtype):
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(cin, cout, 3, padding=1, stride=2 if groups == 4 else 1,
                                            groups=groups), torch.nn.ReLU()).to(dtype).eval()
    x = torch.randn(2, cin, 9, 9).to(dtype)
    x[0, 0, 1, 1] = float("nan")
    cm = opencann.compile(m, (x,), device="vnpu:ascend910b")
    conv = _conv_node(cm)
    assert conv.outputs[0].desc.format == Format.NC1HWC0
    w = conv.arg("weight")
    assert w.desc.format == Format.FRACTAL_Z
    e, cin_opt, cout_opt, blocks = fz_groups(cin // groups, cout // groups, groups, 16)
    assert tuple(w.desc.shape) == (blocks * cin_opt // 16 * 9, cout_opt // 16, 16, 16)
    kind = "depthwise" if cin == cout == groups else "grouped"
    assert any(a["detail"].startswith(f"{kind} conv (groups={groups}) on the Cube") for a in cm.report.applied)
    with torch.no_grad():
        ref = m(x)
        out = cm(x)
        _check(out, ref, dtype)
        x2 = torch.randn_like(x)
        out2 = cm(x2)
        _check(out2, m(x2), dtype)                   # second call, new values
    assert out.data_ptr() != out2.data_ptr()     # outputs are independent


def test_grouped_conv_kernel_direct_and_errors():
    torch.manual_seed(1)
    x, w = torch.randn(1, 12, 5, 5), torch.randn(12, 4, 3, 3)
    y = conv2d_nc1hwc0(to_nc1hwc0(x), to_fractal_z(w, groups=3), in_channels=12, out_channels=12,
                       kernel_size=3, padding=1, groups=3)
    torch.testing.assert_close(from_nc1hwc0(y, (1, 12, 5, 5)),
                               torch.nn.functional.conv2d(x, w, padding=1, groups=3), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="groups=5 must divide"):
        conv2d_nc1hwc0(to_nc1hwc0(x), to_fractal_z(w, groups=3), in_channels=12, out_channels=12,
                       kernel_size=3, groups=5)


def test_grouped_conv_cost_counts_block_diagonal_work():
    dw = conv2d_cost(1, 64, 56, 56, 64, 3, 1, 1, "float16", groups=64)
    dense = conv2d_cost(1, 64, 56, 56, 64, 3, 1, 1, "float16")
    assert dw.useful_flops == pytest.approx(dense.useful_flops / 64)
    assert dw.flops == pytest.approx(dw.useful_flops * 16)        # 16 channels per block, 1/16 useful
    assert dw.breakdown["fz_groups"] == {"e": 16, "cin_opt": 16, "cout_opt": 16, "blocks": 4}
    assert dw.time_us <= dense.time_us
    with pytest.raises(ValueError, match="groups=3 must divide"):
        conv2d_cost(1, 64, 8, 8, 64, 3, groups=3)


class _InvertedResidual(torch.nn.Module):
    """MobileNetV2 block: 1x1 expand, 3x3 depthwise, 1x1 project, residual."""

    def __init__(self, c=16, t=4):
        super().__init__()
        h = c * t
        self.body = torch.nn.Sequential(
            torch.nn.Conv2d(c, h, 1, bias=False), torch.nn.BatchNorm2d(h), torch.nn.ReLU6(),
            torch.nn.Conv2d(h, h, 3, padding=1, groups=h, bias=False), torch.nn.BatchNorm2d(h), torch.nn.ReLU6(),
            torch.nn.Conv2d(h, c, 1, bias=False), torch.nn.BatchNorm2d(c))

    def forward(self, x):
        return x + self.body(x)


@pytest.mark.parametrize("dtype,dev", [(torch.float32, "vnpu:ascend910b"), (torch.float16, "vnpu:ascend910b"),
                                       (torch.float32, "vnpu:ascend910")])
def test_mobilenet_block_end_to_end(dtype, dev):
    torch.manual_seed(0)
    m = torch.nn.Sequential(_InvertedResidual(), _InvertedResidual()).eval()
    for p in m.modules():
        if isinstance(p, torch.nn.BatchNorm2d):
            p.running_mean.uniform_(-0.5, 0.5)
            p.running_var.uniform_(0.5, 2.0)
    m = m.to(dtype)
    x = torch.randn(2, 16, 12, 12).to(dtype)
    cm = opencann.compile(m, (x,), device=dev)
    convs = [n for n in cm.graph.nodes if _is_conv(n)]
    assert len(convs) == 6 and all(n.outputs[0].desc.format == Format.NC1HWC0 for n in convs)
    # in once, out once: no ND island at the depthwise conv nor at the residual Add (on ascend910
    # the fp32 -> fp16 Cube cast of the block input runs in NC1HWC0 and shares its TransData)
    assert cm.graph.op_counts()["TransData"] == 2
    assert all(n.outputs[0].desc.format == Format.NC1HWC0 for n in cm.graph.nodes if n.op == "Add")
    with torch.no_grad():
        if dev == "vnpu:ascend910":        # fp32 Cube operands cast to fp16 (docs/guide/vnpu.md)
            ref = m(x)
            assert (cm(x) - ref).abs().max() <= 2e-2 * ref.abs().max()
        else:
            _check(cm(x), m(x), dtype)


class _MLP(torch.nn.Module):
    """x @ W1 + b1 -> GELU -> @ W2 + b2 (explicit bias adds); ``rows``: the first bias is
    [M, 1] (broadcast along rows, the near miss)."""

    def __init__(self, h=64, f=200, m=24, rows=False):
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(h, f, generator=g) / 8)
        self.b1 = torch.nn.Parameter(torch.randn(m, 1, generator=g) if rows else torch.randn(f, generator=g))
        self.w2 = torch.nn.Parameter(torch.randn(f, h, generator=g) / 8)
        self.b2 = torch.nn.Parameter(torch.randn(h, generator=g))

    def forward(self, x):
        return torch.nn.functional.gelu(x @ self.w1 + self.b1) @ self.w2 + self.b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_nz_kept_through_bias_add_and_gelu(dtype):
    m = _MLP().to(dtype).eval()
    x = torch.randn(24, 64).to(dtype)
    x[3, 5] = float("nan")
    cm = opencann.compile(m, (x,), device="vnpu:ascend910")
    assert cm.graph.op_counts()["TransData"] == 2     # was 4: NZ->ND->NZ around bias + GELU is gone
    for n in cm.graph.nodes:
        if n.op in ("Add", "Gelu"):
            assert n.outputs[0].desc.format == Format.FRACTAL_NZ
    assert not [s for s in cm.report.skipped if s["pass"] == "npu_layout"]
    with torch.no_grad():
        ref = m(x)
        tol = 2e-2        # ascend910: fp32 Cube operands are cast to fp16 (docs/guide/vnpu.md), fp16 tolerance
        out = cm(x)
        assert torch.equal(torch.isnan(out), torch.isnan(ref))
        ok = ~torch.isnan(ref)
        assert (out[ok].double() - ref[ok].double()).abs().max() <= tol * ref[ok].double().abs().max()
        x2 = torch.randn_like(x)
        out2 = cm(x2)
        r2 = m(x2)
        assert (out2.double() - r2.double()).abs().max() <= tol * r2.double().abs().max()
    assert out.data_ptr() != out2.data_ptr()


def test_row_broadcast_bias_keeps_transdata_with_reason():
    m = _MLP(rows=True).eval()
    x = torch.randn(24, 64)
    cm = opencann.compile(m, (x,), device="vnpu:ascend910")
    assert cm.graph.op_counts()["TransData"] == 4
    reasons = [s["reason"] for s in cm.report.skipped if s["pass"] == "npu_layout"]
    assert any("[24, 1] broadcasts to [24, 200] along an axis other than the last (N) one" in r for r in reasons)
    with torch.no_grad():
        ref = m(x)
        assert (cm(x) - ref).abs().max() <= 2e-2 * ref.abs().max()


def test_estimate_rows_have_no_transdata_between_the_matmuls():
    rep = estimate(_MLP().half().eval(), (torch.randn(24, 64).half(),), device="vnpu:ascend910")
    assert sum(r.op == "TransData" for r in rep.rows) == 2
    assert rep.total_time_us > 0


def test_grouped_conv_runtime_weight_gets_grouped_transdata():
    class M(torch.nn.Module):
        def forward(self, x, w):
            return torch.nn.functional.conv2d(x, w, padding=1, groups=4).sigmoid()

    x, w = torch.randn(2, 8, 7, 7), torch.randn(12, 2, 3, 3)
    cm = opencann.compile(M(), (x, w), device="vnpu:ascend910b")
    assert [n.attrs.get("groups") for n in cm.graph.nodes if n.op == "TransData"].count(4) == 1
    for args in ((x, w), (torch.randn_like(x), torch.randn_like(w))):
        _check(cm(*args), M()(*args), torch.float32)


@pytest.mark.parametrize("groups", [1, 4])
def test_conv_batch_zero_on_vnpu(groups):
    m = torch.nn.Conv2d(8, 12, 3, padding=1, groups=groups).eval()
    x = torch.randn(0, 8, 7, 7)
    cm = opencann.compile(m, (x,), device="vnpu:ascend910b")
    with torch.no_grad():
        out = cm(x)
        assert out.shape == m(x).shape == (0, 12, 7, 7)
