"""Stage 2, fusion: `FuseGeluErf`, the exact GELU written out, 0.5·x·(1 + erf(x/√2))
(or x·(1/√2)) ⇒ Gelu(x): one ATen kernel instead of five elementwise passes. Source:
Hendrycks & Gimpel 2016, "Gaussian Error Linear Units" (arXiv:1606.08415).

Rounding: ATen multiplies by 1/√2 where the spelled-out form divides by √2; the two differ
by at most 4.8e-7 absolute in fp32 (randn·3), largest in the negative tail where eager's
1 + erf(z) cancels; the fused value is the closer one to the fp64 formula. NaN and ±inf
positions are eager's (a -0.0 of eager's may come out +0.0): on a CPU whose exact GELU
kernels map +inf to NaN (oneDNN's AVX-512 code, pytorch/pytorch#185770) the spelled-out
form is kept, with the reason in the report (`special_values_differ`)."""
from __future__ import annotations

import math

from ...ir import Graph, Node
from ..base import PassContext, RewritePass, Skip
from .gelu_tanh import _GeluMatch, gelu_factors, gelu_rewrite
from .match import close, producer, read_outside, scalar_operand, special_values_differ


class FuseGeluErf(RewritePass):
    """Mul(Mul(x, 0.5), Add(Erf(Div(x, √2)), 1)) (any order; Mul by 1/√2 too) ⇒ Gelu(x)."""

    name, stage = "fuse_gelu_erf", "fusion"
    ops = ("Mul", "Muls")
    switch_section = "GraphFusion"

    def match(self, root: Node, graph: Graph, ctx: PassContext):
        """The matched nodes when ``node`` is the root of the spelled-out erf GELU ``0.5·x·(1 +
        erf(x/√2))``; a `Skip` with the reason for a near miss; None when ``node`` cannot be
        the root."""
        got = gelu_factors(graph, root, "Erf")
        if got is None or isinstance(got, Skip):
            return got
        x, erf, nodes = got
        arg = producer(erf.inputs[0])
        div = scalar_operand(arg, "Div", "Divs")
        mul = scalar_operand(arg, "Mul", "Muls")
        if div is not None and div[0] is x and close(div[1], math.sqrt(2.0)):
            pass
        elif mul is not None and mul[0] is x and close(mul[1], math.sqrt(0.5)):
            pass
        else:
            return Skip(f"the erf's argument is not {x}/√2")
        nodes.append(arg)
        return read_outside(graph, nodes, root, "GELU") or special_values_differ(x, "gelu") \
            or _GeluMatch(root, x, nodes)

    def rewrite(self, graph: Graph, m: _GeluMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by one `Gelu` node (approximate='none'); returns the
        number of rewrites (1)."""
        return gelu_rewrite(graph, m, ctx, "none")
