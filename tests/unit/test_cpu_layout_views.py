"""The CPU layout stage's NHWC values between oneDNN convolutions meeting views, joins,
in-place ops, outputs and grouped / dilated / strided convolutions: eager's values
(NaN/Inf positions), eager's strides (so ``.view(-1)`` works where eager's does), a
second call leaving the first call's outputs alone."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from helpers import assert_close


class _Convs(nn.Module):
    """Two oneDNN convolutions (NHWC between them) and ``fn`` mixing their values."""

    def __init__(self, fn):
        super().__init__()
        self.c1 = nn.Conv2d(3, 8, 3, padding=1)
        self.c2 = nn.Conv2d(8, 8, 3, padding=1)
        self.fn = fn

    def forward(self, x):
        return self.fn(self, x)


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.25
    x.view(-1)[5] = float("nan")
    x.view(-1)[11] = float("inf")
    return x


def _tuple(o):
    return tuple(o) if isinstance(o, (tuple, list)) else (o,)


_LAYOUT = {
    "flatten": lambda s, x: torch.flatten(F.relu(s.c1(x)), 1),
    "permute": lambda s, x: F.relu(s.c1(x)).permute(0, 2, 3, 1) * 2,
    "narrow_c": lambda s, x: s.c2(F.relu(s.c1(x)))[:, 2:5] + 1,
    "step_h": lambda s, x: s.c2(F.relu(s.c1(x)))[:, :, ::2] * 3,
    "step_w_into_conv": lambda s, x: s.c2(F.relu(s.c1(x))[:, :, :, ::2]),
    "intermediate_out": lambda s, x: (lambda a: (a, s.c2(a)))(F.relu(s.c1(x))),
    "relu_inplace": lambda s, x: s.c2(s.c1(x).relu_()),
    "mul_inplace_out": lambda s, x: (lambda a: (a.mul_(2), a))(s.c1(x)),
    "cat_with_input": lambda s, x: s.c2(torch.cat([s.c1(x)[:, :5], x], 1)),
    "cat_h": lambda s, x: s.c2(torch.cat([s.c1(x), s.c1(x) * 2], 2)),
    "cat_view_out": lambda s, x: (lambda z: (z, z.view(z.shape[0], -1)))(
        torch.cat([s.c1(x), s.c2(s.c1(x))], 1)),
    "stack": lambda s, x: torch.stack([s.c1(x), s.c2(s.c1(x))], 1),
    "interpolate_pad": lambda s, x: s.c2(F.pad(F.interpolate(s.c1(x), scale_factor=2), (1, 2, 0, 1))),
    "softmax_c": lambda s, x: s.c2(s.c1(x)).softmax(1),
    "pixel_shuffle": lambda s, x: F.pixel_shuffle(s.c2(s.c1(x)), 2),
    "group_norm": lambda s, x: F.group_norm(s.c2(s.c1(x)), 2),
}


@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.parametrize("case", sorted(_LAYOUT))
def test_layout_views_and_joins_match_eager(case, batch):
    """NHWC values between convolutions meeting views, joins, in-place ops and outputs."""
    m = _Convs(_LAYOUT[case]).eval()
    x = _x(batch, 3, 8, 8)
    with torch.no_grad():
        ref = m(x.clone())
    cm = opencann.compile(m, (x.clone(),))
    first = cm(x.clone())
    kept = [t.clone() for t in _tuple(first)]
    assert_close(first, ref, 1e-4, 1e-4, strides=True)
    assert_close(cm(x.clone()), ref, 1e-4, 1e-4, strides=True)
    for a, b in zip(_tuple(first), kept):   # a second call left the first's outputs alone
        torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)


def test_layout_grouped_dilated_strided_convs():
    m = nn.Sequential(nn.Conv2d(4, 8, 3, padding=2, dilation=2), nn.ReLU(),
                      nn.Conv2d(8, 8, 3, stride=2, groups=4), nn.Conv2d(8, 8, 3, padding=1, groups=8),
                      nn.Conv2d(8, 6, 1, stride=2)).eval()
    x = _x(3, 4, 11, 11)
    with torch.no_grad():
        ref = m(x)
    cm = opencann.compile(m, (x,))
    assert_close(cm(x), ref, 1e-4, 1e-4, strides=True)
    assert_close(cm(x.clone()), ref, 1e-4, 1e-4, strides=True)
