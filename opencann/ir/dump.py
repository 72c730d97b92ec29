"""Per-stage graph dumps (``opencann atc --dump_graph DIR``, like GE's per-stage dumps):
the graph as Graphviz DOT and as JSON (values with dtype/shape/format, nodes with op,
inputs, outputs and attributes as text); and `to_text`, a stable printed form for
golden tests (values renumbered in order of appearance, as TVM's and MLIR's printers)."""
from __future__ import annotations

import json
import os
from typing import Any, Dict, Iterable, List, Union

from .dot import to_dot
from .graph import Graph, TensorListRef, TensorRef


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


def to_text(graph: Graph, attrs: Union[bool, Iterable[str]] = True) -> str:
    """``graph`` as stable text: inputs keep their names, constants print as ``%c0,
    %c1...`` and node outputs as ``%0, %1...`` in order of appearance, so the text does
    not depend on value ids or on how many values passes made and dropped. Each node is
    ``%out: dtype[shape] = Op(%in, ...; attr=value, ...)`` (``@format`` when not ND); ``attrs``: True (every non-tensor attribute, sorted), False (none) or the names
    to show. One line per input/constant/node, then ``return``."""
    names: Dict[int, str] = {}
    for v in graph.inputs:
        names[id(v)] = f"%{v.name or len(names)}"
    for i, c in enumerate(graph.constants):
        names[id(c)] = f"%c{i}"
    outs = [o for n in graph.nodes for o in n.outputs]
    for i, o in enumerate(outs):
        names[id(o)] = f"%{i}"

    def nm(v) -> str:
        return names.get(id(v), f"%?{v.id}")

    lines = [f"graph({', '.join(f'{nm(v)}: {_desc(v.desc)}' for v in graph.inputs)}):"]
    lines += [f"  {nm(c)}: {_desc(c.desc)} = const" for c in graph.constants]
    for n in graph.nodes:
        plain = sorted((k, a) for k, a in n.attrs.items()
                       if not isinstance(a, (TensorRef, TensorListRef))
                       and (attrs is True or (attrs is not False and k in attrs)))
        tail = "; " + ", ".join(f"{k}={a!r}" for k, a in plain) if plain else ""
        res = ", ".join(f"{nm(o)}: {_desc(o.desc)}" for o in n.outputs)
        lines.append(f"  {res} = {n.op}({', '.join(nm(v) for v in n.inputs)}{tail})")
    lines.append("  return " + ", ".join(nm(v) for v in graph.outputs))
    return "\n".join(lines)


def _desc(d) -> str:
    return str(d)   # dtype[shape], with @format when not ND


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
