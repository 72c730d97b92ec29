"""Can a dynamic dim be padded? Follow it through a symbolic graph, op by op.

ATC serves a call whose batch is between two gears with the larger gear, padding the
batch and dropping the padded rows of the outputs (CANN ATC documentation,
"--dynamic_batch_size"). That is only correct when no op lets a padded row reach a real
one. `follow_padded_dim` proves it for one dim of a graph with symbolic shapes
(`opencann.engine.dynamic`): starting at the graph inputs whose dim is the symbol, it asks each
node's `OpDef.per_index` rule (``opencann.ops.per_index``) where the padded dim goes,
and stops at the first node that mixes entries along it (a reduction over the batch,
attention over padded keys, BatchNorm with batch statistics), at an op without a rule
(unknown: host fallbacks, custom ops), at a random op (the draws depend on the padded
shape) and at a node that takes the dim's size as a value (``x / x.shape[0]``). Every
graph output that depends on padded data must carry it on a known axis, which the
caller slices back.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, Optional

import sympy

from ..ir import Graph, Node, TensorListRef, TensorRef
from ..ir.symbolic import SymExpr, as_expr, parse, symbols_of
from ..ops import OpKind, get_op, is_random
from ..ops.per_index import Axis, outer_of


@dataclass
class PaddingCheck:
    """The answer for one dim: ``safe``; ``outputs`` (graph output index -> the axis
    carrying the dim, for the outputs to slice back); else ``blocked_by`` (``node``,
    ``op``, ``source`` (file:line), ``where`` and ``reason``)."""

    symbol: str
    safe: bool
    outputs: Dict[int, int] = field(default_factory=dict)
    blocked_by: Optional[Dict[str, str]] = None

    def why(self) -> str:
        """One line: why padding does not apply (empty when it does)."""
        b = self.blocked_by
        if b is None:
            return ""
        if b["node"] == "-":
            return f"{b['where']}: {b['reason']}"
        return f"{b['node']} ({b['op']}) at {b['where']}: {b['reason']}"


def _carries(shape, sym: str) -> bool:
    return any(sym in symbols_of(d) for d in shape)


def _stray(shape, a: int, sym: str) -> str:
    """Why axis ``a`` of ``shape`` cannot stand for the padded dim: the dim's size
    also sizes another axis (``x.expand(-1, x.shape[0])``: that axis grows with the
    padding too), or axis ``a``'s size is not a whole multiple of it (``s - 1``,
    ``Min(s, 6)``: its padded entries are not the trailing block). Empty when it can."""
    other = [k for k, d in enumerate(shape) if k != a and sym in symbols_of(d)]
    if other:
        return (f"the padded dim's size also sizes axis {other[0]} of {list(shape)}, "
                "which padding would grow too")
    s = parse(sym)
    q = sympy.cancel(as_expr(shape[a]) / s)
    if s in q.free_symbols or sympy.fraction(q)[1] != 1:
        return (f"axis {a} of {list(shape)} is not a whole multiple of the padded dim, so "
                "its padded entries cannot be sliced off")
    return ""


# the attributes of a view or creation op that only size its output (a size there that
# depends on the padded dim shows in the output's shape, checked by `_stray`); any other
# attribute is a value or picks data at a position (``select``'s ``index``, ``slice``'s
# ``start``, ``full_like``'s ``fill_value``)
_SIZE_ATTRS = frozenset({"size", "shape", "end", "split_size", "split_sizes"})


def _attr_uses(node: Node, sym: str) -> set:
    """The names of ``node``'s non-tensor arguments that depend on ``sym`` (a size or
    a scalar)."""
    used = set()
    for name, val in node.attrs.items():
        if isinstance(val, (TensorRef, TensorListRef)):
            continue
        stack = [val]
        while stack:
            v = stack.pop()
            if isinstance(v, (list, tuple)):
                stack.extend(v)
            elif isinstance(v, dict):
                stack.extend(v.values())
            elif isinstance(v, SymExpr) and sym in symbols_of(v):
                used.add(name)
                break
    return used


def _blocked(sym: str, node: Optional[Node], reason: str) -> PaddingCheck:
    where = node.where() if node is not None else "the graph"
    return PaddingCheck(sym, False, blocked_by={
        "node": node.name if node is not None else "-", "op": node.op if node is not None else "-",
        "source": (node.source or "") if node is not None else "", "where": where,
        "reason": reason})


def _node_rule(n: Node, ins: Dict[int, int], sym: str, sized: set):
    """Node ``n``'s `OpDef.per_index` result for inputs ``ins`` (input index -> padded
    axis), or the reason padding could change its results: random draws, the dim's size
    taken as a value or position (``sized``: the attrs that use it), no rule known."""
    op = get_op(n.op)
    if is_random(n):
        return "draws random numbers, and the draws depend on the padded shape"
    sized = sized - set(getattr(op.per_index, "shape_attrs", ()))   # the node's own domain
    if sized and op.kind not in (OpKind.VIEW, OpKind.CREATION):
        return "takes the padded dim's size as a value"
    if sized - _SIZE_ATTRS:
        return (f"takes the padded dim's size as a value or position "
                f"({', '.join(sorted(sized - _SIZE_ATTRS))}): padding moves it")
    if op.per_index is None:
        return (f"{n.op} states no per-index independence (OpDef.per_index "
                "unknown: a host fallback or custom op)")
    return op.per_index(n, ins, sym)


def follow_padded_dim(graph: Graph, sym: str) -> PaddingCheck:
    """Whether padding the dim ``sym`` (a symbol of ``graph``'s input shapes) can change
    any real entry of ``graph``'s outputs; see the module docstring. Reads ``graph``
    only."""
    axes: Dict[int, int] = {}
    for v in graph.inputs:
        where = [k for k, d in enumerate(v.desc.shape) if d == sym]
        if len(where) > 1:
            return _blocked(sym, None, f"input {v.name} has the dim at {len(where)} positions")
        if where:
            axes[v.id] = Axis(where[0])
    for n in graph.nodes:
        ins = {i: axes[v.id] for i, v in enumerate(n.inputs) if v.id in axes}
        sized = _attr_uses(n, sym)
        if not ins and not sized:
            continue
        op = get_op(n.op)
        res = _node_rule(n, ins, sym, sized)
        if isinstance(res, str):
            return _blocked(sym, n, res)
        outers = {outer_of(a) for a in ins.values()}
        if len(outers) > 1:
            return _blocked(sym, n, "its inputs carry the padded dim merged with different dims")
        outer = outers.pop() if outers else 1
        # a view keeps the values: arange(sym) stays "index i holds i" through it
        iota = op.kind == OpKind.VIEW and bool(ins) and all(
            getattr(a, "iota", False) for a in ins.values())
        for k, o in enumerate(n.outputs):
            a = res.get(k)
            if a is None and _carries(o.desc.shape, sym):
                return _blocked(sym, n, f"output {k} carries the padded dim where it cannot be followed")
            if a is not None:
                if not (0 <= a < len(o.desc.shape)) or sym not in symbols_of(o.desc.shape[a]):
                    return _blocked(sym, n, f"output {k} loses the padded dim (axis {a} of "
                                            f"{list(o.desc.shape)})")
                why = _stray(o.desc.shape, a, sym)
                if why:
                    return _blocked(sym, n, f"output {k}: {why}")
                axes[o.id] = a if isinstance(a, Axis) else Axis(a, outer, iota)
    outs: Dict[int, int] = {}
    for j, v in enumerate(graph.outputs):
        if v.id in axes and outer_of(axes[v.id]) != 1:
            return _blocked(sym, v.producer, f"output {j} carries the padded dim merged with "
                                             "other dims: it cannot be sliced back")
        if v.id in axes:
            outs[j] = int(axes[v.id])
        elif _carries(v.desc.shape, sym):
            return _blocked(sym, v.producer, f"output {j} has the dim in its shape but not "
                                             "on an axis that can be sliced back")
    if graph.signature.writes_inputs:
        writer = _input_writer(graph)
        if writer is not None:
            n, v = writer
            return _blocked(sym, n, f"{n.op} writes graph input {v.name} in place (e.g. a KV "
                                    "cache): a padded copy would be written instead of the "
                                    "caller's tensor")
        return _blocked(sym, None, "the model writes into or returns its inputs, which "
                                   "padded copies cannot stand for")
    return PaddingCheck(sym, True, outputs=outs)


def _input_writer(graph: Graph):
    """(node, input Value) of the first node that writes a graph input in place (its
    `OpDef.inplace_of`), or None."""
    inputs = {v.id for v in graph.inputs}
    for n in graph.nodes:
        for arg in (get_op(n.op).inplace_of or {}).values():
            ref = n.attrs.get(arg)
            if isinstance(ref, TensorRef) and n.inputs[ref.index].id in inputs:
                return n, n.inputs[ref.index]
    return None


def padding_summary(checks: Dict[str, PaddingCheck], names: Dict[str, str]) -> Dict[str, Any]:
    """``report.dynamic["padding"]`` rows: dim name -> {"padded", "blocked_by"}."""
    return {names[s]: {"padded": c.safe, "blocked_by": c.blocked_by} for s, c in checks.items()}
