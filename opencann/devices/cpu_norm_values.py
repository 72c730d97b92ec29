"""Whether a fused norm kernel gives the spelled-out RMSNorm / LayerNorm's NaN, ±inf and
overflow on this CPU, and on which inputs ATen's LayerNorm kernel does.

A spelled-out norm evaluated op by op overflows where a one-pass kernel may not: eager's
``x.mean(-1)`` sums in the input's dtype (a row of 3e38 sums to inf, the row becomes
NaN) where ATen's ``native_layer_norm`` keeps a running mean (Welford) and gives finite
numbers; eager's ``x.var()`` accumulates in float64 where ATen's LayerNorm overflows its
float32 sum of squares past |x − μ| ≈ 1e19 (and returns β); eager's ``(x − μ)²`` overflows
there too. So the compiled model would change eager's result on rows holding huge values.

- RMSNorm: ATen's ``rms_norm`` (torch 2.x on CPU) is the same ops as the spelled-out form,
  bit for bit; `norm_differs("rms_norm", dtype)` checks that on this CPU and torch (a
  fused C++ kernel that accumulates differently would overflow elsewhere than eager).
- LayerNorm: the fused kernel (``ops/kernels/cpu_patterns.py``) runs ATen's
  ``native_layer_norm`` and keeps its result only where `layer_norm_in_range` proves that
  neither eager's ops nor ATen's kernel leave the finite range (every |x| of the tensor
  under `row_bound`, from the kernel's own mean and rstd); otherwise it evaluates the
  spelled-out formula (`layer_norm_formula`, eager's ops) instead. `norm_differs(
  "layer_norm", dtype)` checks on this CPU that every probe row the guard lets through
  matches the formula. γ and β must be finite and moderate (`affine_in_range`), else the
  formula runs: ATen computes (x·rstd − μ·rstd)·γ + β, which meets inf·0 elsewhere.

Probe rows (1000 wide: a vector body and a tail): NaN, ±inf, ±3e38, ±1e13, ±1e20 each at
the head, the body and the tail of a row of randn; rows of ±3e38, 1e20 and 1e19; two 3e38
in one row; clean rows. Compared: NaN and inf positions, inf signs, and finite values
within rounding (1e-4 relative in float32 and float64, 6e-2 in bfloat16). Cached per
(kind, dtype) by `cpu_special_values.special_values_differ`, which reports the reason.
"""
from __future__ import annotations

import math
from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch

NORMS = ("rms_norm", "layer_norm")
_D = 1000
_PLACES = (0, 1, 499, 500, 993, 999)
_SPECIALS = (float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e13, -1e13, 1e20, -1e20)
_EPS = 1e-5


def rms_norm_formula(x: torch.Tensor, weight: Optional[torch.Tensor], eps: float) -> torch.Tensor:
    """x·rsqrt(mean(x², -1, keepdim) + eps) [· weight], eager's ops in x's dtype (Zhang &
    Sennrich 2019, arXiv:1910.07467)."""
    y = x * torch.rsqrt(torch.pow(x, 2).mean(-1, keepdim=True) + eps)
    return y if weight is None else y * weight


def layer_norm_formula(x: torch.Tensor, dims: int, weight: Optional[torch.Tensor],
                       bias: Optional[torch.Tensor], eps: float, variance: str = "pow",
                       root: str = "sqrt") -> torch.Tensor:
    """The spelled-out LayerNorm over the last ``dims`` axes, eager's ops in x's dtype (Ba,
    Kiros & Hinton 2016, arXiv:1607.06450): μ = mean(x), σ² = mean((x − μ)²) (``variance``
    "pow") or var(x, correction=0) ("var"), (x − μ)/sqrt(σ² + eps) (``root`` "sqrt") or
    (x − μ)·rsqrt(σ² + eps) ("rsqrt"), then · weight, + bias when given."""
    axes = list(range(-dims, 0))
    d = x - x.mean(axes, keepdim=True)
    if variance == "var":
        var = torch.var(x, axes, correction=0, keepdim=True)
    else:
        var = torch.pow(d, 2).mean(axes, keepdim=True)
    y = d / torch.sqrt(var + eps) if root == "sqrt" else d * torch.rsqrt(var + eps)
    if weight is not None:
        y = y * weight
    return y if bias is None else y + bias


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


def _probe_rows(dtype: torch.dtype) -> Tuple[Sequence[str], torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    rows, labels = [], []
    for v in _SPECIALS:
        for p in _PLACES:
            r = torch.randn(_D, generator=g, dtype=torch.float64)
            r[p] = v
            rows.append(r)
            labels.append(f"a row with {v:g} at {p}")
    for v in (3e38, -3e38, 1e20, 1e19):
        rows.append(v * (1 + 0.01 * torch.rand(_D, generator=g, dtype=torch.float64)))
        labels.append(f"a row of {v:g}")
    r = torch.randn(_D, generator=g, dtype=torch.float64)
    r[[1, _D - 2]] = 3e38
    rows.append(r)
    labels.append(f"a row with 3e+38 at 1 and {_D - 2}")
    for _ in range(3):
        rows.append(torch.randn(_D, generator=g, dtype=torch.float64))
        labels.append("a row of randn")
    return labels, torch.stack(rows).to(dtype)


def _affine(dtype: torch.dtype):
    g = torch.Generator().manual_seed(1)
    w = (1 + 0.1 * torch.randn(_D, generator=g)).to(dtype)
    return w, (0.1 * torch.randn(_D, generator=g)).to(dtype)


def _strided(x: torch.Tensor) -> torch.Tensor:
    """``x`` as a view with a row stride twice its width (a slice of a wider buffer)."""
    buf = torch.empty(x.shape[0], 2 * x.shape[1], dtype=x.dtype)
    buf[:, ::2] = x
    return buf[:, ::2]


def _kernels(kind: str, dtype: torch.dtype) -> Iterator[Tuple[str, Callable, Callable]]:
    """(name, kernel(x) -> (y, rows the kernel's guard hands to the formula), formula(x))
    of each way a fused ``kind`` node runs."""
    w, b = _affine(dtype)
    if kind == "rms_norm":
        for wt in (w, None):
            tag = " with a weight" if wt is not None else ""
            yield (f"aten.rms_norm{tag}",
                   lambda x, wt=wt: (torch.rms_norm(x, [_D], wt, _EPS), None),
                   lambda x, wt=wt: rms_norm_formula(x, wt, _EPS))
        return
    for variance in ("pow", "var"):
        for root in ("sqrt", "rsqrt"):
            for wt, bs in ((w, b), (None, None)):
                def kernel(x, wt=wt, bs=bs):
                    y, mean, rstd = torch.native_layer_norm(x, [_D], wt, bs, _EPS)
                    ok = [layer_norm_in_range(mean[i], rstd[i], _D, dtype)
                          for i in range(x.shape[0])]
                    return y, torch.tensor([not o for o in ok])
                yield (f"aten.native_layer_norm ({variance}, {root}"
                       f"{', γ, β' if wt is not None else ''})", kernel,
                       lambda x, wt=wt, bs=bs, v=variance, r=root:
                       layer_norm_formula(x, 1, wt, bs, _EPS, v, r))


def _first_difference(got: torch.Tensor, want: torch.Tensor, skip) -> Optional[Tuple[int, int]]:
    """(row, column) of the first element where ``got`` and ``want`` differ in NaN-ness,
    inf-ness, the inf's sign or a finite value beyond rounding; rows in ``skip`` (a bool
    per row) are not compared. None when they agree."""
    tol = 6e-2 if want.dtype in (torch.bfloat16, torch.float16) else 1e-4
    g, w = got.double(), want.double()
    bad = (g.isnan() != w.isnan()) | (g.isinf() != w.isinf()) | (w.isinf() & (g != w))
    both = g.isfinite() & w.isfinite()
    bad |= both & ((g - w).abs() > tol * (1 + w.abs()))
    if skip is not None:
        bad &= ~skip.reshape(-1, 1)
    idx = torch.nonzero(bad)
    return (int(idx[0, 0]), int(idx[0, 1])) if idx.numel() else None


def norm_differs(kind: str, dtype: torch.dtype) -> Optional[str]:
    """None when every way a fused ``kind`` node ("rms_norm", "layer_norm") runs on this
    CPU gives the spelled-out formula's NaN, ±inf and values (to rounding) on the probe
    rows its guard lets through, for ``dtype`` inputs; else one line naming the kernel,
    the row and both results. A kernel that raises is reported as a difference. Raises
    KeyError for another ``kind``. Uncached: `special_values_differ` caches it."""
    if kind not in NORMS:
        raise KeyError(kind)
    labels, x = _probe_rows(dtype)
    for layout, inp in (("", x), (" on a strided view", _strided(x))):
        for name, kernel, form in _kernels(kind, dtype):
            try:
                got, skip = kernel(inp)
            except (RuntimeError, TypeError, ValueError) as e:
                return f"{name}{layout} fails for {dtype} on this CPU ({str(e).splitlines()[0]})"
            want = form(inp)
            at = _first_difference(got, want, skip)
            if at is not None:
                i, j = at
                return (f"{name}{layout} gives {kind}({labels[i]})[{j}] = "
                        f"{got[i, j].item():g} on this CPU where the spelled-out formula "
                        f"gives {want[i, j].item():g}")
    return None


__all__ = ["NORMS", "affine_in_range", "layer_norm_formula", "layer_norm_in_range",
           "layer_norm_limits",
           "norm_differs", "rms_norm_formula", "row_bound"]
