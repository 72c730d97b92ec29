"""`FuseAddLayerNormQuant` (``fuse_add_layer_norm_quant``): an AddLayerNormCast whose low
(bf16) output only int8 layers read, through AscendQuant at one scale ⇒ AddLayerNormQuant
writing that uint8 tensor instead (CANN's AddLayerNormQuant, ``aclnnAddLayerNormQuant``;
kernel ``ops/kernels/add_layer_norm_quant_cpu.py``).

Before (a bf16 transformer block whose Q/K/V or FFN up-projection is int8, what
``quantize_int8`` leaves)::

    y, y_bf16 = AddLayerNormCast(x1, x2, γ, β)
    v = Reshape(y_bf16)                       # [B, S, H] -> [B·S, H]
    q = AscendQuant(v, scale=1/s, offset=z)
    out = QuantLinearAct(q, ...)

After::

    y, y_u8 = AddLayerNormQuant(x1, x2, γ, β; scale=1/s, offset=z)
    v = Reshape(y_u8)                         # uint8
    out = QuantLinearAct(v, ...)

The norm writes one byte per element instead of two, the bf16 tensor is not read again,
and the AscendQuant node goes. Static quantization only: a dynamic QuantLinearAct takes
x's range per call (its readers are no AscendQuant). Numerics: the uint8 value quantizes
the float32 norm, not its bf16 rounding: at most one uint8 step from the unfused chain
(the kernel's docstring). It runs after ``fuse_requant`` (docs/guide/quantization.md).
Does not apply (a Skip with the reason) when the low output is read by anything else (a
bf16 op, a graph output) or quantized at two scales.

The float32 form (an int8 transformer without bf16, what ``opencann.quantize`` gives by
default)::

    x = Add(x1, x2)
    y = LayerNorm(x, γ, β)                    # y: the residual stream, read on as float32
    q = AscendQuant(Reshape(y), scale=1/s, offset=z)

becomes ``y, y_u8 = AddLayerNormQuant(x1, x2, γ, β; scale=1/s, offset=z)`` with
``Reshape(y_u8)`` read by the int8 layer and y by the rest: three passes over the
activation (Add, LayerNorm, AscendQuant) become one, and the Add and AscendQuant nodes go.
Numerics: y to float32 rounding of eager's LayerNorm (a few ulp: the kernel's docstring),
y_u8 the quantization of that y, at most one uint8 step from the unfused chain's. The
same conditions as the AddLayerNorm fusion (the sum read by the norm alone, statistics
unread, one axis, float32 γ / β), and every quantizing reader at one scale."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

from ...ir import DataType, Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import contiguous_strides, residual_layer_norm
from .quant_readers import QuantReaders, quant_paths, quant_readers, to_uint8


@dataclass
class _Match:
    node: Node
    readers: QuantReaders
    add: Optional[Node] = None     #: the float32 form: the residual Add before the LayerNorm
    heads: List[Node] = field(default_factory=list)   #: its readers on the quantizing paths


def _one_scale(r: QuantReaders) -> Optional[Skip]:
    """None when every AscendQuant of ``r`` quantizes at one (scale, offset) by a product
    (the fused kernel's ``y * (1 / step)``); a `Skip` for two scales, or for an ONNX
    QuantizeLinear (AscendQuant with ``step``: x / step, the specification's division, whose
    bits the product misses by one where y / step lies next to a rounding boundary)."""
    if any("step" in q.attrs for q in r.quants):
        return Skip("an ONNX QuantizeLinear reads it (x / step, the specification's "
                    "division): the fused kernel multiplies by 1 / step")
    if len(r.keys) != 1:
        return Skip(f"its readers quantize it at {len(r.keys)} different scales")
    return None


class FuseAddLayerNormQuant(CpuFusion):
    """AddLayerNormCast(x1, x2, γ, β) → (Reshape →)* AscendQuant(s, z) ⇒
    AddLayerNormQuant(x1, x2, γ, β; scale=s, offset=z) → (Reshape →)* (uint8); and the
    float32 form, LayerNorm(Add(x1, x2), γ, β) → (Reshape →)* AscendQuant(s, z) beside
    float32 readers (module docstring)."""

    name, stage = "fuse_add_layer_norm_quant", "fusion"
    ops = ("AddLayerNormCast", "LayerNorm")

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_Match` when every reader of the low output quantizes it (through Reshapes)
        at one (scale, offset) (`_one_scale`); else a `Skip` naming the reader or fact in
        the way. A LayerNorm: `_match_float`."""
        if node.op == "LayerNorm":
            return self._match_float(node, graph)
        low = node.outputs[1]
        r = quant_readers(graph, low)
        if isinstance(r, Skip):
            return Skip(f"its {low.desc.dtype.value} output: {r.reason}")
        if not r.quants:
            return Skip("no AscendQuant reads its low output (no static int8 layer after it)")
        return _one_scale(r) or _Match(node, r)

    @staticmethod
    def _match_float(ln: Node, graph: Graph):
        """The float32 form: None when no reader of the norm quantizes it; a `_Match` when
        a residual Add feeds it (`residual_layer_norm`) and its quantizing readers
        (`quant_paths`) pass `_one_scale`; else a `Skip`."""
        y = ln.outputs[0]
        r, heads = quant_paths(graph, y)
        if not r.quants:
            return None
        add = residual_layer_norm(ln, graph, "its uint8 quantization", missing=(
            "no residual Add produces the LayerNorm's input: the fused node adds two tensors"))
        if isinstance(add, Skip):
            return add
        return _one_scale(r) or _Match(ln, r, add, heads)

    def rewrite(self, graph: Graph, m: _Match, ctx: PassContext) -> int:
        """Replace the node by AddLayerNormQuant (same inputs, the AscendQuant's scale and
        offset as attributes, outputs: the float32 norm and uint8); the Reshapes carry
        uint8 and the AscendQuant nodes go (`to_uint8`). Returns 1."""
        if m.add is not None:
            return self._rewrite_float(graph, m, ctx)
        node = m.node
        inv, off = next(iter(m.readers.keys))
        attrs = {k: v for k, v in node.attrs.items() if k != "dtype"}
        attrs.update(scale=inv, offset=off)
        y, low = node.outputs
        new = graph.create_node("AddLayerNormQuant", list(node.inputs), attrs,
                                [y.desc, low.desc.with_(dtype=DataType.UINT8)],
                                name=node.name.replace("_cast", "") + "_quant", source=node.source,
                                scope=node.scope, before=node)
        new.meta.update({k: v for k, v in node.meta.items() if k in ("strides", "origin")})
        graph.replace_all_uses_with(y, new.outputs[0])
        graph.replace_all_uses_with(low, new.outputs[1])
        graph.erase_node(node)
        to_uint8(graph, m.readers)
        ctx.applied([node], f"uint8 out (step {1.0 / inv:.4g}, offset {off}); "
                            f"{len(m.readers.quants)} AscendQuant removed")
        return 1

    @staticmethod
    def _rewrite_float(graph: Graph, m: _Match, ctx: PassContext) -> int:
        """The float32 form: the Add and the LayerNorm become AddLayerNormQuant; the
        quantizing paths' heads read its uint8 output (their Reshapes retyped, the
        AscendQuant nodes gone: `to_uint8`), every other reader its float32 norm."""
        ln, add = m.node, m.add
        inv, off = next(iter(m.readers.keys))
        ins = list(add.inputs)
        attrs = {"x1": TensorRef(0), "x2": TensorRef(1), "eps": ln.attrs["eps"], "scale": inv, "offset": off}
        for k in ("weight", "bias"):
            if ln.attrs.get(k) is not None:
                attrs[k] = TensorRef(len(ins))
                ins.append(ln.inputs[ln.attrs[k].index])
        y = ln.outputs[0]
        new = graph.create_node("AddLayerNormQuant", ins, attrs, [y.desc, y.desc.with_(dtype=DataType.UINT8)],
                                name=f"{ln.name}_add_quant", source=ln.source, scope=ln.scope, before=ln)
        if ln.meta.get("strides"):
            s = ln.meta["strides"][0] or contiguous_strides(y.desc.shape)
            new.meta["strides"] = [s, s]
        for head in m.heads:
            graph.replace_input(head, y, new.outputs[1])
        graph.replace_all_uses_with(y, new.outputs[0])
        graph.erase_node(ln)
        graph.erase_node(add)
        to_uint8(graph, m.readers)
        ctx.applied([add, ln], f"Add + LayerNorm + AscendQuant: uint8 out (step {1.0 / inv:.4g}, "
                               f"offset {off}) beside the float32 norm; {len(m.readers.quants)} "
                               "AscendQuant removed")
        return 1


__all__ = ["FuseAddLayerNormQuant"]
