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
bf16 op, a graph output) or quantized at two scales."""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import DataType, Graph, Node
from ..base import PassContext, Skip
from .common import CpuFusion
from .quant_readers import QuantReaders, quant_readers, to_uint8


@dataclass
class _Match:
    node: Node
    readers: QuantReaders


class FuseAddLayerNormQuant(CpuFusion):
    """AddLayerNormCast(x1, x2, γ, β) → (Reshape →)* AscendQuant(s, z) ⇒
    AddLayerNormQuant(x1, x2, γ, β; scale=s, offset=z) → (Reshape →)* (uint8)."""

    name, stage = "fuse_add_layer_norm_quant", "fusion"
    ops = ("AddLayerNormCast",)

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """A `_Match` when every reader of the low output quantizes it (through Reshapes)
        at one (scale, offset); else a `Skip` naming the reader or fact in the way."""
        low = node.outputs[1]
        r = quant_readers(graph, low)
        if isinstance(r, Skip):
            return Skip(f"its {low.desc.dtype.value} output: {r.reason}")
        if not r.quants:
            return Skip("no AscendQuant reads its low output (no static int8 layer after it)")
        if len(r.keys) != 1:
            return Skip(f"its readers quantize it at {len(r.keys)} different scales")
        return _Match(node, r)

    def rewrite(self, graph: Graph, m: _Match, ctx: PassContext) -> int:
        """Replace the node by AddLayerNormQuant (same inputs, the AscendQuant's scale and
        offset as attributes, outputs: the float32 norm and uint8); the Reshapes carry
        uint8 and the AscendQuant nodes go (`to_uint8`). Returns 1."""
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


__all__ = ["FuseAddLayerNormQuant"]
