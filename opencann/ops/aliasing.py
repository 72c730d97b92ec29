"""Storage aliasing over a graph: which values may share memory.

Built from each node's `output_aliases` (its OpDef's ``aliases``, taken from the ATen
schema's alias annotations or declared; unknown means "may alias"). A value's *storage
roots* are the values that own the memory it may live in: a graph input, a constant, or
the output of a kernel that returns fresh memory. A view (of a view, of a split
output...) has the roots of what it views. The memory planner, the in-place fusions and
the runtime read this one analysis.
"""
from __future__ import annotations

from typing import Dict, FrozenSet, Iterable, List, Tuple

from ..ir import Graph, Node, Value
from ..ir.liveness import HappensBefore
from .opdef import inplace_inputs, output_aliases, reads_layout, written_inputs


def storage_roots(graph: Graph, writes_as_fresh: bool = False) -> Dict[int, FrozenSet[int]]:
    """Value id -> ids of the values owning the storage it may share (itself for a graph
    input, a constant or a fresh kernel output). Nodes must be in a valid order.

    ``writes_as_fresh=True`` counts an output a node writes into its input in place
    (`inplace_inputs`: a fusion's ``inplace_input``, an op's ``inplace_of``) as a new
    root: the roots then tell apart the memory's contents before and after that write,
    so the readers of the old contents can be found."""
    roots: Dict[int, FrozenSet[int]] = {}
    for v in list(graph.inputs) + list(graph.constants):
        roots[v.id] = frozenset((v.id,))
    for node in graph.nodes:
        fresh = inplace_inputs(node) if writes_as_fresh else {}
        for k, (o, idx) in enumerate(zip(node.outputs, output_aliases(node))):
            if idx and k not in fresh:
                roots[o.id] = frozenset().union(
                    *(roots.get(node.inputs[i].id, frozenset((node.inputs[i].id,))) for i in idx))
            else:
                roots[o.id] = frozenset((o.id,))
    return roots


def aliases_of(graph: Graph, v: Value, roots: Dict[int, FrozenSet[int]] = None) -> List[Value]:
    """Every value other than ``v`` that may share storage with ``v`` (its views, views of
    those, split outputs, what ``v`` itself views, in-place results): the values whose
    reads must count as reads of ``v``'s memory."""
    roots = roots if roots is not None else storage_roots(graph)
    mine = roots.get(v.id, frozenset((v.id,)))
    return [u for u in _values(graph) if u is not v and roots.get(u.id, frozenset()) & mine]


def _values(graph: Graph) -> Iterable[Value]:
    yield from graph.inputs
    yield from graph.constants
    for n in graph.nodes:
        yield from n.outputs


def last_reads(graph: Graph, roots: Dict[int, FrozenSet[int]],
               step: Dict[Node, int]) -> Dict[int, int]:
    """Storage root id -> the last step at which its memory is read through any value
    that may alias it; a root behind a graph output counts as read after the last node
    (``len(graph.nodes)``)."""
    last: Dict[int, int] = {}
    for node in graph.nodes:
        for x in node.inputs:
            for r in roots.get(x.id, (x.id,)):
                last[r] = max(last.get(r, -1), step[node])
    for v in graph.outputs:
        for r in roots.get(v.id, (v.id,)):
            last[r] = len(graph.nodes)
    return last


def ordering_deps(graph: Graph) -> List[Tuple[int, int]]:
    """(earlier step, later step) pairs the node order must keep when nodes run on
    several streams (steps: indices in ``graph.nodes``, a valid order): every data edge
    (producer -> consumer) and, for a node that writes into an input in place
    (`written_inputs`), every other reader of that memory's old contents (through any
    alias) -> the writer (write after read). Sorted, without duplicates."""
    step = {n: i for i, n in enumerate(graph.nodes)}
    deps = set()
    for node in graph.nodes:
        for x in node.inputs:
            if x.producer is not None and x.producer in step:
                deps.add((step[x.producer], step[node]))
    writers = [n for n in graph.nodes if written_inputs(n)]
    if writers:
        before = storage_roots(graph, writes_as_fresh=True)
        for w in writers:
            mine = frozenset().union(*(before.get(w.inputs[j].id, frozenset())
                                       for j in written_inputs(w)))
            for r in graph.nodes:
                if step[r] < step[w] and any(before.get(x.id, frozenset()) & mine
                                             for x in r.inputs):
                    deps.add((step[r], step[w]))
    return sorted(deps)


def graph_happens_before(graph: Graph) -> HappensBefore:
    """The happens-before order of ``graph``'s nodes as scheduled: their order, their
    ``stream`` and `ordering_deps` (`opencann.ir.liveness.HappensBefore`)."""
    return HappensBefore([n.stream for n in graph.nodes], ordering_deps(graph))


def layout_read_inputs(graph: Graph, absolute_offset: bool = False) -> FrozenSet[int]:
    """Indices of ``graph``'s inputs whose memory layout some node's results depend on:
    a node that `reads_layout` (``as_strided``) reading the input or a value that may
    share its storage (a view of it). Such an input must reach the graph with the
    example's strides: a contiguous copy would be read at other places than eager reads.
    ``absolute_offset``: only those read by a node with an explicit ``storage_offset``
    (absolute in the storage, traced from the example's offset; any ``as_strided*``
    host fallback counts), whose input must also start at the example's offset."""
    roots = storage_roots(graph)
    index = {v.id: i for i, v in enumerate(graph.inputs)}
    out = set()
    for node in graph.nodes:
        if reads_layout(node) and not (absolute_offset and node.op == "AsStrided"
                                       and node.attrs.get("storage_offset") is None):
            for v in node.inputs:
                out |= {index[r] for r in roots.get(v.id, ()) if r in index}
    return frozenset(out)
