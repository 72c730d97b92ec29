"""CPU kernel of AddLayerNormQuant (CANN's ``aclnnAddLayerNormQuant``): x = x1 + x2, y the
LayerNorm of x over the last axis in float32 (the residual stream, the caller's value) and
y_q its uint8 quantization for the int8 Linear that reads it: one node where a bf16 graph
with int8 linears had AddLayerNormCast (writing y and its bf16 cast) then an AscendQuant
of that bf16 tensor.

One numba pass over the rows (`add_layer_norm_numba.add_ln_quant`, AddLayerNorm's row code):
each addend read once (a bf16 one widened exactly as it is read), y and y_q written in the
same row loop. It replaced ATen's ``add``, ``native_layer_norm`` and a quantization pass
(three passes over the activation, five reads and writes of it): in a BERT-base int8 + bf16
graph the node took ~200 µs there against ~70 µs alone, its inputs evicted from L2 by the
int8 GEMM before it (docs/performance.md).

Values: y is LayerNorm's float32 result to rounding: mean and variance in float64 (ATen: a
float32 Welford pass), the normalization in float32, so y may differ from ATen's
``native_layer_norm`` (eager's) by float32 rounding: a few ulp of y (measured at [128, 768]:
max |y − exact| 1.3e-6 where ATen's is 1.6e-6, `tests/unit/test_add_layer_norm_quant.py`);
the int8 graph's own error (a uint8 step of the next layer's input, ~0.03) is 10^4 times
larger.
y_q quantizes y itself (`quant_numba.saturate_u8`, the rounding of `quant_numba.quantize_dense`:
``saturate(round_half_even(y / step) + offset)``, NaN → 0, +inf → 255, -inf → 0), not its
bf16 rounding: it may differ from the unfused chain (norm, Cast to bf16, AscendQuant) by one
uint8 step where the bf16 rounding crossed a rounding boundary, and is the closer one.
Special values: a row out of `norm_range.layer_norm_limits`' range (NaN or ±inf in the sum,
|x| near 1e19), γ or β not `affine_in_range` (inf, NaN, huge), an fp16 addend or a strided
input run ATen's ``add`` + ``native_layer_norm`` then the quantization instead (only those
rows for a row out of range; the others keep the one pass's values): eager's NaN rows
(quantized to 0) and values.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

import numpy as np

from ...ir import Node, TensorDesc
from ..parity.norm_range import affine_in_range, layer_norm_limits
from .add_layer_norm_cast_cpu import add_layer_norm_f32
from .int8_cpu import quantize_u8

_NUMBA_DTYPES = (torch.float32, torch.bfloat16)


def add_layer_norm_quant(x1: torch.Tensor, x2: torch.Tensor, weight, bias, eps: float,
                         step: float, offset: int, affine_ok=None):
    """(y, y_q) for x1, x2 [..., D] of one shape (float32 or bf16/fp16 each; the sum is
    float32), ``weight`` γ and ``bias`` β [D] float32 or None: y = LayerNorm(float(x1) +
    float(x2)) over the last axis (float32), y_q = y quantized to uint8 at ``step`` (> 0)
    and ``offset`` (the zero point, in [0, 255]); both fresh and contiguous (a strided input
    gives y_q with y's strides). One numba pass when both addends are float32 or bf16 and
    contiguous; ATen's ops otherwise and for rows out of range (module docstring).
    ``affine_ok``: `affine_in_range` of γ, β when the caller knows it (constants), else
    tested here. Raises ValueError (one line) when x1 and x2 differ in shape or the sum is
    not float32."""
    if x1.shape != x2.shape:
        raise ValueError(f"add_layer_norm_quant: x1 {tuple(x1.shape)} and x2 {tuple(x2.shape)} "
                         "must have one shape (broadcasting is not fused)")
    d = x1.shape[-1] if x1.dim() else 0
    fast = (x1.dtype in _NUMBA_DTYPES and x2.dtype in _NUMBA_DTYPES and torch.float32 in (x1.dtype, x2.dtype)
            and d > 0 and x1.numel() > 0 and x1.is_contiguous() and x2.is_contiguous()
            and all(t is None or (t.dtype == torch.float32 and t.is_contiguous() and t.shape == (d,))
                    for t in (weight, bias)))
    if fast and affine_ok is None:
        affine_ok = affine_in_range(weight, bias, d, torch.float32)
    if fast and affine_ok:
        y = torch.empty(x1.shape, dtype=torch.float32)
        yq = torch.empty(x1.shape, dtype=torch.uint8)
        _numba_pass(x1, x2, weight, bias, eps, step, offset, y, yq)
        return y, yq
    y = add_layer_norm_f32(x1, x2, weight, bias, eps, "add_layer_norm_quant")
    return y, quantize_u8(y, step, offset)


def _rows(x: torch.Tensor, d: int):
    """x (contiguous float32 or bf16) as a numpy [rows, d] array: float32, or bf16 bits as
    uint16 (`add_layer_norm_numba.widen` reads them)."""
    x = x.detach().view(-1, d)
    return x.numpy() if x.dtype == torch.float32 else x.view(torch.int16).numpy().view(np.uint16)


def _numba_pass(x1, x2, weight, bias, eps, step, offset, y, yq) -> None:
    """Run `add_layer_norm_numba.add_ln_quant` into y, yq, then ATen's chain on the rows
    out of range only (a row's LayerNorm depends on that row alone: the other rows keep
    their values whatever NaN another row holds)."""
    from .add_layer_norm_numba import add_ln_quant   # numba loads on the first call only
    from .numba_cache import launch
    d = x1.shape[-1]
    g = (torch.ones(d) if weight is None else weight).detach().numpy()
    be = (torch.zeros(d) if bias is None else bias).detach().numpy()
    bound, rstd_max = layer_norm_limits(d, torch.float32)
    y2, yq2 = y.view(-1, d), yq.view(-1, d)
    bad = torch.empty(y2.shape[0], dtype=torch.uint8)
    with launch(x1.numel()):
        outside = add_ln_quant(_rows(x1, d), _rows(x2, d), g, be, np.float32(eps), y2.numpy(), yq2.numpy(),
                               np.float32(1.0 / step), np.float32(offset), bound, rstd_max, bad.numpy())
    if outside:
        rows = bad.nonzero().view(-1)
        yr = add_layer_norm_f32(x1.reshape(-1, d)[rows], x2.reshape(-1, d)[rows], weight, bias, eps,
                                "add_layer_norm_quant")
        y2[rows] = yr
        yq2[rows] = quantize_u8(yr, step, offset)


def make_add_layer_norm_quant_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                     consts: Sequence) -> Callable:
    """Kernel factory of AddLayerNormQuant(x1, x2, γ, β; attrs eps, scale (AscendQuant's:
    1 / step), offset) -> (y float32, y uint8): ``run(x1, x2, γ, β)``
    (`add_layer_norm_quant`, γ and β tested once here when they are constants); both
    outputs are the kernel's own allocations."""
    eps = float(node.attrs["eps"])
    step, offset = 1.0 / float(node.attrs["scale"]), int(node.attrs["offset"])
    iw = node.attrs["weight"].index if node.attrs.get("weight") is not None else None
    ib = node.attrs["bias"].index if node.attrs.get("bias") is not None else None
    d = int(in_descs[0].shape[-1]) if in_descs[0].is_static else None
    cg, cb = (None if i is None else consts[i] for i in (iw, ib))
    static = d is not None and (iw is None or cg is not None) and (ib is None or cb is not None)
    affine_ok = affine_in_range(cg, cb, d, torch.float32) if static else None

    def run(*xs):
        return add_layer_norm_quant(xs[0], xs[1], None if iw is None else xs[iw],
                                    None if ib is None else xs[ib], eps, step, offset, affine_ok)
    return run


__all__ = ["add_layer_norm_quant", "make_add_layer_norm_quant_kernel"]
