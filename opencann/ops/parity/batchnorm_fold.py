"""The folded weight and bias of Conv2D → BatchNorm(eval), and when folding keeps eager's values.

Eager runs the two ops apart: ``t = conv(x, W) + b`` rounded to the conv's dtype, then
ATen's CPU BatchNorm (``batch_norm_cpu_collect_linear_and_constant_terms``,
aten/src/ATen/native/cpu/batch_norm_kernel.cpp) computes in its opmath type (float32 for
float32/float16/bfloat16 parameters) ``invstd = 1/√(var + eps)``, ``α = invstd·γ``,
``β' = β − μ·α`` and ``y = t·α + β'``. The fold uses that same α and β' (not a float64
γ/√(var+eps), which stays finite where eager's float32 one is inf or 0): ``W' = W·α`` and
``b' = b·α + β'``, each product in float64 and rounded once, so for finite values it only
changes rounding (within 1e-5 relative in float32).

Near the dtype's limit it changes more: eager's ``t`` overflows where ``t·α`` would not
(α < 1), or ``W·α`` overflows (or flushes to 0) where eager's separate steps do not.
`fold_values` folds only when that cannot happen for any input with
``|x| ≤ INPUT_BOUND(dtype)`` = √max (1.8e19 for float32 and bfloat16, 256 for
float16): with ``K`` taps per output, every intermediate of both computations
(``K·X·max|W| + |b|``, its product with ``|α|`` plus ``|β'|``, and ``K·X·max|W'| + |b'|``)
stays within the dtype's max, every constant is finite, and no nonzero ``W·α`` falls
below the smallest normal. Otherwise it returns the reason, and the BatchNorm is kept.
NaN statistics or weights are folded: they make the channel NaN in both computations.
"""
from __future__ import annotations

import math
from typing import Tuple, Union

import torch


def input_bound(dtype: torch.dtype) -> float:
    """The largest input magnitude the fold is proven for: √(finfo(dtype).max)."""
    return math.sqrt(torch.finfo(dtype).max)


def _eager_terms(gamma, beta, mean, var, eps: float):
    """ATen's α, β' per channel, in BatchNorm's opmath type, returned as float64."""
    op = torch.float64 if gamma.dtype == torch.float64 else torch.float32
    invstd = 1 / torch.sqrt(var.to(op) + torch.tensor(eps, dtype=op))
    alpha = invstd * gamma.to(op)
    return alpha.double(), (beta.to(op) - mean.to(op) * alpha).double()


def _headroom_reason(w, b, alpha, beta_e, wf, bf, dtype) -> Union[None, str]:
    """Why an intermediate of eager's conv-then-BatchNorm or of the folded conv could
    pass ``dtype``'s max for an input within `input_bound`, or None."""
    fmax, x, name = torch.finfo(dtype).max, input_bound(dtype), str(dtype).replace("torch.", "")
    taps = w[0].numel()
    mag = lambda t: torch.nan_to_num(t.abs().reshape(t.shape[0], -1), nan=0.0).amax(1)  # noqa: E731
    conv = taps * x * mag(w) + mag(b)
    checks = (("eager's conv output", conv),
              ("eager's BatchNorm output", conv * mag(alpha) + mag(beta_e)),
              ("the folded conv's output", taps * x * mag(wf) + mag(bf)))
    for what, bound in checks:
        over = (bound > fmax).nonzero()
        if len(over):
            c = int(over[0][0])
            return (f"{what} in channel {c} could reach {float(bound[c]):.3g} for inputs up "
                    f"to {x:.3g} ({taps} taps), past {name}'s max {fmax:.3g}: folding would "
                    f"move where inf/NaN appear")
    return None


def fold_values(w: torch.Tensor, b, gamma, beta, mean, var, eps: float
                ) -> Union[Tuple[torch.Tensor, torch.Tensor], str]:
    """``(W', b')`` in ``w``'s dtype for conv weight ``w`` [Cout, Cin/groups, kh, kw],
    bias ``b`` [Cout] or None and BatchNorm's γ, β, μ, var [Cout]; or a string saying
    why folding would not keep eager's values (module docstring)."""
    alpha, beta_e = _eager_terms(gamma, beta, mean, var, eps)
    w64 = w.double()
    b64 = b.double() if b is not None else torch.zeros_like(alpha)
    wf64 = w64 * alpha.reshape(-1, *([1] * (w.dim() - 1)))
    bf64 = b64 * alpha + beta_e
    wf, bf = wf64.to(w.dtype), bf64.to(w.dtype)
    dname = str(w.dtype).replace("torch.", "")
    for name, t in (("the conv weight", w64), ("the conv bias", b64),
                    ("BatchNorm's scale γ/√(var+eps)", alpha), ("BatchNorm's shift β−μ·scale", beta_e),
                    ("the folded weight", wf.double()), ("the folded bias", bf.double())):
        inf = torch.isinf(t.reshape(t.shape[0], -1)).any(1).nonzero()
        if len(inf):
            return (f"{name} is infinite in channel {int(inf[0][0])} (as eager computes it "
                    f"in {dname if 'folded' in name else 'its opmath type'}): folding would "
                    f"move where inf/NaN appear")
    tiny = torch.finfo(w.dtype).tiny
    lost = ((wf64 != 0) & (wf.double().abs() < tiny)).reshape(w.shape[0], -1).any(1).nonzero()
    if len(lost):
        return (f"the folded weight underflows {dname}'s smallest normal {tiny:.3g} in "
                f"channel {int(lost[0][0])} where eager's conv then BatchNorm keeps it")
    reason = _headroom_reason(w64, b64, alpha, beta_e, wf.double(), bf.double(), w.dtype)
    return reason if reason is not None else (wf, bf)
