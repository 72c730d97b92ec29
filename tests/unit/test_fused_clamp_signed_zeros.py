"""Fused relu / clamp / hardtanh keep eager's sign of zero, NaN and infinities (eager's
clamp keeps a value equal to the bound: relu(-0.0) is -0.0), on cpu and vnpu."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from helpers import assert_close


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


# -- fused relu/clamp: maximum(x, 0) turned relu(-0.0) into +0.0 (eager keeps -0.0: its --
# clamp keeps a value equal to the bound), so 1 / relu(x) gave +inf where eager gives -inf.

_ZEROS = torch.tensor([-0.0, 0.0, 1.0, -2.0, float("nan"), float("inf"), -float("inf"), 3.0] * 5)

_CLAMPS = {
    "relu": lambda x: 1 / torch.relu(x * 1),
    "clamp_min_neg_zero": lambda x: 1 / (x * 1).clamp(min=-0.0),
    "clamp_max_zero": lambda x: 1 / (x * 1).clamp(max=0.0),
    "clamp_both": lambda x: 1 / (x * 1).clamp(-0.0, 0.0),
    "hardtanh": lambda x: 1 / torch.nn.functional.hardtanh(x * 1, -0.0, 0.0),
    "relu6": lambda x: 1 / torch.nn.functional.relu6(x * 1),
    "clamp_nan_bound": lambda x: (x * 1).clamp(min=float("nan")) + 1,
    "clamp_int": lambda x: (x.nan_to_num(0).clamp(-9, 9).int() * 2).clamp(-3, 4) + 1,
}


@pytest.mark.parametrize("device", ["cpu", "vnpu"])
@pytest.mark.parametrize("fn", list(_CLAMPS.values()), ids=list(_CLAMPS))
def test_fused_relu_and_clamp_keep_the_sign_of_zero(fn, device):
    m = _Fn(fn)
    cm = opencann.compile(m, (_ZEROS,), device=device, options={"enable": ["fuse_elementwise"]})
    assert any(n.op == "FusedElementwise" for n in cm.graph.nodes)
    for _ in range(2):
        assert_close(cm(_ZEROS.clone()), m(_ZEROS.clone()), rtol=0, atol=0, signed_zeros=True)
