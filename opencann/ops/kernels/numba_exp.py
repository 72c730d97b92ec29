"""A vectorizable ``exp`` for numba kernels' softmax: `exp_shifted` ``(x, n, m)`` writes
``x[j] = exp(x[j] - m)`` for j < n and returns the sum, in one loop that LLVM turns into
AVX-512 code (16 floats per instruction), where ``np.exp`` is a scalar ``expf`` call per
element: numba has no vector ``exp`` without Intel's SVML, which this build lacks (``numba
-s``: "SVML State: False").

Algorithm: ``exp(t) = 2^(t·log2 e)``; ``2^u = 2^k · 2^r`` with k = floor(u + 1/2) and
|r| <= 1/2, ``2^r`` by a degree-6 polynomial (Cephes ``exp2f`` coefficients, Stephen L.
Moshier, relative error < 2e-7, the same polynomial as
`opencann.ops.flash_attention.cpu`'s ``_exp2_sub``) and ``2^k`` built in the exponent bits
(`f32_from_bits`, an LLVM ``bitcast`` through numba's documented
``numba.extending.intrinsic`` extension point). Domain (a softmax's ``score - max``):
u clamped to [-127, 64], so results below ~2^-126.5 and ``exp(-inf)`` are 0 (IEEE's
would be subnormal: at most 1.2e-38 absolute), ``inf - inf`` and NaN give NaN (numba's
``max``/``min`` keep a NaN first argument), as eager's softmax.
"""
from __future__ import annotations

import numpy as np
from llvmlite import ir
from numba import types
from numba.extending import intrinsic

from .numba_cache import njit

_FM = {"reassoc", "contract"}


@intrinsic
def f32_from_bits(typingctx, x):
    """The float32 whose bits are ``x`` taken as an int32 (a wider integer is truncated to
    its low 32 bits first; LLVM ``bitcast``; vectorizes). Callable from numba code only."""
    if not isinstance(x, types.Integer):
        return None
    sig = types.float32(types.int32)

    def codegen(context, builder, signature, args):
        return builder.bitcast(args[0], ir.FloatType())
    return sig, codegen


@njit(fastmath=_FM, cache=True, inline="always")
def exp2_clamped(u):  # pragma: no cover - numba
    """``2^u`` for a float32 ``u`` clamped to [-127, 64] (module docstring: the
    polynomial, the domain, NaN): one branch-free scalar step that LLVM vectorizes in
    the caller's loop. Callable from numba code only."""
    u = min(max(u, np.float32(-127.0)), np.float32(64.0))
    kf = np.floor(u + np.float32(0.5))
    r = u - kf
    p = np.float32(1.0) + r * (np.float32(6.931472028550421e-01) + r * (
        np.float32(2.402264791363012e-01) + r * (np.float32(5.550332471162809e-02) + r * (
            np.float32(9.618437357674640e-03) + r * (np.float32(1.339887440266574e-03)
                                                     + r * np.float32(1.535336188319500e-04))))))
    return p * f32_from_bits((np.int32(kf) + np.int32(127)) << 23)


@njit(fastmath=_FM, cache=True, inline="always")
def exp_shifted(x, n, m):  # pragma: no cover - numba
    """In place ``x[j] = exp(x[j] - m)`` for j < n (``x`` a 1-D float32 array, ``m`` a
    float32); returns the float32 sum of the n results (summed in any order: the callers'
    fast-math ``reassoc``). Relative error < 3e-7 + 1e-7·|x[j] - m| against the exact
    exp of the float32 ``x[j] - m`` for a result above 2^-126 (the polynomial's 2e-7, and
    the float32 rounding of (x - m)·log2 e: 0.03 % at a result of 1e-38, where it moves a
    softmax sum by nothing); module docstring: domain, NaN/Inf. Callable from numba code
    only."""
    tot = np.float32(0.0)
    for j in range(n):
        e = exp2_clamped((x[j] - m) * np.float32(1.4426950408889634))
        x[j] = e
        tot += e
    return tot


__all__ = ["exp2_clamped", "exp_shifted", "f32_from_bits"]
