"""DOT export (Graphviz) of a graph, for `dot -Tsvg`."""
from __future__ import annotations

from .graph import Graph


def to_dot(graph: Graph) -> str:
    """Return the graph as Graphviz DOT text: ops as boxes, edges labelled with
    the tensor description (dtype, shape, format)."""
    lines = [f'digraph "{graph.name}" {{', "  rankdir=TB; node [fontname=Helvetica];"]
    for v in graph.inputs:
        lines.append(f'  v{v.id} [shape=oval, label="{v} {v.desc}"];')
    for n in graph.nodes:
        lines.append(f'  n_{n.name} [shape=box, label="{n.op}\\n{n.name}"];')
    src = {}
    for v in graph.inputs:
        src[v.id] = f"v{v.id}"
    for n in graph.nodes:
        for o in n.outputs:
            src[o.id] = f"n_{n.name}"
    for n in graph.nodes:
        for v in n.inputs:
            if v.is_const:
                continue
            lines.append(f'  {src[v.id]} -> n_{n.name} [label="{v.desc}", fontsize=9];')
    lines.append('  out [shape=oval, label="outputs"];')
    for v in graph.outputs:
        if v.id in src:
            lines.append(f"  {src[v.id]} -> out;")
    lines.append("}")
    return "\n".join(lines)
