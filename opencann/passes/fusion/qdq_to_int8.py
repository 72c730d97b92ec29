"""`QdqToInt8` (``qdq_to_int8``): an ONNX QDQ model's dequantized activation feeding a
convolution or linear with a constant weight ⇒ the int8 kernel reading the uint8 tensor
itself (ONNX Runtime's QDQ format, as its ``QDQSelectorActionTransformer`` turns
DQ → Conv → Q into QLinearConv).

Before (the ONNX frontend converts per-tensor uint8 QuantizeLinear / DequantizeLinear to
AscendQuant / AscendDequant; the weight's DequantizeLinear is folded to an fp32 constant)::

    u = AscendQuant(x, scale=1/s, offset=z)      # uint8
    d = AscendDequant(u, scale=s, offset=z)      # fp32, the float emulation
    y = ConvBiasAct(d, W_fp32, b)                # or ConvAddAct / LinearAct

After::

    u = AscendQuant(x, ...)
    y = QuantConvBiasAct(u, W_int8, scale_w, b, x_scale=s, x_offset=z)

The weight's DequantizeLinear was folded to fp32 ``q * s``; `exact_int8` gives back the
file's int8 values and scales when they are symmetric with ``s = max|w| / 127`` per output
channel or per tensor (ONNX Runtime's ``quantize_static`` with QInt8 weights writes
these; kept as they are, so on a CPU without VNNI a weight beyond |q| = 64 binds the fp32
emulation, `opencann.devices.cpu.int8_weight_bound`). Any other weight (asymmetric,
reduced range) would be requantized, so that layer
keeps the float emulation (a Skip with the reason). Everything else (the output's QuantizeLinear, a
pair in front of another op) stays float emulation. A dequantized x read by several
layers serves each; the AscendDequant goes when none reads it any more.

It does not apply (no Skip: nothing to say) where x is not an AscendDequant's output; it
skips with the reason a weight that is not a constant fp32 tensor, holds NaN/inf or is not
symmetric int8 (`exact_int8`), and a LinearAct that is not a 2-D GEMM. Source: ONNX operator specification
(QuantizeLinear / DequantizeLinear); ONNX Runtime, "Quantize ONNX models" (QDQ format)."""
from __future__ import annotations

import torch

from ...ir import Graph, Node
from ..base import PassContext, Skip
from .quantize_int8 import QuantizeInt8, _QMatch, exact_int8


class QdqToInt8(QuantizeInt8):
    """ConvBiasAct / ConvAddAct / LinearAct(AscendDequant(u, s, z), W fp32 const) ⇒
    QuantConvBiasAct / QuantConvAddAct / QuantLinearAct(u, W_int8, scale_w; x_scale=s,
    x_offset=z)."""

    name, stage = "qdq_to_int8", "fusion"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Rewrite every target whose x is an AscendDequant's output (no option needed:
        the model file says it is quantized). Returns the number of layers rewritten."""
        self._cfg = {}
        self._quants = {}
        self._dequants = []
        n = super(QuantizeInt8, self).run(graph, ctx)
        for d in self._dequants:
            if not d.erased and not d.outputs[0].users and d.outputs[0] not in graph.outputs:
                graph.erase_node(d)
        graph.prune_constants()
        if n:
            ctx.note(f"{n} QDQ layer(s) on int8 kernels")
        return n

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_QMatch` with the AscendDequant's (scale, offset) as the record; None when x
        is no AscendDequant's output; a `Skip` when the weight or shape does not fit."""
        linear = node.op == "LinearAct"
        x = node.arg("mat1" if linear else "input")
        d = x.producer
        if d is None or d.op != "AscendDequant":
            return None
        w = node.arg("mat2" if linear else "weight")
        if not (w.is_const and w.desc.dtype.torch == torch.float32):
            return Skip("QDQ: the weight is not a constant fp32 tensor (float emulation kept)")
        if linear and (x.desc.rank != 2 or w.desc.rank != 2):
            return Skip("QDQ: not a 2-D GEMM (float emulation kept)")
        if not torch.isfinite(w.const).all():
            return Skip("QDQ: the weight holds NaN or inf (float emulation kept)")
        weight = exact_int8(w.const, 1 if linear else 0)
        if weight is None:
            return Skip("QDQ: the weight is not symmetric int8 (per channel or per tensor, "
                        "max |q| = 127): the int8 kernels would requantize it; float emulation kept")
        step, off = float(d.attrs["scale"]), int(d.attrs["offset"])
        self._quants[(x.id, step, off)] = d.inputs[0]
        self._dequants.append(d)
        return _QMatch(node, {"scale_d": step, "offset_d": off},
                       f"QDQ → int8 (scale_d={step:.4g}, offset_d={off}); the file's int8 weights", weight)

    def rewrite(self, graph: Graph, m: _QMatch, ctx: PassContext) -> int:
        """`QuantizeInt8.rewrite` with the uint8 tensor as x and the file's int8 weight.
        Returns 1."""
        return super().rewrite(graph, m, ctx)


__all__ = ["QdqToInt8"]
