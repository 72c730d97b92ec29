"""Stage 2, fusion: user rules. A `FusionRule` is a pattern and its replacement, each an
IR graph over the same inputs (``opencann.register_fusion`` traces them from small torch
functions, as Inductor's ``register_replacement`` does); `UserFusion` is the rule as a
pass, under the rule's name (report, log, ``disable``, the fusion switch file).

Matching is structural, from the pattern's output back to its inputs: every pattern node
matches a graph node of the same op with equal literal attributes (Add and Mul also with
their two operands swapped); a pattern input matches any value, the same one wherever it
recurs; a pattern constant matches an equal constant. A match whose inner values are read
outside it is skipped with that reason. The replacement is inlined with shapes and dtypes
inferred for the matched inputs; one that does not give the matched output's shape and
dtype stops the compile with a `GraphError` naming the rule (`check_rule_rewrite`)."""
from __future__ import annotations

import math
import threading
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

import torch

from ...ir import Graph, Node, TensorListRef, TensorRef, Value
from ...ir.verify import GraphError
from ...ops import infer
from ..base import PassContext, RewritePass
from .match import read_outside, replace_with

_SWAPPABLE = ("Add", "Mul")


@dataclass
class FusionRule:
    """A user's rewrite: ``pattern`` and ``replacement`` are IR graphs with the same
    inputs (in order) and one output each; ``section``: "GraphFusion" or "UBFusion" (its
    fusion switch file section); ``cann_names``: other names the switch file may use."""

    name: str
    pattern: Graph
    replacement: Graph
    section: str = "GraphFusion"
    cann_names: Tuple[str, ...] = ()


_RULES: Dict[str, FusionRule] = {}
#: registration from one thread while another compiles (reads the rules) or registers
_LOCK = threading.Lock()


def register_rule(rule: FusionRule) -> FusionRule:
    """Add ``rule`` (its pass runs first in the fusion stage, in registration order).
    Raises ValueError when the name is taken. Thread-safe."""
    with _LOCK:
        if rule.name in _RULES:
            raise ValueError(f"fusion rule {rule.name!r} is registered already; "
                             "call opencann.unregister_fusion(name) first or choose another name")
        _RULES[rule.name] = rule
    return rule


def unregister_rule(name: str) -> None:
    """Remove the rule ``name``; raises KeyError naming the registered rules. Thread-safe."""
    with _LOCK:
        if name not in _RULES:
            raise KeyError(f"no fusion rule {name!r}; registered: {sorted(_RULES)}")
        del _RULES[name]


def registered_rules() -> List[str]:
    """Names of the registered user fusion rules, in registration order. Thread-safe."""
    with _LOCK:
        return list(_RULES)


def user_passes() -> List["UserFusion"]:
    """One `UserFusion` per registered rule, in registration order (the rules registered
    when it is called, whatever other threads register meanwhile)."""
    with _LOCK:
        rules = list(_RULES.values())
    return [UserFusion(r) for r in rules]


def _exact(v: object) -> object:
    """A literal as a key that equals another only for the same value of the same type:
    2 ≠ 2.0 ≠ True (they promote differently), 0.0 ≠ -0.0, NaN = NaN."""
    if isinstance(v, (list, tuple)):
        return (type(v).__name__, tuple(_exact(y) for y in v))
    if isinstance(v, float):
        return ("float", "nan" if math.isnan(v) else v, math.copysign(1.0, v))
    if isinstance(v, dict):
        return ("dict", tuple(sorted((k, _exact(y)) for k, y in v.items())))
    return (type(v).__name__, v)


def _literals(node: Node) -> Dict[str, object]:
    return {k: _exact(v) for k, v in node.attrs.items()
            if not isinstance(v, (TensorRef, TensorListRef))}


@dataclass
class _RuleMatch:
    root: Node
    binding: Dict[int, Value]      # pattern input index -> graph value
    nodes: List[Node]
    out: Value                     # the root's output the pattern's result matched


class _Matcher:
    """Structural matcher of one pattern graph (see the module docstring)."""

    def __init__(self, pattern: Graph):
        self.pattern = pattern
        self.inputs = {id(v): i for i, v in enumerate(pattern.inputs)}

    def match(self, pv: Value, gv: Value, env: Dict[int, object]) -> Optional[Dict[int, object]]:
        """Extend ``env`` (pattern value/node id -> graph value/node) so that ``pv``
        matches ``gv``; a new dict, or None."""
        if id(pv) in self.inputs:
            bound = env.get(id(pv))
            return env if bound is gv else ({**env, id(pv): gv} if bound is None else None)
        if pv.is_const:
            same = gv.is_const and gv.const.shape == pv.const.shape \
                and gv.const.dtype == pv.const.dtype and _same_bits(gv.const, pv.const)
            return env if same else None
        pn, gn = pv.producer, gv.producer
        if pn is None or gn is None or pn.op != gn.op or len(pn.inputs) != len(gn.inputs) \
                or pn.outputs.index(pv) != gn.outputs.index(gv) or _literals(pn) != _literals(gn):
            return None
        if env.get(id(pn), gn) is not gn:
            return None
        orders = [gn.inputs]
        if pn.op in _SWAPPABLE and len(gn.inputs) == 2:
            orders.append(gn.inputs[::-1])
        for gins in orders:
            e = {**env, id(pn): gn}
            for p_in, g_in in zip(pn.inputs, gins):
                e = self.match(p_in, g_in, e) if e is not None else None
            if e is not None:
                return e
        return None


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Equal values, NaN where NaN, and the same sign of zero (same dtype and shape)."""
    if not torch.equal(a.isnan(), b.isnan()) or not torch.equal(a.nan_to_num(0.0), b.nan_to_num(0.0)):
        return False
    return not a.is_floating_point() or torch.equal(a.signbit(), b.signbit())


class UserFusion(RewritePass):
    """A registered `FusionRule` as a pass: pattern ⇒ replacement, under the rule's name."""

    stage = "fusion"

    def __init__(self, rule: FusionRule):
        self.rule = rule
        self.name = rule.name
        self.switch_section = rule.section
        self.cann_names = tuple(rule.cann_names)
        self.root = rule.pattern.outputs[0].producer
        self.ops = (self.root.op,)
        self.matcher = _Matcher(rule.pattern)

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """The binding of the rule's pattern to the graph when ``node`` is the root of the
        traced pattern (same ops, attributes and wiring); None otherwise."""
        out = node.outputs[self.root.outputs.index(self.rule.pattern.outputs[0])]
        env = self.matcher.match(self.rule.pattern.outputs[0], out, {})
        if env is None:
            return None
        nodes = [env[id(n)] for n in self.rule.pattern.nodes if id(n) in env]
        skip = read_outside(graph, nodes, node, "pattern")
        if skip is not None:
            return skip
        binding = {i: env[id(v)] for i, v in enumerate(self.rule.pattern.inputs)}
        return _RuleMatch(node, binding, nodes, out)

    def rewrite(self, graph: Graph, m: _RuleMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by the rule's traced replacement (the matched output
        of the root, which may be any of its outputs, by the replacement's result, any
        output of its node); returns the number of rewrites (1)."""
        new = inline(graph, self.rule, m)
        old = m.out
        check_rule_rewrite(self.rule.name, m.root, old, new)
        replace_with(graph, m.root, new.producer, m.nodes, m.root.outputs.index(old),
                     new.producer.outputs.index(new))
        ctx.applied(m.nodes[::-1], f"user rule: {len(m.nodes)} → "
                    f"{len(self.rule.replacement.nodes)} nodes")
        return 1


def inline(graph: Graph, rule: FusionRule, m: _RuleMatch) -> Value:
    """Copy ``rule.replacement``'s nodes before ``m.root``, reading the matched inputs;
    each output's shape and dtype inferred anew. Returns the value giving the result.
    Raises `GraphError` naming the rule when inference fails."""
    env: Dict[int, Value] = {id(v): m.binding[i] for i, v in enumerate(rule.replacement.inputs)}
    for c in rule.replacement.constants:
        env[id(c)] = graph.add_const(c.const)
    last = None
    for rn in rule.replacement.nodes:
        n = graph.create_node(rn.op, [env[id(v)] for v in rn.inputs], dict(rn.attrs),
                              [o.desc for o in rn.outputs], name=f"{rule.name}_{rn.name}",
                              source=m.root.source, scope=m.root.scope, before=m.root)
        n.meta.update({k: v for k, v in rn.meta.items() if k in ("aten", "none_outputs")})
        n.meta["rule"] = rule.name
        try:
            descs = infer(n)
        except ValueError as e:
            raise GraphError(f"fusion rule {rule.name!r} at {m.root.name} ({m.root.where()}): "
                             f"its replacement does not fit the matched inputs: {e}") from None
        for o, d in zip(n.outputs, descs):
            o.desc = d
        for rv, o in zip(rn.outputs, n.outputs):
            env[id(rv)] = o
        last = n
    out = env[id(rule.replacement.outputs[0])]
    if last is None or out.producer is None:
        raise GraphError(f"fusion rule {rule.name!r}: the replacement computes nothing "
                         "(it returns an input); return a new tensor")
    return out


def check_rule_rewrite(rule: str, root: Node, old: Value, new: Value) -> None:
    """The verifier's check of a user rule's rewrite: the replacement's result ``new``
    has the matched ``old``'s shape and dtype. Raises `GraphError` naming the rule."""
    if tuple(old.desc.shape) != tuple(new.desc.shape) or old.desc.dtype != new.desc.dtype:
        raise GraphError(f"fusion rule {rule!r} broke the graph at {root.name} ({root.where()}): "
                         f"the replacement gives {new.desc.dtype.value}{list(new.desc.shape)} "
                         f"where the pattern gave {old.desc.dtype.value}{list(old.desc.shape)}; "
                         "make the replacement return the pattern's shape and dtype")
