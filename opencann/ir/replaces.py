"""Which nodes of the converted graph a node does the work of: ``node.meta["replaces"]``.

A rewrite that replaces nodes by new ones (a fusion: Conv2D → Add → Relu ⇒ ConvAddAct)
runs inside `Graph.rewriting`; each node it creates then records the names of the nodes
it erased whose work it does, carried through later rewrites (ConvBiasAct ⇒ ConvAddAct ⇒ QuantConvAddAct
keeps the first Conv2D's name). A rewrite that creates nothing but redirects the erased
nodes' outputs to existing nodes (common-subexpression elimination) adds the names to
those nodes (`RewriteLog.apply` has the rules). Tools that attribute a compiled
node's cost or kernel to the model's nodes read `traced_names` rather than parsing
derived names (``convolution_1_1_add_relu``)."""
from __future__ import annotations

from typing import TYPE_CHECKING, Dict, List, Set, Tuple

if TYPE_CHECKING:
    from .graph import Node


def traced_names(node: "Node") -> Tuple[str, ...]:
    """The names of the nodes whose work ``node`` does: ``meta["replaces"]`` (each once,
    in the order recorded), else ``(node.name,)`` (a node no rewrite formed)."""
    return tuple(node.meta.get("replaces") or (node.name,))


class RewriteLog:
    """What one `Graph.rewriting` block did: the nodes it ``created`` and ``erased`` and,
    for each `Graph.replace_all_uses_with`, the (old, new) producers ``redirected``."""

    __slots__ = ("created", "erased", "redirected")

    def __init__(self) -> None:
        self.created: List["Node"] = []
        self.erased: List["Node"] = []
        self.redirected: List[Tuple["Node", "Node"]] = []

    def apply(self) -> None:
        """Record the block by its dataflow: a node an erased node's output was redirected
        to does that node's work and that of the erased nodes feeding it (Conv2D → Add →
        Relu redirected to ConvAddAct: all three), unless it feeds them itself (a bypassed
        node: an Identity, an AscendQuant the layer before absorbs, a BatchNorm folded into
        its convolution's weights: no work of theirs runs); a created node no output was
        redirected to does the work of the created nodes it feeds (the AscendQuant before a
        QuantConvBiasAct, a merged QKV GEMM before its slices). A created node records only
        these names; an existing one (CSE's survivor) adds them to its own `traced_names`."""
        made = {id(c) for c in self.created}
        gone = {id(e) for e in self.erased}
        acc: Dict[int, List[str]] = {}
        nodes: Dict[int, "Node"] = {}
        for old, new in self.redirected:
            names, feeding = self._work(old, made, gone, acc) if id(old) in gone else ([], set())
            if names and id(new) not in feeding:
                acc.setdefault(id(new), []).extend(names)
                nodes[id(new)] = new
        for c in reversed(self.created):
            if not c.erased and id(c) not in acc:
                down = [u for o in c.outputs for u in o.users if id(u) in made and acc.get(id(u))]
                if down:
                    acc[id(c)] = [s for u in down for s in acc[id(u)]]
                    nodes[id(c)] = c
        for k, names in acc.items():
            t = nodes[k]
            if t.erased or not names:
                continue
            before = [] if k in made else list(traced_names(t))
            t.meta["replaces"] = list(dict.fromkeys(before + names))

    @staticmethod
    def _work(node: "Node", made: Set[int], gone: Set[int],
              acc: Dict[int, List[str]]) -> Tuple[List[str], Set[int]]:
        """(the names of the erased ``node``'s work and of the erased nodes feeding it, the
        ids of the surviving nodes feeding those): an existing node's `traced_names`, a
        created one's names so far."""
        out: List[str] = []
        feeding: Set[int] = set()
        stack, seen = [node], set()
        while stack:
            n = stack.pop()
            if id(n) in seen:
                continue
            seen.add(id(n))
            out += acc.get(id(n), []) if id(n) in made else list(traced_names(n))
            for v in n.inputs:
                if v.producer is not None:
                    (stack.append(v.producer) if id(v.producer) in gone else feeding.add(id(v.producer)))
        return out, feeding


__all__ = ["RewriteLog", "traced_names"]
