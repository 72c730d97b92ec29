"""Specialise a graph with symbolic dims to one concrete shape.

`specialise` copies the (optimised) graph with every symbolic dim bound: tensor
descriptions (``shape``, ``origin_shape``), size arguments (`SymExpr` attrs such as
``view``'s ``[s0*s1, 384]``) and the strides ATen gave each value
(``node.meta["strides"]``). Node and value names and ids are kept, so a memory plan
and a compile report read the same as the symbolic graph's. Constants share their
tensors (weights are never copied); nothing is re-captured or re-optimised. The copy's
``meta["specialised"]`` is True (code generation then binds ints as globals, so every
shape's source is the same text and compiles once).
"""
from __future__ import annotations

import itertools
from typing import Dict

from .graph import Graph, Node, Value
from .symbolic import Bindings, SymExpr, bind, bind_tree
from .types import TensorDesc


def _desc(d: TensorDesc, values: Bindings, memo: Dict[str, int],
          descs: Dict[TensorDesc, TensorDesc]) -> TensorDesc:
    """``d`` bound; ``descs`` memoises whole descs (many values share one: BERT-base's
    595 values have about 40 distinct descs)."""
    out = descs.get(d)
    if out is None:
        if d.is_static and all(isinstance(s, int) for s in d.origin_shape):
            out = d
        else:
            out = d.with_(shape=tuple(bind(s, values, memo) for s in d.shape),
                          origin_shape=tuple(bind(s, values, memo) for s in d.origin_shape))
        descs[d] = out
    return out


def _node_meta(node: Node, values: Bindings, memo: Dict[str, int]) -> dict:
    meta = dict(node.meta)
    st = meta.get("strides")
    if st:
        meta["strides"] = [tuple(bind(s, values, memo) for s in t) if t is not None else None
                           for t in st]
    return meta


_NESTED = (list, tuple, dict, SymExpr)


def _attrs(attrs: dict, values: Bindings, memo: Dict[str, int]) -> dict:
    """A copy of a node's ``attrs`` with every `SymExpr` bound (`bind_tree`), walking
    only the entries that can hold one (scalars and tensor refs are kept as they are)."""
    out = dict(attrs)
    for k, v in attrs.items():
        if isinstance(v, _NESTED):
            out[k] = bind_tree(v, values, memo)
    return out


def specialise(graph: Graph, values: Bindings) -> Graph:
    """A copy of ``graph`` with its symbols bound to ``values`` (symbol -> int): every
    desc, size argument and recorded stride concrete. ``graph`` is left as it is.
    Raises KeyError naming a symbol without a value, ValueError for a dim that is not
    an integer at these values."""
    memo: Dict[str, int] = {}
    descs: Dict[TensorDesc, TensorDesc] = {}
    g = Graph(graph.name)
    g.meta = dict(graph.meta, specialised=True)
    g.signature = graph.signature
    vmap: Dict[int, Value] = {}

    def value(v: Value, producer=None) -> Value:
        nv = Value(v.id, _desc(v.desc, values, memo, descs), producer=producer, const=v.const,
                   name=v.name)
        vmap[v.id] = nv
        return nv

    g.inputs = [value(v) for v in graph.inputs]
    g.constants = [value(v) for v in graph.constants]
    for n in graph.nodes:
        m = Node(n.op, [vmap[v.id] for v in n.inputs], _attrs(n.attrs, values, memo),
                 n.name, n.source, n.scope)
        m.device, m.stream = n.device, n.stream
        m.meta = _node_meta(n, values, memo)
        m.outputs = [value(o, producer=m) for o in n.outputs]
        g.add_node(m)
    g.outputs = [vmap[v.id] for v in graph.outputs]
    g._names = dict(graph._names)
    top = max((v.id for v in vmap.values()), default=-1)
    g._ids = itertools.count(top + 1)
    return g
