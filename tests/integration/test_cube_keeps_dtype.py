"""``precision_mode`` ``must_keep_origin_dtype`` / ``force_fp32`` on a vnpu preset whose
Cube unit has no fp32 (ascend910, ascend310) fail the compile naming the op, its source,
the mode, the preset and the fix, as CANN does, instead of computing convolutions and
matmuls in fp16 (#26 item 4); on a preset with an fp32 Cube (ascend910b), and with the
modes that allow fp16, they compile and match eager."""
import pytest
import torch

import opencann
from opencann.passes.layout.npu_layout import CubeDtypeError


class ConvLinear(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(3, 4, 3)
        self.fc = torch.nn.Linear(4 * 6 * 6, 5)

    def forward(self, x):
        return self.fc(self.conv(x).flatten(1))


class MatmulOnly(torch.nn.Module):
    def forward(self, a, b):
        return a @ b


def _conv():
    torch.manual_seed(0)
    return ConvLinear().eval(), (torch.randn(2, 3, 8, 8),)


def _mm():
    torch.manual_seed(0)
    return MatmulOnly(), (torch.randn(2, 4, 8), torch.randn(2, 8, 3))


@pytest.mark.parametrize("make,op", [(_conv, "Conv2D"), (_mm, "BatchMatMul")])
@pytest.mark.parametrize("preset", ["ascend910", "ascend310"])
@pytest.mark.parametrize("mode", ["must_keep_origin_dtype", "force_fp32"])
def test_no_fp32_cube_refuses_modes_that_keep_fp32(make, op, preset, mode):
    model, args = make()
    with pytest.raises(CubeDtypeError) as e:
        opencann.compile(model, args, device=f"vnpu:{preset}", options={"precision_mode": mode})
    msg = str(e.value)
    assert "\n" not in msg
    for part in (op, "test_cube_keeps_dtype.py:", repr(mode), repr(preset), "allow_fp32_to_fp16",
                 "vnpu:ascend910b"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("make", [_conv, _mm])
@pytest.mark.parametrize("device,mode,tol", [
    ("vnpu:ascend910b", "must_keep_origin_dtype", 1e-5), ("vnpu:ascend910b", "force_fp32", 1e-5),
    ("vnpu:ascend910", "allow_fp32_to_fp16", 5e-3), ("vnpu:ascend310", None, 5e-3)])
def test_cube_modes_that_can_hold_compile_and_match_eager(make, device, mode, tol):
    model, args = make()
    ref = model(*args)
    cm = opencann.compile(model, args, device=device,
                          options={"precision_mode": mode} if mode else {})
    for _ in range(2):
        out = cm(*args)
        assert out.dtype == ref.dtype
        assert ((out - ref).abs().max() / ref.abs().max()).item() < tol


@pytest.mark.parametrize("make,op", [(_conv, "Conv2D"), (_mm, "BatchMatMul")])
@pytest.mark.parametrize("preset", ["ascend910", "ascend310"])
def test_no_bf16_cube_refuses_bf16(make, op, preset):
    """allow_mix_precision_bf16, or a bf16 model, on a Cube without bf16 (Ascend 910/310:
    fp16 and int8) fails naming the op, the preset and the fix, instead of running a bf16
    kernel the chip does not have; ascend910b takes bf16 and matches eager's bf16 range."""
    model, args = make()
    with pytest.raises(CubeDtypeError) as e:
        opencann.compile(model, args, device=f"vnpu:{preset}",
                         options={"precision_mode": "allow_mix_precision_bf16"})
    msg = str(e.value)
    assert "\n" not in msg
    for part in (op, "bfloat16 operands", "'allow_mix_precision_bf16'", repr(preset),
                 "'allow_mix_precision' (fp16)", "vnpu:ascend910b"):
        assert part in msg, (part, msg)
    with pytest.raises(CubeDtypeError, match=r"bfloat16 operands, but the Cube unit"):
        opencann.compile(model.to(torch.bfloat16), tuple(a.bfloat16() for a in args),
                         device=f"vnpu:{preset}")
    model, args = make()
    ref = model(*args)
    cm = opencann.compile(model, args, device="vnpu:ascend910b",
                          options={"precision_mode": "allow_mix_precision_bf16"})
    out = cm(*args)
    assert ((out - ref).abs().max() / ref.abs().max()).item() < 2e-2
