"""`QdqEltwiseToInt8` (``qdq_eltwise_int8``): in an ONNX QDQ model, an Add or MaxPool between
dequantized uint8 tensors whose result is quantized again ⇒ the op on the uint8 tensors
(as ONNX Runtime's QDQ transformer turns DQ → Add → Q into QLinearAdd, DQ → MaxPool → Q
into a uint8 MaxPool).

Before (``qdq_to_int8`` and ``fuse_requant`` leave these between the int8 layers)::

    a = AscendDequant(ua, scale=sa, offset=za)
    b = AscendDequant(ub, scale=sb, offset=zb)
    y = AscendQuant(Add(a, b), scale=1/s, offset=z)          # (ResNet's residual sum)
    m = AscendQuant(MaxPool(AscendDequant(u, s', z')), 1/s', z')

After::

    y = QuantAdd(ua, ub; a_scale=sa, a_offset=za, b_scale=sb, b_offset=zb, scale=s, offset=z)
    m = QuantMaxPool(u)

QuantAdd computes ``saturate(round(((ua - za) * sa + (ub - zb) * sb) / s) + z)``, the QDQ
graph's values up to fp32 rounding (``quantized::add``); the Add's ReLU, which ONNX
Runtime's quantizer folds into the output's zero point, is the saturation at 0. MaxPool
commutes with quantization, so it applies only where the quantization after it equals
the one before (ONNX Runtime keeps it so): then it is exact.

It does not apply (a Skip with the reason) where an input is not dequantized from uint8,
the result has another reader than one AscendQuant or is a graph output, the Add
broadcasts or has ``alpha`` != 1, or the MaxPool's two quantizations differ. Source: ONNX
Runtime, onnxruntime/core/optimizer/qdq_transformer (QDQ selectors and actions)."""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Optional

from ...ir import DataType, Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion


@dataclass
class _EltMatch:
    node: Node
    quant: Node                 # the AscendQuant after it


def _dequantized(v) -> Optional[Node]:
    p = v.producer
    return p if p is not None and p.op == "AscendDequant" else None


class QdqEltwiseToInt8(CpuFusion):
    """AscendQuant(Add(AscendDequant(ua), AscendDequant(ub))) ⇒ QuantAdd(ua, ub);
    AscendQuant(MaxPool(AscendDequant(u))) at the same quantization ⇒ QuantMaxPool(u)."""

    name, stage = "qdq_eltwise_int8", "fusion"
    ops = ("Add", "MaxPool")

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """An `_EltMatch`, None when no input is an AscendDequant's, else a `Skip`."""
        deqs = [_dequantized(v) for v in node.inputs if not v.is_const]
        if not any(deqs):
            return None
        out = node.outputs[0]
        q = next(iter(out.users), None)
        if len(out.users) != 1 or q.op != "AscendQuant" or out in graph.outputs:
            return Skip("QDQ: its result is read by more than one AscendQuant (float emulation kept)")
        if node.op == "Add":
            if len(node.inputs) != 2 or not all(deqs) or node.attrs.get("alpha", 1) != 1:
                return Skip("QDQ: an addend is not dequantized from uint8, or alpha != 1")
            if any(tuple(v.desc.shape) != tuple(out.desc.shape) for v in node.inputs):
                return Skip("QDQ: the Add broadcasts")
            return _EltMatch(node, q)
        d = deqs[0]
        if abs(float(q.attrs["scale"]) * float(d.attrs["scale"]) - 1.0) > 1e-6 \
                or int(q.attrs["offset"]) != int(d.attrs["offset"]):
            return Skip("QDQ: the MaxPool's output is quantized differently from its input")
        return _EltMatch(node, q)

    def rewrite(self, graph: Graph, m: _EltMatch, ctx: PassContext) -> int:
        """The uint8 op in place of the float op and its AscendQuant; dequantizations no
        one reads any more go. Returns 1."""
        node, q = m.node, m.quant
        deqs = [v.producer for v in node.inputs]
        desc = replace(node.outputs[0].desc, dtype=DataType.UINT8)
        if node.op == "Add":
            a, b = deqs
            attrs = {"self": TensorRef(0), "other": TensorRef(1), "a_scale": float(a.attrs["scale"]),
                     "a_offset": int(a.attrs["offset"]), "b_scale": float(b.attrs["scale"]),
                     "b_offset": int(b.attrs["offset"]), "scale": 1.0 / float(q.attrs["scale"]),
                     "offset": int(q.attrs["offset"])}
            new = graph.create_node("QuantAdd", [a.inputs[0], b.inputs[0]], attrs, [desc],
                                    name=node.name + "_u8", source=node.source, scope=node.scope, before=q)
        else:
            new = graph.create_node("QuantMaxPool", [deqs[0].inputs[0]], dict(node.attrs), [desc],
                                    name=node.name + "_u8", source=node.source, scope=node.scope, before=q)
        new.meta["strides"] = list((node.meta.get("strides") or [None])[:1])
        graph.replace_all_uses_with(q.outputs[0], new.outputs[0])
        graph.erase_node(q)
        graph.erase_node(node)
        for d in set(deqs):
            if not d.outputs[0].users and d.outputs[0] not in graph.outputs:
                graph.erase_node(d)
        ctx.applied([node], f"QDQ {node.op} on uint8")
        return 1


__all__ = ["QdqEltwiseToInt8"]
