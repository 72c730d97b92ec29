"""Stage 1, prepare: identity (no-op copy) elimination."""
from __future__ import annotations

import sympy
import torch

from ...ir import Graph, Node
from ...ir.symbolic import as_expr
from ..base import PassContext, RewritePass, Skip


def _contiguous(shape, strides) -> bool:
    # symbolic sizes/strides (dynamic dims) compare as sympy expressions
    expect = as_expr(1)
    for size, st in zip(reversed(shape), reversed(strides)):
        if size != 1 and as_expr(st) != expect:
            return False
        expect = sympy.expand(expect * as_expr(size))
    return True


class IdentityElimination(RewritePass):
    """Drop copies that change nothing: ``clone`` (dropout in eval mode becomes one) of a
    value that is already laid out as the copy would be. Kept when the copy is a graph
    output (results must not alias inputs or each other) or when the input's strides are
    unknown or not contiguous and the copy makes them so (a view may depend on it)."""

    name, stage = "identity_elimination", "prepare"
    ops = ("Identity", "Alias")

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """The Identity/Alias node itself when the copy can go; a `Skip` when it is a
        graph output, or when it makes an input contiguous (``memory_format``) whose strides
        are unknown or not contiguous."""
        src, dst = node.inputs[0], node.outputs[0]
        if any(o is dst for o in graph.outputs):
            return Skip("the copy is a graph output (results must not alias inputs or each other)")
        fmt = node.attrs.get("memory_format")
        if node.op == "Identity" and fmt not in (None, torch.preserve_format):
            p = src.producer
            st = (p.meta.get("strides") or [None] * len(p.outputs))[p.outputs.index(src)] if p else None
            if src.is_const:
                st = tuple(src.const.stride())
            if st is None or not _contiguous(src.desc.shape, st):
                return Skip(f"the copy makes its input contiguous ({fmt}); its strides are "
                            + ("unknown" if st is None else f"{tuple(st)}"))
        return node

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext) -> int:
        """Let the copy's users read its input and erase it; returns 1."""
        graph.replace_all_uses_with(node.outputs[0], node.inputs[0])
        graph.erase_node(node)
        return 1
