"""The IR: `Value` (an SSA edge), `Node` (one op application) and `Graph`.

Modelled on torch.fx's small IR: objects print readably and graph surgery goes through
a few well-named methods (`replace_all_uses_with`, `erase_node`, `insert_node`).
Weights are graph constants: a `Value` whose ``const`` holds the tensor.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Sequence

import torch

from .types import TensorDesc


@dataclass(frozen=True)
class TensorRef:
    """Placeholder in `Node.attrs` for the i-th tensor input (keeps schema order)."""

    index: int


@dataclass(frozen=True)
class TensorListRef:
    """Placeholder for a tensor-list argument: inputs[start:start+length]."""

    start: int
    length: int


class Value:
    """An SSA value: produced by one node (or a graph input / constant), used by many."""

    __slots__ = ("id", "desc", "producer", "users", "const", "name", "__weakref__")

    def __init__(self, vid: int, desc: TensorDesc, producer: "Node | None" = None,
                 const: torch.Tensor | None = None, name: str | None = None):
        self.id = vid
        self.desc = desc
        self.producer = producer
        self.users: List[Node] = []
        self.const = const
        self.name = name

    @property
    def is_const(self) -> bool:
        return self.const is not None

    def __repr__(self) -> str:
        return f"%{self.name or self.id}"


class Node:
    """One op application. ``attrs`` holds every non-tensor argument by schema name;
    tensor arguments appear there as `TensorRef`/`TensorListRef` into ``inputs``.

    ``source`` is ``file:line`` of the user code that created it and ``scope`` the
    module path (``encoder.layer.0.attention``): both are shown in compile reports.
    """

    __slots__ = ("op", "inputs", "outputs", "attrs", "name", "source", "scope",
                 "device", "stream", "meta")

    def __init__(self, op: str, inputs: Sequence[Value], attrs: Dict[str, Any],
                 name: str, source: str = "", scope: str = ""):
        self.op = op
        self.inputs: List[Value] = list(inputs)
        self.outputs: List[Value] = []
        self.attrs = dict(attrs)
        self.name = name
        self.source = source
        self.scope = scope
        self.device = "cpu"
        self.stream = 0
        self.meta: Dict[str, Any] = {}

    @property
    def output(self) -> Value:
        """The single output; raises ValueError for multi-output nodes."""
        if len(self.outputs) != 1:
            raise ValueError(f"{self.name} ({self.op}) has {len(self.outputs)} outputs")
        return self.outputs[0]

    def arg(self, name: str) -> Any:
        """A schema argument by name: a Value for tensors, a list of Values for tensor
        lists, the attribute itself otherwise. Raises KeyError for unknown names."""
        a = self.attrs[name]
        if isinstance(a, TensorRef):
            return self.inputs[a.index]
        if isinstance(a, TensorListRef):
            return self.inputs[a.start:a.start + a.length]
        return a

    def where(self) -> str:
        """Human-readable location: ``scope (file:line)``."""
        parts = [p for p in (self.scope, f"({self.source})" if self.source else "") if p]
        return " ".join(parts) or self.name

    def __repr__(self) -> str:
        outs = ", ".join(f"{o}: {o.desc}" for o in self.outputs)
        plain = {k: v for k, v in self.attrs.items()
                 if not isinstance(v, (TensorRef, TensorListRef))}
        attrs = ", ".join(f"{k}={v}" for k, v in plain.items())
        ins = ", ".join(map(repr, self.inputs))
        return f"{outs} = {self.op}({ins}{'; ' + attrs if attrs else ''})"


def _carry_origin(old: Value, new: Value) -> None:
    src, dst = old.producer, new.producer
    if src is None or dst is None or not src.meta.get("origin"):
        return
    label = src.meta["origin"][src.outputs.index(old)]
    if label is not None:
        dst.meta.setdefault("origin", [None] * len(dst.outputs))[dst.outputs.index(new)] = label


class Graph:
    """A static computation graph: inputs, constants, nodes in a valid order, outputs."""

    def __init__(self, name: str = "graph"):
        self.name = name
        self.inputs: List[Value] = []
        self.outputs: List[Value] = []
        self.constants: List[Value] = []
        self.nodes: List[Node] = []
        self._ids = itertools.count()
        self._names: Dict[str, int] = {}
        self.meta: Dict[str, Any] = {}

    # -- construction ---------------------------------------------------------------
    def _value(self, desc: TensorDesc, **kw) -> Value:
        return Value(next(self._ids), desc, **kw)

    def add_input(self, desc: TensorDesc, name: str | None = None) -> Value:
        v = self._value(desc, name=name)
        self.inputs.append(v)
        return v

    def add_const(self, tensor: torch.Tensor, name: str | None = None) -> Value:
        v = self._value(TensorDesc.of(tensor), const=tensor.detach(), name=name)
        self.constants.append(v)
        return v

    def _unique(self, base: str) -> str:
        n = self._names.get(base, 0)
        self._names[base] = n + 1
        return base if n == 0 else f"{base}_{n}"

    def create_node(self, op: str, inputs: Sequence[Value], attrs: Dict[str, Any],
                    out_descs: Sequence[TensorDesc], name: str | None = None,
                    source: str = "", scope: str = "", before: Node | None = None) -> Node:
        """Create a node, append it (or insert it before ``before``) and wire its uses."""
        node = Node(op, inputs, attrs, self._unique(name or op.lower()), source, scope)
        for v in node.inputs:
            v.users.append(node)
        node.outputs = [self._value(d, producer=node) for d in out_descs]
        if before is None:
            self.nodes.append(node)
        else:
            self.nodes.insert(self.nodes.index(before), node)
        return node

    # -- surgery --------------------------------------------------------------------
    def replace_all_uses_with(self, old: Value, new: Value) -> int:
        """Redirect every use of ``old`` (including graph outputs) to ``new``. ``new`` then
        stands for the traced value ``old`` stood for (its producer's ``meta["origin"]``,
        recorded by the frontend), so rewritten graphs still map back to the model."""
        _carry_origin(old, new)
        count = 0
        for user in list(old.users):
            user.inputs = [new if v is old else v for v in user.inputs]
            new.users.append(user)
            count += 1
        old.users.clear()
        for i, o in enumerate(self.outputs):
            if o is old:
                self.outputs[i] = new
                count += 1
        return count

    def replace_input(self, node: Node, old: Value, new: Value) -> None:
        node.inputs = [new if v is old else v for v in node.inputs]
        old.users.remove(node)
        new.users.append(node)

    def erase_node(self, node: Node) -> None:
        """Remove a node whose outputs are unused; raises ValueError otherwise."""
        for o in node.outputs:
            if o.users or o in self.outputs:
                raise ValueError(f"cannot erase {node.name}: output {o} is still used")
        for v in node.inputs:
            if node in v.users:
                v.users.remove(node)
        self.nodes.remove(node)

    def prune_constants(self) -> None:
        self.constants = [c for c in self.constants if c.users or c in self.outputs]

    def topo_sort(self) -> None:
        """Reorder nodes topologically, stable with respect to the current order."""
        pos = {n: i for i, n in enumerate(self.nodes)}
        indeg = {n: 0 for n in self.nodes}
        for n in self.nodes:
            indeg[n] = len({v.producer for v in n.inputs if v.producer is not None})
        import heapq
        ready = [(pos[n], n.name, n) for n in self.nodes if indeg[n] == 0]
        heapq.heapify(ready)
        order: List[Node] = []
        while ready:
            _, _, n = heapq.heappop(ready)
            order.append(n)
            seen = set()
            for o in n.outputs:
                for u in o.users:
                    if u in seen:
                        continue
                    seen.add(u)
                    indeg[u] -= 1
                    if indeg[u] == 0:
                        heapq.heappush(ready, (pos[u], u.name, u))
        if len(order) != len(self.nodes):
            raise ValueError(f"graph {self.name} has a cycle")
        self.nodes = order

    # -- inspection -----------------------------------------------------------------
    def values(self) -> Iterable[Value]:
        yield from self.inputs
        yield from self.constants
        for n in self.nodes:
            yield from n.outputs

    def op_counts(self) -> Dict[str, int]:
        counts: Dict[str, int] = {}
        for n in self.nodes:
            counts[n.op] = counts.get(n.op, 0) + 1
        return counts

    def __str__(self) -> str:
        lines = [f"graph {self.name}("
                 + ", ".join(f"{v}: {v.desc}" for v in self.inputs) + "):"]
        for c in self.constants:
            lines.append(f"  {c}: {c.desc} = const")
        for n in self.nodes:
            lines.append(f"  {n!r}")
        lines.append("  return " + ", ".join(map(repr, self.outputs)))
        return "\n".join(lines)

    def __repr__(self) -> str:
        return f"<Graph {self.name}: {len(self.nodes)} nodes, {len(self.inputs)} inputs>"
