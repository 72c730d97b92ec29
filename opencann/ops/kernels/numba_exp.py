"""A vectorizable ``exp`` for numba kernels' softmax: `exp_shifted` ``(x, n, m)`` writes
``x[j] = exp(x[j] - m)`` for j < n and returns the sum, in one loop that LLVM turns into
AVX-512 code (16 floats per instruction), where ``np.exp`` is a scalar ``expf`` call per
element: numba has no vector ``exp`` without Intel's SVML, which this build lacks (``numba
-s``: "SVML State: False"). `exp_f32` ``(x)`` is exp of any float32 at ~1 ulp (Cephes
``expf``; SwiGLU's epilogue, `swiglu_numba`), for loops where accuracy over the whole
range matters more than the softmax's few instructions.

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


#: Cephes ``expf`` (Stephen L. Moshier, cephes/single/expf.c): the range ln 2 split in two
#: (Cody & Waite), and the degree-7 polynomial of exp(r) on |r| <= ln 2 / 2
_LN2_HI, _LN2_LO = np.float32(0.693359375), np.float32(-2.12194440e-4)
_EXP_MAX, _EXP_MIN = np.float32(88.72283905206835), np.float32(-87.33654475055310898657)


@njit(fastmath={"contract"}, cache=True, inline="always")
def exp_f32(x):  # pragma: no cover - numba
    """``exp(x)`` for a float32 ``x``, one branch-free step that LLVM vectorizes in the
    caller's loop (where ``np.exp`` is a scalar ``expf`` call): Cephes ``expf``'s range
    reduction and polynomial (relative error ~1 ulp; glibc's correctly rounded ``expf``
    and ATen's SLEEF differ from it by an ulp or two). IEEE's results outside the
    polynomial's range: ``inf`` above ln(FLT_MAX) (``exp(inf) = inf``), 0 below
    ln(FLT_MIN) (no subnormals: at most 1.2e-38 absolute; ``exp(-inf) = 0``), NaN for
    NaN. The caller must not reassociate (no ``reassoc`` fast-math flag: it would fold
    the two-part ln 2 back into one); ``contract`` (FMA) is fine. Callable from numba
    code only."""
    xc = min(max(x, _EXP_MIN), _EXP_MAX)        # a NaN stays NaN (first argument kept)
    z = np.floor(xc * np.float32(1.4426950408889634) + np.float32(0.5))
    r = (xc - z * _LN2_HI) - z * _LN2_LO
    p = (((((np.float32(1.9875691500e-4) * r + np.float32(1.3981999507e-3)) * r
            + np.float32(8.3334519073e-3)) * r + np.float32(4.1665795894e-2)) * r
          + np.float32(1.6666665459e-1)) * r + np.float32(5.0000001201e-1))
    p = p * (r * r) + r + np.float32(1.0)
    # 2^z as 2^a · 2^(z - a), a = z // 2: z spans [-126, 128] and 2^128 alone is inf
    k = np.int32(z)
    a = k >> 1
    e = p * f32_from_bits((a + np.int32(127)) << 23) * f32_from_bits((k - a + np.int32(127)) << 23)
    e = np.float32(np.inf) if x > _EXP_MAX else e
    return np.float32(0.0) if x < _EXP_MIN else e


__all__ = ["exp2_clamped", "exp_f32", "exp_shifted", "f32_from_bits"]
