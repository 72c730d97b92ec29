"""CPU kernel of RmsNorm for a decode step's rows: y = x·rsqrt(mean(x², -1) + eps)·w over
the last axis, one pass over each row, written into the planned buffer (`bind_rms_norm`).

Why: a decoder's first RmsNorm (the embedding's output, before any residual add to fuse it
with: `add_rms_norm_cpu`) runs at the start of every decode step, right after the last
step's LM head streamed its weight through the caches. There ATen's ``rms_norm`` (pow,
mean, add, rsqrt, mul, mul: six dispatches) took 116-142 µs a call for one 768-element
row on the 2-core EPYC (per op inside a 125M Llama's batch-1 step, 30 steps); warm, 28.6
µs. A prebound numba call (`numba_cache.prebound`) has one entry and no dispatch.

Layout: x, y [R, D] (leading dims flattened), w [D] or none; float32; R·D below
`numba_cache.GRAIN` (decode rows; longer inputs keep ATen's kernel). Numerics as
`add_rms_norm_cpu` (Zhang & Sennrich 2019, arXiv:1910.07467; transformers'
LlamaRMSNorm): each x² rounded to fp32 as eager's, their sum in float64 (`sum_squares`:
more exact than ATen's fp32 cascade, so y stays within eager's own rounding of the exact
result, also for a row of one large and many small values), the mean rounded to fp32, r
= 1 / sqrt(mean + eps) and y = (x·r)·w in fp32 in eager's order, no fast-math
(`scale_row`; w absent: a weight of ones, exact). A NaN or inf in a row makes its y NaN;
an x² overflowing gives r = 0 and zeros (NaN where x is inf), as eager; a row of zeros
with eps = 0 gives 0·inf = NaN, as eager.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from .numba_cache import GRAIN, njit, prebound
from .numpy_views import static_view
from ...ir import TensorDesc, numel


@njit(fastmath={"reassoc"}, cache=True)
def sum_squares(x, r):  # pragma: no cover - numba
    """The float64 sum of the float32 squares x[r, j]² (each rounded to float32, as
    eager's ``pow(x, 2)``: one that overflows is inf). ``reassoc`` lets LLVM vectorise
    the sum only; each square is one fp32 product, nothing to contract."""
    acc = 0.0
    for j in range(x.shape[1]):
        acc += np.float64(x[r, j] * x[r, j])
    return acc


@njit(fastmath=False, error_model="numpy", cache=True)
def scale_row(x, r, ms, w, eps, y):  # pragma: no cover - numba
    """y[r, :] = (x[r, :]·rs)·w with rs = 1 / sqrt(ms + eps), all in float32 and in
    eager's order: no fast-math here (``reassoc`` had LLVM hoist (x·w)·rs, which
    overflows or underflows where eager's product does not)."""
    rs = np.float32(1.0) / np.sqrt(ms + eps)
    for j in range(x.shape[1]):
        y[r, j] = (x[r, j] * rs) * w[j]


@njit(fastmath=False, error_model="numpy", cache=True)
def _rows(x, w, eps, y):  # pragma: no cover - numba
    D = x.shape[1]
    for r in range(x.shape[0]):
        scale_row(x, r, np.float32(sum_squares(x, r) / D), w, eps, y)


def decode_rows(x: TensorDesc, weight: Optional[TensorDesc]) -> bool:
    """Whether `bind_rms_norm` serves an RmsNorm over the last axis of ``x`` with weight
    ``weight`` (or none): float32, static, R·D below `numba_cache.GRAIN`, weight [D]."""
    shape = tuple(x.shape)
    return (x.is_static and len(shape) >= 1 and bool(shape[-1]) and x.dtype.torch == torch.float32
            and numel(shape) < GRAIN
            and (weight is None or (weight.is_static and tuple(weight.shape) == shape[-1:]
                                    and weight.dtype.torch == torch.float32)))


def bind_rms_norm(x: TensorDesc, weight: Optional[TensorDesc], eps: float,
                  general: Callable) -> Callable:
    """``run(x, w=None, out=None)``: RmsNorm of ``x`` ([..., D] float32, `decode_rows`)
    by the numba row kernel into ``out`` (a contiguous float32 tensor of x's elements: the
    planned buffer), with ``prebind`` for a compiled graph's static operands; a call that
    does not fit (another shape or dtype, no or a strided ``out``, a strided x) runs
    ``general(x, w)`` (ATen's kernel) and copies into ``out``."""
    shape = tuple(int(d) for d in x.shape)
    d = shape[-1]
    rd, e32 = (numel(shape) // d, d), np.float32(eps)
    ones = np.ones(d, np.float32)

    def views(xt, wt, out):
        if out is None or xt.shape != shape:
            return None
        args = (static_view(xt, rd), ones if wt is None else static_view(wt, (d,)), e32,
                static_view(out, rd))
        return None if any(a is None for a in args) else args

    def run(xt, wt=None, out=None):
        args = views(xt, wt, out)
        if args is None:
            y = general(xt, wt)
            return y if out is None else out.copy_(y.reshape(out.shape))
        _rows(*args)
        return out

    def prebind(xt, wt=None, out=None):
        """``call()`` running ``run(xt, wt, out)`` on these very tensors, or None where
        they do not allow it (`numba_cache.prebound`)."""
        args = views(xt, wt, out)
        return None if args is None else prebound(_rows, args, result=out)
    run.prebind = prebind
    return run


__all__ = ["bind_rms_norm", "decode_rows", "scale_row", "sum_squares"]
