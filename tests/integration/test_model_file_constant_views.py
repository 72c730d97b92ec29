"""A saved and loaded model returns constant views (offset, gapped, transposed,
expanded, overlapping) with eager's strides and values, static and dynamic."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from helpers import assert_close


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    flat = x.view(-1)
    flat[1] = float("nan")
    if flat.numel() > 5:
        flat[3], flat[5] = float("inf"), -0.0
    return x


# == B7-5: a loaded model file loses the strides of a strided view of a constant ===========

class _ConstViews(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("b", torch.arange(12.0).view(3, 4))
        self.w = nn.Parameter(torch.randn(4, 3))

    def forward(self, x):
        return x * 2, self.b.t(), self.b[:1].expand(2, 4), self.b[:, ::2], self.w[::2]


def test_loaded_model_keeps_strides_of_gapped_constant_views(tmp_path):
    m = _ConstViews().eval()
    x = _x(3, 4)
    cm = opencann.compile(m, (x,))
    opencann.save(cm, tmp_path / "m.ocm")
    lm = opencann.load(tmp_path / "m.ocm")
    with torch.no_grad():
        ref = m(x)
    assert_close(cm(x), ref, strides=True, signed_zeros=True)          # the live model has eager's strides
    assert_close(lm(x), ref, strides=True, signed_zeros=True)          # the loaded one: b[:, ::2] and w[::2] come back contiguous


class _MoreConstViews(nn.Module):
    """Every kind of constant view: offset, offset+gapped, widely gapped (saved as values,
    strides rebuilt), a single column of a large matrix, overlapping (as_strided), expanded
    then gapped, transposed then gapped."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.register_buffer("b", torch.randn(3, 4))
        self.register_buffer("big", torch.randn(40, 50))

    def forward(self, x):
        return (x + 1, self.b[1:], self.b[1:, 1::2], self.big[::10, ::7], self.big[:, 3],
                torch.as_strided(self.b, (3, 3), (2, 1)), self.b.t()[::2],
                self.big.unsqueeze(0).expand(3, 40, 50)[:, ::3])


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_loaded_model_keeps_strides_of_every_kind_of_constant_view(tmp_path, dynamic):
    m = _MoreConstViews().eval()
    x = _x(3, 4)
    kw = {"dynamic_shapes": ({0: torch.export.Dim("n", min=2, max=8)},)} if dynamic else {}
    cm = opencann.compile(m, (x,), **kw)
    opencann.save(cm, tmp_path / "m.ocm")
    lm = opencann.load(tmp_path / "m.ocm")
    with torch.no_grad():
        ref = m(x)
    assert_close(cm(x), ref, strides=True, signed_zeros=True)
    assert_close(lm(x), ref, strides=True, signed_zeros=True)
    assert_close(lm(x), ref, strides=True, signed_zeros=True)                           # a second call: constants unchanged
