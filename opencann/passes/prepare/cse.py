"""Stage 1, prepare: common-subexpression elimination."""
from __future__ import annotations

from typing import Any, Dict, Tuple

from ...ir import Graph, TensorListRef, TensorRef
from ...ops import is_random
from ..base import Pass, PassContext


def _key(node) -> Tuple:
    def freeze(a: Any):
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, (TensorRef, TensorListRef)):
            return a
        return repr(a)
    return (node.op, tuple(v.id for v in node.inputs),
            tuple(sorted((k, freeze(v)) for k, v in node.attrs.items())),
            str(node.meta.get("aten", "")))


class CommonSubexpressionElimination(Pass):
    """Replace a node by an earlier identical one (same op, inputs, attributes).
    Random nodes (`is_random`) are never merged: each draws its own values."""

    name, stage = "cse", "prepare"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Merge each node into the first earlier one with the same op, input values,
        attributes and ATen overload; returns the number of nodes removed."""
        seen: Dict[Tuple, Any] = {}
        n = 0
        for node in list(graph.nodes):
            if is_random(node):
                continue
            k = _key(node)
            prev = seen.get(k)
            if prev is None:
                seen[k] = node
                continue
            with graph.rewriting():   # ``prev`` records that it does ``node``'s work too
                for a, b in zip(node.outputs, prev.outputs):
                    graph.replace_all_uses_with(a, b)
                graph.erase_node(node)
            n += 1
        return n
