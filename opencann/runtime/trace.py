"""Per-op profiling as a Chrome trace (Trace Event Format, viewable in chrome://tracing
or ui.perfetto.dev).

The profiling variant of the generated code calls ``_rec(i)`` after node i; `Stamps`
records (node index, `time.perf_counter_ns()`) there, and `chrome_trace_events` turns the
stamps into one complete ("X") event per node: its time runs from the previous stamp (or
the start of the run) to its own, in microseconds.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

from ..ir import Graph


class Stamps(list):
    """(node index, ns since an arbitrary epoch) pairs; calling it with a node index
    appends the current `time.perf_counter_ns()`."""

    def __call__(self, i: int) -> None:
        self.append((i, time.perf_counter_ns()))


def chrome_trace_events(graph: Graph, stamps: List[tuple], t0: int) -> List[Dict[str, Any]]:
    """One Trace Event Format "X" event per stamp: ``name`` the op, ``cat`` the node's
    scope (or "graph"), ``ts``/``dur`` in µs from ``t0`` (ns, `time.perf_counter_ns`),
    ``tid`` its stream, ``args`` its node name and source location."""
    events, prev = [], t0
    for i, t in stamps:
        n = graph.nodes[i]
        events.append({"name": n.op, "cat": n.scope or "graph", "ph": "X",
                       "ts": (prev - t0) / 1e3, "dur": (t - prev) / 1e3, "pid": 0,
                       "tid": n.stream, "args": {"node": n.name, "source": n.source}})
        prev = t
    return events


def write_chrome_trace(events: List[Dict[str, Any]], path: Optional[str]) -> None:
    """Write ``events`` to ``path`` as Trace Event Format JSON (display unit ms); no-op
    when ``path`` is empty. Raises OSError when the file cannot be written."""
    if path:
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
