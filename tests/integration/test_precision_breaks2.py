"""Break sweep of the reduced-precision entries, second round: faults found by a new user
and the rules now in place (values compared against eager PyTorch on random inputs).

- ``opencann.quantize`` refused ``precision_mode="allow_fp32_to_fp16"`` on the cpu as a mode
  that "lowers layers to fp16/bf16", though on the cpu it lowers nothing (every op has an
  fp32 kernel). Rule: the modes that keep fp32 on the device quantize from fp32.
- ``opencann.tune`` with an int8 candidate gave int8 to a node whose layer calibration
  left without a record (every calibration batch NaN at its input); the ``quantize_int8``
  pass then left it in fp32, skipping the bf16 its own error allowed. Rule: such a node
  fails int8's verdict (``applies``) and takes the next candidate."""
from __future__ import annotations

import pytest
import torch

import opencann
from opencann.tools.quantize import quant_report


def _cos(a: torch.Tensor, b: torch.Tensor) -> float:
    return torch.nn.functional.cosine_similarity(a.flatten().double(), b.flatten().double(), 0).item()


class ConvNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.c = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.fc = torch.nn.Linear(8, 16)
        self.fc2 = torch.nn.Linear(16, 5)

    def forward(self, x):
        y = torch.relu(self.c(x))
        return self.fc2(torch.relu(self.fc(y.mean((2, 3)))))


def _model():
    torch.manual_seed(0)
    return ConvNet().eval()


@pytest.mark.parametrize("mode", ["allow_fp32_to_fp16", "force_fp32", "must_keep_origin_dtype"])
def test_quantize_takes_the_modes_that_keep_fp32_on_the_cpu(mode):
    m = _model()
    g = torch.Generator().manual_seed(1)
    batches = [torch.randn(2, 3, 8, 8, generator=g) for _ in range(2)]
    q = opencann.quantize(m, batches, options={"precision_mode": mode})
    rows = quant_report(q)
    assert rows and all(r["int8"] for r in rows), rows
    x = torch.randn(2, 3, 8, 8, generator=g)
    ref = opencann.quantize(m, batches)
    assert torch.equal(q(x), ref(x))        # the same int8 model as with no mode
    assert _cos(q(x), m(x)) > 0.999


def test_quantize_still_refuses_fp16_modes_in_one_line():
    with pytest.raises(ValueError, match="lowers layers to fp16/bf16") as e:
        opencann.quantize(_model(), [torch.randn(2, 3, 8, 8)], options={"precision_mode": "force_fp16"})
    assert "\n" not in str(e.value)


def test_tune_gives_bf16_not_fp32_to_a_layer_calibration_left_without_record():
    m = _model()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(2))
    res = opencann.tune(m, (x,), timing=False, candidates=("fp32", "bf16", "int8"),
                        calibration=[torch.full((2, 3, 8, 8), float("nan"))])
    assert res.precision == {"convolution": "bf16", "addmm": "bf16", "addmm_1": "bf16"}, res.kept
    for n in res.nodes.values():
        assert n.own["int8"].rule == "applies" and "no calibration record" in n.own["int8"].detail
    assert _cos(res.compiled(x), m(x)) > 0.999


def test_tune_int8_where_calibration_records_the_layer():
    m = _model()
    x = torch.randn(2, 3, 8, 8, generator=torch.Generator().manual_seed(3))
    res = opencann.tune(m, (x,), timing=False, candidates=("fp32", "int8"))
    assert set(res.precision.values()) == {"int8"}, res.kept
    assert _cos(res.compiled(x), m(x)) > 0.999
