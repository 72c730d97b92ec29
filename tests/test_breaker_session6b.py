"""Breaker session 6b: today's features (CPU layout stage, freezing on the torch.compile
path, streams with the caller running stream 0) attacked as a demanding user would.
No case here gave a wrong value; these pin the behaviours down. Each compares with eager
PyTorch: random non-zero inputs with NaN/Inf positions, a second call, values, strides,
and ``.view(-1)`` working wherever eager's does."""
from __future__ import annotations

import threading

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import opencann
from helpers import count_in_new_thread


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


def _check(ref, out):
    for r, o in zip(_tuple(ref), _tuple(out)):
        assert r.shape == o.shape
        # strides of size-1 dims carry no layout (torch's is_contiguous ignores them)
        assert [st for st, n in zip(r.stride(), r.shape) if n != 1] == \
            [st for st, n in zip(o.stride(), o.shape) if n != 1]
        torch.testing.assert_close(o, r, rtol=1e-4, atol=1e-4, equal_nan=True)
        try:
            r.view(-1)
        except RuntimeError:
            continue
        o.view(-1)   # eager's is a view: ours must be one too


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
    _check(ref, first)
    _check(ref, cm(x.clone()))
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
    _check(ref, cm(x))
    _check(ref, cm(x.clone()))


class _FrozenM(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Conv2d(3, 4, 3, padding=1)
        self.bn = nn.BatchNorm2d(4)
        self.l = nn.Linear(64, 5)
        self.register_buffer("np", torch.randn(5), persistent=False)

    def forward(self, x):
        return self.l(F.relu(self.bn(self.c(x))).flatten(1)) + self.np


def _other():
    torch.manual_seed(7)
    return _FrozenM().eval()


_CHANGES = {
    "load_state_dict": lambda m: m.load_state_dict(_other().state_dict()),
    "load_state_dict_assign": lambda m: m.load_state_dict(_other().state_dict(), assign=True),
    "half_then_float": lambda m: (m.half(), m.float(), m.c.weight.mul_(2)),
    "data_twice": lambda m: [setattr(m.c.weight, "data", torch.full((4, 3, 3, 3), v)) for v in (0.5, 0.25)],
    "register_buffer_again": lambda m: m.register_buffer("np", torch.full((5,), 3.0), persistent=False),
    "param_set_": lambda m: m.l.bias.set_(torch.full((5,), -2.0)),
    "bn_stat_replaced": lambda m: setattr(m.bn, "running_mean", torch.full((4,), 0.5)),
}


@pytest.mark.parametrize("case", sorted(_CHANGES))
def test_freezing_sees_weight_changes(case):
    """A frozen graph gives eager's value after each kind of weight change."""
    torch.manual_seed(0)
    m = _FrozenM().eval()
    m.bn.running_var.uniform_(0.5, 2)
    x = _x(2, 3, 4, 4)
    torch._dynamo.reset()
    cm = torch.compile(m, backend="opencann")
    with torch.no_grad():
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
        _CHANGES[case](m)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)
        torch.testing.assert_close(cm(x), m(x), equal_nan=True)


class _Branches(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b, self.c, self.d = (nn.Linear(32, 32) for _ in range(4))

    def forward(self, x):
        p, q, r = F.relu(self.a(x)), torch.tanh(self.b(x)), self.c(x).sigmoid()
        return self.d(p + q) * r, (p - q).sum(1)


@pytest.mark.parametrize("streams,costs", [(2, "measured"), (3, "model")])
def test_streams_concurrent_callers_keep_thread_counts(streams, costs):
    """Four threads calling one multi-stream model at once get eager's values; the
    caller's and new threads' intra-op thread counts are unchanged afterwards."""
    torch.manual_seed(0)
    m = _Branches().eval()
    cm = opencann.compile(m, (_x(8, 32),), options={"streams": streams, "stream_costs": costs})
    mine, fresh = torch.get_num_threads(), count_in_new_thread()
    bad = []

    def caller(seed):
        x = _x(8, 32, seed=seed)
        with torch.no_grad():
            ref = m(x)
        for _ in range(5):
            out = cm(x)
            if not all(torch.allclose(a, b, atol=1e-5, equal_nan=True) for a, b in zip(ref, out)):
                bad.append(seed)
    threads = [threading.Thread(target=caller, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not bad
    assert torch.get_num_threads() == mine and count_in_new_thread() == fresh


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
