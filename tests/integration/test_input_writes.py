"""Models writing into their inputs through views (plain views, unfold windows with
gaps or tails, repeating and non-repeating expands), by opencann.compile and
torch.compile: the caller's tensor holds eager's values afterwards (elements no window
covers and -0.0 included), outputs alias the input as eager's do, and writes that
eager applies more than once to an element are refused with one line."""
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

    def forward(self, *args):
        return self.fn(*args)


def _x(*shape, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 0.5
    flat = x.view(-1)
    flat[1] = float("nan")
    if flat.numel() > 5:
        flat[3], flat[5] = float("inf"), -0.0
    return x


def _flat(o):
    if isinstance(o, torch.Tensor):
        return [o]
    if isinstance(o, (tuple, list)):
        return [t for x in o for t in _flat(x)]
    if isinstance(o, dict):
        return [t for x in o.values() for t in _flat(x)]
    return [o]


# == covered, already matching eager: writes into inputs through views ======================

_WRITES = {
    "view_then_write": lambda x: (lambda v: (x.mul_(2), v)[1])(x[0]),
    "clone_then_write": lambda x: (lambda a: (x.add_(1), a, x)[1:])(x.clone()),
    "transposed_write": lambda x: (lambda t: (t.add_(1), x.sum(0), t)[1:])(x.t()),
    "bool_mask_setitem": lambda x: (x.__setitem__(x > 0.5, -1.0), x)[1],
    "interleaved_copy": lambda x: (x[:, ::2].copy_(x[:, 1::2]), x)[1],
    "swapaxes_select_write": lambda x: (x.swapaxes(0, 1)[1].mul_(5), x)[1],
    "diagonal_zero": lambda x: (x.diagonal().zero_(), x.triu())[1],
    "index_add_": lambda x: x.index_add_(0, torch.tensor([0, 0, 3]), torch.ones(3, 6)),
    "as_strided_write": lambda x: (x.as_strided((2, 2), (1, 6)).mul_(3), x)[1],
    "flat_step_fill": lambda x: (x.view(-1)[::5].fill_(7.0), x)[1],
    "chain_inplace": lambda x: (x.relu_().sigmoid_(), x[::2])[1],
}


@pytest.mark.parametrize("backend", ["opencann.compile", "torch.compile"])
@pytest.mark.parametrize("case", sorted(_WRITES))
def test_writes_into_inputs_through_views_match_eager(case, backend):
    m = _Fn(_WRITES[case])
    x = _x(4, 6)
    cm = opencann.compile(m, (x.clone(),)) if backend == "opencann.compile" \
        else torch.compile(m, backend="opencann")
    for seed in (0, 1):
        a, b = _x(4, 6, seed=seed), _x(4, 6, seed=seed)
        with torch.no_grad():
            ref, got = m(a), cm(b)
        assert_close(got, ref, strides=True, signed_zeros=True)
        assert_close(b, a, strides=True, signed_zeros=True)                             # the caller's tensor holds eager's values
        for r, g in zip(_flat(ref), _flat(got)):     # outputs alias the input as eager's do
            r.add_(100.0)
            g.add_(100.0)
        assert_close(b, a, strides=True, signed_zeros=True)


# == B7-7: writes through an unfold view zero the elements no window covers ===============
# torch's functionalization inverts ``unfold`` with ``unfold_backward`` (zeros, then an
# accumulating index_put): every element outside the windows becomes 0 and a -0.0 inside
# them becomes +0.0 (pytorch/pytorch#198102, open). Eager leaves them alone.

_UNFOLD_WRITES = {
    "gaps_input": lambda x: (x.unfold(1, 2, 3).mul_(2), x)[1],
    "tail_input": lambda x: (x.unfold(1, 4, 4).add_(1), x)[1],
    "dim0_input": lambda x: (x.unfold(0, 1, 3).mul_(2), x)[1],
    "gaps_intermediate": lambda x: (lambda y: (y.unfold(1, 2, 3).mul_(2), y)[1])(x * 1),
    "exact_cover_negative_zero": lambda x: (x.unfold(1, 2, 2).mul_(2), x)[1],
    # windows that do not tile a prefix of the dim (6 = 4 + 2 < 2 * 4): as_strided spelling
    "last_gap_cut": lambda x: (x.unfold(1, 2, 4).mul_(2), x)[1],
    "one_window_longer_step": lambda x: (x.unfold(1, 3, 9).mul_(2), x)[1],
    "of_transposed": lambda x: (x.t().unfold(0, 2, 3).mul_(2), x)[1],
    "of_offset_view": lambda x: (x[1:, 1:].unfold(1, 2, 3).mul_(2), x)[1],
    "of_view_last_gap_cut": lambda x: (x.t()[1:].unfold(0, 1, 3).mul_(2), x)[1],
    "of_intermediate_view_gap_cut": lambda x: (lambda y: (y[:, 1:].unfold(1, 2, 4).mul_(2),
                                                          y * 1)[1])(x + 1),
    "unfold_twice": lambda x: (x.unfold(1, 3, 3).unfold(0, 1, 2).mul_(2), x)[1],
    "select_of_windows": lambda x: (x.unfold(1, 2, 3)[:, 1].mul_(2), x)[1],
    "setitem_negative_zero": lambda x: (x.unfold(1, 2, 3).__setitem__((Ellipsis, 0), -0.0), x)[1],
    "copy_in": lambda x: (x.unfold(0, 1, 2).copy_(torch.full((2, 6, 1), -0.0)), x)[1],
    "window_read_after_write": lambda x: (lambda v: (v.add_(1), v.sum(-1), x)[1:])(
        x.unfold(1, 2, 3)),
    "torch_function_form": lambda x: (torch.Tensor.unfold(x, 1, 1, 2).mul_(3), x)[1],
    "dim0_intermediate_tail": lambda x: (lambda y: (y.unfold(0, 1, 3).sub_(1), y + 0)[1])(x * 2),
}


@pytest.mark.parametrize("backend", ["opencann.compile", "torch.compile"])
@pytest.mark.parametrize("case", sorted(_UNFOLD_WRITES))
def test_writes_through_unfold_views_keep_the_other_elements(case, backend):
    m = _Fn(_UNFOLD_WRITES[case])
    x = _x(4, 6)
    x[1, 1] = x[2, 4] = -0.0
    cm = opencann.compile(m, (x.clone(),)) if backend == "opencann.compile" \
        else torch.compile(m, backend="opencann")
    for k in (1, 3):                                  # a second call, other values
        a, b = x.clone() * k, x.clone() * k
        with torch.no_grad():
            ref, got = m(a), cm(b)
        assert_close(b, a, strides=True, signed_zeros=True)                                  # the caller's tensor as eager leaves it
        assert_close(got, ref, strides=True, signed_zeros=True)


class _UnfoldWrite(nn.Module):
    def forward(self, x):
        x.unfold(1, 2, 3).mul_(2)
        return x


def test_writes_through_unfold_views_with_a_dynamic_dim():
    m = _UnfoldWrite()
    cm = opencann.compile(m, (_x(4, 6),), dynamic_shapes={"x": {1: "n"}},
                          dim_ranges={"n": (5, 16)})   # from 5: at least 2 windows
    for n in (6, 7, 8, 11, 16):
        a = _x(4, n, seed=n)
        b = a.clone()
        with torch.no_grad():
            ref, got = m(a), cm(b)
        assert_close(b, a, strides=True, signed_zeros=True)
        assert_close(got, ref, strides=True, signed_zeros=True)


@pytest.mark.parametrize("dynamic", [False, True])
def test_writes_through_unfold_views_in_a_torch_compile_training_graph(dynamic):
    def f(x, w):
        y = x * w
        y.unfold(1, 2, 3).mul_(2)
        z = y[:, 1:] * 1
        z.unfold(1, 2, 4).mul_(3)                     # windows that do not tile: as_strided
        return (y * z[:, :1]).sum(), y, z

    torch._dynamo.reset()
    tf = torch.compile(f, backend="opencann", dynamic=dynamic)
    for n in (7, 9):
        x = _x(3, n, seed=n)
        w1 = torch.randn(n, generator=torch.Generator().manual_seed(n)).requires_grad_()
        w2 = w1.detach().clone().requires_grad_()
        ref, got = f(x, w1), tf(x, w2)
        ref[0].backward()
        got[0].backward()
        assert_close([g.detach() for g in got], [r.detach() for r in ref], strides=True, signed_zeros=True)
        assert_close(w2.grad, w1.grad, strides=True, signed_zeros=True)


@pytest.mark.parametrize("backend", ["opencann.compile", "torch.compile"])
def test_writes_through_overlapping_unfold_windows_are_refused_loudly(backend):
    # eager applies the op once per window, so shared elements are written twice (its
    # order); torch's functionalization refuses such writes: an error, never other values
    m = _Fn(lambda x: (x.unfold(1, 3, 2).mul_(2), x)[1])
    with pytest.raises(Exception, match="internal overlap"):
        cm = opencann.compile(m, (_x(4, 7),)) if backend == "opencann.compile" \
            else torch.compile(m, backend="opencann")
        cm(_x(4, 7))


# == the same kind: a write through an ``expand`` view that repeats elements ===============
# functionalization inverts expand by adding every copy's change (base + sum_to(new - old)):
# ``x[:, :1].expand(4, 3).fill_(2)`` gave 4 * 2 - 3 * x. opencann.compile refuses it with
# one line; torch.compile runs that graph eagerly. A non-repeating expand compiles.

_EXPAND_WRITES = {
    "fill_slice_expand": lambda x: (x[:, :1].expand(4, 3).fill_(2.0), x)[1],
    "zero_intermediate_slice": lambda x: (lambda y: (
        y.unsqueeze(0).expand(2, 4, 6)[:, 1:3].zero_(), y * 1)[1])(x * 2),
    "masked_fill_broadcast_to": lambda x: (torch.broadcast_to(x[:1], (4, 6)).masked_fill_(
        torch.ones(4, 6, dtype=torch.bool), -0.0), x)[1],
    "through_a_written_unfold": lambda x: (x[:1].expand(4, 6).unfold(1, 2, 3).fill_(1.5), x)[1],
}


@pytest.mark.filterwarnings("ignore:Use of masked_fill_ on expanded tensors")
@pytest.mark.parametrize("backend", ["opencann.compile", "torch.compile"])
@pytest.mark.parametrize("case", sorted(_EXPAND_WRITES))
def test_writes_through_repeating_expand_views_follow_eager_or_refuse(case, backend):
    m = _Fn(_EXPAND_WRITES[case])
    x = _x(4, 6)
    if backend == "opencann.compile":
        with pytest.raises(opencann.frontend.torch.CaptureError) as e:
            opencann.compile(m, (x.clone(),))
        msg = str(e.value)
        assert len(msg.splitlines()) == 1 and "expanded view" in msg and "Fix" in msg, msg
        return
    torch._dynamo.reset()
    cm = torch.compile(m, backend="opencann")
    for k in (1, 3):
        a, b = x.clone() * k, x.clone() * k
        with torch.no_grad():
            ref, got = m(a), cm(b)
        assert_close(b, a, strides=True, signed_zeros=True)
        assert_close(got, ref, strides=True, signed_zeros=True)


@pytest.mark.parametrize("backend", ["opencann.compile", "torch.compile"])
def test_writes_through_a_non_repeating_expand_compile(backend):
    m = _Fn(lambda x: (x.expand(4, 6).mul_(2), x[:, None].expand(4, 1, 6)[:, 0].add_(1), x)[2])
    x = _x(4, 6)
    cm = opencann.compile(m, (x.clone(),)) if backend == "opencann.compile" \
        else torch.compile(m, backend="opencann")
    for k in (1, 3):
        a, b = x.clone() * k, x.clone() * k
        with torch.no_grad():
            ref, got = m(a), cm(b)
        assert_close(b, a, strides=True, signed_zeros=True)
        assert_close(got, ref, strides=True, signed_zeros=True)
