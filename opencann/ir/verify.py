"""Graph verifier: structural invariants every pass must preserve."""
from __future__ import annotations

from .graph import Graph, TensorListRef, TensorRef


class GraphError(ValueError):
    """A graph broke an IR invariant; the message names the node and its location."""


def verify(graph: Graph) -> None:
    """Check SSA form, topological order, attr references and that every value's
    ``users`` is exactly the set of live nodes reading it.

    Raises `GraphError` naming the offending node (with source location)."""
    defined = {id(v) for v in graph.inputs} | {id(v) for v in graph.constants}
    for node in graph.nodes:
        for i, v in enumerate(node.inputs):
            if id(v) not in defined:
                raise GraphError(f"{node.name} at {node.where()}: input {i} ({v}) is used "
                                 "before it is defined (not in topological order)")
            if node not in v.users:
                raise GraphError(f"{node.name}: {v} does not list it as a user")
        for a in node.attrs.values():
            if isinstance(a, TensorRef) and a.index >= len(node.inputs):
                raise GraphError(f"{node.name}: attr refers to missing input {a.index}")
            if isinstance(a, TensorListRef) and a.start + a.length > len(node.inputs):
                raise GraphError(f"{node.name}: tensor list ref out of range")
        for o in node.outputs:
            if id(o) in defined:
                raise GraphError(f"{node.name}: output {o} defined twice")
            if o.producer is not node:
                raise GraphError(f"{node.name}: output {o} has another producer")
            defined.add(id(o))
    _check_users(graph)
    for o in graph.outputs:
        if id(o) not in defined:
            raise GraphError(f"graph output {o} is not defined")


def _check_users(graph: Graph) -> None:
    """Every value's ``users`` holds only live nodes of this graph that read it."""
    for v in graph.values():
        for u in v.users:
            if u.erased or u not in graph.nodes:
                raise GraphError(f"{v} lists {u.name} as user, but that node is not in the graph")
            if not any(x is v for x in u.inputs):
                raise GraphError(f"{v} lists {u.name} as user but is not its input")
