"""Stage 5, schedule: a valid topological order on a single stream, recorded as the
`Schedule` artifact (``ctx.artifacts["schedule"]``), which the memory and binding
stages follow (`apply_schedule`)."""
from __future__ import annotations

from ..ir import Graph, Schedule
from ..log import logger
from ..report import fmt_bytes
from .base import Pass, PassContext


class SingleStreamSchedule(Pass):
    """The schedule stage: the graph's nodes in a stable topological order
    (`Graph.topo_sort`: the capture order where it is valid), then, with the option
    ``memory_aware_order`` (default True), the order of `memory_aware_order` when it
    lowers the planned peak of live bytes; all on stream 0."""

    name, stage = "schedule", "schedule"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Sort the nodes, set every ``node.stream`` to 0 and store the `Schedule` (node
        names in order, streams) as ``ctx.artifacts["schedule"]``; returns the number of
        positions whose node changed. The note (and the INFO log) gives the planned peak
        of live bytes before and after. Raises ValueError if the graph has a cycle."""
        before = [n.name for n in graph.nodes]
        graph.topo_sort()
        if ctx.options.get("memory_aware_order", True):
            _memory_aware(graph, ctx)
        for n in graph.nodes:
            n.stream = 0
        ctx.artifacts["schedule"] = Schedule([n.name for n in graph.nodes],
                                             {n.name: 0 for n in graph.nodes})
        return sum(a != b for a, b in zip(before, [n.name for n in graph.nodes]))


def _memory_aware(graph: Graph, ctx: PassContext) -> None:
    """Put ``graph`` in `memory_aware_order`'s order; note and log the peak."""
    from .schedule_order import memory_aware_order  # it plans memory, whose module imports this one
    c = memory_aware_order(graph, ctx.options)
    if c.note:
        ctx.note(c.note)
        return
    if c.method != "capture":
        graph.reorder(c.order)
        ctx.applied(list(c.order[:1]), f"{c.method} order: planned peak {c.before} -> {c.after} B")
    text = (f"planned peak {fmt_bytes(c.before)} -> {fmt_bytes(c.after)} ({c.before} -> "
            f"{c.after} B, {c.method} order)")
    ctx.note(text)
    logger.info("schedule %s: %s", graph.name, text)


def apply_schedule(graph: Graph, schedule: Schedule) -> int:
    """Put ``graph``'s nodes in ``schedule.order`` (node names) and give each its stream
    (``schedule.streams``, default 0), so that what follows (memory planning, binding,
    the model file) runs in the scheduled order. Returns the number of positions whose
    node changed (0: the graph was in that order). Raises ValueError when the schedule
    does not fit the graph: a name that is not one of its nodes, or a node missing or
    ahead of a producer (a pass changed the graph after the schedule stage)."""
    by_name = {n.name: n for n in graph.nodes}
    unknown = [name for name in schedule.order if name not in by_name]
    if unknown or len(by_name) != len(graph.nodes):
        raise ValueError(f"the schedule names {unknown[:3] or 'nodes'} that graph {graph.name} "
                         "does not have (once); run the schedule stage after the last pass "
                         "that changes the graph")
    before = list(graph.nodes)
    order = [by_name[name] for name in schedule.order]
    if order != before:
        try:
            graph.reorder(order)
        except ValueError as e:
            raise ValueError(f"the schedule does not fit graph {graph.name}: {e}") from None
    for n in graph.nodes:
        n.stream = schedule.streams.get(n.name, 0)
    return sum(a is not b for a, b in zip(before, order))
