"""Whether an elementwise ATen kernel gives the same values at every memory layout of its
operands on this CPU, and whether a oneDNN convolution's post-op gives eager's activation
at eager's layout.

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
linspace(-4, 4) with every third element one of NaN, ±inf, ±1.7e38, ±3e38, ±1e13, ±0.0
(each operand shifted, so binary ops meet inf − inf, inf·0, NaN with inf...); integer
operands 0..6 − 3, bool ones every third True. Compared: NaN positions, the sign of every
zero and inf, inf vs finite (overflow), and finite values within rounding (|Δ| ≤ tol·(1 +
|x|), tol 4e-6 in float32/float64, 1.6e-2 in 16-bit floats: vectorised and scalar
transcendental loops may round an ulp apart); integer and bool results exactly. Every
answer is cached per argument tuple (op, operand dtypes and broadcast shapes, literals):
a few ms once per process for an ATen op, 0.1-0.3 s for a convolution probe (oneDNN
creates its primitives). Source of the fault: pytorch/pytorch#185770.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any, Callable, Dict, Iterator, Optional, Sequence, Tuple

import torch

from .cpu import mkldnn_available

LAYOUTS = ("contiguous", "channels_last", "strided")
PROBE_SHAPE = (2, 20, 5, 5)
_SPECIALS = (float("nan"), float("inf"), -float("inf"), 1.7e38, -1.7e38, 3e38, -3e38,
             1e13, -1e13, -0.0, 0.0)
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
    k = (torch.arange(slots.numel()) + shift) % len(_SPECIALS)
    slots.copy_(torch.tensor(_SPECIALS, dtype=x.dtype)[k])


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
    """The first flat index (of the contiguous order) where ``got`` and ``want`` differ:
    NaN-ness, the sign of a zero or an inf, inf vs finite, a finite value beyond rounding
    (|Δ| > tol·(1 + |want|), tol from `_RTOL`; not checked when ``finite`` is False: a
    sum in another order rounds a cancelling row differently), a special value's
    difference named before a finite one; exact equality for integer and bool results.
    None when they agree."""
    got, want = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
    if got.dtype != want.dtype:
        return 0
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(want.element_size())
    if want.dtype.is_floating_point and bits is not None and torch.equal(got.view(bits), want.view(bits)):
        return None                                 # bit for bit: the common case, one pass
    if not want.dtype.is_floating_point:
        bad = got != want
    else:
        nan, gnan = torch.isnan(want), torch.isnan(got)
        winf, ginf = torch.isinf(want), torch.isinf(got)
        exact = (winf | ginf | (want == 0) | (got == 0)) & ~nan
        bad = (gnan != nan) | (exact & ((got != want) | (torch.signbit(got) != torch.signbit(want))))
        special = bad & (gnan | nan | ginf | winf)
        if finite and not special.any():
            g, w = got.double(), want.double()
            bad |= ~exact & ~nan & ((g - w).abs() > _RTOL.get(want.dtype, 4e-6) * (1.0 + w.abs()))
        else:
            bad = special                           # name a special value first
    idx = torch.nonzero(bad)
    return int(idx[0]) if idx.numel() else None


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


def _show(t: torch.Tensor, i: int) -> str:
    return "%g" % t.contiguous().reshape(-1)[i].item()


@functools.lru_cache(maxsize=None)
def layout_differs(overload: Any, args: tuple, kwargs: tuple = (),
                   layouts: Tuple[str, ...] = LAYOUTS) -> Optional[str]:
    """None when ``overload`` gives the same values (module docstring: NaN, ±inf, ±0.0,
    overflow, finite values within rounding) with its `Operand` arguments laid out as
    each of ``layouts`` (default contiguous, channels-last, strided; mixed too when
    channels-last is among them) as with all contiguous, on this CPU; else one line
    naming the layout, the input and both results (the reason a rewrite keeps the op at
    eager's layout).

    ``args``: the positional arguments, an `Operand` for each tensor (4-D shapes), tuples
    for lists; ``kwargs``: (name, value) pairs, likewise. A call that raises at some layout
    is reported as a difference. Cached per (overload, args, kwargs, layouts). Source:
    pytorch/pytorch#185770 (oneDNN's AVX-512 GELU, used for contiguous tensors only)."""
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
            x = ", ".join(_show(t, i) if t.shape == want.shape else "…" for t in base)
            return (f"{name} gives {_show(got, i)} for ({x}) with {desc} on this CPU but "
                    f"{_show(want, i)} with contiguous operands")
    return None


# oneDNN post-op (name, algorithm) of each activation opencann fuses into a convolution
_POST_OPS = {"gelu": ("gelu", "none"), "tanh": ("tanh", ""), "sigmoid": ("sigmoid", ""),
             "silu": ("swish", "")}
_EAGER_ACT: Dict[str, Callable] = {
    "gelu": lambda t: torch.ops.aten.gelu(t), "tanh": torch.tanh, "sigmoid": torch.sigmoid,
    "silu": torch.nn.functional.silu, "relu": torch.relu}


def _identity_conv(x: torch.Tensor, post_op: str = "none", algorithm: str = "",
                   other: Optional[torch.Tensor] = None, inplace: bool = False) -> torch.Tensor:
    """oneDNN's convolution (``mkldnn._convolution_pointwise``, ConvBiasAct/ConvAddAct's
    kernel) as an identity: depthwise 1×1, weight 1, no bias; with ``other`` its binary
    "add" post-op (in place into ``other`` when ``inplace``)."""
    c = x.shape[1]
    w = torch.ones(c, 1, 1, 1, dtype=x.dtype)
    conv = (0, 0), (1, 1), (1, 1), c
    if other is None:
        return torch.ops.mkldnn._convolution_pointwise(x, w, None, *conv, post_op, [], algorithm)
    if inplace:
        return torch.ops.mkldnn._convolution_pointwise_.binary(other, x, w, None, *conv, "add",
                                                               None, None, [], "")
    return torch.ops.mkldnn._convolution_pointwise.binary(x, other, w, None, *conv, "add",
                                                          None, None, [], "")


@functools.lru_cache(maxsize=None)
def conv_post_op_differs(act: str, dtype: torch.dtype, layout: str) -> Optional[str]:
    """None when a oneDNN convolution with ``act`` fused ("gelu" (erf), "tanh", "sigmoid",
    "silu" as its post-op; "relu" as eager's in-place ReLU on oneDNN's output, as
    ``ConvBiasAct`` runs it) gives the values of the convolution alone followed by
    eager's ``act`` on its output laid out as ``layout`` (eager's layout of the conv's
    output: one of `LAYOUTS`), on this CPU, for inputs of ``dtype``; else one line naming
    the input and both results (`FuseConvAct`'s Skip reason). Probed with the input both
    contiguous and channels-last; a kernel that raises is a difference. Cached per
    (act, dtype, layout). Raises KeyError for another ``act``."""
    eager = _EAGER_ACT[act]
    post_op, algorithm = _POST_OPS.get(act, ("none", ""))
    if not mkldnn_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    x = probe_tensor(dtype, PROBE_SHAPE)
    for in_lay in ("contiguous", "channels_last"):
        xi = at_layout(x, in_lay)
        try:
            fused = _identity_conv(xi, post_op, algorithm)
            if act == "relu":
                fused = torch.relu_(fused)
            want = eager(at_layout(_identity_conv(xi), layout))
        except (RuntimeError, TypeError, ValueError) as e:
            return f"oneDNN's convolution with {act} fails for {dtype} ({str(e).splitlines()[0]})"
        i = values_differ(fused, want)
        if i is not None:
            return (f"oneDNN's convolution with the {act} post-op gives {act}({_show(x, i)}) = "
                    f"{_show(fused, i)} on this CPU where eager's {act} on the {layout} "
                    f"convolution output gives {_show(want, i)} (pytorch/pytorch#185770)")
    return None


@functools.lru_cache(maxsize=None)
def conv_sum_differs(relu: bool, dtype: torch.dtype, layout: str, other_layout: str) -> Optional[str]:
    """None when oneDNN's convolution with the binary "add" post-op (in and out of place,
    then eager's in-place ReLU when ``relu``: ``ConvAddAct``'s kernel) gives the values of
    the convolution alone laid out as ``layout``, plus the addend laid out as
    ``other_layout`` with eager's ``add`` (then ``relu``), on this CPU for ``dtype``; else
    one line naming the inputs and both results (`FuseConvAddAct`'s Skip reason). Cached."""
    if not mkldnn_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    x = probe_tensor(dtype, PROBE_SHAPE)
    other = probe_tensor(dtype, PROBE_SHAPE, shift=1)
    for in_lay in ("contiguous", "channels_last"):
        xi = at_layout(x, in_lay)
        conv = _identity_conv(xi)
        want = torch.add(at_layout(conv, layout), at_layout(other, other_layout))
        want = torch.relu(want) if relu else want
        for inplace in (False, True) if other_layout != "strided" else (False,):
            try:
                o = at_layout(other, other_layout).clone(memory_format=torch.preserve_format)
                fused = _identity_conv(xi, other=o, inplace=inplace)
                fused = torch.relu_(fused) if relu else fused
            except (RuntimeError, TypeError, ValueError) as e:
                return f"oneDNN's convolution with the sum post-op fails for {dtype} ({e})"
            i = values_differ(fused, want)
            if i is not None:
                what = "sum + ReLU" if relu else "sum"
                return (f"oneDNN's convolution with the {what} post-op gives {_show(fused, i)} "
                        f"for ({_show(x, i)}, {_show(other, i)}) on this CPU where eager's add"
                        f"{' + relu' if relu else ''} at the {layout} layout gives "
                        f"{_show(want, i)}")
    return None


__all__ = ["LAYOUTS", "PROBE_SHAPE", "Operand", "at_layout", "conv_post_op_differs",
           "conv_sum_differs", "layout_differs", "probe_tensor", "values_differ"]
