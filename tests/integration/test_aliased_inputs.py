"""Inputs that share memory (one tensor for two arguments, overlapping or interleaved
views of one buffer): refused with one line naming both inputs where the model writes
into one of them (nothing written), run with eager's values and writes otherwise;
torch.compile follows eager; `overlaps` is exact."""
from __future__ import annotations

import pytest
import torch
import torch.nn as nn

import opencann
from opencann.runtime.input_overlap import overlaps


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
