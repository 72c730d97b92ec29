"""Breaker session 5: inputs that gear padding, streams and dynamic shapes got wrong.
Each test compares with eager PyTorch (random non-zero inputs, NaN positions, a second
call, outputs independent of each other and of later calls)."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from opencann.frontend.torch import ConversionError

GEARS = {"dynamic_batch_size": [1, 2, 4, 8]}


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _padded(cm) -> bool:
    return any(v["padded"] for v in cm.report.dynamic["padding"]["dims"].values())


def _check_calls(cm, model, make, sizes=(3, 5, 3)):
    """Each size against eager, NaN rows included, outputs fresh on every call."""
    kept = []
    for n in sizes:
        args = make(n)
        ref, got = model(*args), cm(*args)
        refs = ref if isinstance(ref, tuple) else (ref,)
        gots = got if isinstance(got, tuple) else (got,)
        for r, g in zip(refs, gots):
            assert g.shape == r.shape
            torch.testing.assert_close(g, r, equal_nan=True)
        kept.append((gots, refs))
    for gots, refs in kept:        # later calls did not overwrite earlier outputs
        for r, g in zip(refs, gots):
            torch.testing.assert_close(g, r, equal_nan=True)


# -- gear padding: the padded dim's size used as another axis's size -------------------

def _x(n, w=10):
    torch.manual_seed(n)
    x = torch.randn(n, w) + 0.5
    x[n // 2, 1] = float("nan")
    return (x,)


@pytest.mark.parametrize("fn", [
    lambda x: x[:, :1].expand(-1, x.shape[0]).sum(1),             # sums B copies
    lambda x: (x[:, :1] + torch.zeros(x.shape[0], x.shape[0])).mean(1),
    lambda x: x[:, :1].expand(-1, x.shape[0]) * 2,                 # output [B, B]
    lambda x: x[:, x.shape[0] - 1],                                # select index B-1
    lambda x: x[:, x.shape[0] - 1:x.shape[0]],                     # slice start B-1
    lambda x: x.narrow(1, x.shape[0] - 1, 1) * 3,
    lambda x: x * torch.full_like(x, x.shape[0]),                  # B as a fill value
], ids=["expand_sum", "square_mean", "square_out", "select_index", "slice_start",
        "narrow", "full_like"])
def test_gear_padding_blocked_where_the_batch_size_sizes_another_axis(fn):
    m = _Fn(fn).eval()
    cm = opencann.compile(m, _x(8), options=GEARS)
    assert not _padded(cm)
    with pytest.raises(ValueError, match="not one of the gears"):
        cm(*_x(3))
    _check_calls(cm, m, _x, sizes=(4, 2, 4))


# -- gear options: inputs that do not all carry the gear dim ---------------------------

class _XW(nn.Module):
    def forward(self, x, w):
        return x @ w


def test_dynamic_batch_size_with_an_input_without_the_batch_is_one_clear_error():
    with pytest.raises(ValueError, match=r"input 'w' has 5 there and 'x' has 8.*"
                                         r"dynamic_shapes=\{'x': \{0: 'batch'\}\}"):
        opencann.compile(_XW(), (torch.randn(8, 5), torch.randn(5, 5)), options=GEARS)
    # the fix the message names works, padded, with eager's values
    m = _XW()
    cm = opencann.compile(m, (torch.randn(8, 5), torch.randn(5, 5)),
                          dynamic_shapes={"x": {0: "batch"}}, options=GEARS)
    assert _padded(cm)
    w = torch.randn(5, 5)
    _check_calls(cm, m, lambda n: (_x(n, 5)[0], w))


# -- gear padding: outputs that are views of an input ----------------------------------

class _Views(nn.Module):
    def forward(self, x):
        return x.t(), x[:, 1:], x * 2


def test_padded_call_returns_views_of_the_callers_input_as_eager_does():
    m = _Views()
    cm = opencann.compile(m, _x(8), options=GEARS)
    assert _padded(cm)
    _check_calls(cm, m, _x)
    for n in (3, 4, 1):        # padded (3), exact gear (4), gear 1
        x = _x(n)[0]
        got, ref = cm(x), m(x)
        for g, r in zip(got[:2], ref[:2]):
            assert g.stride() == r.stride()
        x.mul_(-1)             # eager's views follow the caller's tensor
        for g, r in zip(got, ref):
            torch.testing.assert_close(g, r, equal_nan=True)


# -- dynamic shapes: a static dim of another size names the dynamic dims, not symbols --

def test_dynamic_shape_error_names_the_dims_not_internal_symbols(tmp_path):
    m = nn.Linear(16, 4).eval()
    cm = opencann.compile(m, (torch.randn(2, 5, 16),), dynamic_shapes={"input": {0: "b", 1: "s"}})
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        with pytest.raises(ValueError, match=r"compiled for float32\[b,s,16\]; the shape differs"):
            c(torch.randn(2, 5, 15))
        x = torch.randn(3, 7, 16)
        torch.testing.assert_close(c(x), m(x))


# -- capture: one tensor object given for two arguments --------------------------------

class _AB(nn.Module):
    def forward(self, a, b):
        return a * 2 + b


class _Star(nn.Module):
    def forward(self, x, *rest):
        return x * 2 + rest[0].sum(1, keepdim=True)


@pytest.mark.parametrize("kw", [{}, {"dynamic_shapes": {"a": {0: "n"}, "b": {0: "n"}}},
                                {"options": GEARS}], ids=["static", "dynamic", "gears"])
def test_same_tensor_for_two_arguments_at_compile_time_keeps_them_apart(kw):
    x = _x(8, 5)[0]
    m = _AB()
    cm = opencann.compile(m, (x, x), **kw)     # torch.export alone traces b for both
    _check_calls(cm, m, lambda n: (_x(8 if not kw else n, 5)[0], torch.randn(8 if not kw else n, 5)))


@pytest.mark.parametrize("kw", [{"dynamic_shapes": ({0: "b"}, {0: "b"})},
                                {"dynamic_shapes": {"x": {0: "b"}, "arg1": {0: "b"}}},
                                {"options": GEARS}], ids=["tuple", "dict", "gears"])
def test_dynamic_dims_of_a_star_args_forward(kw):
    m = _Star()
    x = torch.randn(8, 5)
    cm = opencann.compile(m, (x, torch.randn(8, 5)), **kw)
    _check_calls(cm, m, lambda n: (_x(n, 5)[0], torch.randn(n, 5)))
    if "options" in kw:
        assert _padded(cm)


# -- dynamic shapes and gears: a size returned as a value ------------------------------

class _Sizes(nn.Module):
    def forward(self, x):
        return x * 2, x.shape[0], [x.shape[0] * 3 + 1, x.shape[1]]


@pytest.mark.parametrize("kw", [{"options": GEARS}, {"dynamic_shapes": {"x": {0: "b", 1: "s"}}}],
                         ids=["gears", "dynamic"])
def test_sizes_returned_as_values_are_the_calls_ints(kw, tmp_path):
    m = _Sizes()
    cm = opencann.compile(m, _x(8, 5), **kw)
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        for n in (3, 4, 3):     # padded to gear 4, exact gear, again
            x = _x(n, 5)[0]
            got, ref = c(x), m(x)
            torch.testing.assert_close(got[0], ref[0], equal_nan=True)
            assert got[1:] == ref[1:] and type(got[1]) is int


class _HalfSize(nn.Module):
    def forward(self, x):
        return x * 2, x.shape[0] / 2


def test_float_arithmetic_on_a_dynamic_size_is_one_clear_error():
    with pytest.raises(ConversionError, match=r"x.shape\[0\] // 2"):
        opencann.compile(_HalfSize(), _x(8, 5), dynamic_shapes={"x": {0: "b"}})
