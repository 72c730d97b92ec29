"""Per-stage graph dumps (``opencann atc --dump_graph DIR``, like GE's per-stage dumps):
the graph as Graphviz DOT and as JSON (values with dtype/shape/format, nodes with op,
inputs, outputs and attributes as text)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, List

from .dot import to_dot
from .graph import Graph


def to_json(graph: Graph) -> Dict[str, Any]:
    """A readable JSON form of ``graph`` (not a model file: attributes are their repr)."""
    def val(v) -> Dict[str, Any]:
        d = v.desc
        return {"id": v.id, "name": str(v), "dtype": str(d.dtype.value), "shape": list(d.shape),
                "format": str(d.format.value)}
    return {"name": graph.name, "inputs": [val(v) for v in graph.inputs],
            "constants": [val(v) for v in graph.constants],
            "nodes": [{"name": n.name, "op": n.op, "inputs": [v.id for v in n.inputs],
                       "outputs": [val(v) for v in n.outputs],
                       "attrs": {k: repr(a) for k, a in n.attrs.items()}} for n in graph.nodes],
            "outputs": [v.id for v in graph.outputs]}


def write_stage(directory: str, index: int, stage: str, graph: Graph) -> List[str]:
    """Write ``graph`` to ``directory/<index>_<stage>.dot`` and ``.json``; returns both paths.
    Raises OSError when the directory cannot be created or written."""
    os.makedirs(directory, exist_ok=True)
    base = os.path.join(directory, f"{index:02d}_{stage}")
    with open(base + ".dot", "w", encoding="utf-8") as f:
        f.write(to_dot(graph))
    with open(base + ".json", "w", encoding="utf-8") as f:
        json.dump(to_json(graph), f, indent=1)
    return [base + ".dot", base + ".json"]
