"""CPU kernel of AddLayerNormCast: the LayerNorm counterpart of CANN's AddRmsNormCast
(``aclnnAddRmsNormCast``: x = x1 + x2, y1 the norm in float32, y2 = Cast(y1) in
bf16/fp16). In mixed precision (``allow_mix_precision_bf16``) a transformer block's
residual stream is float32 and its GEMMs bf16, so each norm was Cast(bf16 → fp32), Add,
LayerNorm, Cast(fp32 → bf16): four kernels; here one node, three ATen calls.

Exactness: the outputs are the bits of that chain. bf16/fp16 → fp32 is exact, and ATen's
``add`` of a bf16 and a float32 tensor promotes to float32 inside its TensorIterator
(the same float32 sum as the Cast then the Add); the norm is ATen's
``native_layer_norm``, the chain's own kernel; ``Tensor.to(bfloat16)`` rounds to nearest
even (NaN stays NaN), as the chain's Cast. Why not a numba kernel: ATen's float32
LayerNorm statistics are a vectorized Welford with cascade sums whose lanes depend on the
CPU's vector width (``aten/src/ATen/native/cpu/moments_utils.h``) and whose multiply-adds
the compiler contracts to FMAs; a numba replica (tried: every FMA placement in the
moments) did not give ATen's bits, and this fusion promises the chain's values.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...ir import Node, TensorDesc


def add_layer_norm_cast(x1: torch.Tensor, x2: torch.Tensor, weight, bias, eps: float,
                        dtype: torch.dtype):
    """(y, y_low) for x1, x2 [..., D] of one shape (float32, bf16 or fp16 each; the sum is
    float32), ``weight`` γ and ``bias`` β [D] float32 or None: y = LayerNorm(float(x1) +
    float(x2)) over the last axis in float32 (ATen's kernel), y_low = y cast to ``dtype``
    (bf16 or fp16, round to nearest even). Raises ValueError (one line) when x1 and x2
    differ in shape or the sum is not float32."""
    y = add_layer_norm_f32(x1, x2, weight, bias, eps, "add_layer_norm_cast")
    return y, y.to(dtype)


def add_layer_norm_f32(x1: torch.Tensor, x2: torch.Tensor, weight, bias, eps: float,
                       op: str) -> torch.Tensor:
    """LayerNorm(float(x1) + float(x2)) over the last axis, float32 (ATen's ``add`` and
    ``native_layer_norm``): the residual stream both AddLayerNormCast and AddLayerNormQuant
    write. Raises ValueError (one line starting with ``op``) when x1 and x2 differ in
    shape or the sum is not float32."""
    if x1.shape != x2.shape:
        raise ValueError(f"{op}: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} "
                         "must have one shape (broadcasting is not fused)")
    s = torch.add(x1, x2)
    if s.dtype != torch.float32:
        raise ValueError(f"{op}: x1 {x1.dtype} + x2 {x2.dtype} is {s.dtype}; "
                         "one addend must be float32 (the residual stream)")
    return torch.native_layer_norm(s, [s.shape[-1]], weight, bias, eps)[0]


def make_add_layer_norm_cast_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                    consts: Sequence) -> Callable:
    """Kernel factory of AddLayerNormCast(x1, x2, γ, β; attrs eps, dtype) -> (y float32,
    y in ``dtype``): ``run(x1, x2, γ, β)`` (`add_layer_norm_cast`); outputs are the
    kernel's own allocations (ATen's ``native_layer_norm`` has no ``out=`` here)."""
    eps = float(node.attrs["eps"])
    dtype = node.attrs["dtype"]
    iw = node.attrs["weight"].index if node.attrs.get("weight") is not None else None
    ib = node.attrs["bias"].index if node.attrs.get("bias") is not None else None

    def run(*xs):
        return add_layer_norm_cast(xs[0], xs[1], None if iw is None else xs[iw],
                                   None if ib is None else xs[ib], eps, dtype)
    return run


__all__ = ["add_layer_norm_cast", "add_layer_norm_f32", "make_add_layer_norm_cast_kernel"]
