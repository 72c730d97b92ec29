"""CPU kernel of RotaryMul (``torch_npu.npu_rotary_mul``): rotary position embedding
y = x·cos + rotate_half(x)·sin, rotate_half(x) = cat(-x[..., D/2:], x[..., :D/2]), in one
pass (RoFormer, Su et al. 2021, arXiv:2104.09864; the half-rotation layout of
transformers' ``rotate_half`` in ``modeling_llama.py``). Replaces the seven ops a
traced Llama attention spells it with (two slices, Neg, ConcatD, two Muls, Add) per
query and key tensor: in a decode step each is a call on a few hundred elements.

Layout: x [B, N, S, D] (any strides: the query/key heads are a transposed view of a
linear's output), cos and sin broadcastable to x along its leading dims (``[B, 1, S,
D]`` as transformers makes them; read at index 0 along a dim of size 1, no expanded
copy: an expanded NumPy view costs more than the kernel at decode sizes), y [B, N, S, D]
(contiguous, or above the grain any strides with a unit last one); float32, D even.
Rows (b, n, s) split over the cores with ``prange`` above ATen's grain
(`numba_cache.launch`), on the calling thread below it. Above the grain, where x, cos and
sin have a unit stride along D (the usual case: heads viewed out of a linear's output),
each row runs as unit-stride 1-D loops over flat views of the tensors (`_row_flat`) that
LLVM vectorises, and a query and key pair share one parallel loop: a 512-token prefill of
a 12/4-head, D = 64 layer 820 -> 293 us on 2 threads (two strided calls before,
same-process A/B).

Numerics: no fast-math, so each product and the sum round as eager's separate ``mul``,
``mul`` and ``add`` (no fused multiply-add): y is eager's bit for bit, inf and NaN
positions included, except the sign of a NaN that comes through the negated half
(LLVM rewrites a + (−b)·s as a − b·s, as IEEE 754 leaves a NaN result's sign
unspecified; eager's ``neg`` flips it).
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import numpy as np
import torch
from numba import prange

from .numba_cache import GRAIN, launch, njit
from .out_arg import check_out
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


@njit(cache=True, inline="always")
def _row_flat(x, xs, c, cs, s, ss, y, ys, t, N, S, h):  # pragma: no cover - numba
    """Row t of the [B·N·S, D] rows of a head-dim-contiguous x: ``x``, ``c``, ``s``,
    ``y`` (the result) are flat 1-D views of their tensors' spans and ``xs``, ``cs``,
    ``ss``, ``ys`` their (b, n, i) strides in elements (0 along a broadcast dim). Unit-stride 1-D loops: LLVM vectorises them (no fast-math: each product and
    the sum still round alone, eager's bits)."""
    b = t // (N * S)
    n = (t // S) % N
    i = t % S
    xo = b * xs[0] + n * xs[1] + i * xs[2]
    co = b * cs[0] + n * cs[1] + i * cs[2]
    so = b * ss[0] + n * ss[1] + i * ss[2]
    yo = b * ys[0] + n * ys[1] + i * ys[2]
    # slices indexed by the loop counter: no negative-index wraparound test per access
    xa, xb, ca, cb = x[xo:xo + h], x[xo + h:xo + 2 * h], c[co:co + h], c[co + h:co + 2 * h]
    sa, sb, ya, yb = s[so:so + h], s[so + h:so + 2 * h], y[yo:yo + h], y[yo + h:yo + 2 * h]
    for d in range(h):
        ya[d] = xa[d] * ca[d] + (-xb[d]) * sa[d]
    for d in range(h):
        yb[d] = xb[d] * cb[d] + xa[d] * sb[d]


@njit(parallel=True, cache=True)
def _parallel_pair_flat(xq, qs, Nq, yq, yqs, xk, ks, Nk, yk, yks, c, cs, s, ss, S, rq, rk,
                        h):  # pragma: no cover - numba
    """`_row_flat` over the rq query rows then the rk key rows, one parallel loop."""
    for t in prange(rq + rk):
        if t < rq:
            _row_flat(xq, qs, c, cs, s, ss, yq, yqs, t, Nq, S, h)
        else:
            _row_flat(xk, ks, c, cs, s, ss, yk, yks, t - rq, Nk, S, h)


@njit(cache=True, inline="always")
def _heads_span(x, xst, y, yst, c, s, b, i, cb, sb, N, h):  # pragma: no cover - numba
    """Every head of token i of row b of one input with a unit stride along D = 2h:
    ``x`` and ``y`` (the result) are the 1-D spans of their memory (`_flat`), ``xst`` /
    ``yst`` their (b, n, i) strides in elements (any layout: the heads viewed out of a
    linear's output, fused QKV or not, eager's BSND results or contiguous ones); c and s
    [Bc, S, D] C-contiguous. Slices of the spans indexed by the loop counter: unit-stride
    loops LLVM vectorises (no fast-math: eager's bits)."""
    for n in range(N):
        o = b * xst[0] + n * xst[1] + i * xst[2]
        p = b * yst[0] + n * yst[1] + i * yst[2]
        xa, xz, ya, yz = x[o:o + h], x[o + h:o + 2 * h], y[p:p + h], y[p + h:p + 2 * h]
        for d in range(h):
            ya[d] = xa[d] * c[cb, i, d] + (-xz[d]) * s[sb, i, d]
        for d in range(h):
            yz[d] = xz[d] * c[cb, i, d + h] + xa[d] * s[sb, i, d + h]


@njit(cache=True)
def _serial_pair_span(xq, qst, yq, yqst, Nq, xk, kst, yk, ykst, Nk, c, s, B, S,
                      h):  # pragma: no cover - numba
    """`_serial_pair` through `_heads_span` (arguments from `_span_args`)."""
    for b in range(B):
        cb, sb = (b if c.shape[0] > 1 else 0), (b if s.shape[0] > 1 else 0)
        for i in range(S):
            _heads_span(xq, qst, yq, yqst, c, s, b, i, cb, sb, Nq, h)
            _heads_span(xk, kst, yk, ykst, c, s, b, i, cb, sb, Nk, h)


_SPAN_MIN = 1 << 14   # q and k elements from which `_span_args` pays (measured, below)


def _span_args(q, k, c, s, yq, yk):
    """The arguments of `_serial_pair_span` when ``q``, ``k`` (BNSD float32, one batch,
    sequence and head dim), ``yq``, ``yk`` (float32 of their shapes, no element twice:
    `_unit_last`) all have a unit stride along D, and ``c``, ``s`` (4-D NumPy, `_as4`)
    broadcast along the heads only, with C-contiguous [Bc, S, D] rows; else None (and
    below `_SPAN_MIN` elements, where the spans' preparation costs more than the strided
    rows: a decode step's B = 8, S = 1 took 51 against 48 µs). At a 32-token prefill of a
    12/4-head, D = 64 layer (q and k sliced out of a fused QKV output, results in eager's
    BSND layout) one call took 59 µs against 90 through the strided rows
    (`_serial_pair`; one process, least of 300, 2 threads) and ~500 through the two
    `rotary_mul` calls and copies a non-contiguous output took before."""
    if q.numel() + k.numel() < _SPAN_MIN or q.dim() != 4 or k.dim() != 4:
        return None
    B, _, S, D = q.shape
    if not (k.shape[0] == B and k.shape[2:] == q.shape[2:] and D % 2 == 0
            and q.dtype == k.dtype == torch.float32 and q.stride(3) == 1 and k.stride(3) == 1
            and _unit_last(yq, q.shape) and _unit_last(yk, k.shape)
            and c.shape[1] == s.shape[1] == 1 and c.shape[2] == s.shape[2] == S):
        return None
    c3, s3 = c[:, 0], s[:, 0]
    if not (c3.flags.c_contiguous and s3.flags.c_contiguous):
        return None
    return (_flat(q), _row_strides(q), _flat(yq), _row_strides(yq), q.shape[1],
            _flat(k), _row_strides(k), _flat(yk), _row_strides(yk), k.shape[1],
            c3, s3, B, S, D // 2)


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


def _span(t: torch.Tensor) -> int:
    """Elements from ``t``'s first to its last element (non-empty; non-negative strides)."""
    return 1 + sum((n - 1) * st for n, st in zip(t.shape, t.stride()))


def _span_bytes(t: torch.Tensor) -> tuple:
    """[first, last + 1) byte addresses of ``t``'s elements (`_span`)."""
    lo = t.data_ptr()
    return lo, lo + _span(t) * t.element_size()


def _overlaps(out: torch.Tensor, *xs: torch.Tensor) -> bool:
    """Whether the span of ``out`` meets the span of any of ``xs`` (byte ranges from
    the first to the last element of each: conservative for strided views, e.g. a
    strided ``out`` whose rows interleave with an input's)."""
    if not out.numel():
        return False
    lo, hi = _span_bytes(out)
    for x in xs:
        if x.numel():
            a, b = _span_bytes(x)
            if a < hi and lo < b:
                return True
    return False


def rotary_mul(x: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor, out=None) -> torch.Tensor:
    """x·r1 + rotate_half(x)·r2 (module docstring) for ``x`` [B, N, S, D] float32 (D
    even) and ``r1`` (cos), ``r2`` (sin) float32 broadcastable to it; result [B, N, S, D]
    float32, into ``out`` when given (any strides; one that overlaps an input, e.g.
    ``out=x``, gets a copy of the result: a row's second half reads the first half it
    overwrote). Raises ValueError (one line) for other ranks, dtypes, an odd D, shapes
    that do not broadcast or an ``out`` that is not float32 of x's shape."""
    check_out("rotary_mul", out, x.shape)
    if out is not None and _overlaps(out, x, r1, r2):
        return out.copy_(rotary_mul(x, r1, r2))
    if x.dim() != 4 or x.shape[-1] % 2 or not (x.dtype == r1.dtype == r2.dtype == torch.float32):
        raise ValueError(f"rotary_mul: expected float32 x [B, N, S, D] with D even and float32 "
                         f"cos/sin, got x {tuple(x.shape)} {x.dtype}, {r1.dtype}, {r2.dtype}")
    c, s = (_as4(r, x.shape) for r in (r1, r2))
    rows = x.shape[0] * x.shape[1] * x.shape[2]
    if rows * x.shape[3] >= GRAIN:   # head-dim-contiguous: the vectorised rows, any out
        y = out if _unit_last(out, x.shape) else torch.empty(x.shape, dtype=torch.float32)
        if _pair_flat(x, None, r1, r2, y, None):
            return y if out is None or y is out else out.copy_(y)
    y = out if out is not None and out.is_contiguous() else torch.empty(x.shape,
                                                                        dtype=torch.float32)
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


def _flat(t: torch.Tensor) -> "np.ndarray":
    """A 1-D NumPy view of the span of memory ``t`` (non-empty, last stride 1) covers,
    from its first element to its last."""
    return torch.as_strided(t.detach(), (_span(t),), (1,), t.storage_offset()).numpy()


def _row_strides(t: torch.Tensor) -> "np.ndarray":
    """The (b, n, i) strides of a 4-D ``t`` in elements, 0 along a dim of size 1."""
    return np.array([st if n > 1 else 0 for n, st in zip(t.shape[:3], t.stride()[:3])], np.int64)


def _unit_last(out, shape) -> bool:
    """Whether ``out`` (or None) is a float32 tensor of ``shape`` with a unit last stride
    and no element written twice (no stride 0 along a dim of size > 1; other strides any):
    what the flat rows write directly."""
    return (out is not None and tuple(out.shape) == tuple(shape) and out.dtype == torch.float32
            and out.numel() > 0 and out.stride(-1) == 1
            and all(st != 0 or n == 1 for n, st in zip(out.shape, out.stride())))


def _pair_flat(q, k, r1, r2, oq, ok) -> bool:
    """`_parallel_pair_flat` of ``q`` and ``k`` (None: q alone) into ``oq``, ``ok``
    (of their shapes, float32, unit last stride: `_unit_last`) when both are 4-D float32 [B, N, S, D] with a unit last stride and the float32
    cos ``r1`` / sin ``r2`` broadcast to them along the leading dims (D itself, never
    broadcast: the rows read D elements of each) with a unit last stride (along the heads only when q is alone or q and k have as many heads); False,
    nothing written, otherwise."""
    xs = (q,) if k is None else (q, k)
    if not (all(x.dim() == 4 and x.numel() and x.stride(3) == 1 and x.dtype == torch.float32 for x in xs)
            and q.shape[3] % 2 == 0 and r1.dtype == r2.dtype == torch.float32
            and all(x.shape[0] == q.shape[0] and x.shape[2:] == q.shape[2:] for x in xs)):
        return False
    cs = []
    for r in (r1, r2):
        r4 = r.reshape((1,) * (4 - r.dim()) + tuple(r.shape)) if r.dim() < 4 else r
        if r4.dim() != 4 or r4.stride(3) != 1 or r4.shape[3] != q.shape[3] \
                or any(m not in (1, n) for x in xs for m, n in zip(r4.shape, x.shape)):
            return False
        cs.append(r4)
    B, Nq, S, D = q.shape
    kk, ko = (q, oq) if k is None else (k, ok)
    rq, rk = B * Nq * S, (0 if k is None else B * k.shape[1] * S)
    with launch((rq + rk) * D):
        _parallel_pair_flat(_flat(q), _row_strides(q), Nq, _flat(oq), _row_strides(oq),
                            _flat(kk), _row_strides(kk), kk.shape[1], _flat(ko), _row_strides(ko),
                            _flat(cs[0]), _row_strides(cs[0]), _flat(cs[1]), _row_strides(cs[1]),
                            S, rq, rk, D // 2)
    return True


def _span_pair(q, k, r1, r2, oq, ok, memo: Optional[dict]):
    """(q', k') through `_serial_pair_span` when `_span_args` accepts the tensors (below
    the grain, from `_SPAN_MIN` elements), into ``oq``/``ok`` (None: fresh ones); else
    None, nothing written. ``memo`` (a graph node's dict, or None) keeps the last
    call's kernel arguments under its tensors' addresses, shapes and strides: a
    compiled graph calls the node on the same planned buffers every time, and the
    spans' preparation (~40 µs, hot) is most of the call (the kernel: 9.5 µs). Each
    entry's NumPy views keep their memory alive, so an address in the key is never
    another tensor's."""
    if not (0 < q.numel() < GRAIN and 0 < k.numel() < GRAIN and q.dim() == k.dim() == 4
            and r1.dtype == r2.dtype == torch.float32):
        return None
    yq = oq if oq is not None else torch.empty(q.shape, dtype=torch.float32)
    yk = ok if ok is not None else torch.empty(k.shape, dtype=torch.float32)
    key = None
    if memo is not None and oq is not None and ok is not None:
        key = tuple((t.data_ptr(), t.dtype, tuple(t.shape), t.stride()) for t in (q, k, r1, r2, oq, ok))
        args = memo.get(key)
        if args is not None:
            _serial_pair_span(*args)
            return yq, yk
    args = _span_args(q, k, _as4(r1, q.shape), _as4(r2, q.shape), yq, yk)
    if args is None:
        return None
    if key is not None:
        memo.clear()
        memo[key] = args
    _serial_pair_span(*args)
    return yq, yk


def apply_rotary_pos_emb(q: torch.Tensor, k: torch.Tensor, r1: torch.Tensor, r2: torch.Tensor,
                         out=None, memo: Optional[dict] = None):
    """(`rotary_mul` (q, r1, r2), `rotary_mul` (k, r1, r2)) for a query and a key of one
    layer sharing cos (``r1``) and sin (``r2``): torch_npu's ``npu_apply_rotary_pos_emb``
    computed out of place; ``out`` a pair of float32 tensors of q's and k's shapes (else
    fresh ones; written directly when contiguous, or at prefill sizes with a unit last
    stride, e.g. eager's transposed layout; else through a copy; an output overlapping an
    input gets a copy of the result).
    One numba call below ATen's grain. ``memo``: a graph kernel's dict (`_span_pair`).
    Raises `rotary_mul`'s ValueErrors (an ``out`` that is not a pair of float32 tensors
    of q's and k's shapes among them)."""
    if out is not None:
        if len(out) != 2 or any(o is None for o in out):
            raise ValueError(f"apply_rotary_pos_emb: out must be a (query, key) pair of tensors, "
                             f"got {[None if o is None else type(o).__name__ for o in out]}; "
                             "pass both, or out=None for fresh ones")
        check_out("apply_rotary_pos_emb", out[0], q.shape)
        check_out("apply_rotary_pos_emb", out[1], k.shape)
    if out is not None and any(_overlaps(o, q, k, r1, r2) for o in out):
        yq, yk = apply_rotary_pos_emb(q, k, r1, r2)
        return out[0].copy_(yq), out[1].copy_(yk)
    oq, ok = out if out is not None else (None, None)
    span = _span_pair(q, k, r1, r2, oq, ok, memo)
    if span is not None:   # a short prefill: vectorised rows, any unit-D-stride layout
        return span
    fast = (q.dim() == k.dim() == 4 and q.shape[0] == k.shape[0] and q.shape[2:] == k.shape[2:]
            and q.shape[3] % 2 == 0 and q.numel() < GRAIN and k.numel() < GRAIN
            and q.dtype == k.dtype == r1.dtype == r2.dtype == torch.float32
            and (oq is None or (oq.is_contiguous() and ok.is_contiguous())))
    if fast:     # cos/sin must broadcast along the heads: q and k have their own counts
        c, s = _as4(r1, q.shape), _as4(r2, q.shape)
        fast = c.shape[1] == 1 and s.shape[1] == 1
    if not fast:
        if q.numel() + k.numel() >= GRAIN and q.dim() == 4 and k.dim() == 4:
            yq = oq if _unit_last(oq, q.shape) else torch.empty(q.shape, dtype=torch.float32)
            yk = ok if _unit_last(ok, k.shape) else torch.empty(k.shape, dtype=torch.float32)
            if _pair_flat(q, k, r1, r2, yq, yk):   # a prefill: both in one parallel loop
                return (yq if oq is None or yq is oq else oq.copy_(yq),
                        yk if ok is None or yk is ok else ok.copy_(yk))
        return rotary_mul(q, r1, r2, out=oq), rotary_mul(k, r1, r2, out=ok)
    yq = oq if oq is not None else torch.empty(q.shape, dtype=torch.float32)
    yk = ok if ok is not None else torch.empty(k.shape, dtype=torch.float32)
    if q.numel() and k.numel():
        _serial_pair(q.detach().numpy(), k.detach().numpy(), c, s, yq.numpy(), yk.numpy())
    return yq, yk


def make_apply_rotary_pos_emb_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                     consts: Sequence) -> Callable:
    """Kernel factory of ApplyRotaryPosEmb(query, key, cos, sin) -> (query', key'):
    ``run(q, k, cos, sin, out=None)`` (`apply_rotary_pos_emb`)."""
    iq, ik, ic, is_ = (node.attrs[n].index for n in ("query", "key", "cos", "sin"))
    memo: dict = {}

    def run(*xs, out=None):
        return apply_rotary_pos_emb(xs[iq], xs[ik], xs[ic], xs[is_], out=out, memo=memo)
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
