"""Models that read an input's memory layout (``as_strided``, ``is_contiguous``,
``stride``, ``storage_offset``) need inputs in the example's layout, else one error
saying so (live, dynamic and loaded models); models that read no layout take any layout
with eager's values and writes."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann


class _Fn(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    x.view(-1)[1] = float("nan")
    return x


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


# -- as_strided with an explicit storage offset: absolute, traced from the example's ----
# A model computing x.as_strided(size, stride, x.storage_offset() + 1) was traced with the
# example's offset (0): the graph's offset 1 is absolute, so a call with a view starting
# at offset 5 read base[1:] where eager reads base[6:] (silently wrong before).

class _AsStrided(nn.Module):
    def __init__(self, relative=False):
        super().__init__()
        self.relative = relative

    def forward(self, x):
        if self.relative:
            return x.as_strided((2, 2), (1, 2)) * 2
        return x.as_strided((2, 2), (1, 2), x.storage_offset() + 1) * 2


def _base():
    b = torch.arange(20.0) + 0.5
    b[7] = float("nan")
    return b


@pytest.mark.parametrize("how", ["static", "dynamic", "loaded"])
def test_as_strided_absolute_offset_refuses_other_offsets(how, tmp_path):
    m = _AsStrided()
    ex = _base()[:6].clone()
    if how == "dynamic":
        cm = opencann.compile(m, (ex,), dynamic_shapes={"x": {0: "n"}})
    else:
        cm = opencann.compile(m, (ex,))
    if how == "loaded":
        opencann.save(cm, str(tmp_path / "m.ocm"))
        cm = opencann.load(str(tmp_path / "m.ocm"))
    for x in (_base()[:6], _base().clone()[:6].clone()):   # the example's offset: eager's value
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
    with pytest.raises(ValueError, match="storage offset 5 .the example's: 0."):
        cm(_base()[5:11])


def test_as_strided_example_at_offset_refuses_fresh_input():
    m = _AsStrided()
    cm = opencann.compile(m, (_base()[3:9],))
    x = _base()[3:9]
    torch.testing.assert_close(cm(x), m(x), equal_nan=True)
    with pytest.raises(ValueError, match="storage offset 0 .the example's: 3."):
        cm(_base()[:6].clone())


def test_as_strided_relative_offset_takes_any_offset():
    """No explicit offset: as_strided starts at the input's own offset, as in eager."""
    m = _AsStrided(relative=True)
    cm = opencann.compile(m, (_base()[:6].clone(),))
    for x in (_base()[5:11], _base()[:6].clone(), _base()[1:7]):
        out = cm(x)
        torch.testing.assert_close(out, m(x), equal_nan=True)
        assert out.data_ptr() != x.data_ptr()


class _AsStridedOwnStrides(nn.Module):
    def forward(self, x):
        return x.as_strided((3, 4), x.stride()) * 2


@pytest.mark.parametrize("how", ["static", "loaded"])
def test_as_strided_transposed_example_refuses_other_strides(how, tmp_path):
    """The example was transposed (strides (1, 3)): x.stride() was traced in. A contiguous
    call read other elements than eager (silently wrong before); now refused."""
    m = _AsStridedOwnStrides()
    cm = opencann.compile(m, (torch.randn(4, 3).t(),))
    if how == "loaded":
        opencann.save(cm, str(tmp_path / "m.ocm"))
        cm = opencann.load(str(tmp_path / "m.ocm"))
    x = (torch.arange(12.0).reshape(4, 3) + 0.5).t()
    x[0, 1] = float("nan")
    torch.testing.assert_close(cm(x), m(x), equal_nan=True)
    torch.testing.assert_close(cm(x), m(x), equal_nan=True)
    with pytest.raises(ValueError, match=r"strides \(4, 1\) \(the example's: \(1, 3\)\)"):
        cm(x.contiguous())


# -- the model's own code asks an input's layout (is_contiguous, stride, storage_offset) ----
# torch.export bakes the answer for the example's layout; a call in another layout would get
# the example layout's branch / number silently. Such inputs must come in the example's layout.

class _Branch(nn.Module):
    def forward(self, x):
        return x * 2 if x.is_contiguous() else x * 3


class _Stride(nn.Module):
    def forward(self, x):
        return x * x.stride(0)


class _ViewStride(nn.Module):      # the query on a view of the input
    def forward(self, x):
        return x + 1 if x[:, :2].t().is_contiguous() else x - 1


class _Offset(nn.Module):
    def forward(self, x):
        return x + x.storage_offset()


class _Plain(nn.Module):           # no query: any layout is accepted and matches eager
    def forward(self, x):
        return torch.relu(x) * 2


@pytest.mark.parametrize("m", [_Branch(), _Stride(), _ViewStride(), _Offset()],
                         ids=["is_contiguous", "stride", "view_query", "storage_offset"])
def test_layout_queried_in_model_code_needs_the_examples_layout(m, tmp_path):
    x = torch.randn(3, 4)
    x[0, 1] = float("nan")
    cm = opencann.compile(m, (x,))
    opencann.save(cm, tmp_path / "m.ocm")
    for c in (cm, opencann.load(tmp_path / "m.ocm")):
        for _ in range(2):                                   # example layout: eager's values
            y = torch.randn(3, 4)
            torch.testing.assert_close(c(y), m(y), equal_nan=True)
        bad = [torch.randn(4, 3).t()] + ([torch.randn(5, 4)[1:4]] if isinstance(m, _Offset) else [])
        for b in bad:
            with pytest.raises(ValueError, match=r"reads its memory layout"):
                c(b)


def test_no_layout_query_accepts_any_layout():
    m = _Plain()
    cm = opencann.compile(m, (torch.randn(3, 4),))
    for b in (torch.randn(4, 3).t(), torch.randn(5, 4)[1:4], torch.randn(3, 8)[:, ::2]):
        out = cm(b)
        torch.testing.assert_close(out, m(b))
        out.add_(1)                                          # independent of the input
        torch.testing.assert_close(cm(b), m(b))
