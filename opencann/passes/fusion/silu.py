"""Stage 2, fusion: `FuseSiLU`, x·sigmoid(x) (either operand order) ⇒ Swish(x), ATen's
``silu`` in one pass over memory instead of two. Runs before the Linear/Conv + activation
fusions, which then take the Swish as their post-op (Linear+SiLU).

Rounding: ``silu`` computes x / (1 + e⁻ˣ) where eager's spelled-out form rounds sigmoid
first; they differ by at most 1.2e-7 relative in fp32 (measured on randn·3), and NaN, ±inf
and signed zeros land where eager puts them (tests/unit/test_pattern_fusions.py); on a CPU whose
SiLU kernels place them elsewhere the spelled-out form is kept (`special_values_differ`)."""
from __future__ import annotations

from dataclasses import dataclass

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, RewritePass, Skip
from .match import producer, record_formula, replace_with, special_values_differ, tensor_pair


@dataclass
class _SiLUMatch:
    mul: Node
    sigmoid: Node


class FuseSiLU(RewritePass):
    """Mul(x, Sigmoid(x)) or Mul(Sigmoid(x), x) ⇒ Swish(x)."""

    name, stage = "fuse_silu", "fusion"
    ops = ("Mul",)
    switch_section = "GraphFusion"

    def match(self, mul: Node, graph: Graph, ctx: PassContext):
        """The matched nodes when ``node`` is the root of ``x * sigmoid(x)`` (either operand
        order); a `Skip` with the reason for a near miss; None when ``node`` cannot be the
        root."""
        pair = tensor_pair(mul, "Mul")
        if pair is None:
            return None
        for s, other in (pair, pair[::-1]):
            sig = producer(s, "Sigmoid")
            if sig is None:
                continue
            if sig.inputs[0] is not other:
                return Skip(f"multiplies sigmoid({sig.inputs[0]}) by {other}, not by the "
                            "sigmoid's own input")
            if graph.sole_user(s) is not mul:
                return Skip(f"the sigmoid {s} is read elsewhere too: fusing would compute "
                            "it twice")
            if mul.outputs[0].desc != other.desc:
                return Skip(f"the product {mul.outputs[0].desc} broadcasts or promotes "
                            f"{other.desc}")
            return special_values_differ(other, "silu") or _SiLUMatch(mul, sig)
        return None

    def rewrite(self, graph: Graph, m: _SiLUMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by one `Swish` (SiLU) node; returns the number of rewrites
        (1)."""
        x = m.sigmoid.inputs[0]
        new = graph.create_node("Swish", [x], {"self": TensorRef(0)}, [m.mul.outputs[0].desc],
                                name=f"{m.mul.name}_silu", source=m.mul.source,
                                scope=m.mul.scope, before=m.mul)
        replace_with(graph, m.mul, new, [m.mul, m.sigmoid])
        record_formula(graph, "silu", x)
        ctx.applied([m.sigmoid, m.mul], "Sigmoid+Mul")
        return 1
