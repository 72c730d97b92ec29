"""Calls of models compiled with dynamic dims or ATC-style gears, at the edges: the padded
size used as another axis's size (padding blocked), inputs without the gear dim, padded
calls returning views of the caller's input, sizes returned or used as values, one
tensor given for two arguments, ``*args`` forwards, and errors naming the user's dims.
Each compares with eager PyTorch (random non-zero inputs, NaN positions, several calls,
earlier outputs left alone by later calls)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import opencann
from opencann.frontend.torch import ConversionError
from helpers import assert_calls_like_eager


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _AB(nn.Module):
    def forward(self, a, b):
        return a * 2 + b


GEARS = {"dynamic_batch_size": [1, 2, 4, 8]}


def _padded(cm) -> bool:
    return any(v["padded"] for v in cm.report.dynamic["padding"]["dims"].values())


# -- gear padding: the padded dim's size used as another axis's size -------------------

def _xb(n, w=10):
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
    cm = opencann.compile(m, _xb(8), options=GEARS)
    assert not _padded(cm)
    with pytest.raises(ValueError, match="not one of the gears"):
        cm(*_xb(3))
    assert_calls_like_eager(cm, m, _xb, (4, 2, 4))


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
    assert_calls_like_eager(cm, m, lambda n: (_xb(n, 5)[0], w))


# -- gear padding: outputs that are views of an input ----------------------------------

class _Views(nn.Module):
    def forward(self, x):
        return x.t(), x[:, 1:], x * 2


def test_padded_call_returns_views_of_the_callers_input_as_eager_does():
    m = _Views()
    cm = opencann.compile(m, _xb(8), options=GEARS)
    assert _padded(cm)
    assert_calls_like_eager(cm, m, _xb)
    for n in (3, 4, 1):        # padded (3), exact gear (4), gear 1
        x = _xb(n)[0]
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

class _Star(nn.Module):
    def forward(self, x, *rest):
        return x * 2 + rest[0].sum(1, keepdim=True)


@pytest.mark.parametrize("kw", [{}, {"dynamic_shapes": {"a": {0: "n"}, "b": {0: "n"}}},
                                {"options": GEARS}], ids=["static", "dynamic", "gears"])
def test_same_tensor_for_two_arguments_at_compile_time_keeps_them_apart(kw):
    x = _xb(8, 5)[0]
    m = _AB()
    cm = opencann.compile(m, (x, x), **kw)     # torch.export alone traces b for both
    assert_calls_like_eager(cm, m, lambda n: (_xb(8 if not kw else n, 5)[0], torch.randn(8 if not kw else n, 5)))


@pytest.mark.parametrize("kw", [{"dynamic_shapes": ({0: "b"}, {0: "b"})},
                                {"dynamic_shapes": {"x": {0: "b"}, "arg1": {0: "b"}}},
                                {"options": GEARS}], ids=["tuple", "dict", "gears"])
def test_dynamic_dims_of_a_star_args_forward(kw):
    m = _Star()
    x = torch.randn(8, 5)
    cm = opencann.compile(m, (x, torch.randn(8, 5)), **kw)
    assert_calls_like_eager(cm, m, lambda n: (_xb(n, 5)[0], torch.randn(n, 5)))
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
    cm = opencann.compile(m, _xb(8, 5), **kw)
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        for n in (3, 4, 3):     # padded to gear 4, exact gear, again
            x = _xb(n, 5)[0]
            got, ref = c(x), m(x)
            torch.testing.assert_close(got[0], ref[0], equal_nan=True)
            assert got[1:] == ref[1:] and type(got[1]) is int


class _HalfSize(nn.Module):
    def forward(self, x):
        return x * 2, x.shape[0] / 2


def test_float_arithmetic_on_a_dynamic_size_is_returned_per_call():
    """``x.shape[0] / 2`` (a float of a dynamic size) compiles and is bound per call."""
    m = _HalfSize()
    cm = opencann.compile(m, _xb(8, 5), dynamic_shapes={"x": {0: "b"}})
    for n in (8, 5, 3):
        x, = _xb(n, 5)
        got, want = cm(x), m(x)
        torch.testing.assert_close(got[0], want[0], equal_nan=True)
        assert type(got[1]) is float and got[1] == want[1]


# -- a size of a dynamic dim used as a value next to tensors of static shape -----------
def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    x.view(-1)[1] = float("nan")
    return x


# x.sum(0) + x.shape[0]: the Add's inputs are static, its scalar is symbolic; the
# inference check ran the op on meta tensors with the symbol in it and failed.

_SIZES = {
    "static_plus_size": lambda x: x.sum(0) + x.shape[0],
    "mean_times_numel": lambda x: x.mean() * x.numel(),
    "full_of_size": lambda x: x + torch.full((1,), x.shape[0]),
    "where_size": lambda x: torch.where(x > 0, x, x.shape[0]),
    "new_full": lambda x: x.new_full((2,), x.shape[0] * 2),
    "amax_times_size": lambda x: x.amax(0) * x.shape[0],
    "static_dim_sqrt": lambda x: x.sum(0) / math.sqrt(x.shape[1]) + x.shape[0],
}


@pytest.mark.parametrize("fn", list(_SIZES.values()), ids=list(_SIZES))
def test_dynamic_size_as_a_value_with_static_tensors(fn, tmp_path):
    m = _Fn(fn)
    cm = opencann.compile(m, (_x(4, 3),), dynamic_shapes={"x": {0: "b"}})
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        assert_calls_like_eager(c, m, lambda n: (_x(n, 3, seed=n),), (3, 5, 4))


@pytest.mark.parametrize("fn", list(_SIZES.values()), ids=list(_SIZES))
def test_torch_compile_dynamic_size_as_a_value_with_static_tensors(fn):
    torch._dynamo.reset()
    before = len(opencann.dynamo.eager_fallbacks())   # other tests' fallbacks stay listed
    cf = torch.compile(fn, backend="opencann", dynamic=True)
    for n in (3, 5, 7):
        x = _x(n, 3, seed=n)
        torch.testing.assert_close(cf(x), fn(x), equal_nan=True)
    assert opencann.dynamo.eager_fallbacks()[before:] == []
