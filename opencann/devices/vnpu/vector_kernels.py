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

On FRACTAL_NZ (`layer_norm_nz`, `softmax_nz`: CANN's LayerNorm and SoftmaxV2 take NZ
after a matmul on chips whose Cube writes NZ): a logical row (fixed M index) is spread
over the N1 fractal columns and the C0 lanes of storage (..., N1, M1, 16, C0); the
reduction runs over those two axes with the padding masked out (`formats.valid_mask`),
and the padding of the result is zero again.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

import torch
import torch.nn.functional as F

from .formats import valid_mask

__all__ = ["VECTOR_FLOATS", "layer_norm", "layer_norm_nz", "rms_norm", "softmax", "softmax_nz", "ub_dtype"]

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


_NZ_ROW = (-4, -1)      # a logical row's axes in FRACTAL_NZ storage (..., N1, M1, 16, C0)


def _nz_vector(v: torch.Tensor, n1: int, c0: int) -> torch.Tensor:
    """A [N] vector (γ, β) laid out to broadcast over NZ storage: (N1, 1, 1, C0), zero-padded."""
    v = v.reshape(-1)
    return F.pad(v, (0, n1 * c0 - v.shape[0])).reshape(n1, 1, 1, c0)


def _nz_rows(t: torch.Tensor, origin_shape: Sequence[int]) -> torch.Tensor:
    """Per-row statistics (..., 1, M1, 16, 1) of NZ storage → origin_shape[:-1] + (1,)."""
    m = int(origin_shape[-2]) if len(origin_shape) >= 2 else 1
    flat = t.reshape(*t.shape[:-4], -1)[..., :m]
    return flat.reshape(*tuple(origin_shape[:-1]), 1)


def layer_norm_nz(x: torch.Tensor, origin_shape: Sequence[int], weight: Optional[torch.Tensor] = None,
                  bias: Optional[torch.Tensor] = None, eps: float = 1e-5
                  ) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last axis of a FRACTAL_NZ tensor, in the Unified Buffer.

    Args: x FRACTAL_NZ storage (..., N1, M1, 16, C0) of a logical [..., M, N] tensor
        ``origin_shape``; weight, bias [N] or None; eps.
    Returns (y, mean, rstd): y FRACTAL_NZ in x's dtype with zero padding; mean and rstd
        float32 of shape origin_shape[:-1] + (1,) (ND, as ``native_layer_norm`` gives them).
    Raises ValueError: a non-float x. Same arithmetic as `layer_norm` (fp32, two passes).
    """
    acc = ub_dtype(x.dtype)
    mask = valid_mask(origin_shape, "FRACTAL_NZ", x.dtype)
    n = float(origin_shape[-1])
    zero = torch.zeros((), dtype=acc)
    xf = torch.where(mask, x.to(acc), zero)
    mean = xf.sum(dim=_NZ_ROW, keepdim=True) / n
    d = torch.where(mask, xf - mean, zero)
    rstd = torch.rsqrt((d * d).sum(dim=_NZ_ROW, keepdim=True) / n + eps)
    y = d * rstd
    n1, c0 = x.shape[-4], x.shape[-1]
    if weight is not None:
        y = y * _nz_vector(weight.to(acc), n1, c0)
    if bias is not None:
        y = y + _nz_vector(bias.to(acc), n1, c0)
    y = torch.where(mask, y, zero)
    return y.to(x.dtype), _nz_rows(mean, origin_shape), _nz_rows(rstd, origin_shape)


def softmax_nz(x: torch.Tensor, origin_shape: Sequence[int], log: bool = False,
               out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """(Log-)softmax over the last axis of a FRACTAL_NZ tensor (storage (..., N1, M1, 16, C0)
    of logical ``origin_shape`` [..., M, N]) in float32, padding excluded from the max and
    the sum and zero in the result. Returns NZ storage in ``out_dtype`` (x's).
    Raises ValueError for a non-float x."""
    acc = ub_dtype(x.dtype)
    mask = valid_mask(origin_shape, "FRACTAL_NZ", x.dtype)
    zero = torch.zeros((), dtype=acc)
    xf = torch.where(mask, x.to(acc), torch.full((), float("-inf"), dtype=acc))
    m = xf.amax(dim=_NZ_ROW, keepdim=True)
    m = torch.where(torch.isfinite(m), m, zero)
    e = torch.exp(xf - m)
    s = e.sum(dim=_NZ_ROW, keepdim=True)
    y = (xf - m - torch.log(s)) if log else e / s
    return torch.where(mask, y, zero).to(out_dtype or x.dtype)
