"""The int8 ops' arithmetic in fp32, for layers whose oneDNN uint8 x int8 kernels would not
be exact (`int8_cpu.onednn_takes`: on x86 without VNNI / AMX-int8 the kernels add pairs of
products in int16 with saturation, exact only for |w| <= 64,
`opencann.devices.cpu.int8_weight_bound`; oneDNN developer guide, "Nuances of int8
computations"): there, 8-bit weights (a model quantized on a VNNI host, an ONNX file's
int8 weights), and every layer where even 7-bit products saturate.

`make_quant_conv_kernel` and `make_quant_linear_kernel` (``int8_cpu``) bind these there:
the same node, attributes and results as the oneDNN kernels, computed as the integer sum
``Σ (x_q - x_offset) · w_q`` in fp32 (integer-valued operands: exact while a sum stays
under 2^24, a rounding of the exact sum beyond), then scaled by ``x_scale · w_scale`` per
output channel, plus bias, the residual addend (fp32, or uint8 at ``accum_scale`` /
``accum_offset``), the activation, and the uint8 requantization at ``out_scale`` /
``out_offset`` (`quantize_u8`) or a bf16 cast. Slower than the fp32 graph (the operands
are widened per call); correct on any CPU, and for any model file or ONNX int8 weights.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ...ir import Node, TensorDesc, TensorRef
from .cpu import _ACT_FN
from .int8_quantize import dynamic_params, quantize_u8


def _index(a, name: str) -> Optional[int]:
    return a[name].index if isinstance(a.get(name), TensorRef) else None


def _finish(y: torch.Tensor, node: Node, act: str) -> torch.Tensor:
    """The activation ``act`` (eager's in-place op), then the node's output dtype: uint8
    at ``out_scale`` / ``out_offset``, bf16, or fp32 as is."""
    fn = _ACT_FN.get(act) if act != "none" else None
    if fn is not None:
        y = fn(y)
    dt = node.outputs[0].desc.dtype.torch
    if dt == torch.uint8:
        return quantize_u8(y, float(node.attrs["out_scale"]), int(node.attrs["out_offset"]))
    return y.to(torch.bfloat16) if dt == torch.bfloat16 else y


def emulated_quant_conv(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """QuantConvBiasAct / QuantConvAddAct's ``run(*inputs)`` in fp32 (module docstring);
    the arguments and results of `int8_cpu.make_quant_conv_kernel`."""
    a = node.attrs
    stride, pad, dil, groups = (list(a["stride"]), list(a["padding"]), list(a["dilation"]),
                                int(a["groups"]))
    step, offset = float(a["x_scale"]), int(a["x_offset"])
    w = consts[a["weight"].index].float()
    scale = (step * consts[a["w_scale"].index].double()).float().view(1, -1, 1, 1)
    xi, bi, oi = a["input"].index, _index(a, "bias"), _index(a, "other")
    uint8_addend = oi is not None and node.outputs[0].desc.dtype.torch == torch.uint8
    conv = torch.nn.functional.conv2d

    def run(*ins):
        x = ins[xi]
        acc = conv(x.float().sub_(offset), w, None, stride, pad, dil, groups)
        y = acc.mul_(scale)
        if bi is not None:
            y.add_(ins[bi].view(1, -1, 1, 1))
        if oi is not None:
            other = ins[oi]
            y.add_(other.float().sub_(int(a["accum_offset"])).mul_(float(a["accum_scale"]))
                   if uint8_addend else other)
        return _finish(y, node, a["act"])
    return run


def emulated_quant_linear(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """QuantLinearAct's ``run(*inputs)`` in fp32 (module docstring); the arguments and
    results of `int8_cpu.make_quant_linear_kernel` (a dynamic node quantizes x per call
    first, as that kernel does)."""
    a = node.attrs
    xi, bi = a["mat1"].index, _index(a, "self")
    w = consts[a["mat2"].index].float()                          # [k, n], integer-valued
    w_scale = consts[a["w_scale"].index].double()
    dynamic = bool(a.get("dynamic"))
    step, offset = (1.0, 0) if dynamic else (float(a["x_scale"]), int(a["x_offset"]))
    scales = {}

    def run(*ins):
        x = ins[xi]
        s, z = step, offset
        if dynamic:
            s, z = dynamic_params(x)
            x = quantize_u8(x, s, z)
        if s not in scales:
            scales.clear()
            scales[s] = (s * w_scale).float()
        y = torch.mm(x.float().sub_(z), w).mul_(scales[s])
        if bi is not None:
            y.add_(ins[bi])
        return _finish(y, node, a["act"])
    return run


__all__ = ["emulated_quant_conv", "emulated_quant_linear"]
