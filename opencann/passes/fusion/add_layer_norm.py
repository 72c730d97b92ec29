"""Stage 2, fusion: `FuseAddLayerNorm`, a residual Add read only by a LayerNorm over the
last axis ⇒ AddLayerNorm (ONNX Runtime's SkipLayerNormalization,
``onnxruntime/core/optimizer/skip_layer_norm_fusion.cc``): one pass over the rows that
never writes the sum (kernel: ``ops/kernels/add_layer_norm.py``).

Off by default (``default_enabled = False``): on the 2-core AVX2 machine it saves 9 µs
of 44 per [128, 768] row block, under the end-to-end noise of BERT-base (the
LayerNorms and Adds are ~2% of its time, the GEMMs ~93%); see docs/performance.md.
Enable with ``options={"enable": ["fuse_add_layer_norm"]}``.
"""
from __future__ import annotations

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import residual_layer_norm


class FuseAddLayerNorm(CpuFusion):
    """LayerNorm(Add(a, b), γ, β) over the last axis, the sum read by nothing else and the
    statistics unread ⇒ AddLayerNorm(a, b, γ, β)."""

    name, stage = "fuse_add_layer_norm", "fusion"
    ops = ("LayerNorm",)
    switch_section = "GraphFusion"
    default_enabled = False

    def match(self, ln: Node, graph: Graph, ctx: PassContext):
        """The (LayerNorm, Add) pair; None when no Add produces the LayerNorm's input; a
        `Skip` with the reason for a near miss (broadcast or scaled Add, the sum or the
        statistics read elsewhere, normalization over several axes, no γ or β, dtypes)."""
        x = ln.inputs[0]
        add = residual_layer_norm(ln, graph, float_affine=False)
        if add is None or isinstance(add, Skip):
            return add
        if ln.attrs.get("weight") is None or ln.attrs.get("bias") is None:
            return Skip("LayerNorm without γ or β (elementwise_affine=False)")
        if any(v.desc.dtype != x.desc.dtype for v in ln.inputs):
            return Skip(f"γ/β dtypes {[v.desc.dtype.value for v in ln.inputs[1:]]} differ from "
                        f"x's {x.desc.dtype.value}")
        return ln, add

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the Add and the LayerNorm by one AddLayerNorm node. Returns 1."""
        ln, add = m
        a, b = add.inputs
        gamma, beta = ln.inputs[ln.attrs["weight"].index], ln.inputs[ln.attrs["bias"].index]
        new = graph.create_node(
            "AddLayerNorm", [a, b, gamma, beta],
            {"self": TensorRef(0), "other": TensorRef(1), "weight": TensorRef(2),
             "bias": TensorRef(3), "eps": ln.attrs["eps"]},
            [ln.outputs[0].desc], name=f"{ln.name}_add", source=ln.source, scope=ln.scope,
            before=ln)
        if ln.meta.get("strides"):
            new.meta["strides"] = ln.meta["strides"][:1]
        graph.replace_all_uses_with(ln.outputs[0], new.outputs[0])
        graph.erase_node(ln)
        graph.erase_node(add)
        ctx.applied([add, ln], "residual Add + LayerNorm")
        return 1
