"""Breaker session 6: calls and graphs that gave wrong values or failed where eager works.
Each test compares with eager PyTorch (random non-zero inputs, NaN positions, a second
call, outputs independent of each other and of later calls)."""
from __future__ import annotations

import math

import pytest
import torch
import torch.nn as nn

import opencann
from opencann.runtime.input_overlap import overlaps


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class _AB(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, a, b):
        return self.fn(a, b)


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    x.view(-1)[1] = float("nan")
    return x


def _same(n=4):
    x = _x(n, 6, seed=1)
    return x, x


def _overlapping(n=4):
    b = _x(n + 1, 6, seed=1)
    return b[:n], b[1:]


def _interleaved(n=4):
    b = _x(n, 12, seed=1)
    return b[:, ::2], b[:, 1::2]


# -- inputs that share memory, where the model writes into one of them -----------------
# The graph reads its inputs as separate tensors; eager's b sees a.add_(1) at once.

_WRITERS = {
    "add_then_read": lambda a, b: (a.add_(1), b * 2),
    "both_written": lambda a, b: (a.mul_(2), b.add_(1)),
    "setitem": lambda a, b: (a.__setitem__(0, 1.0), a + b)[1],
    "copy_into": lambda a, b: a.copy_(b * 3),
}


@pytest.mark.parametrize("calls", [_same, _overlapping], ids=["same_tensor", "overlapping_views"])
@pytest.mark.parametrize("fn", list(_WRITERS.values()), ids=list(_WRITERS))
@pytest.mark.parametrize("kw", [{}, {"dynamic_shapes": {"a": {0: "n"}, "b": {0: "n"}}}],
                         ids=["static", "dynamic"])
def test_aliased_inputs_of_a_model_writing_into_one_are_refused(calls, fn, kw, tmp_path):
    m = _AB(fn)
    cm = opencann.compile(m, (_x(4, 6), _x(4, 6, seed=2)), **kw)
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        a, b = calls()
        before = a.clone()
        with pytest.raises(ValueError, match=r"input 'a' \(argument #0\) and input 'b' "
                                             r"\(argument #1\) .*writes into input 'a'"):
            c(a, b)
        torch.testing.assert_close(a, before, equal_nan=True)   # nothing written
        # separate tensors (the fix the message names) give eager's values and writes
        ra, rb = (t.clone() for t in calls())
        ga, gb = ra.clone(), rb.clone()
        ref, got = m(ra, rb), c(ga, gb)
        for r, g in zip(ref if isinstance(ref, tuple) else (ref,),
                        got if isinstance(got, tuple) else (got,)):
            torch.testing.assert_close(g, r, equal_nan=True)
        torch.testing.assert_close((ga, gb), (ra, rb), equal_nan=True)


@pytest.mark.parametrize("fn", list(_WRITERS.values()), ids=list(_WRITERS))
def test_disjoint_views_of_one_buffer_run_with_eagers_values(fn):
    """Views that interleave (b[:, ::2], b[:, 1::2]) share a storage but no element:
    not refused, eager's values and writes."""
    m = _AB(fn)
    cm = opencann.compile(m, tuple(t.clone() for t in _interleaved()))
    for _ in range(2):
        ra, rb = _interleaved()
        ga, gb = _interleaved()
        ref, got = m(ra, rb), cm(ga, gb)
        for r, g in zip(ref if isinstance(ref, tuple) else (ref,),
                        got if isinstance(got, tuple) else (got,)):
            torch.testing.assert_close(g, r, equal_nan=True)
        torch.testing.assert_close(ga._base, ra._base, equal_nan=True)


def test_aliased_inputs_of_a_model_that_writes_nothing_still_run():
    m = _AB(lambda a, b: (a * 2 + b, b.sin()))
    cm = opencann.compile(m, (_x(4, 6), _x(4, 6, seed=2)))
    for calls in (_same, _overlapping):
        a, b = calls()
        ref, got = m(a, b), cm(a, b)
        torch.testing.assert_close(got, ref, equal_nan=True)


def test_torch_compile_follows_eager_on_aliased_written_inputs():
    def fn(a, b):
        a.add_(1)
        return b * 2

    torch._dynamo.reset()
    cf = torch.compile(fn, backend="opencann")
    for calls in (_same, _overlapping):
        ra, rb = calls()
        ga, gb = calls()
        torch.testing.assert_close(cf(ga, gb), fn(ra, rb), equal_nan=True)
        torch.testing.assert_close(ga, ra, equal_nan=True)


def test_overlaps_is_exact():
    b = torch.arange(60.).reshape(5, 12)
    assert overlaps(b[:4], b[1:]) and overlaps(b, b) and overlaps(b.t(), b[0])
    assert not overlaps(b[:2], b[2:]) and not overlaps(b, b.clone())
    assert not overlaps(b[:, ::2], b[:, 1::2]) and not overlaps(b[:, 0], b[:, 1])
    assert overlaps(b.view(torch.int16)[:, 1::2], b[:, 1])      # other dtype, same bytes
    x = torch.arange(100.)
    assert overlaps(x[::3], x[44:46]) and not overlaps(x[::3], x[46:48])
    assert not overlaps(x[:0], x)


# -- a size of a dynamic dim used as a value next to tensors of static shape -----------
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
        kept = []
        for n in (3, 5, 4):
            x = _x(n, 3, seed=n)
            ref, got = m(x), c(x)
            torch.testing.assert_close(got, ref, equal_nan=True)
            kept.append((got, ref))
        for got, ref in kept:
            torch.testing.assert_close(got, ref, equal_nan=True)


@pytest.mark.parametrize("fn", list(_SIZES.values()), ids=list(_SIZES))
def test_torch_compile_dynamic_size_as_a_value_with_static_tensors(fn):
    torch._dynamo.reset()
    before = len(opencann.dynamo.eager_fallbacks())   # other tests' fallbacks stay listed
    cf = torch.compile(fn, backend="opencann", dynamic=True)
    for n in (3, 5, 7):
        x = _x(n, 3, seed=n)
        torch.testing.assert_close(cf(x), fn(x), equal_nan=True)
    assert opencann.dynamo.eager_fallbacks()[before:] == []


# -- as_strided reads the memory layout: a caller's transposed tensor made contiguous --
# was read at other places than eager reads it (x.as_strided((2, 2), (1, 2)) of x.t()).

_LAYOUT = {
    "as_strided": lambda x: x.as_strided((2, 2), (1, 2)) * 2,
    "as_strided_of_view": lambda x: x[1:].as_strided((3,), (2,)) + 1,
    "as_strided_write": lambda x: (x.as_strided((2,), (3,)).add_(5), x * 1)[1],
}


def _transposed():
    return _x(6, 4, seed=3).t()


def _strided():
    return _x(4, 12, seed=4)[:, ::2]


@pytest.mark.parametrize("fn", list(_LAYOUT.values()), ids=list(_LAYOUT))
def test_as_strided_of_an_input_in_another_layout_is_refused(fn, tmp_path):
    m = _Fn(fn)
    cm = opencann.compile(m, (_x(4, 6),))
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        for make in (_transposed, _strided):
            with pytest.raises(ValueError, match=r"input 'x' \(argument #0\) has strides .* "
                                                 r"reads its memory layout \(as_strided"):
                c(make())
        for n in range(2):                       # contiguous calls: eager's values and writes
            rx, gx = _x(4, 6, seed=n), _x(4, 6, seed=n)
            ref, got = m(rx), c(gx)
            torch.testing.assert_close(got, ref, equal_nan=True)
            torch.testing.assert_close(gx, rx, equal_nan=True)


@pytest.mark.parametrize("fn", list(_LAYOUT.values()), ids=list(_LAYOUT))
def test_as_strided_compiled_on_the_callers_layout_matches_eager(fn):
    m = _Fn(fn)
    cm = opencann.compile(m, (_transposed(),))
    for _ in range(2):
        rx, gx = _transposed(), _transposed()
        ref, got = m(rx), cm(gx)
        torch.testing.assert_close(got, ref, equal_nan=True)
        torch.testing.assert_close(gx, rx, equal_nan=True)


def test_layout_free_models_still_take_any_layout():
    m = _Fn(lambda x: (x.t() * 2, x.reshape(-1) + 1, x[::2].sum(0)))
    cm = opencann.compile(m, (_x(4, 6),))
    for make in (_transposed, _strided):
        x = make()
        for g, r in zip(cm(x), m(x)):
            torch.testing.assert_close(g, r, equal_nan=True)


# -- baked float arguments: 0.0 and -0.0 compared equal, so a call with -0.0 ran the ----
# graph baked with 0.0 (1 / (x * 0 + s) gave +inf where eager gives -inf).

class _Scaled(nn.Module):
    def forward(self, x, s, pair=(1.0, 2.0)):
        return 1 / (x * 0 + s) + torch.copysign(x, torch.tensor(pair[1]))


@pytest.mark.parametrize("compiled_with, called_with", [
    ((0.0,), (-0.0,)), ((-0.0,), (0.0,)), ((1.0, (1.0, 0.0)), (1.0, (1.0, -0.0)))],
    ids=["zero_then_negative_zero", "negative_zero_then_zero", "zero_inside_a_tuple"])
def test_baked_float_arguments_tell_the_sign_of_zero(compiled_with, called_with, tmp_path):
    m = _Scaled()
    x = _x(5)
    cm = opencann.compile(m, (x, *compiled_with))
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        with pytest.raises(ValueError, match=r"was .*0\.0 when the model was compiled and is "
                                             r".*0\.0 now"):
            c(x, *called_with)
        torch.testing.assert_close(c(x, *compiled_with), m(x, *compiled_with), equal_nan=True)


def test_baked_nan_argument_still_matches_nan():
    m = _Scaled()
    x = _x(5)
    cm = opencann.compile(m, (x, float("nan")))
    torch.testing.assert_close(cm(x, float("nan")), m(x, float("nan")), equal_nan=True)


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


def _bits_equal(a, b):
    """Equal values, zeros of equal sign, NaN where eager has NaN."""
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, equal_nan=True, rtol=0, atol=0)
    if a.is_floating_point():
        s = torch.copysign(torch.ones_like(a), a)
        t = torch.copysign(torch.ones_like(b), b)
        keep = ~a.isnan()
        assert torch.equal(s[keep], t[keep])


@pytest.mark.parametrize("device", ["cpu", "vnpu"])
@pytest.mark.parametrize("fn", list(_CLAMPS.values()), ids=list(_CLAMPS))
def test_fused_relu_and_clamp_keep_the_sign_of_zero(fn, device):
    m = _Fn(fn)
    cm = opencann.compile(m, (_ZEROS,), device=device, options={"enable": ["fuse_elementwise"]})
    assert any(n.op == "FusedElementwise" for n in cm.graph.nodes)
    for _ in range(2):
        _bits_equal(cm(_ZEROS.clone()), m(_ZEROS.clone()))
