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
LlamaRMSNorm): the mean of x² accumulated in fp32 (fastmath ``reassoc``/``contract``
only, another summation order than ATen's: y agrees with eager to fp32 rounding), r = 1 /
sqrt(mean + eps), y = (x·r)·w (eager's order; w absent: a weight of ones, exact). A NaN
or inf in a row makes its y NaN; x² overflowing gives r = 0 and zeros (NaN where x is
inf), as eager; a row of zeros with eps = 0 gives 0·inf = NaN, as eager.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch

from .numba_cache import GRAIN, njit, prebound
from .numpy_views import static_view
from ...ir import TensorDesc, numel

_FM = {"reassoc", "contract"}


@njit(fastmath=_FM, error_model="numpy", cache=True)
def _rows(x, w, eps, y):  # pragma: no cover - numba
    D = x.shape[1]
    for r in range(x.shape[0]):
        acc = np.float32(0.0)
        for j in range(D):
            acc += x[r, j] * x[r, j]
        rs = np.float32(1.0) / np.sqrt(acc / np.float32(D) + eps)
        for j in range(D):
            y[r, j] = (x[r, j] * rs) * w[j]


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


__all__ = ["bind_rms_norm", "decode_rows"]
