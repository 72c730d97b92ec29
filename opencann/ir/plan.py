"""Artifacts of the memory and schedule stages, consumed by the runtime, and
`apply_schedule`, which puts a graph in a `Schedule`'s order.

A `MemoryPlan` maps each planned buffer to an offset in one arena. Sizes are bytes,
rounded up to ``alignment``. ``lower_bound`` is the largest number of bytes live at any
single step, the bound no offset assignment can beat (as XLA's buffer assignment reports
its own gap to it).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Tuple

from .graph import Graph


@dataclass
class Buffer:
    """One planned allocation: a root value and the values that alias it."""

    root: int                 # value id that owns the storage
    size: int                 # bytes, aligned
    start: int                # first step (node index) at which it is live
    end: int                  # last step at which it is read
    offset: int = -1          # byte offset in the arena
    aliases: List[int] = field(default_factory=list)  # view / in-place value ids


@dataclass
class MemoryPlan:
    """The memory stage's result: each planned buffer's arena offset and size (bytes), which buffer
    each planned value lives in, the arena size next to its lower bound (the most bytes live at
    one step, `opencann.ir.liveness`) and to one allocation per value, the in-place reuses and
    why the other values are not planned."""
    buffers: Dict[int, Buffer]            # root value id -> buffer
    value_buffer: Dict[int, int]          # value id -> root value id (only planned values)
    arena_bytes: int
    lower_bound: int
    naive_bytes: int                      # one fresh allocation per planned value
    alignment: int
    strategy: str
    inplace: List[Tuple[str, str]] = field(default_factory=list)  # (node, input) reused
    unplanned: Dict[str, str] = field(default_factory=dict)       # value -> why not planned

    @property
    def ratio(self) -> float:
        """arena / lower bound (1.0 is optimal)."""
        return self.arena_bytes / self.lower_bound if self.lower_bound else 1.0

    def summary(self) -> Dict[str, object]:
        """The plan as the compile report's ``memory`` entry: byte sizes, arena/lower-bound ratio,
        counts, strategy, alignment and the kernel-allocated values grouped by reason."""
        return {"arena_bytes": self.arena_bytes, "lower_bound_bytes": self.lower_bound,
                "naive_bytes": self.naive_bytes, "arena_over_lower_bound": round(self.ratio, 4),
                "buffers": len(self.buffers), "inplace_reuses": len(self.inplace),
                "strategy": self.strategy, "alignment": self.alignment,
                "kernel_allocated_values": sum("graph output" not in r for r in self.unplanned.values()),
                "graph_output_values": sum("graph output" in r for r in self.unplanned.values()),
                "kernel_allocated": self.kernel_allocated()}

    def kernel_allocated(self, limit: int = 8) -> Dict[str, object]:
        """Values outside the arena (not graph outputs), grouped by reason: reason ->
        {"count", "values" (the first ``limit``)}."""
        out: Dict[str, Dict[str, object]] = {}
        for v, r in self.unplanned.items():
            if "graph output" in r:
                continue
            e = out.setdefault(r, {"count": 0, "values": []})
            e["count"] += 1
            if len(e["values"]) < limit:
                e["values"].append(v)
        return out


@dataclass
class Schedule:
    """Execution order (node names) and stream of each node; events join streams."""

    order: List[str]
    streams: Dict[str, int]
    events: List[Tuple[str, str]] = field(default_factory=list)  # (producer, consumer)


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
