"""Bandwidth-bound skinny GEMM (GEMV) for linears with at most 32 rows: LLM decode and short
prefills.

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
its own slices of W exactly once; as many threads as torch's intra-op count, one below
ATen's grain or on an oversubscribed host: `numba_cache.launch_threads`; each output is
one thread's dot product, so the count never changes a bit). A prange step is
`gemv_tile`'s register tile: ``mr`` rows of x (1 or 4; above 4 rows, blocks of 4 or 8, below:
x's rows past M repeat row M - 1, computed and never stored) times ``rw`` rows of W that lie ``ceil(N / rw)`` rows
apart (``rw`` = `gemv_tile.rows_for` ``(mr)``: 8, 6, 3 with AVX-512), accumulated in
vector registers over all of K in one pass, each W row's successor prefetched into L2 as
it goes; W rows past N repeat row N - 1 (computed, never stored), so no N needs its own
loop. Two decisions, measured on the 2-core Xeon (the rotation of a 125M Llama's decode
weights as its step holds them, 49 with Q/K/V and gate/up merged, 400 MB, the kernels
called directly on one thread, least of 15 interleaved runs while other jobs ran, load
~2.7): W rows far apart are ``rw`` concurrent memory streams per thread where adjacent
rows are one, and the accumulators stay in registers for the whole of K where the earlier
numba tile (`_tile8`: two adjacent W rows x eight x rows, its K loop cut into 64-element
steps around the prefetches) summed all 16 accumulators horizontally every step: 8 rows
41.4 -> 27.8 ms, 4 rows 37.2 -> 26.7, 1 row 27.2 -> 25.7 (MKL's ``mm`` 29.3);
docs/performance.md, "Decode GEMM: the register tile" (also `bench/gemv.py --rotation`,
two threads). On the 2-core AMD EPYC (Zen 4: one 512-bit FMA per cycle, 32 KiB L1d), the
same 49 weights, numba kernels called directly on two threads, median of 16 interleaved
passes: at M = 8 the far-apart 3-row tile 15.51 ms against 19.85 for 3 adjacent rows and
20.80 for one row at a time. At M = 1 one row after the other (a plain loop LLVM
vectorises, one stream per thread) had measured 12.03 ms against 13.02 for the tile of 8
far-apart rows while the tile prefetched into L1; with the prefetch into L2 (`gemv_tile`)
the tile is level or ahead: medians of 24-40 interleaved passes, four processes, 16.29 ->
13.82, 14.63 -> 14.23, 13.61 -> 12.63, 13.06 -> 12.80 ms (the host's bandwidth moves
between runs), hence the tile at every M. M = 5..32 (a short prompt's prefill, a large
decode batch) runs a tile over blocks of x's rows within each prange step, so the tile's
W rows are read from memory once and from L1 for the other blocks: blocks of 8 rows
where the 8-row tile has as many accumulators as the 4-row one (AVX-512: 8 x 3 and 4 x
6), else of 4 (AVX2's 16 registers: 8 x 1 against 4 x 3; the 8 x 1 tile loads nine
vectors for eight FMAs and waits on L2 for x's rows, the 4 x 3 one loads seven for
twelve). On the 2-core AMD EPYC with AVX2, the 85 decode weights of that Llama (400 MB),
the kernels called directly on two threads in one process, least of 16 interleaved
passes, 8 x 1 -> 4 x 3 blocks: 5 rows 24.9 -> 21.8 ms, 6 rows 29.6 -> 25.2, 8 rows 28.7
-> 25.6, 12 rows 51.6 -> 33.7, 16 rows 62.8 -> 42.3, 32 rows 114.6 -> 78.9
(``bench/gemv.py --rotation`` gives the same kernel against MKL and oneDNN).
On the Xeon, the 8-row tile against MKL's ``mm`` on W as nn.Linear holds it,
one thread: 16 rows 45.0 / 79.7 ms, 32 rows 73.3 / 91.8, 64 rows 133.4 / 127.6, 128 rows
261.5 / 205.0. On the AVX2 EPYC the 4-row blocks against oneDNN's inner product on the
same [N, K] weight (what an LLM's merged Q/K/V and gate/up weights, which keep no other
layout, race; 4 weights of 768 x 4096 in turn, least of 10 interleaved calls, 2 threads,
GFLOP/s): 32 rows 58 / 47, 48 rows 68 / 53, 64 rows 65 / 56, 96 rows 64 / 63. `MAX_ROWS`
stays 32: with 64 the race bound the GEMV for a 34-row GEMM on rows of ±3e38 whose
overflowed outputs then differed from eager's (inf where eager's sum in K order gave NaN:
the GEMV sums K in vector lanes first), which a test of the norms' special values
caught; not settled.
The tile multiplies with FMA and sums its lanes once, reassociated (no ``nnan``/``ninf``),
so NaN and Inf propagate as in eager (a NaN or Inf in x or W makes the outputs it reaches
NaN/Inf; the summation order differs from MKL's, so results agree with eager to fp32
rounding, not bit for bit). Bias: added after the dot product (as addmm's beta=1 C).

Source: the row-parallel GEMV of issue #27 item 4; the layout and loop are the textbook
matrix-vector product (Golub & Van Loan, Matrix Computations, 4th ed., §1.1.5, "row
oriented" gaxpy), with the M rows of x as a register block of outputs (§1.5, "Vectorization
and Locality"; `gemv_tile`) and software prefetch (Intel 64 and IA-32 Architectures
Optimization Reference Manual, "Software prefetch").
"""
from __future__ import annotations

import contextlib
import functools
from typing import Callable, Optional

import numba
import numpy as np
import torch
from numba import prange

from .gemv_tile import dot_tile, rows_for
from .numba_cache import entry_point, launch_guard, launch_threads, njit, prebound
from .numpy_views import static_view

MAX_ROWS = 32  # the kernel handles x with 1..MAX_ROWS rows (decode: one token per sequence)
_FM = {"reassoc", "contract"}  # vectorise the K reduction; keep NaN/Inf semantics


_R1, _R4 = rows_for(1), rows_for(4)   # W rows per tile (`gemv_tile`)
_TILE1, _TILE4 = dot_tile(1, _R1), dot_tile(4, _R4)
# x's rows per block above 4 rows: the block whose tile issues the most FMAs per K step
# (mr x rows_for(mr) accumulators), 8 on a tie (module docstring: AVX-512 8 x 3, AVX2 4 x 3)
_MB = 8 if 8 * rows_for(8) >= 4 * _R4 else 4
_RB = rows_for(_MB)
_TILEB = _TILE4 if _MB == 4 else dot_tile(_MB, _RB)


@njit(fastmath=_FM, cache=True, inline="always")
def _put(y, m, n, b, has_bias, s):  # pragma: no cover - compiled by numba
    """y[m, n] = s (+ b[n]) when (m, n) is inside y (a tile's padding rows/columns are not)."""
    if m < y.shape[0] and n < y.shape[1]:
        y[m, n] = s + b[n] if has_bias else s


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv1_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """M = 1: `_TILE1` (x's row x ``_R1`` rows of w, h apart) per prange step; x [1, K],
    w [N, K], y [1, N] fp32 C-contiguous."""
    h = (w.shape[0] + _R1 - 1) // _R1
    for t in prange(h):
        s = _TILE1(x, w, t, h)
        for q in range(_R1):
            _put(y, 0, t + q * h, b, has_bias, s[q])


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv4_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """M = 2..4: `_TILE4` (x's 4 rows x ``_R4`` rows of w, h apart) per prange step;
    x [M, K], w [N, K], y [M, N] fp32 C-contiguous."""
    h = (w.shape[0] + _R4 - 1) // _R4
    for t in prange(h):
        s = _TILE4(x, w, t, h)
        for q in range(_R4):
            for m in range(4):
                _put(y, m, t + q * h, b, has_bias, s[4 * q + m])


@njit(parallel=True, fastmath=_FM, cache=True)
def _gemv_blocks_kernel(x, w, b, has_bias, y):  # pragma: no cover - compiled by numba
    """M = 5..`MAX_ROWS`: `_TILEB` for x's rows m0..m0 + `_MB` - 1, m0 = 0, `_MB`, ...,
    per prange step (the step's ``_RB`` rows of w stay in L1 from one block of x's rows
    to the next; a last block of fewer rows repeats x's last row, never stored); x [M,
    K], w [N, K], y [M, N] fp32 C-contiguous."""
    M = x.shape[0]
    h = (w.shape[0] + _RB - 1) // _RB
    for t in prange(h):
        for m0 in range(0, M, _MB):
            s = _TILEB(x[m0:], w, t, h)
            for q in range(_RB):
                for m in range(_MB):
                    _put(y, m0 + m, t + q * h, b, has_bias, s[_MB * q + m])


def _kernel_for(m: int):
    """The compiled kernel for ``m`` rows of x (1 <= m <= `MAX_ROWS`): `_gemv1_kernel`,
    `_gemv4_kernel` (2..4) or `_gemv_blocks_kernel` (5..32)."""
    return _gemv1_kernel if m == 1 else _gemv4_kernel if m <= 4 else _gemv_blocks_kernel


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


def _check_threads(threads: Optional[int], name: str = "gemv") -> None:
    """Raises ValueError unless ``threads`` is None or an int in 1..numba's pool size
    (``name``: the kernel the message names)."""
    if threads is not None and not (isinstance(threads, int) and not isinstance(threads, bool)
                                    and 1 <= threads <= numba.config.NUMBA_NUM_THREADS):
        raise ValueError(f"{name}: threads must be an int in 1..{numba.config.NUMBA_NUM_THREADS} "
                         f"(numba's pool on this host), got {threads!r}; or None for the "
                         f"launch policy's choice")


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
    written in place when contiguous and clear of x and the bias (else through a copy:
    `_shares_memory`), else a fresh tensor is
    returned; ``threads``: exactly that many threads on every call (a bandwidth
    measurement), instead of `numba_cache.launch_threads`' choice per call (torch's
    intra-op count, one thread on an oversubscribed host). Values: `gemv`'s (module
    docstring: fp32 rounding of ``F.linear``'s, NaN/Inf propagated). Raises ValueError
    naming the bad argument: at bind for the weight, ``rows`` or ``threads`` (an int
    from 1 to numba's pool size), at a call for an x that
    is not float32 [rows, K], a bias that is not float32 [N] or an ``out`` that is not
    float32 [rows, N]."""
    _check_weight(w_nk, None)
    if not 1 <= rows <= MAX_ROWS:
        raise ValueError(f"gemv: rows must be 1..{MAX_ROWS}, got {rows}; use F.linear for larger M")
    _check_threads(threads)
    n, k = (int(d) for d in w_nk.shape)
    run = bind_rows_kernel(_kernel_for(rows), w_nk.detach().numpy(), rows, n, k, threads)
    run.weight = w_nk   # held: a cache that keeps the packed copy weakly sees it alive
    return run


def bind_rows_kernel(kernel, wn: np.ndarray, rows: int, n: int, k: int,
                     threads: Optional[int] = None, name: str = "gemv") -> Callable[..., torch.Tensor]:
    """``run(x, bias=None, out=None)`` calling the numba GEMM ``kernel(x, wn, b, has_bias,
    y)`` (x [rows, k], y [rows, n], b [n] fp32 C-contiguous NumPy arrays; ``wn`` the
    constant weight in the kernel's own layout), as `bind_gemv` describes: shapes, the
    launch policy's work size and the threading layer's lock resolved once, a call with
    the previous call's tensors through the kernel's entry point, ``run.prebind`` for the
    code generator. ``name`` prefixes the call's one-line ValueErrors (`_refuse`)."""
    f32 = torch.float32
    xshape, yshape, work = torch.Size((rows, k)), torch.Size((rows, n)), rows * k * n
    bshape = torch.Size((n,))
    guard = launch_guard()
    lock = None if isinstance(guard, contextlib.nullcontext) else guard
    get_threads, set_threads = numba.get_num_threads, numba.set_num_threads
    # the last call's (x, out, bias, data pointers, entry point, args), replaced whole (a
    # thread reads it once); the entry point skips the dispatcher (`entry_point`)
    last: list = [None]
    entries: dict = {}     # has bias -> the kernel's entry point

    def run(x: torch.Tensor, bias: Optional[torch.Tensor] = None,
            out: Optional[torch.Tensor] = None) -> torch.Tensor:
        if x.shape != xshape or x.dtype is not f32 or (out is not None and (
                out.shape != yshape or out.dtype is not f32)) or (bias is not None and (
                bias.shape != bshape or bias.dtype is not f32)):
            _refuse(x, out, xshape, yshape, bias, name)
        nt = threads if threads is not None else launch_threads(work)
        if get_threads() != nt:
            set_threads(nt)
        m = last[0]       # read once: another thread may replace it (never mutated)
        if m is not None and x is m[0] and out is m[1] and bias is m[2] \
                and m[3] == _place(x, out, bias):
            _call(m[4], m[5], lock)   # the last call's tensors: its views, no dispatch
            return out
        return _views_call(kernel, wn, x, bias, out, yshape, lock, last, entries, name)
    run.prebind = functools.partial(_prebind, kernel, wn, xshape, yshape, work, threads, lock)
    return run


def _prebind(kernel, wn: np.ndarray, xshape, yshape, work: int, threads: Optional[int], lock,
             x: torch.Tensor, bias: Optional[torch.Tensor] = None,
             out: Optional[torch.Tensor] = None) -> Optional[Callable[[], torch.Tensor]]:
    """`bind_gemv`'s ``run.prebind(x, bias=None, out=None)``: ``call()`` running ``run(x,
    bias, out)`` on these very tensors and returning ``out`` (`numba_cache.prebound`), or
    None where they do not allow it (not contiguous float32 of the bound shapes, or an
    ``out`` overlapping x or the bias: `_shares_memory`)."""
    if out is not None and _shares_memory(out, x, bias):
        return None
    views = [static_view(t, s) if t is not None and t.shape == s else None
             for t, s in ((x, xshape), (out, yshape))]
    bn = _NO_BIAS if bias is None else static_view(bias, (yshape[1],))
    if any(a is None for a in views) or bn is None:
        return None
    return prebound(kernel, (views[0], wn, bn, bias is not None, views[1]), work, threads, lock,
                    result=out)


def _refuse(x: torch.Tensor, out: Optional[torch.Tensor], xshape, yshape,
            bias: Optional[torch.Tensor] = None, name: str = "gemv") -> None:
    """Raise the bound kernel's one-line ValueError for ``x``, ``bias`` or ``out``."""
    if x.shape != xshape or x.dtype is not torch.float32:
        raise ValueError(f"{name}: x must be float32 {list(xshape)} (the bound rows and K), "
                         f"got {tuple(x.shape)} {x.dtype}; bind the kernel for this shape")
    if bias is not None and (tuple(bias.shape) != (yshape[1],) or bias.dtype != torch.float32):
        raise ValueError(f"{name}: bias must be float32 [{yshape[1]}], got {tuple(bias.shape)} {bias.dtype}")
    raise ValueError(f"{name}: out must be float32 {list(yshape)}, got {tuple(out.shape)} {out.dtype}")


def _views_call(kernel, wn: np.ndarray, x: torch.Tensor, bias: Optional[torch.Tensor],
                out: Optional[torch.Tensor], yshape, lock, last: list,
                entries: dict, name: str = "gemv") -> torch.Tensor:
    """A bound GEMV call through the dispatcher: x, bias and the output as NumPy views
    (contiguous copies where they are not), the result into ``out`` (a copy when it is
    not contiguous) or a fresh tensor, through the kernel's entry point (``entries``,
    by whether there is a bias: the arguments' types never change) once it is compiled;
    ``last[0]`` set to this call's tensors, pointers, the entry point and arguments when
    every view is the caller's tensor itself (cleared otherwise). Raises `_refuse_place`'s
    ValueError for a tensor it cannot read or write through NumPy."""
    _refuse_place(x, bias, out, name)
    x0, b0 = x, bias
    if x.requires_grad or not x.is_contiguous():
        x = x.detach().contiguous()
    if bias is None:
        bn = _NO_BIAS
    else:
        if bias.requires_grad or not bias.is_contiguous():
            bias = bias.detach().contiguous()
        bn = bias.numpy()
    y = out if out is not None and out.is_contiguous() and not _shares_memory(out, x, bias) \
        else torch.empty(yshape, dtype=torch.float32)
    args = (x.numpy(), wn, bn, bias is not None, y.numpy())
    fn = entries.get(args[3])    # every call's types are the same (C-contiguous float32)
    _call(kernel if fn is None else fn, args, lock)
    if fn is None:
        fn = entries[args[3]] = entry_point(kernel, args)
    last[0] = None if fn is None or not (x is x0 and bias is b0 and y is out) else \
        (x, out, bias, _place(x, out, bias), fn, args)
    if out is not None and y is not out:
        return out.copy_(y)
    return y


def _shares_memory(out: torch.Tensor, *inputs: Optional[torch.Tensor]) -> bool:
    """Whether ``out``'s bytes may overlap those of any of ``inputs`` (None skipped): the
    kernel writes outputs while other tiles still read x and the bias (``out=x`` would be
    read after it was written), so such an ``out`` is filled through a copy. Conservative:
    the span from the first to the last element of each, in one storage."""
    def span(t: torch.Tensor) -> tuple:   # torch strides are >= 0
        if t.numel() == 0:
            return 0, 0
        last = sum((d - 1) * s for d, s in zip(t.shape, t.stride()))
        return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()
    o_lo, o_hi = span(out)
    for t in inputs:
        if t is not None and o_hi > o_lo:
            lo, hi = span(t)
            if lo < o_hi and o_lo < hi:
                return True
    return False


def _place(x: torch.Tensor, out: torch.Tensor, bias: Optional[torch.Tensor]) -> tuple:
    """Where the last call's tensors lie: data pointers and strides (a tensor whose
    strides changed in place, ``x.t_()`` on a square x or ``as_strided_``, is not the
    memory layout of the NumPy views made for it)."""
    return (x.data_ptr(), x.stride(), out.data_ptr(), out.stride(),
            0 if bias is None else bias.data_ptr(), None if bias is None else bias.stride())


def _refuse_place(x: torch.Tensor, bias: Optional[torch.Tensor], out: Optional[torch.Tensor],
                  name: str) -> None:
    """Raise a one-line ValueError for an x, bias or out that is not in CPU memory, or an
    ``out`` that requires grad (written in place: autograd refuses it, as eager's out=)."""
    for what, t in (("x", x), ("bias", bias), ("out", out)):
        if t is not None and (t.device.type != "cpu" or (what == "out" and t.requires_grad)):
            raise ValueError(f"{name}: {what} must be a float32 CPU tensor"
                             f"{' that does not require grad' if what == 'out' else ''}, got "
                             f"{tuple(t.shape)} {t.dtype} on {t.device}"
                             f"{' requiring grad' if t.requires_grad else ''}")


def _call(fn: Callable, args: tuple, lock) -> None:
    """``fn(*args)``, under ``lock`` (the workqueue layer's) when there is one."""
    if lock is None:
        fn(*args)
    else:
        with lock:
            fn(*args)


def gemv(x: torch.Tensor, w_nk: torch.Tensor, bias: Optional[torch.Tensor] = None,
         out: Optional[torch.Tensor] = None, threads: Optional[int] = None) -> torch.Tensor:
    """``x @ w_nk.T + bias`` for x [M, K] fp32 with 1 <= M <= `MAX_ROWS` (32), ``w_nk`` [N, K]
    fp32 C-contiguous (`pack_weight`), ``bias`` [N] fp32 or None; result [M, N] fp32,
    written into ``out`` when given (any strides; a non-contiguous one, or one overlapping
    x or the bias, gets a copy);
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
    if out is not None and (tuple(out.shape) != (x.shape[0], w_nk.shape[0]) or out.dtype != torch.float32):
        raise ValueError(f"gemv: out must be float32 {[x.shape[0], w_nk.shape[0]]}, got "
                         f"{tuple(out.shape)} {out.dtype}")
    return bind_gemv(w_nk, x.shape[0], threads)(x, bias, out)


__all__ = ["MAX_ROWS", "bind_gemv", "bind_rows_kernel", "gemv", "pack_weight"]
