"""Where ATen's one-pass LayerNorm gives the spelled-out LayerNorm's result (to
rounding): the guard the fused LayerNorm kernels test on their own statistics
(``ops/kernels/cpu_patterns.py``, ``ops/kernels/add_layer_norm.py``) and the LayerNorm
probe (`norms`) checks on this CPU.

A spelled-out norm evaluated op by op overflows where a one-pass kernel may not: eager's
``x.mean(-1)`` sums in the input's dtype (a row of 3e38 sums to inf, the row becomes
NaN) where ATen's ``native_layer_norm`` keeps a running mean (Welford) and gives finite
numbers; eager's ``x.var()`` accumulates in float64 where ATen's LayerNorm overflows its
float32 sum of squares past |x − μ| ≈ 1e19 (and returns β); eager's ``(x − μ)²``
overflows there too. So the kernel keeps ATen's result only where `layer_norm_in_range`
proves that neither side leaves the finite range, and γ, β only when `affine_in_range`
(ATen computes (x·rstd − μ·rstd)·γ + β, which meets inf·0 elsewhere).
"""
from __future__ import annotations

import math
from typing import Optional, Tuple

import torch


def row_bound(d: int, dtype: torch.dtype) -> float:
    """The largest |x| (d elements a row) for which no op of the spelled-out LayerNorm or
    of ATen's kernel can overflow in ``dtype``: d·|x| (the row's sum) and 4·d·|x|² (the
    sum of squares) stay under max/32, a factor 4 of margin for the kernel's rounded
    statistics. 1.6e17 at d = 100 in float32."""
    return math.sqrt(torch.finfo(dtype).max / (128.0 * max(int(d), 1)))


def layer_norm_limits(d: int, dtype: torch.dtype) -> Tuple[float, float]:
    """(bound, rstd_max) of `layer_norm_in_range` for rows of d elements in ``dtype``: a
    row is in range when |μ| + √d/rstd ≤ bound (`row_bound`) and 0 < rstd ≤ rstd_max =
    max/(16·bound). For kernels that check their own statistics in their loop."""
    bound = row_bound(d, dtype)
    return bound, torch.finfo(dtype).max / (16.0 * bound)


def layer_norm_in_range(mean: torch.Tensor, rstd: torch.Tensor, d: int,
                        dtype: torch.dtype) -> bool:
    """True when ATen's LayerNorm result (its ``mean`` and ``rstd`` per row, d elements a
    row, input ``dtype``) is the spelled-out formula's up to rounding: every |x − μ| is at
    most √d/rstd, so every |x| ≤ max|μ| + √d/min(rstd), which must be under `row_bound`;
    and rstd under max/(16·bound), so x·rstd does not overflow. NaN or inf statistics
    (a NaN, an inf, an overflowing row) give False: the caller then runs the formula."""
    bound, rstd_max = layer_norm_limits(d, dtype)
    lo_hi = torch.stack([*torch.aminmax(mean), *torch.aminmax(rstd)]).tolist()
    m_lo, m_hi, r_lo, r_hi = lo_hi
    if not (r_lo > 0.0 and r_hi <= rstd_max):
        return False
    return max(-m_lo, m_hi) + math.sqrt(d) / r_lo <= bound


def affine_in_range(weight: Optional[torch.Tensor], bias: Optional[torch.Tensor], d: int,
                    dtype: torch.dtype) -> bool:
    """True when γ and β (either may be None) are finite and small enough that y·γ + β
    cannot overflow for a normalized |y| ≤ √d in either evaluation order: |γ| ≤
    max/(16·√d), |β| ≤ max/4."""
    top = torch.finfo(dtype).max
    for t, lim in ((weight, top / (16.0 * math.sqrt(max(d, 1)))), (bias, top / 4.0)):
        if t is not None and t.numel() and not float(t.detach().abs().max()) <= lim:
            return False
    return True


__all__ = ["affine_in_range", "layer_norm_in_range", "layer_norm_limits", "row_bound"]
