"""The IR: `Value` (an SSA edge), `Node` (one op application) and `Graph`.

Modelled on torch.fx's small IR: objects print readably and graph surgery goes through
a few well-named methods (`replace_all_uses_with`, `erase_node`, `insert_node`).
Weights are graph constants: a `Value` whose ``const`` holds the tensor.
"""
from __future__ import annotations

import heapq
import itertools
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Dict, Iterable, Iterator, KeysView, List, Optional, Sequence, Tuple

import torch

from ..devices import CPU, Device
from .replaces import RewriteLog
from .signature import CallSignature
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
    """An SSA value: produced by one node (or a graph input / constant), used by many.

    ``users`` is the ordered set of nodes that read it (a node that reads it twice, as
    ``x * x``, is one user); it is kept by `Node`/`Graph` methods, never edited here."""

    __slots__ = ("id", "desc", "producer", "_users", "const", "name", "__weakref__")

    def __init__(self, vid: int, desc: TensorDesc, producer: "Node | None" = None,
                 const: torch.Tensor | None = None, name: str | None = None):
        self.id = vid
        self.desc = desc
        self.producer = producer
        self._users: Dict[Node, None] = {}
        self.const = const
        self.name = name

    @property
    def users(self) -> KeysView["Node"]:
        """The nodes reading this value, in the order they started to (read-only)."""
        return self._users.keys()

    @property
    def is_const(self) -> bool:
        """True when the value is a graph constant (``const`` holds its tensor)."""
        return self.const is not None

    @property
    def traced_strides(self) -> "Tuple | None":
        """The strides (elements) ATen gave this value when the graph was traced, as
        recorded in its producer's ``meta["strides"]``; None for graph inputs, constants
        and values of nodes a pass created without recording any (contiguous). A node a
        pass inserts to stand for this value (a Cast, a kernel swap) must carry them:
        views after it, and the caller, rely on eager's layout."""
        if self.producer is None:
            return None
        strides = self.producer.meta.get("strides")
        k = self.producer.outputs.index(self)
        return strides[k] if strides and k < len(strides) else None

    def __repr__(self) -> str:
        return f"%{self.name or self.id}"


class Node:
    """One op application. ``attrs`` holds every non-tensor argument by schema name;
    tensor arguments appear there as `TensorRef`/`TensorListRef` into ``inputs``.

    ``inputs`` is a tuple: change it with `replace_input`, `set_input` or `set_inputs`,
    which keep every value's ``users`` exact. ``erased`` is True once the node was
    removed from its graph (`Graph.erase_node`).
    ``source`` is ``file:line`` of the user code that created it and ``scope`` the
    module path (``encoder.layer.0.attention``): both are shown in compile reports.
    """

    __slots__ = ("op", "_inputs", "outputs", "attrs", "name", "source", "scope",
                 "device", "stream", "meta", "erased", "_prev", "_next", "_owner")

    def __init__(self, op: str, inputs: Sequence[Value], attrs: Dict[str, Any],
                 name: str, source: str = "", scope: str = ""):
        self.op = op
        self._inputs: Tuple[Value, ...] = tuple(inputs)
        self.outputs: List[Value] = []
        self.attrs = dict(attrs)
        self.name = name
        self.source = source
        self.scope = scope
        self.device: Device = CPU
        self.stream = 0
        self.meta: Dict[str, Any] = {}
        self.erased = False
        self._owner: "NodeList | None" = None   # in a graph: its inputs list it as a user
        self._prev: "Node | None" = None
        self._next: "Node | None" = None

    # -- inputs -----------------------------------------------------------------------
    @property
    def inputs(self) -> Tuple[Value, ...]:
        """The input values in schema order (a tuple; change it with `set_inputs`,
        `set_input`, `replace_input` or `add_input`, which keep ``users`` exact)."""
        return self._inputs

    def set_inputs(self, values: Sequence[Value]) -> None:
        """Replace the whole input tuple, updating the users of old and new values."""
        old, self._inputs = self._inputs, tuple(values)
        if self._owner is not None:
            for v in old:
                if v not in self._inputs:
                    v._users.pop(self, None)
            for v in self._inputs:
                v._users[self] = None

    def set_input(self, i: int, new: Value) -> None:
        """Replace input ``i`` (one position) by ``new``."""
        ins = list(self._inputs)
        ins[i] = new
        self.set_inputs(ins)

    def replace_input(self, old: Value, new: Value) -> None:
        """Replace every occurrence of ``old`` among the inputs by ``new``."""
        self.set_inputs([new if v is old else v for v in self._inputs])

    def add_input(self, v: Value) -> int:
        """Append ``v`` as a new input; returns its index (for a `TensorRef`)."""
        self.set_inputs(self._inputs + (v,))
        return len(self._inputs) - 1

    def _link(self, owner: "NodeList") -> None:
        self._owner = owner
        for v in self._inputs:
            v._users[self] = None

    def _unlink(self) -> None:
        self._owner = None
        for v in self._inputs:
            v._users.pop(self, None)

    # -- inspection -------------------------------------------------------------------
    @property
    def output(self) -> Value:
        """The single output; raises ValueError for multi-output nodes."""
        if len(self.outputs) != 1:
            raise ValueError(f"{self.name} ({self.op}) has {len(self.outputs)} outputs")
        return self.outputs[0]

    @property
    def next(self) -> "Node | None":
        """The node after this one in its graph's order (None for the last)."""
        n = self._next
        return None if n is None or isinstance(n, _Root) else n

    def arg(self, name: str) -> Any:
        """A schema argument by name: a Value for tensors, a list of Values for tensor
        lists, the attribute itself otherwise. Raises KeyError for unknown names."""
        a = self.attrs[name]
        if isinstance(a, TensorRef):
            return self.inputs[a.index]
        if isinstance(a, TensorListRef):
            return list(self.inputs[a.start:a.start + a.length])
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
class _Root:
    """The sentinel of a graph's doubly linked node list."""

    __slots__ = ("_prev", "_next")

    def __init__(self):
        self._prev = self._next = self


class NodeList:
    """The nodes of a graph in order: a doubly linked list (O(1) insert and erase, as
    torch.fx's). Iterable (erasing the current node while iterating is safe), sized,
    reversible; indexing is O(n) and meant for diagnostics."""

    def __init__(self):
        self._root = _Root()
        self._len = 0

    def __len__(self) -> int:
        return self._len

    def __iter__(self) -> Iterator[Node]:
        n = self._root._next
        while n is not self._root:
            if not n.erased:
                yield n
            n = n._next   # read after the yield: nodes inserted after n are visited

    def __reversed__(self) -> Iterator[Node]:
        n = self._root._prev
        while n is not self._root:
            if not n.erased:
                yield n
            n = n._prev

    def __getitem__(self, i):
        return list(self)[i]

    def __contains__(self, node: object) -> bool:
        return isinstance(node, Node) and node._owner is self and not node.erased

    def _insert(self, node: Node, before: "Node | _Root") -> None:
        prev = before._prev
        node._prev, node._next = prev, before
        prev._next = node
        before._prev = node
        node._link(self)
        self._len += 1

    def _remove(self, node: Node) -> None:
        # the node keeps its _prev/_next so that an iteration standing on it can go on
        node._prev._next = node._next
        node._next._prev = node._prev
        node._unlink()
        self._len -= 1

    def _clear(self) -> None:
        self._root._prev = self._root._next = self._root
        self._len = 0


class Graph:
    """A static computation graph: inputs, constants, nodes in a valid order, outputs.

    Invariants (checked by `opencann.ir.verify`): every node's inputs list it among
    their ``users`` and nothing else does; erased nodes are in no ``users``. Keep them
    by changing the graph only through `create_node`, `add_node`, `erase_node`,
    `replace_all_uses_with` and the `Node` input methods."""

    #: the open `rewriting` block's record (a class default: graphs built by older code)
    _rewrite: "RewriteLog | None" = None

    def __init__(self, name: str = "graph"):
        self.name = name
        self.inputs: List[Value] = []
        self.outputs: List[Value] = []
        self.constants: List[Value] = []
        self._nodes = NodeList()
        self._ids = itertools.count()
        self._names: Dict[str, int] = {}
        # the calling convention (outputs, written inputs, eager's aliasing and layouts),
        # written by the frontends; ``meta``: per-stage notes (`opencann.ir.signature`)
        self.signature = CallSignature()
        self.meta: Dict[str, Any] = {}

    @property
    def nodes(self) -> NodeList:
        """The nodes in order (`NodeList`: iterate, ``len``, ``reversed``)."""
        return self._nodes

    # -- construction ---------------------------------------------------------------
    def _value(self, desc: TensorDesc, **kw) -> Value:
        return Value(next(self._ids), desc, **kw)

    def add_input(self, desc: TensorDesc, name: str | None = None) -> Value:
        """Append a graph input described by ``desc`` (shape, dtype, format); returns
        its `Value` (no producer). Inputs are bound positionally, in the order added."""
        v = self._value(desc, name=name)
        self.inputs.append(v)
        return v

    def add_const(self, tensor: torch.Tensor, name: str | None = None) -> Value:
        """Add ``tensor`` (detached, not copied) as a graph constant; returns its
        `Value`, whose ``desc`` is ``TensorDesc.of(tensor)`` (ND). Raises ValueError for a dtype
        the IR does not model (`DataType.from_torch`)."""
        v = self._value(TensorDesc.of(tensor), const=tensor.detach(), name=name)
        self.constants.append(v)
        return v

    def _unique(self, base: str) -> str:
        """``base``, or ``base_<k>`` with the first k that no node has taken (a derived
        name is taken too: a later ``base_1`` from the trace gets ``base_1_1``)."""
        n = self._names.get(base, 0)
        name = base if n == 0 else f"{base}_{n}"
        while n and name in self._names:
            n += 1
            name = f"{base}_{n}"
        self._names[base] = n + 1
        self._names.setdefault(name, 1)
        return name

    def create_node(self, op: str, inputs: Sequence[Value], attrs: Dict[str, Any],
                    out_descs: Sequence[TensorDesc], name: str | None = None,
                    source: str = "", scope: str = "", before: Node | None = None) -> Node:
        """Create a node, append it (or insert it before ``before``) and wire its uses."""
        node = Node(op, inputs, attrs, self._unique(name or op.lower()), source, scope)
        node.outputs = [self._value(d, producer=node) for d in out_descs]
        self._nodes._insert(node, self._nodes._root if before is None else before)
        if self._rewrite is not None:
            self._rewrite.created.append(node)
        return node

    def add_node(self, node: Node, before: Node | None = None) -> Node:
        """Insert a node built elsewhere (a model file's), keeping its name and outputs;
        appended, or before ``before``. Raises ValueError if it is in a graph already."""
        if node._owner is not None or node.erased:
            raise ValueError(f"{node.name} is (or was) in a graph already")
        self._names[node.name] = self._names.get(node.name, 0) + 1
        self._nodes._insert(node, self._nodes._root if before is None else before)
        return node

    # -- surgery --------------------------------------------------------------------
    def replace_all_uses_with(self, old: Value, new: Value) -> int:
        """Redirect every use of ``old`` (including graph outputs) to ``new``; returns
        the number of users and output positions redirected. ``new`` then stands for the
        traced value ``old`` stood for (its producer's ``meta["origin"]``, recorded by the
        frontend), so rewritten graphs still map back to the model."""
        _carry_origin(old, new)
        if self._rewrite is not None and None not in (old.producer, new.producer):
            self._rewrite.redirected.append((old.producer, new.producer))
        count = 0
        for user in list(old.users):
            user.replace_input(old, new)
            count += 1
        for i, o in enumerate(self.outputs):
            if o is old:
                self.outputs[i] = new
                count += 1
        return count

    def replace_input(self, node: Node, old: Value, new: Value) -> None:
        """``node.replace_input(old, new)``: every use of ``old`` by ``node`` reads ``new``."""
        node.replace_input(old, new)

    def erase_node(self, node: Node) -> None:
        """Remove a node whose outputs are unused, in O(1); sets ``node.erased``.
        Raises ValueError if an output is still used or the node is not in this graph."""
        if node not in self._nodes:
            raise ValueError(f"cannot erase {node.name}: it is not in graph {self.name}")
        for o in node.outputs:
            if o.users or o in self.outputs:
                raise ValueError(f"cannot erase {node.name}: output {o} is still used")
        self._nodes._remove(node)
        node.erased = True
        if self._rewrite is not None:
            self._rewrite.erased.append(node)

    @contextmanager
    def rewriting(self) -> Iterator[None]:
        """A block that replaces nodes: when it ends without raising, the nodes taking over
        the erased nodes' work (by the block's dataflow: the nodes their outputs were
        redirected to, and the created nodes feeding those; `RewriteLog.apply`) record
        the erased nodes' names in ``meta["replaces"]`` (read with `traced_names`). A
        block that raises records nothing; a block inside another is part of the outer
        one."""
        if self._rewrite is not None:
            yield
            return
        self._rewrite = log = RewriteLog()
        try:
            yield
        finally:
            self._rewrite = None
        log.apply()

    def sole_user(self, v: Value) -> Optional[Node]:
        """The one node reading ``v`` (``x * x`` is one reader), or None when ``v`` has
        no reader, several, or is a graph output (the caller sees it too)."""
        if len(v.users) != 1 or any(o is v for o in self.outputs):
            return None
        return next(iter(v.users))

    def prune_constants(self) -> None:
        """Drop the constants no node reads and no graph output returns."""
        self.constants = [c for c in self.constants if c.users or c in self.outputs]

    def topo_sort(self) -> None:
        """Reorder nodes topologically, stable with respect to the current order.
        Raises ValueError if the graph has a cycle."""
        nodes = list(self._nodes)
        pos = {n: i for i, n in enumerate(nodes)}
        indeg = {n: len({v.producer for v in n.inputs if v.producer is not None})
                 for n in nodes}
        ready = [(pos[n], n.name, n) for n in nodes if indeg[n] == 0]
        heapq.heapify(ready)
        order: List[Node] = []
        while ready:
            _, _, n = heapq.heappop(ready)
            order.append(n)
            for u in {u: None for o in n.outputs for u in o.users}:
                indeg[u] -= 1
                if indeg[u] == 0:
                    heapq.heappush(ready, (pos[u], u.name, u))
        if len(order) != len(nodes):
            raise ValueError(f"graph {self.name} has a cycle")
        self._nodes._clear()
        for n in order:   # relink in the new order (users stay as they are)
            self._nodes._insert(n, self._nodes._root)

    def reorder(self, order: Sequence[Node]) -> None:
        """Put the nodes in ``order``: every node of the graph once, each after the
        producers of its inputs. Raises ValueError naming the first node that is
        missing, extra, repeated or ahead of a producer (the graph is left unchanged)."""
        nodes = list(self._nodes)
        live, seen = set(nodes), set()
        for n in order:
            if n not in live or n in seen:
                raise ValueError(f"order lists {n.name} " + ("twice" if n in seen else
                                 f"which is not a node of graph {self.name}"))
            late = next((v for v in n.inputs if v.producer in live and v.producer not in seen), None)
            if late is not None:
                raise ValueError(f"order puts {n.name} before {late.producer.name}, which "
                                 f"produces its input {late!r}")
            seen.add(n)
        if len(seen) != len(nodes):
            missing = next(n for n in nodes if n not in seen)
            raise ValueError(f"order leaves out {missing.name} ({len(nodes) - len(seen)} nodes)")
        self._nodes._clear()
        for n in order:   # relink in the new order (users stay as they are)
            self._nodes._insert(n, self._nodes._root)

    # -- inspection -----------------------------------------------------------------
    def values(self) -> Iterable[Value]:
        """Every value: the inputs, then the constants, then each node's outputs in
        node order."""
        yield from self.inputs
        yield from self.constants
        for n in self.nodes:
            yield from n.outputs

    def op_counts(self) -> Dict[str, int]:
        """Number of nodes per op name, in order of first appearance."""
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
