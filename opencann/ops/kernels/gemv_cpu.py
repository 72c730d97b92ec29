"""Bandwidth-bound skinny GEMM (GEMV) for linears with at most 4 rows: LLM decode.

``y[M, N] = x[M, K] @ W[N, K]^T + b`` in fp32, M <= `MAX_ROWS`. At decode time a linear
reads its whole weight (K·N·4 bytes) to make M·N outputs, so its time is the weight's
read time: the kernel must stream W at the memory bandwidth, and read it once for all M
rows. BLAS GEMMs are tuned for large M (they pack panels of W per call, which at M = 1
costs as much as the product); issue #27 measured torch's M = 1 GEMM at 13-17 GB/s of W
where a row-parallel loop reads ~46 GB/s on the same machine.

Layout: W is kept as ``[N, K]`` row-major, fp32, contiguous ("NK", nn.Linear's own
weight layout; a LinearAct's constant ``w_t [K, N]`` is transposed into it once, at bind
time, by `pack_weight`). Each output feature n is one contiguous K-long row of W.

Kernel: numba ``prange`` over output features (row-parallel: each thread streams its own
contiguous slice of W exactly once; as many threads as torch's intra-op count, one below
ATen's grain or on an oversubscribed host: `numba_cache.launch_threads`; each output is
one thread's dot product, so the count never changes a bit); for one row of W the M dot products run in one pass
over K (M accumulators; the row is read once from memory, the x rows stay in L1). The K
loop is vectorised with fastmath ``reassoc``/``contract`` only (no ``nnan``/``ninf``), so
NaN and Inf propagate as in eager (a NaN or Inf in x or W makes the outputs it reaches
NaN/Inf; the summation order differs from MKL's, so results agree with eager to fp32
rounding, not bit for bit). Bias: added after the dot product (as addmm's beta=1 C).

Source: the row-parallel GEMV of issue #27 item 4; the layout and loop are the textbook
matrix-vector product (Golub & Van Loan, Matrix Computations, 4th ed., §1.1.5, "row
oriented" gaxpy).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from numba import prange

from .numba_cache import launch, njit

MAX_ROWS = 4  # the kernel handles x with 1..MAX_ROWS rows (decode: one token per sequence)
_FM = {"reassoc", "contract"}  # vectorise the K reduction; keep NaN/Inf semantics


@njit(fastmath=_FM, cache=True, inline="always")
def _row(x, w, n):  # pragma: no cover - compiled by numba
    """The M (<= 4) dot products of x's rows with row n of w, in one pass over K."""
    M, K = x.shape
    s0 = np.float32(0.0)
    s1 = np.float32(0.0)
    s2 = np.float32(0.0)
    s3 = np.float32(0.0)
    if M == 1:
        for k in range(K):
            s0 += x[0, k] * w[n, k]
    elif M == 2:
        for k in range(K):
            wk = w[n, k]
            s0 += x[0, k] * wk
            s1 += x[1, k] * wk
    elif M == 3:
        for k in range(K):
            wk = w[n, k]
            s0 += x[0, k] * wk
            s1 += x[1, k] * wk
            s2 += x[2, k] * wk
    else:
        for k in range(K):
            wk = w[n, k]
            s0 += x[0, k] * wk
            s1 += x[1, k] * wk
            s2 += x[2, k] * wk
            s3 += x[3, k] * wk
    return s0, s1, s2, s3


@njit(fastmath=_FM, cache=True, inline="always")
def _store(y, n, b, has_bias, s0, s1, s2, s3):  # pragma: no cover - compiled by numba
    """y[:, n] = the M sums (+ b[n])."""
    M = y.shape[0]
    bn = b[n] if has_bias else np.float32(0.0)
    y[0, n] = s0 + bn if has_bias else s0
    if M > 1:
        y[1, n] = s1 + bn if has_bias else s1
    if M > 2:
        y[2, n] = s2 + bn if has_bias else s2
    if M > 3:
        y[3, n] = s3 + bn if has_bias else s3


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """y[m, n] = sum_k x[m, k] * w[n, k] (+ b[n]); x [M<=4, K], w [N, K], y [M, N], fp32
    C-contiguous. prange over rows of w (groups of eight when M = 1): each thread reads its
    own rows once. With M = 1, eight rows of w stream at once (more loads in flight: the
    DRAM-bound LM head read 7.8 -> 12.5 GB/s on the 2-core host with four rows; 60
    rotating 768x2048 / 2048x768 weights, 377 MB, 24.6 -> 26.7 GB/s with eight, load 1.5,
    F.linear 26.9 on the same weights), else one."""
    M, K = x.shape
    N = w.shape[0]
    if M == 1:
        for t in prange(N // 8):
            n = 8 * t
            s0 = np.float32(0.0)
            s1 = np.float32(0.0)
            s2 = np.float32(0.0)
            s3 = np.float32(0.0)
            s4 = np.float32(0.0)
            s5 = np.float32(0.0)
            s6 = np.float32(0.0)
            s7 = np.float32(0.0)
            for k in range(K):
                xk = x[0, k]
                s0 += xk * w[n, k]
                s1 += xk * w[n + 1, k]
                s2 += xk * w[n + 2, k]
                s3 += xk * w[n + 3, k]
                s4 += xk * w[n + 4, k]
                s5 += xk * w[n + 5, k]
                s6 += xk * w[n + 6, k]
                s7 += xk * w[n + 7, k]
            _store(y, n, b, has_bias, s0, s0, s0, s0)
            _store(y, n + 1, b, has_bias, s1, s1, s1, s1)
            _store(y, n + 2, b, has_bias, s2, s2, s2, s2)
            _store(y, n + 3, b, has_bias, s3, s3, s3, s3)
            _store(y, n + 4, b, has_bias, s4, s4, s4, s4)
            _store(y, n + 5, b, has_bias, s5, s5, s5, s5)
            _store(y, n + 6, b, has_bias, s6, s6, s6, s6)
            _store(y, n + 7, b, has_bias, s7, s7, s7, s7)
        for n in range(N - N % 8, N):
            s0, s1, s2, s3 = _row(x, w, n)
            _store(y, n, b, has_bias, s0, s1, s2, s3)
    else:
        for n in prange(N):
            s0, s1, s2, s3 = _row(x, w, n)
            _store(y, n, b, has_bias, s0, s1, s2, s3)


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


def gemv(x: torch.Tensor, w_nk: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """``x @ w_nk.T + bias`` for x [M, K] fp32 with 1 <= M <= `MAX_ROWS`, ``w_nk`` [N, K]
    fp32 C-contiguous (`pack_weight`), ``bias`` [N] fp32 or None; result [M, N] fp32,
    written into ``out`` when given (any strides; a non-contiguous one gets a copy).
    Matches ``F.linear(x, w_nk, bias)`` to fp32 rounding (module docstring). Raises
    ValueError naming the bad argument on shape/dtype/row-count mismatch."""
    if x.dim() != 2 or x.dtype != torch.float32 or not 1 <= x.shape[0] <= MAX_ROWS:
        raise ValueError(f"gemv: x must be float32 [M, K] with 1 <= M <= {MAX_ROWS}, got "
                         f"{tuple(x.shape)} {x.dtype}; use F.linear for larger M")
    m, k = x.shape
    if w_nk.dim() != 2 or w_nk.shape[1] != k or w_nk.dtype != torch.float32 \
            or not w_nk.is_contiguous():
        raise ValueError(f"gemv: the weight must be float32 C-contiguous [N, {k}], got "
                         f"{tuple(w_nk.shape)} {w_nk.dtype}; pass it through pack_weight")
    n = w_nk.shape[0]
    if bias is not None and (tuple(bias.shape) != (n,) or bias.dtype != torch.float32):
        raise ValueError(f"gemv: bias must be float32 [{n}], got {tuple(bias.shape)} {bias.dtype}")
    y = out if out is not None and out.is_contiguous() else torch.empty(m, n)
    b = _NO_BIAS if bias is None else bias.detach().contiguous().numpy()
    with launch(m * k * n):
        _gemv_kernel(x.detach().contiguous().numpy(), w_nk.detach().numpy(), b, bias is not None,
                     y.numpy())
    if out is not None and y is not out:
        out.copy_(y)
        return out
    return y


__all__ = ["MAX_ROWS", "gemv", "pack_weight"]
