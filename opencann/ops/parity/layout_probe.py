"""The layout probe: does an ATen kernel give the same values at every memory layout of
its operands on this CPU? (The convolution post-op probes are in `conv_probes`.)

Eager's result is eager's kernel at eager's layout (the traced strides), and on some CPUs
that kernel depends on the layout: on AVX-512, ATen sends contiguous fp32/bf16 GELU to
oneDNN's ``eltwise_gelu_erf`` (gelu(+inf) = NaN, 1.7e38 overflows to inf;
pytorch/pytorch#185770) and channels-last or strided tensors to its own vectorised loop
(gelu(+inf) = +inf, gelu(1.7e38) = 1.7e38). So a rewrite that moves an op to another
layout (the CPU layout stage's NHWC regions, a oneDNN convolution's channels-last output
read as is) or to another kernel (an activation as a convolution's post-op) must ask here
first:

- `layout_differs(overload, args, kwargs)`: runs ``overload`` on probe operands (`Operand`
  placeholders in ``args``/``kwargs``, the rest literal) laid out contiguous,
  channels-last, strided (every other element) and mixed (one operand channels-last, the
  others contiguous, each way round), and compares every result with the contiguous one.
- `conv_post_op_differs(act, dtype, layout)` / `conv_sum_differs(relu, dtype, layout,
  other_layout)`: oneDNN's convolution with the activation (or the sum, then eager's
  in-place ReLU, as ``ConvAddAct`` runs) vs the convolution alone followed by eager's op
  on its output at ``layout`` (eager's layout of the convolution's output).

Probe operands: 1000-element 4-D tensors (a vector body and a tail in every layout),
linspace(-4, 4) with every third element one of `specials.LAYOUT_SPECIALS` (NaN, ±inf,
±1.7e38, ±3e38, ±1e13, ±0.0; each operand shifted, so binary ops meet inf − inf, inf·0, NaN with inf...); integer
operands 0..6 − 3, bool ones every third True. Compared by `compare.first_difference`
with ``zeros``: NaN positions, the sign of every
zero and inf, inf vs finite (overflow), and finite values within rounding (|Δ| ≤ tol·(1 +
|x|), tol 4e-6 in float32/float64, 1.6e-2 in 16-bit floats: vectorised and scalar
transcendental loops may round an ulp apart); integer and bool results exactly. Every
answer is cached per argument tuple (op, operand dtypes and broadcast shapes, literals)
in memory and on disk (`probe.Probe`): a few ms for an ATen op, once per machine. Source of the fault: pytorch/pytorch#185770.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Tuple

import torch

from .compare import first_difference
from .probe import Probe, register
from .specials import LAYOUT_SPECIALS

LAYOUTS = ("contiguous", "channels_last", "strided")
PROBE_SHAPE = (2, 20, 5, 5)
_RTOL = {torch.float32: 4e-6, torch.float64: 4e-6, torch.float16: 1.6e-2, torch.bfloat16: 1.6e-2}


@dataclass(frozen=True)
class Operand:
    """A tensor operand of a probed call: its dtype and its shape in the probe (4-D,
    `PROBE_SHAPE`'s size on each dim the operand does not broadcast along, else 1)."""

    dtype: torch.dtype
    shape: Tuple[int, ...] = PROBE_SHAPE
    sparse: bool = False      # `probe_tensor`'s pattern for window and reduction ops


def probe_tensor(dtype: torch.dtype, shape: Sequence[int], shift: int = 0,
                 sparse: bool = False) -> torch.Tensor:
    """A contiguous probe operand of ``shape``: floats linspace(-4, 4) with every third
    element (from ``shift``) one of NaN, ±inf, ±1.7e38, ±3e38, ±1e13, ±0.0; integers
    0..6 − 3; bools True every third element. ``sparse`` (for pooling, reductions,
    BatchNorm, whose windows would all hold a NaN): seeded randn with every 37th element
    special and, for 4-D shapes with C > 5, channel planes 3 and 5 of ±1.7e38/3e38 (their
    sums overflow in one order and not in another)."""
    n = 1
    for s in shape:
        n *= int(s)
    idx = torch.arange(n)
    if dtype == torch.bool:
        return ((idx + shift) % 3 == 0).reshape(shape)
    if not dtype.is_floating_point:
        return ((idx + shift) % 7 - 3).to(dtype).reshape(shape)
    if sparse:
        x = torch.randn(n, dtype=torch.float64, generator=torch.Generator().manual_seed(shift))
        _scatter_specials(x, shift % 37, 37, shift)
        x = x.reshape(shape)
        if len(shape) == 4 and shape[1] > 5:
            x[:, 3] = 3e38
            x[:, 5] = -1.7e38
            x[:, 5, ..., ::2] = 1.7e38
        return x.to(dtype)
    x = torch.linspace(-4.0, 4.0, n, dtype=torch.float64)
    _scatter_specials(x, shift % 3, 3, shift)
    return x.to(dtype).reshape(shape)


def _scatter_specials(x: torch.Tensor, start: int, step: int, shift: int) -> None:
    """x[start::step] = the k-th special value (from ``shift``, cycling), in place."""
    slots = x[start::step]
    k = (torch.arange(slots.numel()) + shift) % len(LAYOUT_SPECIALS)
    slots.copy_(torch.tensor(LAYOUT_SPECIALS, dtype=x.dtype)[k])


def at_layout(t: torch.Tensor, layout: str) -> torch.Tensor:
    """``t`` (4-D) with the same values laid out as ``layout``: "contiguous",
    "channels_last" (NHWC strides) or "strided" (every other element of a buffer twice as
    wide along the last dim). Raises KeyError for another layout."""
    if layout == "contiguous":
        return t.contiguous()
    if layout == "channels_last":
        return t.contiguous(memory_format=torch.channels_last)
    if layout == "strided":
        buf = torch.empty(tuple(t.shape[:-1]) + (2 * t.shape[-1],), dtype=t.dtype)
        buf[..., ::2] = t
        return buf[..., ::2]
    raise KeyError(layout)


def values_differ(got: torch.Tensor, want: torch.Tensor, finite: bool = True) -> Optional[int]:
    """The first flat index (of the contiguous order) where ``got`` and ``want`` differ
    (`compare.first_difference` with ±0.0 compared by sign, and finite values within
    rounding unless ``finite`` is False: a sum in another order rounds a cancelling row
    differently); None when they agree."""
    rtol = _RTOL.get(want.dtype, 4e-6) if finite else None
    return first_difference(got, want, rtol=rtol, zeros=True)


def _layouts(n_operands: int, layouts: Sequence[str]) -> Iterator[Tuple[str, Tuple[str, ...]]]:
    """(description, layout per operand) of every arrangement probed besides all
    contiguous: each of ``layouts`` for all operands, and mixed when "channels_last" is
    among them."""
    for lay in layouts:
        if lay != "contiguous":
            yield f"{lay} operands", (lay,) * n_operands
    if n_operands > 1 and "channels_last" in layouts:
        for k in range(n_operands):
            yield (f"operand {k} channels-last, the others contiguous",
                   tuple("channels_last" if j == k else "contiguous" for j in range(n_operands)))


def _bind(args: tuple, kwargs: tuple, tensors: Sequence[torch.Tensor]) -> Tuple[list, dict]:
    """``args``/``kwargs`` with the k-th `Operand` replaced by ``tensors[k]``."""
    it = iter(tensors)

    def sub(a):
        return next(it) if isinstance(a, Operand) else (list(a) if isinstance(a, tuple) else a)
    out_args = [sub(a) for a in args]
    return out_args, {k: sub(v) for k, v in kwargs}


def _first(result: Any) -> torch.Tensor:
    return result[0] if isinstance(result, (tuple, list)) else result


def show_element(t: torch.Tensor, i: int) -> str:
    """Element ``i`` of ``t`` in row-major order (of its logical shape), as ``%g`` text:
    how the probe reasons quote a value."""
    return "%g" % t.contiguous().reshape(-1)[i].item()


def _layout_differs(overload: Any, args: tuple, kwargs: tuple,
                    layouts: Tuple[str, ...]) -> Optional[str]:
    """None when ``overload`` gives the same values (module docstring: NaN, ±inf, ±0.0,
    overflow, finite values within rounding) with its `Operand` arguments laid out as
    each of ``layouts`` (default contiguous, channels-last, strided; mixed too when
    channels-last is among them) as with all contiguous, on this CPU; else one line
    naming the layout, the input and both results (the reason a rewrite keeps the op at
    eager's layout).

    ``args``: the positional arguments, an `Operand` for each tensor (4-D shapes), tuples
    for lists; ``kwargs``: (name, value) pairs, likewise. A call that raises at some layout
    is reported as a difference. Source: pytorch/pytorch#185770 (oneDNN's AVX-512 GELU,
    used for contiguous tensors only). Uncached: `layout_differs` caches it."""
    ops = [a for a in args if isinstance(a, Operand)] + [v for _, v in kwargs if isinstance(v, Operand)]
    base = [probe_tensor(o.dtype, o.shape, shift=k, sparse=o.sparse) for k, o in enumerate(ops)]
    name = str(overload)
    try:
        a, kw = _bind(args, kwargs, base)
        want = _first(overload(*a, **kw))
    except (RuntimeError, TypeError, ValueError) as e:
        return f"{name} fails on the probe ({str(e).splitlines()[0]})"
    for desc, lays in _layouts(len(ops), layouts):
        try:
            a, kw = _bind(args, kwargs, [at_layout(t, lay) for t, lay in zip(base, lays)])
            got = _first(overload(*a, **kw))
        except (RuntimeError, TypeError, ValueError) as e:
            return f"{name} fails with {desc} on this CPU ({str(e).splitlines()[0]})"
        i = values_differ(got, want, finite=not any(o.sparse for o in ops))
        if i is not None:
            x = ", ".join(show_element(t, i) if t.shape == want.shape else "…" for t in base)
            return (f"{name} gives {show_element(got, i)} for ({x}) with {desc} on this CPU but "
                    f"{show_element(want, i)} with contiguous operands")
    return None


LAYOUT_PROBE = register(Probe(
    "layout", guards="the CPU layout stage's NHWC regions (passes/layout/cpu_layout.py), "
    "elementwise ops reading a oneDNN convolution's channels-last output (runtime/codegen.py), "
    "a model file's re-check at load",
    kernel="the node's ATen overload with channels-last, strided and mixed operands",
    inputs="`probe_tensor` operands of the node's dtypes and broadcast shapes",
    run=_layout_differs))


def layout_differs(overload: Any, args: tuple, kwargs: tuple = (),
                   layouts: Tuple[str, ...] = LAYOUTS) -> Optional[str]:
    """`_layout_differs` (None, or where ``overload`` gives other values at another layout
    of its `Operand` arguments than with all contiguous, on this CPU), cached per
    (overload, args, kwargs, layouts) in memory and on disk (`LAYOUT_PROBE`)."""
    return LAYOUT_PROBE(overload, tuple(args), tuple(kwargs), tuple(layouts))


__all__ = ["LAYOUTS", "LAYOUT_PROBE", "PROBE_SHAPE", "Operand", "at_layout", "layout_differs",
           "probe_tensor", "values_differ"]
