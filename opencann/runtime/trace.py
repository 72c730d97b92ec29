"""Per-op profiling as a Chrome trace (Trace Event Format, viewable in chrome://tracing
or ui.perfetto.dev).

The profiling variant of the generated code calls ``_rec(i)`` after node i; `Stamps`
records (node index, `time.perf_counter_ns()`) there, and `chrome_trace_events` turns the
stamps into one complete ("X") event per node: its time runs from the previous stamp (or
the start of the run) to its own, in microseconds. On several streams each stream is a
track (``tid``) whose stamps count from the stream's own previous stamp (a marker after
each wait), and `stream_trace_events` adds flow arrows ("s"/"f") for the events.
"""
from __future__ import annotations

import json
import time
from typing import Any, Dict, List, Optional

from ..ir import Graph
from ..ops import graph_happens_before


class Stamps(list):
    """(node index, ns since an arbitrary epoch) pairs; calling it with a node index
    appends the current `time.perf_counter_ns()`."""

    def __call__(self, i: int) -> None:
        self.append((i, time.perf_counter_ns()))


def chrome_trace_events(graph: Graph, stamps: List[tuple], t0: int) -> List[Dict[str, Any]]:
    """One Trace Event Format "X" event per stamp: ``name`` the op, ``cat`` the node's
    scope (or "graph"), ``ts``/``dur`` in µs from ``t0`` (ns, `time.perf_counter_ns`),
    ``tid`` its stream, ``args`` its node name and source location."""
    events, prev = [], {}
    for i, t in stamps:
        if i < 0:  # stream ~i starts or resumes after a wait (several streams)
            prev[~i] = t
            continue
        n = graph.nodes[i]
        p = prev.get(n.stream, t0)
        events.append({"name": n.op, "cat": n.scope or "graph", "ph": "X",
                       "ts": (p - t0) / 1e3, "dur": (t - p) / 1e3, "pid": 0,
                       "tid": n.stream, "args": {"node": n.name, "source": n.source,
                                                  **({"tiles": n.meta["tiles"]} if "tiles" in n.meta else {})}})
        prev[n.stream] = t
    return events


def stream_trace_events(graph: Graph, events: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """For a graph on several streams: a ``thread_name`` metadata event per stream
    ("stream k", one track per tid) and, for each event of the schedule
    (`graph_happens_before`), a flow arrow from the end of its producer's "X" event
    ("s") to the start of its consumer's ("f", ``bp: "e"``), ``id`` the event's index."""
    out: List[Dict[str, Any]] = [
        {"name": "thread_name", "ph": "M", "pid": 0, "tid": k, "args": {"name": f"stream {k}"}}
        for k in sorted({n.stream for n in graph.nodes})]
    x = {e["args"]["node"]: e for e in events if e.get("ph") == "X"}
    for k, (p, c) in enumerate(graph_happens_before(graph).events):
        a, b = x.get(graph.nodes[p].name), x.get(graph.nodes[c].name)
        if a is None or b is None:
            continue
        out.append({"name": "event", "cat": "stream", "ph": "s", "id": k, "pid": 0,
                    "tid": a["tid"], "ts": a["ts"] + a["dur"]})
        out.append({"name": "event", "cat": "stream", "ph": "f", "bp": "e", "id": k, "pid": 0,
                    "tid": b["tid"], "ts": b["ts"]})
    return out


def write_chrome_trace(events: List[Dict[str, Any]], path: Optional[str]) -> None:
    """Write ``events`` to ``path`` as Trace Event Format JSON (display unit ms); no-op
    when ``path`` is empty. Raises OSError when the file cannot be written."""
    if path:
        with open(path, "w") as f:
            json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
