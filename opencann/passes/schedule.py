"""Stage 5, schedule: a valid topological order, recorded as the `Schedule` artifact
(``ctx.artifacts["schedule"]``), which the memory and binding stages follow
(`apply_schedule`). On one stream by default; with the option ``streams`` N > 1,
independent branches go to up to N logical streams (`assign_streams`) joined by
events (record on the producer's stream, wait on the consumer's) for each
cross-stream dependence not already implied by stream order and other events
(`opencann.ir.liveness.HappensBefore`)."""
from __future__ import annotations

from typing import Dict, List, Mapping, Optional, Sequence, Tuple

from ..ir import Graph, Node, Schedule, apply_schedule
from ..log import logger
from ..ops import get_op, graph_happens_before, is_random, ordering_deps
from ..report import fmt_bytes
from .base import Pass, PassContext
from .schedule_order import memory_aware_order

__all__ = ["SingleStreamSchedule", "apply_schedule", "assign_streams", "multi_stream_schedule",
           "node_costs", "node_seconds", "predict_streams", "stream_summary"]


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
        if ctx.options["memory_aware_order"]:
            _memory_aware(graph, ctx)
        for n in graph.nodes:
            n.stream = 0
        ctx.artifacts["schedule"] = Schedule([n.name for n in graph.nodes],
                                             {n.name: 0 for n in graph.nodes})
        if ctx.options["streams"] > 1:
            _schedule_streams(graph, ctx)
        return sum(a != b for a, b in zip(before, [n.name for n in graph.nodes]))


def _memory_aware(graph: Graph, ctx: PassContext) -> None:
    """Put ``graph`` in `memory_aware_order`'s order; note and log the peak."""
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


def _schedule_streams(graph: Graph, ctx: PassContext) -> None:
    """Option ``streams`` > 1: assign streams and events (`multi_stream_schedule`),
    store the schedule and its summary (compile report ``streams``)."""
    asked = ctx.options["streams"]
    sched = multi_stream_schedule(graph, asked)
    ctx.artifacts["schedule"] = sched
    st = ctx.report.streams = stream_summary(graph, sched)
    why = ("" if st["streams"] == asked else f" of {asked} asked: no more branches are worth a "
           "stream and an event by the cost model (node_seconds)")
    ctx.note(f"{st['streams']} streams{why}, {len(sched.events)} events")
    logger.info("schedule: %d streams%s, nodes per stream %s, %d events for %d cross-stream "
                "dependences", st["streams"], why, st["nodes_per_stream"], st["events"],
                st["cross_stream_dependences"])


# -- several streams ------------------------------------------------------------------
# Time model of one node for stream assignment (seconds): a fixed cost per kernel call
# (the generated code's Python call and ATen dispatch) plus its FLOPs and bytes moved
# (`OpDef.cost`) at rough host rates. Only the ratios matter: they decide whether a
# branch is worth another stream and an event.
_CALL_S, _FLOPS_PER_S, _BYTES_PER_S = 4e-6, 2e10, 1e10
_EVENT_S = 8e-6  # one record + wait between streams (threading.Event, thread wake-up)


def node_seconds(node: Node) -> float:
    """Estimated run time of ``node`` in seconds, from its OpDef's cost (FLOPs, bytes):
    call overhead + FLOPs / 2e10 + bytes / 1e10; the call overhead alone for a node
    with symbolic shapes or without a cost."""
    if not all(v.desc.is_static for v in (*node.inputs, *node.outputs)):
        return _CALL_S
    try:
        c = get_op(node.op).cost(node)
    except (KeyError, TypeError, ValueError):
        return _CALL_S
    return _CALL_S + c.flops / _FLOPS_PER_S + c.bytes / _BYTES_PER_S


def assign_streams(graph: Graph, nstreams: int,
                   seconds: Optional[Mapping[str, float]] = None) -> Dict[str, int]:
    """Node name -> stream (0 .. ``nstreams - 1``) for ``graph`` in its current (valid)
    node order, which each stream keeps. The CPOP list scheduler (Topcuoglu, Hariri and
    Wu, "Performance-effective and low-complexity task scheduling for heterogeneous
    computing", IEEE TPDS 2002): the critical path (the longest chain by the node times,
    CPOP's critical-path processor) goes on stream 0; every other node, in order, goes
    to the stream where it would finish earliest (HEFT's earliest-finish-time), a
    dependence from another stream costing one event and stream 0 counting the
    critical-path nodes still to come that may run beside it (the order is fixed: each
    stream runs its nodes in it, which keeps waits deadlock-free); ties keep it on its latest
    producer's stream, then the lowest stream. Random ops stay on stream 0 in order (one
    generator, drawn in eager's order). Dependences are `ordering_deps`. Node times:
    ``seconds`` (node name -> s, e.g. measured at binding by `Executor.node_seconds`;
    a node it lacks, and every node without it, by `node_seconds`' cost model). The
    same graph, order and times always give the same streams. Raises ValueError for
    ``nstreams < 1``."""
    if nstreams < 1:
        raise ValueError(f"streams must be >= 1, got {nstreams}")
    nodes = list(graph.nodes)
    n = len(nodes)
    if nstreams == 1 or n == 0:
        return {x.name: 0 for x in nodes}
    cost = node_costs(graph, seconds)
    preds, succs = _deps(graph)
    pinned = _critical_path(cost, preds, succs) | {i for i, x in enumerate(nodes) if is_random(x)}
    stream, finish = [0] * n, [0.0] * n
    avail = [0.0] * nstreams
    later_cp = _later_pinned_cost(cost, succs, sorted(pinned))
    for i in range(n):
        home = max(preds[i], key=lambda p: finish[p], default=None)
        best = None
        for s in ([0] if i in pinned else range(nstreams)):
            ready = max((finish[p] + (_EVENT_S if stream[p] != s else 0.0) for p in preds[i]),
                        default=0.0)
            # stream 0 also owes the critical-path nodes later in the order that may run
            # alongside this one (neither its ancestors nor its descendants)
            busy = avail[s] + (later_cp[i] if s == 0 and i not in pinned else 0.0)
            end = max(ready, busy) + cost[i]
            key = (end, home is None or stream[home] != s, s)
            if best is None or key < best[0]:
                best = (key, s)
        s = best[1]
        stream[i], finish[i] = s, best[0][0]
        avail[s] = finish[i]
    return {x.name: stream[i] for i, x in enumerate(nodes)}


def node_costs(graph: Graph, seconds: Optional[Mapping[str, float]] = None) -> List[float]:
    """Per node of ``graph`` in order: its time in seconds, from ``seconds`` (node name
    -> s) where given, else `node_seconds` (the cost model)."""
    seconds = seconds or {}
    return [seconds[x.name] if x.name in seconds else node_seconds(x) for x in graph.nodes]


def _deps(graph: Graph) -> Tuple[List[List[int]], List[List[int]]]:
    """(predecessors, successors) of each step by `ordering_deps`."""
    n = len(graph.nodes)
    preds: List[List[int]] = [[] for _ in range(n)]
    succs: List[List[int]] = [[] for _ in range(n)]
    for p, c in ordering_deps(graph):
        preds[c].append(p)
        succs[p].append(c)
    return preds, succs


def predict_streams(graph: Graph, streams: Sequence[int], cost: Sequence[float]
                    ) -> Tuple[List[float], float]:
    """(busy seconds per stream, predicted call seconds) of ``graph`` run with node i on
    ``streams[i]`` and taking ``cost[i]`` seconds: each stream runs its nodes in graph
    order, a node starts when its stream is free and its producers have finished (one
    event, `_EVENT_S`, later for a producer on another stream). The predicted call time
    is the schedule's critical path: the longest chain of node times, stream order and
    waits (a lower bound when streams really overlap; ``sum(busy)`` is one stream's)."""
    preds, _ = _deps(graph)
    k = max(streams, default=0) + 1
    busy, avail = [0.0] * k, [0.0] * k
    finish = [0.0] * len(cost)
    for i, s in enumerate(streams):
        ready = max((finish[p] + (_EVENT_S if streams[p] != s else 0.0) for p in preds[i]),
                    default=0.0)
        finish[i] = avail[s] = max(ready, avail[s]) + cost[i]
        busy[s] += cost[i]
    return busy, max(finish, default=0.0)


def _later_pinned_cost(cost: List[float], succs, pinned: List[int]) -> List[float]:
    """Per step i: the cost of the pinned steps after i that do not depend on i
    (descendant sets as int bitsets)."""
    n = len(cost)
    desc = [0] * n
    for i in range(n - 1, -1, -1):
        for c in succs[i]:
            desc[i] |= (1 << c) | desc[c]
    return [sum(cost[j] for j in pinned if j > i and not desc[i] >> j & 1) for i in range(n)]


def _critical_path(cost: List[float], preds, succs) -> set:
    """Steps of the longest path by ``cost`` (bottom levels, CPOP's critical path)."""
    n = len(cost)
    bottom = [0.0] * n
    for i in range(n - 1, -1, -1):
        bottom[i] = cost[i] + max((bottom[c] for c in succs[i]), default=0.0)
    sources = [i for i in range(n) if not preds[i]]
    if not sources:
        return set()
    cur = max(sources, key=lambda i: (bottom[i], -i))
    path = {cur}
    while succs[cur]:
        cur = max(succs[cur], key=lambda i: (bottom[i], -i))
        path.add(cur)
    return path


def stream_summary(graph: Graph, schedule: Schedule,
                   seconds: Optional[Mapping[str, float]] = None) -> Dict[str, object]:
    """The compile report's ``streams`` entry: number of streams, events (kept, and the
    cross-stream dependences they cover), nodes per stream, ``costs`` ("measured" when
    ``seconds``, node name -> s, is given, else "model": `node_seconds`), and from those
    times (`predict_streams`, µs): ``estimated_serial_us`` (one stream),
    ``predicted_busy_us`` per stream and ``predicted_call_us`` (the critical path with
    stream order and events)."""
    per: Dict[int, int] = {}
    for name in schedule.order:
        s = schedule.streams.get(name, 0)
        per[s] = per.get(s, 0) + 1
    cross = sum(1 for p, c in ordering_deps(graph)
                if graph.nodes[p].stream != graph.nodes[c].stream)
    cost = node_costs(graph, seconds)
    busy, call = predict_streams(graph, [x.stream for x in graph.nodes], cost)
    return {"streams": max(per, default=0) + 1, "events": len(schedule.events),
            "cross_stream_dependences": cross,
            "nodes_per_stream": [per.get(s, 0) for s in range(max(per, default=0) + 1)],
            "costs": "measured" if seconds else "model",
            "estimated_serial_us": round(1e6 * sum(cost), 1),
            "predicted_busy_us": [round(1e6 * b, 1) for b in busy],
            "predicted_call_us": round(1e6 * call, 1)}


def multi_stream_schedule(graph: Graph, nstreams: int,
                          seconds: Optional[Mapping[str, float]] = None) -> Schedule:
    """The `Schedule` of ``graph`` in its current order with `assign_streams` (node
    times ``seconds`` where given, else the cost model) and the events of
    `HappensBefore` (cross-stream dependences, redundant waits removed); sets every
    ``node.stream``."""
    streams = assign_streams(graph, nstreams, seconds)
    for x in graph.nodes:
        x.stream = streams[x.name]
    hb = graph_happens_before(graph)
    names = [x.name for x in graph.nodes]
    return Schedule(names, streams, [(names[p], names[c]) for p, c in hb.events])
