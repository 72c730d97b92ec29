"""Stage 2, fusion: `FuseGatedMLP`, the gated MLP of Llama-style models (SwiGLU; Shazeer
2020, "GLU Variants Improve Transformer", arXiv:2002.05202), silu(x·W1) * (x·W3), ⇒
GatedMLP(x, W1, W3): both GEMMs, the SiLU and the product in one kernel that writes one
tensor instead of four. Runs after `FuseSiLU` (it looks for the Swish that pass makes).

CPU only: the vnpu's Cube + Vector version is the UB-fusion work of issue #16 item 3.
The two GEMMs run the kernel chosen for their shape, as a bias-free LinearAct's (eager's
``mm``, same bits, or with constant fp32 weights a prepacked GEMM or the decode GEMV:
eager's values to fp32 rounding); the SiLU is ATen's."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

from ...ir import Graph, Node, TensorRef, Value
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import producer, read_outside, replace_with, tensor_pair


@dataclass
class _GatedMatch:
    root: Node
    x: Value
    w1: Value
    w3: Value
    nodes: List[Node]


def _gemm(v: Value) -> Optional[Tuple[Node, List[Node]]]:
    """(the MatMul, nodes) when ``v`` is MatMul(x, W) or a Reshape of one."""
    view = producer(v, "Reshape", "UnsafeReshape")
    mm = producer(view.inputs[0] if view is not None else v, "MatMul")
    if mm is None:
        return None
    return mm, [mm] + ([view] if view is not None else [])


class FuseGatedMLP(CpuFusion):
    """Mul(Swish([Reshape] MatMul(x, W1)), [Reshape] MatMul(x, W3)) (either order)
    ⇒ GatedMLP(x, W1, W3)."""

    name, stage = "fuse_gated_mlp", "fusion"
    ops = ("Mul",)
    switch_section = "GraphFusion"

    def match(self, mul: Node, graph: Graph, ctx: PassContext):
        """The matched nodes when ``node`` is the root of ``silu(x W1ᵀ + b1) * (x W3ᵀ + b3)``;
        a `Skip` with the reason for a near miss; None when ``node`` cannot be the root."""
        pair = tensor_pair(mul, "Mul")
        if pair is None:
            return None
        for a, b in (pair, pair[::-1]):
            sw = producer(a, "Swish")
            if sw is None:
                continue
            g1, g3 = _gemm(sw.inputs[0]), _gemm(b)
            if g1 is None or g3 is None:
                return Skip("the SiLU's input and the other factor are not both x·W products")
            (mm1, n1), (mm3, n3) = g1, g3
            if mm1.inputs[0] is not mm3.inputs[0]:
                return Skip(f"the two GEMMs read different inputs ({mm1.inputs[0]}, "
                            f"{mm3.inputs[0]})")
            if mm1.inputs[1].desc != mm3.inputs[1].desc or a.desc != b.desc \
                    or mul.outputs[0].desc != a.desc:
                return Skip(f"W1 {mm1.inputs[1].desc} and W3 {mm3.inputs[1].desc} (or the "
                            "products) differ in shape or dtype")
            nodes = [mul, sw, *n1, *n3]
            skip = read_outside(graph, nodes, mul, "gated MLP")
            if skip is not None:
                return skip
            return _GatedMatch(mul, mm1.inputs[0], mm1.inputs[1], mm3.inputs[1], nodes)
        return None

    def rewrite(self, graph: Graph, m: _GatedMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by one `GatedMLP` node; returns the number of rewrites
        (1)."""
        attrs = {"x": TensorRef(0), "w1": TensorRef(1), "w3": TensorRef(2)}
        new = graph.create_node("GatedMLP", [m.x, m.w1, m.w3], attrs, [m.root.outputs[0].desc],
                                name=f"{m.root.name}_gated_mlp", source=m.root.source,
                                scope=m.root.scope, before=m.root)
        replace_with(graph, m.root, new, m.nodes)
        ctx.applied(m.nodes[::-1], "silu(x·W1) * (x·W3)")
        return 1
