"""CPU kernel of RotaryMul (``torch_npu.npu_rotary_mul``): rotary position embedding
y = x·cos + rotate_half(x)·sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), in one
pass (RoFormer, Su et al. 2021, arXiv:2104.09864; the half-rotation layout of
transformers' ``rotate_half`` in ``modeling_llama.py``). Replaces the seven ops a
traced Llama attention spells it with (two slices, Neg, ConcatD, two Muls, Add) per
query and key tensor: in a decode step each is a call on a few hundred elements.

Layout: x [B, N, S, D] (any strides: the query/key heads are a transposed view of a
linear's output), cos and sin broadcastable to x along its leading dims (``[B, 1, S,
D]`` as transformers makes them; read at index 0 along a dim of size 1, no expanded
copy: an expanded NumPy view costs more than the kernel at decode sizes), y [B, N, S, D] contiguous; float32, D even.
Rows (b, n, s) split over the cores with ``prange`` above ATen's grain
(`numba_cache.launch`), on the calling thread below it.

Numerics: no fast-math, so each product and the sum round as eager's separate ``mul``,
``mul`` and ``add`` (no fused multiply-add): y is eager's bit for bit, NaN and inf
included.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch
from numba import prange

from .numba_cache import GRAIN, launch, njit
from ...ir import Node, TensorDesc


@njit(cache=True, inline="always")
def _row(x, c, s, y, t):  # pragma: no cover - numba
    """Row t of the [B·N·S, D] rows; c and s are 4-D with 1 in a dim they broadcast
    along (indexed at 0 there: no expanded copy)."""
    B, N, S, D = x.shape
    b = t // (N * S)
    n = (t // S) % N
    i = t % S
    cb, cn, ci = (b if c.shape[0] > 1 else 0), (n if c.shape[1] > 1 else 0), (i if c.shape[2] > 1 else 0)
    sb, sn, si = (b if s.shape[0] > 1 else 0), (n if s.shape[1] > 1 else 0), (i if s.shape[2] > 1 else 0)
    h = D // 2
    for d in range(h):
        y[b, n, i, d] = x[b, n, i, d] * c[cb, cn, ci, d] + (-x[b, n, i, d + h]) * s[sb, sn, si, d]
    for d in range(h, D):
        y[b, n, i, d] = x[b, n, i, d] * c[cb, cn, ci, d] + x[b, n, i, d - h] * s[sb, sn, si, d]


@njit(cache=True)
def _serial(x, c, s, y):  # pragma: no cover - numba
    B, N, S, _ = x.shape
    for t in range(B * N * S):
        _row(x, c, s, y, t)


@njit(parallel=True, cache=True)
def _parallel(x, c, s, y):  # pragma: no cover - numba
    B, N, S, _ = x.shape
    for t in prange(B * N * S):
        _row(x, c, s, y, t)


@njit(cache=True)
def _serial_pair(xq, xk, c, s, yq, yk):  # pragma: no cover - numba
    """`_serial` on the query and on the key, one call."""
    _serial(xq, c, s, yq)
    _serial(xk, c, s, yk)


def _as4(r: torch.Tensor, shape) -> "np.ndarray":
    """``r`` as a 4-D NumPy view (leading 1s added) whose dims equal ``shape``'s or are 1
    (the kernel indexes those at 0); ValueError when it does not broadcast so."""
    a = r.detach().numpy()
    if a.ndim < 4:
        a = a.reshape((1,) * (4 - a.ndim) + a.shape)
    if a.ndim != 4 or a.shape[3] != shape[3] or any(m not in (1, n) for m, n in zip(a.shape, shape)):
        raise ValueError(f"rotary_mul: cos/sin {tuple(r.shape)} do not broadcast to x "
                         f"{tuple(shape)} along its leading dims; pass them as [B, 1, S, D]")
    return a


def rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, out=None) -> torch.Tensor:
    """x·r1 + rotate_half(x)·r2 (module docstring) for ``x`` [B, N, S, D] float32 (D
    even) and ``r1`` (cos), ``r2`` (sin) float32 broadcastable to it; result [B, N, S, D]
    float32, into ``out`` when given (contiguous). Raises ValueError (one line) for
    other ranks, dtypes, an odd D or shapes that do not broadcast."""
    if x.dim() != 4 or x.shape[-1] % 2 or not (x.dtype == r1.dtype == r2.dtype == torch.float32):
        raise ValueError(f"rotary_mul: expected float32 x [B, N, S, D] with D even and float32 "
                         f"cos/sin, got x {tuple(x.shape)} {x.dtype}, {r1.dtype}, {r2.dtype}")
    c, s = (_as4(r, x.shape) for r in (r1, r2))
    y = out if out is not None and out.is_contiguous() else torch.empty(x.shape)
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    if rows and x.shape[3]:
        args = (x.detach().numpy(), c, s, y.numpy())
        if rows * x.shape[3] < GRAIN:
            _serial(*args)
        else:
            with launch(rows * x.shape[3]):
                _parallel(*args)
    if out is not None and y is not out:
        return out.copy_(y)
    return y


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                         out=None):
    """(`rotary_mul` (q, r1, r2), `rotary_mul` (k, r1, r2)) for a query and a key of one
    layer sharing cos (``r1``) and sin (``r2``): torch_npu's ``npu_apply_rotary_pos_emb``
    computed out of place; ``out`` a pair of contiguous float32 tensors of q's and k's
    shapes (else fresh ones). One numba call below ATen's grain. Raises `rotary_mul`'s
    ValueErrors."""
    oq, ok = out if out is not None else (None, None)
    fast = (q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
            and q.shape[3] % 2 == 0 and q.numel() < GRAIN and k.numel() < GRAIN
            and q.dtype == k.dtype == r1.dtype == r2.dtype == torch.float32
            and (oq is None or (oq.is_contiguous() and ok.is_contiguous())))
    if fast:     # cos/sin must broadcast along the heads: q and k have their own counts
        c, s = _as4(r1, q.shape), _as4(r2, q.shape)
        fast = c.shape[1] == 1 and s.shape[1] == 1
    if not fast:
        return rotary_mul(q, r1, r2, out=oq), rotary_mul(k, r1, r2, out=ok)
    yq = oq if oq is not None else torch.empty(q.shape)
    yk = ok if ok is not None else torch.empty(k.shape)
    if q.numel() and k.numel():
        _serial_pair(q.detach().numpy(), k.detach().numpy(), c, s, yq.numpy(), yk.numpy())
    return yq, yk


def make_apply_rotary_pos_emb_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                     consts: Sequence) -> Callable:
    """Kernel factory of ApplyRotaryPosEmb(query, key, cos, sin) -> (query', key'):
    ``run(q, k, cos, sin, out=None)`` (`apply_rotary_pos_emb`)."""
    iq, ik, ic, is_ = (node.attrs[n].index for n in ("query", "key", "cos", "sin"))

    def run(*xs, out=None):
        return apply_rotary_pos_emb(xs[iq], xs[ik], xs[ic], xs[is_], out=out)
    return run


def make_rotary_mul_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory of RotaryMul(input, r1, r2) -> y: ``run(x, r1, r2, out=None)``
    (`rotary_mul`)."""
    ix, i1, i2 = (node.attrs[k].index for k in ("input", "r1", "r2"))

    def run(*xs, out=None):
        return rotary_mul(xs[ix], xs[i1], xs[i2], out=out)
    return run


__all__ = ["apply_rotary_pos_emb", "make_apply_rotary_pos_emb_kernel", "make_rotary_mul_kernel",
           "rotary_mul"]
