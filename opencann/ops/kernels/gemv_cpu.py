"""Bandwidth-bound skinny GEMM (GEMV) for linears with at most 8 rows: LLM decode.

``y[M, N] = x[M, K] @ W[N, K]^T + b`` in fp32, M <= `MAX_ROWS`. At decode time a linear
reads its whole weight (K·N·4 bytes) to make M·N outputs, so its time is the weight's
read time: the kernel must stream W at the memory bandwidth, and read it once for all M
rows. BLAS GEMMs are tuned for large M (they pack panels of W per call, which at M = 1
costs as much as the product); issue #27 measured torch's M = 1 GEMM at 13-17 GB/s of W
where a row-parallel loop reads ~46 GB/s on the same machine.

Layout: W is kept as ``[N, K]`` row-major, fp32, contiguous ("NK", nn.Linear's own
weight layout; a LinearAct's constant ``w_t [K, N]`` is transposed into it once, at bind
time, by `pack_weight`). Each output feature n is one contiguous K-long row of W.

Kernel: numba ``prange`` over tiles of output features (row-parallel: each thread streams
its own contiguous slices of W exactly once, two at M = 1; as many threads as torch's intra-op count, one
below ATen's grain or on an oversubscribed host: `numba_cache.launch_threads`; each
output is one thread's dot product, so the count never changes a bit). A tile is a few
rows of W times all rows of x, their M·rows dot products accumulated in one pass over K
(a row of W is read once from memory; the x rows stay in L1/L2): M = 1 eight rows of W,
two groups of four half the matrix apart (`_gemv1_kernel`);
M = 2..4 four rows of W x four rows of x (`_tile4`), M = 5..8 two rows x eight
(`_tile8`); a tile's x rows past M repeat row M - 1 and its W rows past N repeat row
N - 1 (computed, never stored), so no N needs its own loop. At 8 rows the loop
does 8 FMAs per weight element, as much time as the memory read on this class of CPU:
`_tile4`/`_tile8` walk K in `CHUNK`-long steps and first `prefetch` the next tile's
lines of that step, so memory works while the FMAs run (the rotation of a 125M Llama's
decode weights at M = 8, 2 threads: 23.7-25.9 ms without, 20.3-20.9 with;
docs/performance.md).
The K loop is vectorised with fastmath ``reassoc``/``contract`` only (no
``nnan``/``ninf``), so NaN and Inf propagate as in eager (a NaN or Inf in x or W makes
the outputs it reaches NaN/Inf; the summation order differs from MKL's, so results agree
with eager to fp32 rounding, not bit for bit). Bias: added after the dot product (as
addmm's beta=1 C).

Source: the row-parallel GEMV of issue #27 item 4; the layout and loop are the textbook
matrix-vector product (Golub & Van Loan, Matrix Computations, 4th ed., §1.1.5, "row
oriented" gaxpy), with the M rows of x as a register block of outputs (§1.5, "Vectorization
and Locality") and software prefetch a chunk ahead (Intel 64 and IA-32 Architectures
Optimization Reference Manual, "Software prefetch").
"""
from __future__ import annotations

import contextlib
from typing import Callable, Optional

import numba
import numpy as np
import torch
from numba import prange

from .numba_cache import entry_point, launch_guard, launch_threads, njit
from .numba_prefetch import prefetch

MAX_ROWS = 8  # the kernel handles x with 1..MAX_ROWS rows (decode: one token per sequence)
_FM = {"reassoc", "contract"}  # vectorise the K reduction; keep NaN/Inf semantics


# K elements per step of the 2..8-row tiles (one prefetch burst per step). Each step ends
# in a horizontal sum of every accumulator (LLVM vectorises the step's loop alone), so a
# longer step computes faster in cache (8 rows, L2-resident weight, 1 thread: 31, 39, 49
# GFMA/s at 64, 128, 256; 51 unchunked) but prefetches in larger bursts (more lines asked
# at once than a core keeps in flight, our reading): on the rotation of the module
# docstring (2 threads) 64 and 128 tied and 32, 256, 384 were 5-10% slower
CHUNK = 64


@njit(fastmath=_FM, cache=True, inline="always")
def _put(y, m, n, b, has_bias, s):  # pragma: no cover - compiled by numba
    """y[m, n] = s (+ b[n]) when (m, n) is inside y (a tile's padding rows/columns are not)."""
    if m < y.shape[0] and n < y.shape[1]:
        y[m, n] = s + b[n] if has_bias else s


@njit(fastmath=_FM, cache=True, inline="always")
def _tile4(x, w, n):  # pragma: no cover - compiled by numba
    """The 16 dot products of x's rows 0..3 with w's rows n..n+3, in one pass over K. Rows
    past x's or w's last stand for the last (computed, never stored: `_put`); each CHUNK of
    K first prefetches the same CHUNK of rows n+4..n+7 (the next tile)."""
    M, K = x.shape
    N = w.shape[0]
    r1, r2, r3 = min(1, M - 1), min(2, M - 1), min(3, M - 1)
    n1, n2, n3 = min(n + 1, N - 1), min(n + 2, N - 1), min(n + 3, N - 1)
    p0, p1 = min(n + 4, N - 1), min(n + 5, N - 1)
    p2, p3 = min(n + 6, N - 1), min(n + 7, N - 1)
    a0 = a1 = a2 = a3 = b0 = b1 = b2 = b3 = np.float32(0.0)
    c0 = c1 = c2 = c3 = d0 = d1 = d2 = d3 = np.float32(0.0)
    for kc in range(0, K, CHUNK):
        ke = min(kc + CHUNK, K)
        for kp in range(kc, ke, 16):            # 16 fp32 = one 64-byte line
            prefetch(w, p0, kp)
            prefetch(w, p1, kp)
            prefetch(w, p2, kp)
            prefetch(w, p3, kp)
        # 1-D views indexed from 0: LLVM sees unit-stride loads and vectorises over k
        wa, wb, wc, wd = w[n, kc:ke], w[n1, kc:ke], w[n2, kc:ke], w[n3, kc:ke]
        xa, xb, xc, xd = x[0, kc:ke], x[r1, kc:ke], x[r2, kc:ke], x[r3, kc:ke]
        for k in range(ke - kc):
            x0, x1, x2, x3 = xa[k], xb[k], xc[k], xd[k]
            v = wa[k]
            a0 += x0 * v
            a1 += x1 * v
            a2 += x2 * v
            a3 += x3 * v
            v = wb[k]
            b0 += x0 * v
            b1 += x1 * v
            b2 += x2 * v
            b3 += x3 * v
            v = wc[k]
            c0 += x0 * v
            c1 += x1 * v
            c2 += x2 * v
            c3 += x3 * v
            v = wd[k]
            d0 += x0 * v
            d1 += x1 * v
            d2 += x2 * v
            d3 += x3 * v
    return a0, a1, a2, a3, b0, b1, b2, b3, c0, c1, c2, c3, d0, d1, d2, d3


@njit(fastmath=_FM, cache=True, inline="always")
def _tile8(x, w, n):  # pragma: no cover - compiled by numba
    """The 16 dot products of x's rows 0..7 with w's rows n and n+1, in one pass over K
    (rows past the last stand for the last, as in `_tile4`; prefetches rows n+2, n+3)."""
    M, K = x.shape
    N = w.shape[0]
    r1, r2, r3 = min(1, M - 1), min(2, M - 1), min(3, M - 1)
    r4, r5, r6, r7 = min(4, M - 1), min(5, M - 1), min(6, M - 1), min(7, M - 1)
    n1 = min(n + 1, N - 1)
    p0, p1 = min(n + 2, N - 1), min(n + 3, N - 1)
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = np.float32(0.0)
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = np.float32(0.0)
    for kc in range(0, K, CHUNK):
        ke = min(kc + CHUNK, K)
        for kp in range(kc, ke, 16):
            prefetch(w, p0, kp)
            prefetch(w, p1, kp)
        wa, wb = w[n, kc:ke], w[n1, kc:ke]
        xa, xb, xc, xd = x[0, kc:ke], x[r1, kc:ke], x[r2, kc:ke], x[r3, kc:ke]
        xe, xf, xg, xh = x[r4, kc:ke], x[r5, kc:ke], x[r6, kc:ke], x[r7, kc:ke]
        for k in range(ke - kc):
            x0, x1, x2, x3 = xa[k], xb[k], xc[k], xd[k]
            x4, x5, x6, x7 = xe[k], xf[k], xg[k], xh[k]
            v = wa[k]
            a0 += x0 * v
            a1 += x1 * v
            a2 += x2 * v
            a3 += x3 * v
            a4 += x4 * v
            a5 += x5 * v
            a6 += x6 * v
            a7 += x7 * v
            v = wb[k]
            b0 += x0 * v
            b1 += x1 * v
            b2 += x2 * v
            b3 += x3 * v
            b4 += x4 * v
            b5 += x5 * v
            b6 += x6 * v
            b7 += x7 * v
    return a0, a1, a2, a3, a4, a5, a6, a7, b0, b1, b2, b3, b4, b5, b6, b7


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv1_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """M = 1: y[0, n] = x[0] . w[n] (+ b[n]); x [1, K], w [N, K], y [1, N], fp32
    C-contiguous. The N rows of w are G = ceil(N / 4) groups of four; prange step t
    streams two groups half the matrix apart (t and t + ceil(G / 2)), eight rows at once
    (more loads in flight: the DRAM-bound LM head read 7.8 -> 12.5 GB/s on the 2-core
    host with four rows instead of one group), so each thread reads two distant regions
    of w in step ("r4x2"); rows past N stand for row N - 1 (computed, never stored).
    Against eight adjacent rows per step: the bare rotation of a 125M Llama's decode
    weights, 2 threads, 32.7 GB/s against 30-32 (MKL's GEMV 32.1); its 12-layer decode
    step on one thread (CPU time per step, 176 steps, load 4.8-5.3) least 29.88 against
    30.38 ms, median 31.08 against 31.37 (docs/performance.md, "LLM decode")."""
    K = x.shape[1]
    N = w.shape[0]
    h = ((N + 3) // 4 + 1) // 2   # prange steps: pairs of four-row groups
    xa = x[0]
    for t in prange(h):
        n = 4 * t
        m = 4 * (t + h)
        # 1-D rows indexed from 0: unit-stride loads LLVM vectorises over k
        w0, w1 = w[min(n, N - 1)], w[min(n + 1, N - 1)]
        w2, w3 = w[min(n + 2, N - 1)], w[min(n + 3, N - 1)]
        w4, w5 = w[min(m, N - 1)], w[min(m + 1, N - 1)]
        w6, w7 = w[min(m + 2, N - 1)], w[min(m + 3, N - 1)]
        s0 = s1 = s2 = s3 = s4 = s5 = s6 = s7 = np.float32(0.0)
        for k in range(K):
            xk = xa[k]
            s0 += xk * w0[k]
            s1 += xk * w1[k]
            s2 += xk * w2[k]
            s3 += xk * w3[k]
            s4 += xk * w4[k]
            s5 += xk * w5[k]
            s6 += xk * w6[k]
            s7 += xk * w7[k]
        _put(y, 0, n, b, has_bias, s0)
        _put(y, 0, n + 1, b, has_bias, s1)
        _put(y, 0, n + 2, b, has_bias, s2)
        _put(y, 0, n + 3, b, has_bias, s3)
        _put(y, 0, m, b, has_bias, s4)
        _put(y, 0, m + 1, b, has_bias, s5)
        _put(y, 0, m + 2, b, has_bias, s6)
        _put(y, 0, m + 3, b, has_bias, s7)


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv4_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """M = 2..4: `_tile4` (4 rows of w x 4 rows of x) per prange step; x [M, K],
    w [N, K], y [M, N] fp32 C-contiguous."""
    N = w.shape[0]
    for t in prange((N + 3) // 4):
        n = 4 * t
        s = _tile4(x, w, n)
        for q in range(4):
            for m in range(4):
                _put(y, m, n + q, b, has_bias, s[4 * q + m])


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv8_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """M = 5..8: `_tile8` (2 rows of w x 8 rows of x) per prange step; x [M, K],
    w [N, K], y [M, N] fp32 C-contiguous."""
    N = w.shape[0]
    for t in prange((N + 1) // 2):
        n = 2 * t
        s = _tile8(x, w, n)
        for q in range(2):
            for m in range(8):
                _put(y, m, n + q, b, has_bias, s[8 * q + m])


def _kernel_for(m: int):
    """The compiled kernel for ``m`` rows of x (1 <= m <= `MAX_ROWS`): `_gemv1_kernel`,
    `_gemv4_kernel` (2..4) or `_gemv8_kernel` (5..8)."""
    return _gemv1_kernel if m == 1 else _gemv4_kernel if m <= 4 else _gemv8_kernel


_NO_BIAS = np.zeros(1, np.float32)  # stands in for b when there is none (never read)


def pack_weight(w: torch.Tensor, transposed: bool = False) -> torch.Tensor:
    """The kernel's weight layout: ``[N, K]`` fp32 C-contiguous, made once (compile/bind
    time). ``w``: [N, K] (nn.Linear's weight), or [K, N] with ``transposed=True`` (a
    LinearAct's ``w_t``). Raises ValueError for a non-2-D or non-fp32 weight."""
    if w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"gemv: the weight must be a 2-D float32 tensor, got {tuple(w.shape)} "
                         f"{w.dtype}; use F.linear for other dtypes")
    w = w.detach()
    return (w.t() if transposed else w).contiguous()


def _check_weight(w_nk: torch.Tensor, k: Optional[int]) -> None:
    """Raise ValueError unless ``w_nk`` is float32 C-contiguous [N, k] (any K when k is None)."""
    if w_nk.dim() != 2 or (k is not None and w_nk.shape[1] != k) \
            or w_nk.dtype != torch.float32 or not w_nk.is_contiguous():
        raise ValueError(f"gemv: the weight must be float32 C-contiguous [N, {'K' if k is None else k}], "
                         f"got {tuple(w_nk.shape)} {w_nk.dtype}; pass it through pack_weight")


def _check_bias(bias: Optional[torch.Tensor], n: int) -> None:
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != torch.float32):
        raise ValueError(f"gemv: bias must be float32 [{n}], got {tuple(bias.shape)} {bias.dtype}")


def bind_gemv(w_nk: torch.Tensor, rows: int, threads: Optional[int] = None
              ) -> Callable[..., torch.Tensor]:
    """``run(x, bias=None, out=None)`` = ``x @ w_nk.T + bias`` for x [rows, K] fp32, the
    decode GEMV bound once (plan/bind time) to the constant weight ``w_nk`` [N, K] fp32
    C-contiguous (`pack_weight`) and the row count ``rows`` (1 <= rows <= `MAX_ROWS`):
    the weight's numpy view, the compiled kernel for ``rows`` (`_kernel_for`), the work
    size of the launch policy and the threading layer's lock are resolved here, so a call
    checks x's shape and dtype, converts x, bias and the output to numpy views and
    dispatches (an 8 x 64 weight, one thread, the 2-core Xeon: 4.3-4.5 µs per call
    against 7.9-10.3 through the per-call wrapper `gemv` had been, the kernel alone
    0.8-0.9; docs/performance.md, "Decode GEMV bound at plan time"). A call with the
    previous call's x, out and bias (a compiled graph's arena buffers: every decode step)
    reuses that call's NumPy views and the kernel's compiled entry point
    (`numba_cache.entry_point`, no dispatch).

    ``bias``: [N] fp32 or None, per call; ``out``: [rows, N] fp32 (the planned buffer),
    written in place when contiguous (else through a copy), else a fresh tensor is
    returned; ``threads``: exactly that many threads on every call (a bandwidth
    measurement), instead of `numba_cache.launch_threads`' choice per call (torch's
    intra-op count, one thread on an oversubscribed host). Values: `gemv`'s (module
    docstring: fp32 rounding of ``F.linear``'s, NaN/Inf propagated). Raises ValueError
    naming the bad argument: at bind for the weight or ``rows``, at a call for an x that
    is not float32 [rows, K] or an ``out`` that is not [rows, N]."""
    _check_weight(w_nk, None)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv: rows must be 1..{MAX_ROWS}, got {rows}; use F.linear for larger M")
    n, k = (int(d) for d in w_nk.shape)
    kernel, wn, f32 = _kernel_for(rows), w_nk.detach().numpy(), torch.float32
    xshape, yshape, work = torch.Size((rows, k)), torch.Size((rows, n)), rows * k * n
    guard = launch_guard()
    lock = None if isinstance(guard, contextlib.nullcontext) else guard
    get_threads, set_threads = numba.get_num_threads, numba.set_num_threads
    # the last call's x, out, bias, their data pointers, the kernel's entry point and its
    # arguments: a graph hands the same arena buffers every call, and the entry point
    # skips the dispatcher's type resolution (`numba_cache.entry_point`)
    last: list = []
    entries: dict = {}     # has bias -> the kernel's entry point

    def run(x: torch.Tensor, bias: Optional[torch.Tensor] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.shape != xshape or x.dtype is not f32 or (out is not None and out.shape != yshape):
            _refuse(x, out, xshape, yshape)
        nt = threads if threads is not None else launch_threads(work)
        if get_threads() != nt:
            set_threads(nt)
        if last and x is last[0] and out is last[1] and bias is last[2] \
                and last[3] == (x.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr()):
            _call(last[4], last[5], lock)   # the last call's tensors: its views, no dispatch
            return out
        return _views_call(kernel, wn, x, bias, out, yshape, lock, last, entries)
    run.weight = w_nk   # held: a cache that keeps the packed copy weakly sees it alive
    return run


def _refuse(x: torch.Tensor, out: Optional[torch.Tensor], xshape, yshape) -> None:
    """Raise the bound GEMV's one-line ValueError for ``x`` or ``out``."""
    if x.shape != xshape or x.dtype is not torch.float32:
        raise ValueError(f"gemv: x must be float32 {list(xshape)} (the bound rows and K), "
                         f"got {tuple(x.shape)} {x.dtype}; bind the GEMV for this shape")
    raise ValueError(f"gemv: out must be {list(yshape)}, got {tuple(out.shape)}")


def _views_call(kernel, wn: np.ndarray, x: torch.Tensor, bias: Optional[torch.Tensor],
                out: Optional[torch.Tensor], yshape, lock, last: list,
                entries: dict) -> torch.Tensor:
    """A bound GEMV call through the dispatcher: x, bias and the output as NumPy views
    (contiguous copies where they are not), the result into ``out`` (a copy when it is
    not contiguous) or a fresh tensor, through the kernel's entry point (``entries``,
    by whether there is a bias: the arguments' types never change) once it is compiled;
    ``last`` set to this call's tensors, pointers, the entry point and arguments when
    every view is the caller's tensor itself (cleared otherwise)."""
    x0, b0 = x, bias
    if x.requires_grad or not x.is_contiguous():
        x = x.detach().contiguous()
    if bias is None:
        bn = _NO_BIAS
    else:
        if bias.requires_grad or not bias.is_contiguous():
            bias = bias.detach().contiguous()
        bn = bias.numpy()
    y = out if out is not None and out.is_contiguous() else torch.empty(yshape)
    args = (x.numpy(), wn, bn, bias is not None, y.numpy())
    fn = entries.get(args[3])    # every call's types are the same (C-contiguous float32)
    _call(kernel if fn is None else fn, args, lock)
    if fn is None:
        fn = entries[args[3]] = entry_point(kernel, args)
    last[:] = [] if fn is None or not (x is x0 and bias is b0 and y is out) else \
        [x, out, bias, (x.data_ptr(), out.data_ptr(), 0 if bias is None else bias.data_ptr()), fn, args]
    if out is not None and y is not out:
        return out.copy_(y)
    return y


def _call(fn: Callable, args: tuple, lock) -> None:
    """``fn(*args)``, under ``lock`` (the workqueue layer's) when there is one."""
    if lock is None:
        fn(*args)
    else:
        with lock:
            fn(*args)


def gemv(x: torch.Tensor, w_nk: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, threads: Optional[int] = None) -> torch.Tensor:
    """``x @ w_nk.T + bias`` for x [M, K] fp32 with 1 <= M <= `MAX_ROWS` (8), ``w_nk`` [N, K]
    fp32 C-contiguous (`pack_weight`), ``bias`` [N] fp32 or None; result [M, N] fp32,
    written into ``out`` when given (any strides; a non-contiguous one gets a copy);
    ``threads``: exactly that many threads (a bandwidth measurement), instead of
    `numba_cache.launch`'s choice (one thread on an oversubscribed host). One call binds
    and runs (`bind_gemv`; a caller that repeats a shape binds once instead).
    Matches ``F.linear(x, w_nk, bias)`` to fp32 rounding (module docstring). Raises
    ValueError naming the bad argument on shape/dtype/row-count mismatch."""
    if x.dim() != 2 or x.dtype != torch.float32 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv: x must be float32 [M, K] with 1 <= M <= {MAX_ROWS}, got "
                         f"{tuple(x.shape)} {x.dtype}; use F.linear for larger M")
    _check_weight(w_nk, x.shape[1])
    _check_bias(bias, w_nk.shape[0])
    if out is not None and tuple(out.shape) != (x.shape[0], w_nk.shape[0]):
        raise ValueError(f"gemv: out must be {[x.shape[0], w_nk.shape[0]]}, got {tuple(out.shape)}")
    return bind_gemv(w_nk, x.shape[0], threads)(x, bias, out)


__all__ = ["MAX_ROWS", "bind_gemv", "gemv", "pack_weight"]
