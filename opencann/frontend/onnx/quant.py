"""ONNX converters, linear quantization: QuantizeLinear and DequantizeLinear (opset 13+),
per-tensor and per-axis scale / zero point, int8 and uint8 (int16 too where the IR has
it). Semantics: the ONNX operator specification (onnx/docs/Operators.md):

* ``QuantizeLinear``: ``y = saturate(round(x / scale) + zero_point)``, rounding half to
  even (``aten.round``), saturating to the type's range: ``+inf`` gives the type's
  maximum (255 / 127), ``-inf`` its minimum. NaN has no value in the specification;
  ONNX Runtime (1.x, CPU) gives the type's minimum (0 / -128) whatever the zero point,
  and so do we. (onnx's reference evaluator gives the minimum for +inf too, which the
  specification's saturation contradicts: it is not used for these ops.)
* ``DequantizeLinear``: ``y = (x - zero_point) * scale`` in ``scale``'s type, the
  difference taken in int32 (exact, as ONNX Runtime).

Per-tensor uint8 with a constant scale and zero point, on a float32 (non-constant) x,
converts to one IR op each (int8 too, as uint8 shifted by 128: a QuantizeLinear to int8
feeding a DequantizeLinear becomes AscendQuant → AscendDequant with the zero point + 128,
the same values): ``AscendQuant`` (QuantizeLinear; with its ``step`` attribute the op
divides, x / scale, as the specification) and
``AscendDequant`` (DequantizeLinear). The ``qdq_to_int8`` pass then runs a
QuantizeLinear → DequantizeLinear pair before a Conv / MatMul / Gemm with constant weights
(ONNX Runtime's QDQ format) on the int8 kernels; any pair it leaves runs as these two ops
(float emulation of the int8 model, as before).

Blocked quantization (``block_size``, opset 21), float8/int4 types and a
``precision`` / ``output_dtype`` other than the zero point's raise NotConverted (host
fallback)."""
from __future__ import annotations

import torch

from ...ir import DataType, TensorDesc, Value
from .converter import Converter, NotConverted, OnnxNode, torch_dtype
from .registry import converts
from .tensor import norm_axis, reshape, shape

aten = torch.ops.aten

_RANGES = {torch.uint8: (0, 255), torch.int8: (-128, 127), torch.int16: (-32768, 32767)}


def _per_axis(cv: Converter, n: OnnxNode, p: Value, x: Value) -> Value:
    """Scale or zero point ``p`` shaped to broadcast against ``x``: a scalar (or
    one-element) ``p`` as is, a 1-D ``p`` along attribute ``axis`` (default 1)."""
    if n.attr("block_size", 0):
        raise NotConverted("blocked quantization (block_size)")
    if p.desc.rank == 0 or (p.desc.rank == 1 and shape(p)[0] == 1):
        return p
    if p.desc.rank != 1:
        raise NotConverted(f"scale / zero point of rank {p.desc.rank}")
    r = x.desc.rank
    axis = norm_axis(n.attr("axis", 1), r)
    view = [1] * r
    view[axis] = shape(p)[0]
    return reshape(cv, p, view)


def _per_tensor_u8(n: OnnxNode, x: Value, qt: torch.dtype):
    """(step, uint8 zero point) when node ``n`` (QuantizeLinear / DequantizeLinear) is per
    tensor on uint8 or int8 with a constant one-element float32 scale (> 0, finite) and
    zero point, and ``x`` is no constant; else None (the general emulation converts it).
    int8 is taken as uint8 shifted by 128 (``q - zp == (q + 128) - (zp + 128)``, the same
    saturation bounds): the zero point returned is then ``zp + 128``."""
    if qt not in (torch.uint8, torch.int8) or x.is_const or n.attr("block_size", 0):
        return None
    scale = n.x(1)
    if not (scale.is_const and scale.const.numel() == 1 and scale.const.dtype == torch.float32):
        return None
    step = float(scale.const.reshape(()))
    zp = 0
    if n.has(2):
        z = n.x(2)
        if not (z.is_const and z.const.numel() == 1):
            return None
        zp = int(z.const.reshape(()))
    zp += 128 if qt == torch.int8 else 0
    return (step, zp) if 0.0 < step < float("inf") else None


def _int8_view(cv: Converter, u: Value, offset: int) -> Value:
    """The int8 tensor ``u - 128`` of uint8 ``u`` (QuantizeLinear's int8 result, for any
    reader that needs it), remembered so that a DequantizeLinear of it reads ``u`` itself
    (then nothing reads this and DCE drops it)."""
    t = cv.call(aten.sub.Tensor, cv.call(aten._to_copy.default, u, dtype=torch.int16),
                cv.scalar(128, torch.int16))
    y = cv.call(aten._to_copy.default, t, dtype=torch.int8)
    if not hasattr(cv, "u8_of"):
        cv.u8_of = {}
    cv.u8_of[y.id] = (u, offset)
    return y


def _ir_op(cv: Converter, op: str, x: Value, attrs, dtype: DataType) -> Value:
    """One IR node ``op`` on ``x`` (attrs ``self`` plus ``attrs``) of ``x``'s shape in ``dtype``."""
    from ...ir import TensorRef
    node = cv.graph.create_node(op, [x], {"self": TensorRef(0), **attrs},
                                [TensorDesc(x.desc.shape, dtype, x.desc.format)],
                                name=cv.node.name if cv.node else None, source=cv.source(),
                                scope=cv.scope())
    # contiguous strides, as `Converter.call` records them (the CPU layout stage rewrites
    # them to channels-last where NHWC flows through)
    node.meta["strides"] = [tuple(torch.empty(x.desc.shape, device="meta").stride())]
    return node.outputs[0]


@converts("QuantizeLinear")
def quantize_linear(cv: Converter, n: OnnxNode):
    """ONNX QuantizeLinear: ``saturate(round_half_even(x / scale) + zero_point)`` to the zero
    point's type (or ``output_dtype``; default uint8), per tensor or per ``axis``, computed in
    float32; NaN gives the type's minimum (as ONNX Runtime). Raises NotConverted for other input
    or output types and the ``precision`` attribute. Returns the node's outputs (a list of
    Values)."""
    x = n.x(0)
    if n.has(2):
        qt = n.x(2).desc.dtype.torch
    else:
        qt = torch_dtype(n.attr("output_dtype", 2) or 2, cv.where())
    if n.has(2) and n.attr("output_dtype", 0) and torch_dtype(n.attr("output_dtype"), cv.where()) != qt:
        raise NotConverted("output_dtype differs from the zero point's type")
    if qt not in _RANGES or not (x.desc.dtype.is_floating or x.desc.dtype.torch == torch.int32):
        raise NotConverted(f"quantizing {x.desc.dtype} to {qt}")
    if n.attr("precision", 0):
        raise NotConverted("precision attribute")
    lo, hi = _RANGES[qt]
    f32 = torch.float32
    pt = _per_tensor_u8(n, x, qt)
    if pt is not None and x.desc.dtype.torch == f32:
        step, zp = pt
        u = _ir_op(cv, "AscendQuant", x, {"scale": 1.0 / step, "offset": zp, "step": step},
                   DataType.UINT8)
        return [u if qt == torch.uint8 else _int8_view(cv, u, zp)]
    xf = x if x.desc.dtype.torch == f32 else cv.call(aten._to_copy.default, x, dtype=f32)
    scale = _per_axis(cv, n, n.x(1), x)
    if scale.desc.dtype.torch != f32:
        scale = cv.call(aten._to_copy.default, scale, dtype=f32)
    y = cv.call(aten.round.default, cv.call(aten.div.Tensor, xf, scale))
    if n.has(2):
        zp = cv.call(aten._to_copy.default, _per_axis(cv, n, n.x(2), x), dtype=f32)
        y = cv.call(aten.add.Tensor, y, zp)
    y = cv.call(aten.clamp.default, y, float(lo), float(hi))
    # NaN: the type's minimum, as ONNX Runtime (clamp keeps NaN, and a NaN cast is undefined)
    y = cv.call(aten.where.self, cv.call(aten.isnan.default, y), cv.scalar(float(lo), f32), y)
    return [cv.call(aten._to_copy.default, y, dtype=qt)]


@converts("DequantizeLinear")
def dequantize_linear(cv: Converter, n: OnnxNode):
    """ONNX DequantizeLinear: ``(x - zero_point) * scale`` in the scale's dtype, per tensor or per
    ``axis``; float16/bfloat16 scales multiply in float32 and round once. Raises NotConverted
    for other input types or a differing ``output_dtype``. Returns the node's outputs (a list of
    Values)."""
    x = n.x(0)
    xt = x.desc.dtype.torch
    if xt not in _RANGES and xt != torch.int32:
        raise NotConverted(f"dequantizing {x.desc.dtype}")
    scale = n.x(1)
    out = scale.desc.dtype.torch
    if n.attr("output_dtype", 0) and torch_dtype(n.attr("output_dtype"), cv.where()) != out:
        raise NotConverted("output_dtype differs from the scale's type")
    pt = _per_tensor_u8(n, x, xt)
    if pt is not None and out == torch.float32:
        if xt == torch.int8:
            u, off = getattr(cv, "u8_of", {}).get(x.id, (None, None))
            if u is not None and off == pt[1]:
                return [_ir_op(cv, "AscendDequant", u, {"scale": pt[0], "offset": off}, DataType.FLOAT)]
        else:
            return [_ir_op(cv, "AscendDequant", x, {"scale": pt[0], "offset": pt[1]}, DataType.FLOAT)]
    scale = _per_axis(cv, n, scale, x)
    d = cv.call(aten._to_copy.default, x, dtype=torch.int32)
    if n.has(2):
        zp = cv.call(aten._to_copy.default, _per_axis(cv, n, n.x(2), x), dtype=torch.int32)
        d = cv.call(aten.sub.Tensor, d, zp)
    if out == torch.float32:
        return [cv.call(aten.mul.Tensor, cv.call(aten._to_copy.default, d, dtype=out), scale)]
    # float16 / bfloat16 scales: the product in float32, rounded once to the scale's type
    y = cv.call(aten.mul.Tensor, cv.call(aten._to_copy.default, d, dtype=torch.float32),
                cv.call(aten._to_copy.default, scale, dtype=torch.float32))
    return [cv.call(aten._to_copy.default, y, dtype=out)]
