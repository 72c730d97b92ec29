"""Stage 1, prepare: dead-code elimination."""
from __future__ import annotations

from ...ir import Graph
from ..base import Pass, PassContext


class DeadCodeElimination(Pass):
    """Remove nodes none of whose outputs are used. Unused random ops are removed too:
    their values are unobservable. The compiled model then advances torch's RNG by
    fewer draws than eager would; its random stream is its own (reproducible under
    ``torch.manual_seed``), not eager's bit for bit."""

    name, stage = "dce", "prepare"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Erase, from the last node back, nodes with no used output, then unused
        constants; returns the number of nodes erased."""
        outs = {id(v) for v in graph.outputs}
        n = 0
        for node in reversed(list(graph.nodes)):
            if not any(o.users or id(o) in outs for o in node.outputs):
                graph.erase_node(node)
                n += 1
        graph.prune_constants()
        return n
