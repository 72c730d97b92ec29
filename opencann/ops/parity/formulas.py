"""The spelled-out formulas the formula fusions replace, evaluated op by op as eager
evaluates the written-out model: eager's side of the activation and norm probes, and the
fallback the fused LayerNorm kernel runs where its fast path would leave eager's result
(``ops/kernels/cpu_patterns.py``)."""
from __future__ import annotations

import math
from typing import Optional

import torch


def formula(x: torch.Tensor, act: str) -> torch.Tensor:
    """The spelled-out activation, evaluated op by op as eager evaluates the written-out
    model: "gelu" 0.5·x·(1 + erf(x/√2)), "gelu_tanh" 0.5·x·(1 + tanh(√(2/π)·(x +
    0.044715·x³))) (Hendrycks & Gimpel 2016, arXiv:1606.08415), "silu" x·sigmoid(x)
    (Elfwing et al. 2017, arXiv:1702.03118). Raises KeyError for another ``act``."""
    if act == "gelu_tanh":
        inner = math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))
        return 0.5 * x * (1.0 + torch.tanh(inner))
    if act == "gelu":
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))
    if act == "silu":
        return x * torch.sigmoid(x)
    raise KeyError(act)


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


__all__ = ["formula", "layer_norm_formula", "rms_norm_formula"]
