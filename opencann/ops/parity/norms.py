"""The norm probes: does a fused RMSNorm / LayerNorm kernel give the spelled-out norm's
NaN, ±inf, overflow and values (to rounding) on this CPU?

- RMSNorm: ATen's ``rms_norm`` (torch 2.x on CPU) is the same ops as the spelled-out form,
  bit for bit; `norm_differs("rms_norm", dtype)` checks that on this CPU and torch (a
  fused C++ kernel that accumulates differently would overflow elsewhere than eager).
- LayerNorm: the fused kernel (``ops/kernels/cpu_patterns.py``) runs ATen's
  ``native_layer_norm`` and keeps its result only where `norm_range.layer_norm_in_range`
  holds, else it evaluates the spelled-out formula (`formulas.layer_norm_formula`).
  `norm_differs("layer_norm", dtype)` checks on this CPU that every probe row the guard
  lets through matches the formula.

Probe rows (1000 wide: a vector body and a tail): each of `specials.NORM_SPECIALS` (NaN,
±inf, ±3e38, ±1e13, ±1e20) at the head, the body and the tail of a row of randn; rows of
±3e38, 1e20 and 1e19; two 3e38 in one row; clean rows; contiguous and as a strided view.
Compared by `compare.first_difference` (NaN and inf positions, inf signs, finite values
within 1e-4 relative in float32 and float64, 6e-2 in bfloat16 and float16).
"""
from __future__ import annotations

from typing import Callable, Iterator, Optional, Sequence, Tuple

import torch

from .compare import first_difference
from .formulas import layer_norm_formula, rms_norm_formula
from .norm_range import layer_norm_in_range
from .specials import NORM_SPECIALS

NORMS = ("rms_norm", "layer_norm")
_D = 1000
_PLACES = (0, 1, 499, 500, 993, 999)
_EPS = 1e-5


def probe_rows(dtype: torch.dtype) -> Tuple[Sequence[str], torch.Tensor]:
    """(a label per row, the probe rows [R, 1000] in ``dtype``): module docstring."""
    g = torch.Generator().manual_seed(0)
    rows, labels = [], []
    for v in NORM_SPECIALS:
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


def kernels(kind: str, dtype: torch.dtype) -> Iterator[Tuple[str, Callable, Callable]]:
    """(name, kernel(x) -> (y, rows the kernel's guard hands to the formula or None),
    formula(x)) of each way a fused ``kind`` node runs."""
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


def norm_differs(kind: str, dtype: torch.dtype) -> Optional[str]:
    """None when every way a fused ``kind`` node ("rms_norm", "layer_norm") runs on this
    CPU gives the spelled-out formula's NaN, ±inf and values (to rounding) on the probe
    rows its guard lets through, for ``dtype`` inputs; else one line naming the kernel,
    the row and both results. A kernel that raises is reported as a difference. Raises
    KeyError for another ``kind``. Uncached: `special_values.special_values_differ`
    caches it."""
    if kind not in NORMS:
        raise KeyError(kind)
    labels, x = probe_rows(dtype)
    rtol = 6e-2 if dtype in (torch.bfloat16, torch.float16) else 1e-4
    for layout, inp in (("", x), (" on a strided view", _strided(x))):
        for name, kernel, form in kernels(kind, dtype):
            try:
                got, skip = kernel(inp)
            except (RuntimeError, TypeError, ValueError) as e:
                return f"{name}{layout} fails for {dtype} on this CPU ({str(e).splitlines()[0]})"
            want = form(inp)
            at = first_difference(got, want, rtol=rtol,
                                  where=None if skip is None else ~skip.reshape(-1, 1))
            if at is not None:
                i, j = divmod(at, want.shape[-1])
                return (f"{name}{layout} gives {kind}({labels[i]})[{j}] = "
                        f"{got[i, j].item():g} on this CPU where the spelled-out formula "
                        f"gives {want[i, j].item():g}")
    return None


__all__ = ["NORMS", "kernels", "norm_differs", "probe_rows"]
