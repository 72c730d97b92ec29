"""Per-preset vnpu layout rules (issue 17): ND-direct matmuls on 910B (no TransData around
them), fp32 -> fp16 casts for the Cube on 910/310 (reported), results against eager."""
import pytest
import torch

import opencann
from opencann.devices.vnpu import ascend310, ascend910, ascend910b


class _Mlp(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = torch.nn.Linear(40, 48), torch.nn.Linear(48, 24)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


class _Cnn(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c1, self.c2 = torch.nn.Conv2d(3, 20, 3, padding=1), torch.nn.Conv2d(20, 8, 1)

    def forward(self, x):
        return self.c2(torch.relu(self.c1(x))) + 1.0


def _x(*shape, seed=1):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def _matmuls(cm):
    return [n for n in cm.graph.nodes if n.op in ("MatMul", "BatchMatMul", "MatMulV2")]


def test_capabilities():
    assert ascend910b.cube_nd_direct and "float32" in ascend910b.cube_dtypes
    assert not ascend910.cube_nd_direct and "float32" not in ascend910.cube_dtypes
    assert not ascend310.cube_nd_direct and "float32" not in ascend310.cube_dtypes
    # no fp32 Cube on 910/310: fp32 work runs at the fp16 rate after the cast; 910B: 1/4 of fp16
    assert ascend910.peak_cube_tflops(4) == ascend910.peak_cube_tflops(2)
    assert ascend910b.peak_cube_tflops(4) == pytest.approx(ascend910b.peak_cube_tflops(2) / 4)


def test_910b_matmul_is_nd_direct_without_transdata():
    torch.manual_seed(0)
    m, x = _Mlp().eval(), _x(5, 40)
    cm = opencann.compile(m, (x,), device="vnpu:ascend910b")
    assert _matmuls(cm) and all(n.outputs[0].desc.format.value == "ND" for n in _matmuls(cm))
    assert cm.graph.op_counts().get("TransData", 0) == 0
    with torch.no_grad():
        ref = m(x)
    out = cm(x)
    assert torch.allclose(out, ref, rtol=1e-5, atol=1e-5)
    assert torch.allclose(cm(x * 2), m(x * 2).detach(), rtol=1e-5, atol=1e-5)   # second call


def test_910_matmul_keeps_nz_and_casts_fp32_to_fp16():
    torch.manual_seed(0)
    m, x = _Mlp().eval(), _x(5, 40)
    cm = opencann.compile(m, (x,), device="vnpu:ascend910")
    mm = _matmuls(cm)
    assert mm and all(n.outputs[0].desc.format.value == "FRACTAL_NZ" for n in mm)
    assert all(n.outputs[0].desc.dtype.value == "float16" for n in mm)
    assert cm.graph.op_counts().get("TransData", 0) >= 2
    applied = [a for a in cm.report.applied if a["detail"] == "fp32 to fp16 for the Cube"]
    assert len(applied) == 2
    with torch.no_grad():
        ref = m(x)
    out = cm(x)
    assert out.dtype == torch.float32 and out.shape == ref.shape
    assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2)        # fp16 operands, fp32 accumulation
    assert not torch.equal(out, ref)                             # the cast really happened
    xn = x.clone()
    xn[0, 3] = float("nan")
    o2 = cm(xn)
    assert torch.isnan(o2[0]).all() and not torch.isnan(o2[1:]).any()


@pytest.mark.parametrize("preset", ["ascend310", "ascend910b"])
def test_conv_rules_per_preset(preset):
    torch.manual_seed(0)
    m, x = _Cnn().eval(), _x(2, 3, 9, 9)
    cm = opencann.compile(m, (x,), device=f"vnpu:{preset}")
    convs = [n for n in cm.graph.nodes if n.op == "Conv2D"]
    assert convs and all(n.outputs[0].desc.format.value == "NC1HWC0" for n in convs)
    casts = [n for n in cm.graph.nodes if n.op == "Cast"]
    reported = [a for a in cm.report.applied if a["detail"] == "fp32 to fp16 for the Cube"]
    with torch.no_grad():
        ref = m(x)
    out = cm(x)
    if preset == "ascend310":
        assert all(n.outputs[0].desc.dtype.value == "float16" for n in convs)
        assert casts   # one in, one out, none between the two convs' exact fp16 -> fp32 -> fp16
        assert len(reported) == len(convs) == 2                  # each cast Cube op is in the report
        assert torch.allclose(out, ref, rtol=2e-2, atol=2e-2)
    else:
        assert not casts and not reported
        assert torch.allclose(out, ref, rtol=1e-4, atol=1e-4)
    assert out.dtype == torch.float32


def test_cpu_compile_unchanged():
    torch.manual_seed(0)
    m, x = _Mlp().eval(), _x(5, 40)
    cm = opencann.compile(m, (x,))
    assert not any(n.op in ("Cast", "TransData") for n in cm.graph.nodes)
    with torch.no_grad():
        assert torch.allclose(cm(x), m(x), rtol=1e-6, atol=1e-6)
