"""numba row kernels of the residual LayerNorms: `add_ln` (AddLayerNorm: y = LayerNorm(a +
b)) and `add_ln_quant` (AddLayerNormQuant: the same y and its uint8 quantization), one
pass over the rows each, rows split over the cores with ``prange``. They share the row's
sum and statistics (`row_add`, `row_stats`).

One row: a + b (either addend float32 or bf16, widened exactly: `widen`) into a row-sized
buffer and its sum, the mean and the biased variance in float64 (two passes over that
buffer, which stays in L1: d = 768 is 3 KiB), then ``(s − μ)·rstd·γ + β`` written to y
(`add_ln`: in float64, rounded once; `add_ln_quant`: in float32), and for `add_ln_quant` its
uint8 quantization in the same loop (`quant_numba.saturate_u8`: ``saturate(round_half_even(y / step) + offset)``,
NaN → 0). So each input is read from memory once and each output written once: in a
graph, right after an int8 GEMM has streamed its weights through L2, each further pass
over a [128, 768] activation cost more than its arithmetic (docs/performance.md).

Each kernel returns how many rows leave the range where its result is eager's to rounding
(`ops.parity.norm_range.layer_norm_limits`: NaN or ±inf in the row, a sum that
overflows, |x| near 1e19); the caller then runs ATen's ops instead (eager's special
values). Fast-math flags ``reassoc, contract`` only, as ``ops/flash_attention/cpu.py``: the
reductions vectorize and NaN/Inf keep IEEE semantics. numba because the project's CPU
codegen is numba (DESIGN.md). Source of the algorithm: the two-pass mean and variance
(Chan, Golub and LeVeque, "Algorithms for computing the sample variance", 1983: the
two-pass form, accurate where the one-pass sum of squares cancels).
"""
from __future__ import annotations

import numpy as np
from numba import prange, types
from numba.extending import overload

from .numba_cache import njit
from .quant_bf16_numba import f32_of_bits
from .quant_numba import saturate_u8

FASTMATH = {"reassoc", "contract"}


def widen(v):
    """The float32 value of one element: a float as it is, a uint16 or int16 as the bits of
    a bf16 (``bits << 16`` viewed as float32: exact, bf16 is fp32's upper half)."""
    if isinstance(v, (np.uint16, np.int16)):
        bits = np.array([v]).view(np.uint16).astype(np.uint32) << np.uint32(16)
        return bits.view(np.float32)[0]
    return np.float32(v)


@overload(widen, inline="always")
def _widen_impl(v):  # pragma: no cover - typed by numba
    if isinstance(v, types.Float):
        return lambda v: np.float32(v)
    if v in (types.uint16, types.int16):   # bf16 bits (an int16 sign-extends: the bits kept are the same)
        return lambda v: f32_of_bits(np.uint32(v) << np.uint32(16))
    return None


@njit(cache=True, inline="always", error_model="numpy")
def row_add(a, b, r, s):  # pragma: no cover - compiled by numba
    """s[j] = widen(a[r, j]) + widen(b[r, j]) (float32) for row r of a, b [rows, d]
    (float32, or bf16 bits as uint16 / int16); returns Σ s in float64."""
    t = np.float64(0.0)
    for j in range(s.size):
        v = widen(a[r, j]) + widen(b[r, j])
        s[j] = v
        t += v
    return t


@njit(cache=True, inline="always", error_model="numpy")
def row_stats(s, total, eps, bound, rstd_max):  # pragma: no cover - compiled by numba
    """(μ, rstd, in range) of the row s (float32 [d]) whose sum is ``total``: μ and the
    biased variance in float64, rstd = 1/√(var + eps); in range as
    `norm_range.layer_norm_in_range` tests it (False for NaN statistics)."""
    d = s.size
    m = total / d
    var = np.float64(0.0)
    for j in range(d):
        c = s[j] - m
        var += c * c
    var /= d
    rs = 1.0 / np.sqrt(var + eps)
    ok = rs > 0.0 and rs <= rstd_max and abs(m) + np.sqrt(np.float64(d)) / rs <= bound
    return m, rs, ok


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def add_ln(a, b, g, be, eps, out, bound, rstd_max):  # pragma: no cover - compiled by numba
    """out [rows, d] (float32) = LayerNorm(a + b) with γ = g, β = be [d] (float32); a, b
    [rows, d] float32 or bf16 bits (uint16). Returns the rows out of range (module
    docstring). The sum is kept in a row-sized scratch array (out may be a buffer the
    caller's fallback must not see half-written by a sum)."""
    rows, d = a.shape
    outside = 0
    for r in prange(rows):
        s = np.empty(d, np.float32)
        m, rs, ok = row_stats(s, row_add(a, b, r, s), eps, bound, rstd_max)
        if not ok:
            outside += 1
        for j in range(d):
            out[r, j] = (s[j] - m) * rs * g[j] + be[j]
    return outside


@njit(fastmath=FASTMATH, cache=True, inline="always", error_model="numpy")
def row_quant(a, b, g, be, p, y, yq, r):  # pragma: no cover - compiled by numba
    """Row r of `add_ln_quant`: y[r] = LayerNorm(a[r] + b[r]) (y's row holds the sum until
    it is normalized: no scratch), yq[r] its uint8 quantization; True when in range."""
    s = y[r]
    m, rs, ok = row_stats(s, row_add(a, b, r, s), p[0], p[3], p[4])
    mf, rf = np.float32(m), np.float32(rs)
    inv, offset = np.float32(p[1]), np.float32(p[2])
    for j in range(s.size):
        v = (s[j] - mf) * rf * g[j] + be[j]
        s[j] = v
        yq[r, j] = saturate_u8(v, inv, offset)
    return ok


@njit(parallel=True, fastmath=FASTMATH, cache=True, error_model="numpy")
def add_ln_quant(a, b, g, be, p, y, yq, bad):  # pragma: no cover - compiled by numba
    """y [rows, d] (float32) = LayerNorm(a + b) with `add_ln`'s statistics, normalized in
    float32 (μ and rstd rounded to float32 once: the float64 product halved the vector
    width and cost 20 of 65 µs at [128, 768] on one thread), and yq [rows, d] (uint8) =
    saturate(round_half_even(y / step) + offset), NaN → 0; a, b [rows, d] float32 or bf16
    bits (uint16 or int16), γ = g and β = be [d] float32, ``p`` float64 [eps, 1/step,
    offset, bound, rstd_max] (`norm_range.layer_norm_limits`; one array: each argument
    costs numba's dispatch ~0.3 µs). Marks each row out of range (module docstring) 1 in
    ``bad`` [rows] (uint8; 0 elsewhere) for the caller to redo; returns their count."""
    outside = 0
    for r in prange(a.shape[0]):
        ok = row_quant(a, b, g, be, p, y, yq, r)
        bad[r] = not ok
        outside += not ok
    return outside


@njit(fastmath=FASTMATH, cache=True, error_model="numpy")
def add_ln_quant_serial(a, b, g, be, p, y, yq, bad):  # pragma: no cover - compiled by numba
    """`add_ln_quant` on the calling thread alone: no parallel launch (its fixed cost)
    when `numba_cache.launch_threads` gives one thread."""
    outside = 0
    for r in range(a.shape[0]):
        ok = row_quant(a, b, g, be, p, y, yq, r)
        bad[r] = not ok
        outside += not ok
    return outside


__all__ = ["FASTMATH", "add_ln", "add_ln_quant", "add_ln_quant_serial", "row_add", "row_quant", "row_stats",
           "widen"]
