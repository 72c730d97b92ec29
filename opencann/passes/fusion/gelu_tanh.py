"""Stage 2, fusion: `FuseGeluTanh`, GPT-2's spelled-out GELU (transformers' ``gelu_new`` /
``NewGELUActivation``) 0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³))) ⇒ Gelu(x,
approximate="tanh"): one ATen kernel instead of eight elementwise passes, and a
Linear+GELU for `FuseLinearAct` after it. Source of the formula: Hendrycks & Gimpel 2016,
"Gaussian Error Linear Units" (arXiv:1606.08415), eq. for the tanh approximation.

Rounding: eager's spelled-out form loses digits where 1 + tanh(z) cancels (x < -3); ATen's
kernel evaluates the same formula in one pass. The two differ by at most 2.4e-7 absolute
in fp32 (measured on randn·3); the fused value is the closer one to the fp64 formula
(tests/unit/test_pattern_fusions.py). NaN and ±inf positions are eager's: the rewrite is skipped
on a CPU whose GELU kernels place them elsewhere (`special_values_differ`)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, RewritePass, Skip
from .match import (close, factors, producer, read_outside, record_formula, replace_with,
                    scalar_operand, special_values_differ)

SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
CUBIC = 0.044715


@dataclass
class _GeluMatch:
    root: Node
    x: object
    nodes: List[Node]


def one_plus(v, fn: str):
    """(the ``fn`` node, the Add) when ``v`` is ``fn(z) + 1`` (either order), else None."""
    add = producer(v)
    so = scalar_operand(add, "Add", "Adds")
    if so is None or so[1] != 1.0 or producer(so[0], fn) is None:
        return None
    return producer(so[0], fn), add


def gelu_factors(graph: Graph, root: Node, fn: str):
    """(x, the ``fn`` node, nodes) when ``root`` is the product 0.5·x·(1 + fn(...)), the
    product written in any order and grouping; a `Skip` when it is ``x·(1 + fn(...))``
    with another scale; None when no factor is ``1 + fn(...)``."""
    tensors, scale, muls = factors(graph, root)
    hit = [(t, one_plus(t, fn)) for t in tensors if one_plus(t, fn) is not None]
    if not hit or len(tensors) != 2:
        return None
    t, (f, add) = hit[0]
    x = tensors[1] if tensors[0] is t else tensors[0]
    if scale != 0.5:
        return Skip(f"x·(1 + {fn.lower()}(…)) is scaled by {scale:g}, GELU by 0.5")
    if root.outputs[0].desc != x.desc or not x.desc.dtype.torch.is_floating_point:
        return Skip(f"the product {root.outputs[0].desc} broadcasts or promotes x "
                    f"{x.desc}: Gelu(x) would give x's shape and dtype")
    return x, f, muls + [add, f]


class FuseGeluTanh(RewritePass):
    """Mul(Mul(x, 0.5), Add(Tanh(Mul(Add(x, Mul(Pow(x, 3), 0.044715)), √(2/π))), 1))
    ⇒ Gelu(x, approximate="tanh")."""

    name, stage = "fuse_gelu_tanh", "fusion"
    ops = ("Mul", "Muls")
    #: CANN graph fusion reference, "GeluFusionPass": Pow, Mul, Add, Tanh ⇒ Gelu (the tanh form)
    switch_section, cann_names = "GraphFusion", ("GeluFusionPass",)

    def match(self, root: Node, graph: Graph, ctx: PassContext):
        """The matched nodes when ``node`` is the root of GPT-2's spelled-out tanh GELU
        ``0.5·x·(1 + tanh(√(2/π)·(x + 0.044715·x³)))``; a `Skip` with the reason for a near
        miss; None when ``node`` cannot be the root."""
        got = gelu_factors(graph, root, "Tanh")
        if got is None or isinstance(got, Skip):
            return got
        x, tanh, nodes = got
        inner = scalar_operand(producer(tanh.inputs[0]), "Mul", "Muls")
        if inner is None or not close(inner[1], SQRT_2_OVER_PI):
            return Skip("the tanh's argument is not √(2/π)·(…)" if inner is None else
                        f"the tanh's argument is scaled by {inner[1]:g}, not √(2/π) = 0.797885")
        u = producer(inner[0], "Add")
        if u is None or len(u.inputs) != 2 or u.attrs.get("alpha", 1) != 1 or x not in u.inputs:
            return Skip(f"the tanh's argument is not √(2/π)·({x} + 0.044715·{x}³)")
        cube_term = u.inputs[1] if u.inputs[0] is x else u.inputs[0]
        c = scalar_operand(producer(cube_term), "Mul", "Muls")
        pw = producer(c[0], "Pow") if c else None
        if c is None or pw is None or pw.inputs[0] is not x or pw.attrs.get("exponent") != 3:
            return Skip(f"the cubic term is not c·{x}³")
        if not close(c[1], CUBIC):
            return Skip(f"the cubic coefficient is {c[1]:g}, GELU's is 0.044715")
        nodes += [producer(tanh.inputs[0]), u, producer(cube_term), pw]
        return read_outside(graph, nodes, root, "GELU") or special_values_differ(x, "gelu_tanh") \
            or _GeluMatch(root, x, nodes)

    def rewrite(self, graph: Graph, m: _GeluMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by one `Gelu` node (approximate='tanh'); returns the
        number of rewrites (1)."""
        return gelu_rewrite(graph, m, ctx, "tanh")


def gelu_rewrite(graph: Graph, m: _GeluMatch, ctx: PassContext, approximate: str) -> int:
    """Replace match ``m`` by one Gelu(x, approximate) node."""
    new = graph.create_node("Gelu", [m.x], {"self": TensorRef(0), "approximate": approximate},
                            [m.root.outputs[0].desc], name=f"{m.root.name}_gelu",
                            source=m.root.source, scope=m.root.scope, before=m.root)
    replace_with(graph, m.root, new, m.nodes)
    record_formula(graph, "gelu_tanh" if approximate == "tanh" else "gelu", m.x)
    ctx.applied(m.nodes[::-1], f"spelled-out GELU ({approximate})")
    return 1
