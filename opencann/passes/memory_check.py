"""The memory plan's verifier: no two values that may be live at once share arena bytes.

Checked from the graph and the plan alone, independently of how the planner decided:
each value's storage roots come from the ops' aliasing (`storage_roots`), each root's
buffer from the plan (``value_buffer``: in-place results share their input's buffer),
and a buffer's *users* are the nodes producing or reading any value in it. Two buffers
whose byte ranges meet are correct only when every user of one is known finished
before any user of the other starts: in the node order on one stream, in the
happens-before order of streams and events (`graph_happens_before`) on several. Run by
the memory stage with the option ``verify`` and by the tests on every plan.
"""
from __future__ import annotations

from typing import Dict, Set

from ..ir import Graph, MemoryPlan
from ..ops import graph_happens_before, output_aliases, storage_roots


def buffer_users(graph: Graph, plan: MemoryPlan) -> Dict[int, Set[int]]:
    """Buffer root id -> steps (indices in ``graph.nodes``) of the nodes that produce or
    read a value whose storage may be in that buffer."""
    sroots = storage_roots(graph)
    users: Dict[int, Set[int]] = {r: set() for r in plan.buffers}
    for i, node in enumerate(graph.nodes):
        for v in (*node.inputs, *node.outputs):
            for r in sroots.get(v.id, (v.id,)):
                b = plan.value_buffer.get(r)
                if b in users:
                    users[b].add(i)
    return users


def check_plan(graph: Graph, plan: MemoryPlan) -> int:
    """Check ``plan`` against ``graph`` as scheduled (node order, ``node.stream``):
    every buffer lies within the arena and holds its values, a node writing in place
    into a buffer starts after its earlier users finished, and any two buffers whose
    byte ranges overlap are used one entirely before the other (every user of one
    happens-before every user of the other). Returns the number of overlapping pairs
    checked. Raises ValueError naming the first two buffers (values, nodes, bytes) that
    may be live at the same time in the same bytes."""
    hb = graph_happens_before(graph)
    users = buffer_users(graph, plan)
    # values with storage of their own; a view (expand, slice) may span more or fewer
    # bytes than its shape says and lies within its base's buffer, checked with the base
    values = {v.id: v for n in graph.nodes
              for v, al in zip(n.outputs, output_aliases(n)) if not al}
    for vid, r in plan.value_buffer.items():
        b = plan.buffers[r]
        if vid in values and values[vid].desc.nbytes > b.size:
            raise ValueError(f"memory plan: %{vid} ({values[vid].desc.nbytes} B) does not fit "
                             f"its buffer %{r} ({b.size} B)")
    bufs = sorted(plan.buffers.values(), key=lambda b: b.offset)
    for b in bufs:
        if b.offset < 0 or b.offset + b.size > plan.arena_bytes:
            raise ValueError(f"memory plan: buffer %{b.root} [{b.offset}, {b.offset + b.size}) "
                             f"lies outside the arena of {plan.arena_bytes} B")
    _check_overwrites(graph, plan, hb, users)
    checked = 0
    for k, a in enumerate(bufs):
        for b in bufs[k + 1:]:
            if b.offset >= a.offset + a.size:
                break  # sorted by offset: no later buffer meets a either
            checked += 1
            ua, ub = users[a.root], users[b.root]
            if not ua or not ub:
                continue
            if all(hb.all_before(ua, y) for y in ub) or all(hb.all_before(ub, y) for y in ua):
                continue
            na, nb = graph.nodes[min(ua)], graph.nodes[min(ub)]
            raise ValueError(
                f"memory plan: buffers %{a.root} (made by {na.name}, bytes [{a.offset}, "
                f"{a.offset + a.size})) and %{b.root} (made by {nb.name}, bytes [{b.offset}, "
                f"{b.offset + b.size})) overlap but may be live at the same time "
                f"(streams {sorted({graph.nodes[i].stream for i in ua})} and "
                f"{sorted({graph.nodes[i].stream for i in ub})}); the planner must keep them apart")
    return checked


def _check_overwrites(graph: Graph, plan: MemoryPlan, hb, users: Dict[int, Set[int]]) -> None:
    """A node writing a fresh result into a buffer that already holds a value (in place)
    must start after every earlier user of that buffer is known finished. Raises
    ValueError naming the writer and the user it may overwrite under."""
    for i, node in enumerate(graph.nodes):
        for o, al in zip(node.outputs, output_aliases(node)):
            r = plan.value_buffer.get(o.id)
            if al or r is None or r == o.id:
                continue
            early = [u for u in users[r] if u < i and not hb.before(u, i)]
            if early:
                u = graph.nodes[early[0]]
                raise ValueError(f"memory plan: {node.name} (stream {node.stream}) writes in place "
                                 f"into buffer %{r} while {u.name} (stream {u.stream}) may still "
                                 "use it; the planner must not reuse it in place there")
