"""Stage 5, schedule: a valid topological order on a single stream."""
from __future__ import annotations

from ..ir import Graph, Schedule
from .base import Pass, PassContext


class SingleStreamSchedule(Pass):
    name, stage = "schedule", "schedule"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        before = [n.name for n in graph.nodes]
        graph.topo_sort()
        for n in graph.nodes:
            n.stream = 0
        ctx.artifacts["schedule"] = Schedule([n.name for n in graph.nodes],
                                             {n.name: 0 for n in graph.nodes})
        return sum(a != b for a, b in zip(before, [n.name for n in graph.nodes]))
