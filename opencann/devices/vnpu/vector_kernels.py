"""Vector-unit kernels of the vnpu in ND: the norms and softmax of transformers and LLMs,
executed on the host with torch the way the Ascend kernels compute them.

Compute semantics (as the Ascend C LayerNorm / RmsNorm / SoftmaxV2 kernels do; CANN
ops-nn ``layer_norm_v3``, ``rms_norm``, ``softmax_v2`` tiling: fp16 and bf16 rows are cast
to fp32 in the Unified Buffer, reduced and normalised in fp32, and cast back when the
result is written to GM): every reduction and every normalisation runs in float32, the
result is rounded once to the output dtype. float32 in, float32 throughout.

* `layer_norm`: (x − mean) · rstd · γ + β over the trailing ``normalized_shape``, with
  the mean and rstd (the ``native_layer_norm`` outputs) in float32 shape [..., 1, ...].
* `rms_norm`: x · rsqrt(mean(x²) + ε) · γ (``upcast``: the normalised value is rounded to
  the input dtype before the γ product, as transformers' LlamaRMSNorm does).
* `softmax`: exp(x − max) / sum over one axis (``log``: log-softmax).

NaN and ±Inf propagate as in eager: a NaN in a row makes that row NaN.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch

__all__ = ["VECTOR_FLOATS", "layer_norm", "rms_norm", "softmax", "ub_dtype"]

VECTOR_FLOATS = (torch.float16, torch.bfloat16, torch.float32)


def ub_dtype(dt: torch.dtype) -> torch.dtype:
    """The dtype the Vector unit reduces ``dt`` in: float32 for fp16/bf16/fp32, float64
    kept (host-only dtype, not an NPU one). Raises ValueError for a non-float dtype."""
    if dt == torch.float64:
        return dt
    if dt not in VECTOR_FLOATS:
        raise ValueError(f"vnpu vector kernel: dtype {dt} is not a float type; cast the input "
                         f"to float16, bfloat16 or float32 first")
    return torch.float32


def _axes(x: torch.Tensor, normalized_shape: Sequence[int], name: str) -> Tuple[int, ...]:
    k = len(normalized_shape)
    if k == 0 or tuple(x.shape[x.dim() - k:]) != tuple(int(s) for s in normalized_shape):
        raise ValueError(f"vnpu {name}: normalized_shape {list(normalized_shape)} is not the trailing shape of "
                         f"the input {list(x.shape)}; pass the last dims of the input")
    return tuple(range(x.dim() - k, x.dim()))


def layer_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
               bias: Optional[torch.Tensor] = None, eps: float = 1e-5
               ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm in the Unified Buffer.

    Args: x [..., *normalized_shape] float; weight, bias normalized_shape or None; eps.
    Returns (y, mean, rstd): y in x's dtype; mean and rstd float32, x's shape with the
        normalised dims kept as 1 (``native_layer_norm``'s layout).
    Raises ValueError: a normalized_shape that is not x's trailing shape, a non-float x.
    Source: Ba et al. 2016, "Layer Normalization"; variance is the biased mean of
    squared deviations (two passes over the row in UB, as the Ascend kernel does).
    """
    axes = _axes(x, normalized_shape, "LayerNorm")
    acc = ub_dtype(x.dtype)
    xf = x.to(acc)
    mean = xf.mean(dim=axes, keepdim=True)
    d = xf - mean
    rstd = torch.rsqrt((d * d).mean(dim=axes, keepdim=True) + eps)
    y = d * rstd
    if weight is not None:
        y = y * weight.to(acc)
    if bias is not None:
        y = y + bias.to(acc)
    return y.to(x.dtype), mean, rstd


def rms_norm(x: torch.Tensor, normalized_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
             eps: Optional[float] = None, upcast: bool = False) -> torch.Tensor:
    """RMSNorm in the Unified Buffer: x · rsqrt(mean(x², normalised dims) + eps) · weight.

    Args: x [..., *normalized_shape] float; weight normalized_shape or None; eps (None:
        ``torch.finfo(x.dtype).eps``, as ATen's ``rms_norm``); upcast: round the normalised
        value to x's dtype before the weight product (transformers' LlamaRMSNorm).
    Returns: x's shape; x's dtype (upcast with a weight: the promoted dtype of weight and x,
        as ``weight * y`` gives in eager).
    Raises ValueError: normalized_shape not x's trailing shape, a non-float x.
    Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization".
    """
    axes = _axes(x, normalized_shape, "RmsNorm")
    acc = ub_dtype(x.dtype)
    eps = torch.finfo(x.dtype).eps if eps is None else float(eps)
    xf = x.to(acc)
    y = xf * torch.rsqrt((xf * xf).mean(dim=axes, keepdim=True) + eps)
    if upcast:
        y = y.to(x.dtype)
        return y if weight is None else weight * y
    if weight is not None:
        y = y * weight.to(acc)
    return y.to(x.dtype)


def softmax(x: torch.Tensor, dim: int, log: bool = False, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(Log-)softmax along ``dim`` in the Unified Buffer: max, exp(x − max), sum, divide
    (log: x − max − log(sum)), all in float32.

    Args: x float tensor; dim the axis; log: log-softmax; out_dtype: result dtype (x's).
    Returns: x's shape in ``out_dtype``. Raises ValueError for a non-float x or a bad dim.
    """
    if not -x.dim() <= dim < max(x.dim(), 1):
        raise ValueError(f"vnpu softmax: dim {dim} is out of range for a rank-{x.dim()} input")
    acc = ub_dtype(x.dtype)
    xf = x.to(acc)
    m = xf.amax(dim=dim, keepdim=True)
    m = torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc))   # all -inf row: exp(-inf) = 0
    e = torch.exp(xf - m)
    s = e.sum(dim=dim, keepdim=True)
    y = (xf - m - torch.log(s)) if log else e / s
    return y.to(out_dtype or x.dtype)
