"""CPU kernel of AddLayerNormQuant (CANN's ``aclnnAddLayerNormQuant``): x = x1 + x2, y the
LayerNorm of x over the last axis in float32 (the residual stream, the caller's value) and
y_q its uint8 quantization for the int8 Linear that reads it: one node where a bf16 graph
with int8 linears had AddLayerNormCast (writing y and its bf16 cast) then an AscendQuant
of that bf16 tensor.

Values: y is the bits AddLayerNormCast gives (ATen's ``add`` promoting a bf16 addend to
float32, ATen's ``native_layer_norm``: its docstring says why not numba). y_q quantizes y
itself (`quant_numba.quantize_dense`: ``saturate(round_half_even(y / step) + offset)``,
NaN → 0, +inf → 255, -inf → 0), not its bf16 rounding: it may differ from the unfused
chain by one uint8 step where the bf16 rounding crossed a rounding boundary (at most one
step: bf16's error is below half a step over the quantized range), and is the closer one.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...ir import Node, TensorDesc
from .add_layer_norm_cast_cpu import add_layer_norm_f32
from .int8_cpu import quantize_u8


def add_layer_norm_quant(x1: torch.Tensor, x2: torch.Tensor, weight, bias, eps: float,
                         step: float, offset: int):
    """(y, y_q) for x1, x2 [..., D] of one shape (float32 or bf16/fp16 each; the sum is
    float32), ``weight`` γ and ``bias`` β [D] float32 or None: y = LayerNorm(float(x1) +
    float(x2)) over the last axis (float32, ATen's kernel), y_q = y quantized to uint8 at
    ``step`` (> 0) and ``offset`` (the zero point, in [0, 255]) with y's strides. Raises
    ValueError (one line) when x1 and x2 differ in shape or the sum is not float32."""
    y = add_layer_norm_f32(x1, x2, weight, bias, eps, "add_layer_norm_quant")
    return y, quantize_u8(y, step, offset)


def make_add_layer_norm_quant_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                     consts: Sequence) -> Callable:
    """Kernel factory of AddLayerNormQuant(x1, x2, γ, β; attrs eps, scale (AscendQuant's:
    1 / step), offset) -> (y float32, y uint8): ``run(x1, x2, γ, β)``
    (`add_layer_norm_quant`); both outputs are the kernel's own allocations."""
    eps = float(node.attrs["eps"])
    step, offset = 1.0 / float(node.attrs["scale"]), int(node.attrs["offset"])
    iw = node.attrs["weight"].index if node.attrs.get("weight") is not None else None
    ib = node.attrs["bias"].index if node.attrs.get("bias") is not None else None

    def run(*xs):
        return add_layer_norm_quant(xs[0], xs[1], None if iw is None else xs[iw],
                                    None if ib is None else xs[ib], eps, step, offset)
    return run


__all__ = ["add_layer_norm_quant", "make_add_layer_norm_quant_kernel"]
