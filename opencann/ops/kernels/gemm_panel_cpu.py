"""Panel GEMM: ``y[M, N] = x[M, K] @ W[K, N] + b`` in fp32 on a constant weight packed once
into NR-wide column panels, for LinearAct's prefill and encoder shapes (M from a few rows
to a few thousand).

Layout: W is packed at bind time into ``[P, K, NR]`` (`pack_panels`; P = ceil(N / NR),
panel p = columns p*NR .. p*NR + NR - 1, each K row of a panel contiguous, columns past N
zero), the B operand of Goto's algorithm, so the micro-kernel streams one panel row after
the other. x is read in place (unit stride along K).

Kernel: numba ``prange`` over the panels (each thread reads its own panels of W once, from
memory, and keeps the panel in L2 while it runs every block of x's rows against it); per
panel, blocks of MR rows of x through `gemm_tile`'s register tile (MR x NR = 6 x 16 with
AVX2, 12 x 32 with AVX-512; a last block of fewer rows runs the tile of MR/3, 2MR/3 or MR
rows that covers it, its rows past M repeating x's last row, computed and never stored),
then the bias added as the tile's block is stored. K is not blocked: the whole panel (48
KiB at K = 768, 192 KiB at K = 3072) stays in L2 while x's rows stream through L1; on the
2-core AMD EPYC (AVX2) K blocks of 128 or 256 (B's block in L1) measured no faster, and a
software prefetch of the next panel no faster either (interleaved A/B, 8 weights in
rotation, 2 threads). Threads: as many as torch's intra-op count (`numba_cache.
launch_threads`; one on an oversubscribed host); every output is one thread's, so the
count never changes a bit.

Measured against oneDNN's inner product on its blocked weight (``onednn_packed``) and MKL's
``addmm``, 2 threads, the 2-core AMD EPYC with AVX2 only, 8 weights in rotation (cold),
median over 5 interleaved rounds of the least of 10 calls (`bench/gemm_panel.py`), GFLOP/s:
see docs/performance.md, "Panel GEMM"; the bind-time race (`cpu.gemm_kernel`) picks per
shape, so a CPU where oneDNN or MKL is faster keeps them.

Values: fp32 rounding of ``F.linear``'s (FMA in K order, another order than MKL's blocked
sums); NaN and Inf propagate as in eager (no ``nnan``/``ninf`` fast-math flags).

Source: K. Goto and R. van de Geijn, "Anatomy of High-Performance Matrix Multiplication",
ACM TOMS 34(3), 2008 (packed B panels, register micro-kernel); `gemm_tile`.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch
from numba import prange

from .gemm_tile import panel_shape, panel_tile
from .numba_cache import njit

_FM = {"contract"}   # FMA contraction only: NaN/Inf semantics kept
MR, NR = panel_shape()
_TS, _TM, _TL = panel_tile(MR // 3), panel_tile(2 * MR // 3), panel_tile(MR)
_TLB = panel_tile(MR, bias=True)


@njit(parallel=True, fastmath=_FM, cache=True)
def _panel_kernel(x, bp, b, has_bias, y):  # pragma: no cover - compiled by numba
    """y = x @ W (+ b): prange over the panels of ``bp`` [P, K, NR] (`pack_panels`), per
    panel every block of ``MR`` rows of x [M, K] through the register tile, a whole block
    stored (bias added) into y by the tile itself, an edge block (fewer rows or columns)
    through a scratch tile; y [M, N] fp32 C-contiguous, b [N] (read when ``has_bias``)."""
    m_rows = x.shape[0]
    n_cols = y.shape[1]
    for p in prange(bp.shape[0]):
        acc = np.empty((MR, NR), np.float32)
        n0 = p * NR
        nn = min(NR, n_cols - n0)
        for m0 in range(0, m_rows, MR):
            r = min(MR, m_rows - m0)
            if r == MR and nn == NR:
                if has_bias:
                    _TLB(x, bp, m0, p, y, m0, n0, b, n0)
                else:
                    _TL(x, bp, m0, p, y, m0, n0, b, 0)
                continue
            if r <= MR // 3:
                _TS(x, bp, m0, p, acc, 0, 0, b, 0)
            elif r <= 2 * MR // 3:
                _TM(x, bp, m0, p, acc, 0, 0, b, 0)
            else:
                _TL(x, bp, m0, p, acc, 0, 0, b, 0)
            for m in range(r):
                for j in range(nn):
                    y[m0 + m, n0 + j] = acc[m, j] + b[n0 + j] if has_bias else acc[m, j]


def pack_panels(w: torch.Tensor, transposed: bool = True) -> torch.Tensor:
    """The kernel's weight layout ``[P, K, NR]`` fp32 C-contiguous (module docstring), made
    once (bind time). ``w``: [K, N] (a LinearAct's ``w_t``, ``transposed=True``) or [N, K]
    (nn.Linear's weight). Raises ValueError for a non-2-D or non-fp32 weight."""
    if not _cpu_tensor(w) or w.dim() != 2 or w.dtype != torch.float32:
        raise ValueError(f"gemm_panel: the weight must be a 2-D float32 CPU tensor, got "
                         f"{_describe(w)}; use F.linear for other dtypes")
    w_kn = w.detach() if transposed else w.detach().t()
    k, n = (int(d) for d in w_kn.shape)
    full, rest = divmod(n, NR)
    packed = torch.empty(full + (rest > 0), k, NR, dtype=torch.float32)   # one copy, no padded one
    packed[:full].copy_(w_kn[:, :full * NR].reshape(k, full, NR).permute(1, 0, 2))
    if rest:
        packed[full, :, rest:] = 0
        packed[full, :, :rest] = w_kn[:, full * NR:]
    return packed


def _cpu_tensor(t) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == "cpu"


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _describe(t) -> str:
    """``t``'s shape, dtype and (when not the CPU) device, or its type for a non-tensor."""
    if not isinstance(t, torch.Tensor):
        return f"a {type(t).__name__}"
    where = "" if t.device.type == "cpu" else f" on {t.device}"
    return f"{tuple(t.shape)} {t.dtype}{where}"


def _check_columns(packed: torch.Tensor, n) -> None:
    """Raise ValueError unless ``n`` is the column count of the weight ``packed`` holds:
    an int that needs exactly its panels, with the last panel's columns past ``n`` zero
    (`pack_panels` pads with zeros: a smaller ``n`` would drop real columns)."""
    p = int(packed.shape[0])
    if not (_is_int(n) and n >= 0 and -(-n // NR) == p):
        raise ValueError(f"gemm_panel: n = {n!r} does not match {p} panels of {NR} (n must be "
                         f"an int from {(p - 1) * NR + 1 if p else 0} to {p * NR})")
    if p and bool(packed[-1, :, n - (p - 1) * NR:].any()):
        raise ValueError(f"gemm_panel: n = {n} drops columns of the packed weight (its last "
                         f"panel holds values past column {n}); pass the weight's own N")


def bind_panel(packed: torch.Tensor, rows: int, n: int, threads: Optional[int] = None
               ) -> Callable[..., torch.Tensor]:
    """``run(x, bias=None, out=None)`` = ``x @ W + bias`` for x [rows, K] fp32, the panel
    GEMM bound once (plan/bind time) to ``packed`` (`pack_panels` of W [K, n]) and the row
    count ``rows`` (>= 1): as `gemv_cpu.bind_gemv` binds (a call with the previous call's
    tensors skips the dispatcher; ``run.prebind`` for the code generator). ``out``: [rows,
    n] fp32, written in place when contiguous (else through a copy), else a fresh tensor
    is returned; ``threads``: exactly that many threads instead of the launch policy's.
    Raises ValueError naming the bad argument: at bind for ``packed``, ``rows`` or ``n``,
    at a call for an x, bias or out of the wrong shape or dtype."""
    from .gemv_cpu import _check_threads, bind_rows_kernel
    if not _cpu_tensor(packed) or packed.dim() != 3 or packed.shape[2] != NR \
            or packed.dtype != torch.float32 or not packed.is_contiguous():
        raise ValueError(f"gemm_panel: the weight must be float32 C-contiguous [P, K, {NR}] on the "
                         f"CPU, got {_describe(packed)}; pass it through pack_panels")
    if not (_is_int(rows) and rows >= 1):
        raise ValueError(f"gemm_panel: rows must be a positive int, got {rows!r}")
    _check_columns(packed, n)
    _check_threads(threads, "gemm_panel")
    run = bind_rows_kernel(_panel_kernel, packed.detach().numpy(), rows, n, int(packed.shape[1]),
                           threads, "gemm_panel")
    run.weight = packed   # held: a cache that keeps the packed copy weakly sees it alive
    return run


def gemm_panel(x: torch.Tensor, w: torch.Tensor, bias: Optional[torch.Tensor] = None,
               out: Optional[torch.Tensor] = None, threads: Optional[int] = None) -> torch.Tensor:
    """``F.linear(x, w, bias)`` for x [M, K] fp32 and nn.Linear's weight ``w`` [N, K] fp32,
    by the panel GEMM (packs ``w`` on every call: for tests and measurements; a caller that
    repeats a weight packs once with `pack_panels` and binds with `bind_panel`). Raises
    ValueError for a mismatched shape or dtype."""
    if not (_cpu_tensor(x) and _cpu_tensor(w)) or x.dim() != 2 or x.dtype != torch.float32 \
            or w.dim() != 2 or w.shape[1] != x.shape[1]:
        raise ValueError(f"gemm_panel: x must be float32 [M, K] and w [N, K] (CPU tensors), got "
                         f"{_describe(x)} and {_describe(w)}")
    n = int(w.shape[0])
    return bind_panel(pack_panels(w, transposed=False), int(x.shape[0]), n, threads)(x, bias, out)


__all__ = ["MR", "NR", "bind_panel", "gemm_panel", "pack_panels"]
