"""ONNX converters, the QOperator format: QLinearConv and QLinearMatMul (ONNX Runtime's
``quantize_static(..., quant_format=QuantFormat.QOperator)``) as the QDQ composition
the int8 passes lower:

    AscendDequant(x) → Conv / MatMul (the weight dequantized once here, an fp32 constant;
    QLinearConv's int32 bias times ``x_scale * w_scale``) → AscendQuant(y_scale, y_zero_point)

``qdq_to_int8`` then runs the convolution / linear on oneDNN's int8 kernel reading x's
uint8 tensor, and ``fuse_requant`` writes its uint8 result at ``y_scale`` directly: one
int8 kernel per node, as ONNX Runtime's own QLinearConv. Where those passes do not apply
(a weight that is not symmetric int8, an input not 2-D for QLinearMatMul's linear) the
composition runs as float emulation of the specification.

Converted: uint8 x and y per tensor with constant scales and zero points; a constant
int8 / uint8 weight per tensor or per output channel (QLinearConv: axis 0; QLinearMatMul:
the last axis of b). Anything else (int8 activations, non-constant weights or scales)
raises NotConverted: the node runs on ONNX Runtime (host fallback), as before.
Source: ONNX operator specification (QLinearConv, QLinearMatMul)."""
from __future__ import annotations

import torch

from ...ir import DataType
from .converter import Converter, NotConverted, OnnxNode
from .nn import _auto_pads, _pad_input, matmul
from .quant import _ir_op, _per_tensor_u8
from .registry import converts
from .tensor import shape

aten = torch.ops.aten


def _u8_params(n: OnnxNode, scale_i: int, zp_i: int):
    """(step, zero point) of inputs ``scale_i`` / ``zp_i`` of ``n``: constant, one element,
    uint8; NotConverted otherwise."""
    s, z = n.x(scale_i), n.x(zp_i) if n.has(zp_i) else None
    if not (s.is_const and s.const.numel() == 1 and (z is None or (z.is_const and z.const.numel() == 1
                                                                     and z.const.dtype == torch.uint8))):
        raise NotConverted("activation scale / zero point not constant uint8 per tensor")
    step = float(s.const.reshape(()))
    if not 0.0 < step < float("inf"):
        raise NotConverted(f"activation scale {step}")
    return step, 0 if z is None else int(z.const.reshape(()))


def _weight(n: OnnxNode, w_i: int, axis_of) -> torch.Tensor:
    """The dequantized fp32 weight ``(w - zp) * scale`` (per tensor or along ``axis_of(w)``)."""
    w, s = n.x(w_i), n.x(w_i + 1)
    z = n.x(w_i + 2) if n.has(w_i + 2) else None
    if not (w.is_const and s.is_const and (z is None or z.is_const)) \
            or w.const.dtype not in (torch.int8, torch.uint8):
        raise NotConverted("weight, scale or zero point not a constant int8 / uint8 tensor")
    wt = w.const.to(torch.int32)
    axis = axis_of(wt)
    view = [1] * wt.dim()
    if s.const.numel() > 1:
        view[axis] = -1
    sc = s.const.float().reshape(view)
    zp = z.const.to(torch.int32).reshape(view) if z is not None else 0
    return ((wt - zp).float() * sc).contiguous()


def _x(cv: Converter, n: OnnxNode):
    x = n.x(0)
    if x.desc.dtype.torch != torch.uint8 or x.is_const:
        raise NotConverted(f"x of {x.desc.dtype} (uint8 activations only)")
    step, zp = _u8_params(n, 1, 2)
    return _ir_op(cv, "AscendDequant", x, {"scale": step, "offset": zp}, DataType.FLOAT), step


@converts("QLinearConv")
def qlinear_conv(cv: Converter, n: OnnxNode):
    """ONNX QLinearConv → AscendDequant → ``aten.convolution`` (dequantized constant weight,
    bias ``B * x_scale * w_scale``) → AscendQuant. Raises NotConverted (host fallback) for
    int8 activations or non-constant weights / scales. Returns the node's outputs."""
    xd, x_step = _x(cv, n)
    w = _weight(n, 3, lambda t: 0)
    y_step, y_zp = _u8_params(n, 6, 7)
    b = None
    if n.has(8):
        bv = n.x(8)
        if not bv.is_const:
            raise NotConverted("bias not constant")
        ws = n.x(4).const.float().reshape(-1)
        b = cv.const((bv.const.double() * x_step * ws.double()).float())
    sp = shape(xd)[2:]
    r = len(sp)
    k = n.attr("kernel_shape") or list(w.shape[2:])
    strides = list(n.attr("strides", [1] * r))
    dil = list(n.attr("dilations", [1] * r))
    xd, padding = _pad_input(cv, xd, _auto_pads(n, sp, k, strides, dil))
    y = cv.call(aten.convolution.default, xd, cv.const(w), b, strides, padding, dil, False,
                [0] * r, n.attr("group", 1))
    return [_ir_op(cv, "AscendQuant", y, {"scale": 1.0 / y_step, "offset": y_zp}, DataType.UINT8)]


@converts("QLinearMatMul")
def qlinear_matmul(cv: Converter, n: OnnxNode):
    """ONNX QLinearMatMul → AscendDequant → matmul (dequantized constant b, per tensor or
    per column) → AscendQuant. Raises NotConverted (host fallback) for int8 activations
    or a non-constant b. Returns the node's outputs."""
    ad, _ = _x(cv, n)
    b = _weight(n, 3, lambda t: t.dim() - 1)
    y_step, y_zp = _u8_params(n, 6, 7)
    y = matmul(cv, ad, cv.const(b))
    return [_ir_op(cv, "AscendQuant", y, {"scale": 1.0 / y_step, "offset": y_zp}, DataType.UINT8)]
