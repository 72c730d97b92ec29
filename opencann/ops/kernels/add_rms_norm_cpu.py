"""CPU kernel of AddRmsNorm (``torch_npu.npu_add_rms_norm``): the residual sum s = a + b and
y = RMSNorm(s)·w over the last axis, in one pass over each row, both written: a
decoder's residual stream (s) goes on to the next residual add while y feeds the next
linears. Replaces an ATen ``add`` writing s and ``rms_norm`` reading it back (two
kernels, and in a decode step two calls on a 768-element row whose cost is the call, not
the arithmetic).

Layout: a, b, y, s [R, D] (any leading dims flattened into R rows), w [D]; float32.
Rows split over the cores with ``prange`` above ATen's grain (`numba_cache.launch`: a
prefill), on the calling thread alone below it (a decode step: no OpenMP team).

Numerics (Zhang & Sennrich 2019, "Root Mean Square Layer Normalization",
arXiv:1910.07467; transformers' LlamaRMSNorm): s = a + b rounded to fp32 as eager's add
(s bit for bit); each s² rounded to fp32 as eager's, summed in float64 (vectorised:
``reassoc`` on the sum only), the mean rounded to fp32, so y agrees with eager to its own
fp32 rounding; r = 1 / sqrt(mean + eps) and y = (s·r)·w in fp32, eager's order, without
fast-math (`rms_norm_cpu.scale_row`). Special values as the
spelled-out form: a NaN or inf in a row makes its y NaN; s² overflowing (|s| ≳ 1.8e19)
gives r = 0 and a row of zeros (NaN where s is inf), as eager; a row of zeros with eps = 0
gives r = inf and y = 0·inf = NaN, as eager (numba's ``error_model="numpy"``: IEEE
division, not Python's ZeroDivisionError).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from numba import prange

from .numba_cache import GRAIN, entry_point, launch, njit, prebound
from .rms_norm_cpu import scale_row
from .numpy_views import NumpyViews, static_view
from .out_arg import check_out
from ...ir import Node, TensorDesc, numel


@njit(fastmath={"reassoc"}, cache=True)
def _add_sum_squares(a, b, s, r):  # pragma: no cover - numba
    """s[r, :] = a[r, :] + b[r, :] (fp32, eager's add) and the float64 sum of the fp32
    squares of s[r, :] (`rms_norm_cpu.sum_squares`'s arithmetic)."""
    acc = 0.0
    for j in range(a.shape[1]):
        v = a[r, j] + b[r, j]
        s[r, j] = v
        acc += np.float64(v * v)
    return acc


@njit(fastmath=False, error_model="numpy", cache=True)
def _row(a, b, w, eps, y, s, r):  # pragma: no cover - numba
    scale_row(s, r, np.float32(_add_sum_squares(a, b, s, r) / a.shape[1]), w, eps, y)


@njit(fastmath=False, error_model="numpy", cache=True)
def _serial(a, b, w, eps, y, s):  # pragma: no cover - numba
    for r in range(a.shape[0]):
        _row(a, b, w, eps, y, s, r)


@njit(parallel=True, fastmath=False, error_model="numpy", cache=True)
def _parallel(a, b, w, eps, y, s):  # pragma: no cover - numba
    for r in prange(a.shape[0]):
        _row(a, b, w, eps, y, s, r)


def add_rms_norm(a: torch.Tensor, b: torch.Tensor, weight: torch.Tensor, eps: float,
                 out=None):
    """(y, s): s = a + b and y = s·rsqrt(mean(s², -1) + eps)·weight, for ``a``, ``b``
    [..., D] float32 of one shape and ``weight`` [D] float32 (module docstring:
    numerics). ``out``: a (y, s) pair of contiguous float32 tensors to write (s of a's
    shape, y of a's elements, any shape: the fused node may give it the squeezed shape of a
    view), else fresh ones. Raises ValueError (one line) for other shapes or dtypes
    (``out``'s included)."""
    d = a.shape[-1] if a.dim() else 0
    if a.shape != b.shape or a.dim() < 1 or tuple(weight.shape) != (d,) \
            or not (a.dtype == b.dtype == weight.dtype == torch.float32):
        raise ValueError(f"add_rms_norm: expected float32 a, b [..., D] of one shape and weight "
                         f"[D], got {tuple(a.shape)} {a.dtype}, {tuple(b.shape)} {b.dtype}, "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if out is not None:
        if len(out) != 2:
            raise ValueError(f"add_rms_norm: out must be a (y, s) pair, got {len(out)} items")
        check_out("add_rms_norm", out[0], None, numel=a.numel())
        check_out("add_rms_norm", out[1], a.shape)
    y, s = out if out is not None and out[0].is_contiguous() and out[1].is_contiguous() \
        else (torch.empty(a.shape if out is None else out[0].shape, dtype=torch.float32),
              torch.empty(a.shape, dtype=torch.float32))
    rows = a.numel() // d if d else 0
    if rows == 0:
        return _into(out, y, s)
    args = (a.detach().numpy().reshape(rows, d), b.detach().numpy().reshape(rows, d),
            weight.detach().numpy(), np.float32(eps), y.numpy().reshape(rows, d),
            s.numpy().reshape(rows, d))   # NumPy's reshape: a view (cheaper than torch's)
    if rows * d < GRAIN:
        _serial(*args)
    else:
        with launch(rows * d):
            _parallel(*args)
    return _into(out, y, s)


def _into(out, y: torch.Tensor, s: torch.Tensor):
    """(y, s), copied into ``out`` when it was given but could not be written directly."""
    if out is None or out[0] is y:
        return y, s
    return out[0].copy_(y), out[1].copy_(s)


def bind_add_rms_norm(a: TensorDesc, b: TensorDesc, weight: TensorDesc, eps: float) -> Callable:
    """``run(a, b, weight, out=None) -> (y, s)``: `add_rms_norm` for a compiled graph whose
    operands have the static descriptions given. Where those allow it (float32 a, b
    [..., D] of one static shape, weight [D]; rows * D below `GRAIN`, a decode step's rows)
    the shape and dtype checks are made once, here, and a call with planned contiguous
    ``out`` buffers is the numba call on memoized NumPy views (`NumpyViews`: the graph
    hands the same arena buffers at every call), through the kernel's entry point for
    their types (`numba_cache.entry_point`: every view is C-contiguous float32), and a
    call with the last call's tensors reuses its views — measured for one 768-element
    row 1.1 against 6.8 µs a call warm; right after a 64 MiB copy (a decode GEMM's cold
    caches) 22 against 109 µs. Any other call takes `add_rms_norm` (its checks and
    one-line errors). Same bits on either path."""
    def general(x1, x2, g, out=None):
        return add_rms_norm(x1, x2, g, eps, out=out)
    shape = tuple(a.shape)
    if not (a.is_static and a.shape == b.shape and len(shape) >= 1 and shape[-1]
            and tuple(weight.shape) == shape[-1:]
            and a.dtype.torch == b.dtype.torch == weight.dtype.torch == torch.float32):
        return general
    d = int(shape[-1])
    rows = numel(shape) // d
    if rows * d >= GRAIN:
        return general
    rd, views, e32, f32 = (rows, d), NumpyViews(), np.float32(eps), torch.float32
    # the last fast call's (5 tensors, pointers, entry, args), replaced whole; `_serial`'s entry
    last, entry = [None], [None]

    def run(x1, x2, g, out=None):
        if out is None:
            return general(x1, x2, g)
        y, s = out
        m = last[0]     # read once: another thread may replace it (never mutated)
        if m is not None and x1 is m[0] and x2 is m[1] and g is m[2] and y is m[3] and s is m[4] \
                and m[5] == (x1.data_ptr(), x2.data_ptr(), g.data_ptr(), y.data_ptr(), s.data_ptr()):
            m[6](*m[7])      # the same tensors as the last call: its views
            return y, s
        args = (views.shaped(x1, rd), views.shaped(x2, rd), views.shaped(g, (d,)), e32,
                views.shaped(y, rd), views.shaped(s, rd))
        if any(x is None for x in args) or x1.shape != shape or x2.shape != shape \
                or not all(t.dtype is f32 for t in (x1, x2, g, y, s)):
            return general(x1, x2, g, out=out)    # its checks: the entry point is float32's
        fn = entry[0]       # every call's views have the same types (C-contiguous float32)
        (_serial if fn is None else fn)(*args)
        fn = entry[0] = fn if fn is not None else entry_point(_serial, args)
        if fn is not None:
            last[0] = (x1, x2, g, y, s, (x1.data_ptr(), x2.data_ptr(), g.data_ptr(),
                                         y.data_ptr(), s.data_ptr()), fn, args)
        return y, s

    def prebind(x1, x2, g, out=None):
        """``call()`` running ``run(x1, x2, g, out)`` on these very tensors (the same
        objects over the same memory at every call), or None where they do not allow it
        (`numba_cache.prebound`)."""
        if out is None or x1.shape != shape or x2.shape != shape:
            return None
        args = (static_view(x1, rd), static_view(x2, rd), static_view(g, (d,)), e32,
                static_view(out[0], rd), static_view(out[1], rd))
        return None if any(a is None for a in args) else prebound(_serial, args, result=out)
    run.prebind = prebind
    return run


def make_add_rms_norm_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory of AddRmsNorm(x1, x2, gamma; attrs epsilon) -> (y, x): ``run(x1, x2,
    gamma, out=None)`` (`bind_add_rms_norm` over `add_rms_norm`; ``out`` the planned (y, x)
    buffers)."""
    eps = float(node.attrs["epsilon"])
    i1, i2, ig = (node.attrs[k].index for k in ("x1", "x2", "gamma"))
    bound = bind_add_rms_norm(in_descs[i1], in_descs[i2], in_descs[ig], eps)

    def run(*xs, out=None):
        return bound(xs[i1], xs[i2], xs[ig], out=out)
    if hasattr(bound, "prebind"):
        run.prebind = lambda *xs, out=None: bound.prebind(xs[i1], xs[i2], xs[ig], out)
    return run


__all__ = ["add_rms_norm", "bind_add_rms_norm", "make_add_rms_norm_kernel"]
