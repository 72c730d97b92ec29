"""Stage 2, fusion: `FuseLayerNorm`, LayerNorm written out by hand, (x − μ) / √(σ² + ε)
[· γ] [+ β] with μ, σ² the mean and biased variance over the trailing axes ⇒
LayerNormFormula: ATen's ``native_layer_norm``, one kernel instead of seven passes, where
that gives the formula's value. Source: Ba, Kiros & Hinton 2016, "Layer Normalization"
(arXiv:1607.06450); ATen's kernel is ``aten/src/ATen/native/cpu/layer_norm_kernel.cpp``.

Only when it is exactly LayerNorm: μ and σ² reduce the same trailing axes with keepdim;
σ² is mean((x − μ)²) (or ``var(correction=0)``) of the same x; ε is a constant added
under the root (√(σ² + ε) or rsqrt(σ² + ε)); γ and β have the normalized shape. Every near
miss is skipped with its reason (an unbiased variance, ε outside the root, another axis,
keepdim=False...); a γ or β of another shape stays a separate op (reason recorded).

Special values: eager's ops overflow where ATen's one-pass kernel does not (a row of 3e38
sums to inf in ``mean`` and gives NaN; ``(x − μ)²`` overflows past 1.8e19 and gives β;
``var()`` accumulates in float64 and does not), so the node keeps how σ² and the root were
written and its kernel falls back to those ops whenever ATen's statistics leave the range
where both agree (``ops.parity.norm_range``); the probe of this CPU
(`special_values_differ`, "layer_norm") must find no difference, else the spelled-out form
is kept with its reason, and a model file holding the fusion is re-checked at load.

Rounding: ATen computes the statistics in one pass (Welford) where the spelled-out form
takes two; they differ by at most 4.8e-7 absolute in fp32 (randn, D = 64) and by more
relative to outputs near zero, as any reordered sum does."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional, Tuple

import torch

from ...ir import Graph, Node, TensorRef, Value
from ..base import PassContext, RewritePass, Skip
from .match import (producer, read_outside, record_formula, replace_with, scalar_operand,
                    special_values_differ, tensor_pair)


@dataclass
class _LnMatch:
    root: Node
    x: Value
    dims: int                     # number of trailing axes normalized
    eps: float
    nodes: List[Node]
    variance: str = "pow"         # σ² as mean((x − μ)²) ("pow") or var(x, correction=0)
    root_form: str = "sqrt"       # ÷ √(σ² + ε) ("sqrt") or · rsqrt(σ² + ε)
    gamma: Optional[Value] = None
    beta: Optional[Value] = None
    notes: List[str] = field(default_factory=list)


def _denominator(root: Node) -> Optional[Tuple[Value, object]]:
    """(numerator, (variance, eps, nodes) or a Skip) when ``root`` divides by a square
    root (Div by Sqrt, Mul by Rsqrt, either order), else None."""
    pair = tensor_pair(root, "Div")
    if pair is not None:
        num, den = pair
        d = producer(den)
        if d is not None and d.op == "Sqrt":
            add = scalar_operand(producer(d.inputs[0]), "Add", "Adds")
            if add is None:
                return num, Skip("no constant ε is added under the square root")
            return num, (add[0], add[1], [d, producer(d.inputs[0])])
        add = scalar_operand(d, "Add", "Adds")
        if add is not None and producer(add[0], "Sqrt") is not None:
            return num, Skip("ε is added after the square root, (x−μ)/(√σ² + ε); LayerNorm "
                             "adds it under the root, √(σ² + ε)")
        return None
    pair = tensor_pair(root, "Mul")
    if pair is None:
        return None
    for num, r in (pair, pair[::-1]):
        rs = producer(r, "Rsqrt")
        if rs is not None:
            add = scalar_operand(producer(rs.inputs[0]), "Add", "Adds")
            if add is None:
                return num, Skip("no constant ε is added under the rsqrt")
            return num, (add[0], add[1], [rs, producer(rs.inputs[0])])
    return None


def _trailing(node: Node, rank: int) -> Optional[int]:
    """How many trailing axes ``node`` reduces (with keepdim), or None."""
    dims = sorted(d % rank for d in (node.attrs.get("dim") or []))
    if not dims or dims != list(range(rank - len(dims), rank)) or not node.attrs.get("keepdim"):
        return None
    return len(dims)


def _centered(num: Value) -> "Tuple[Value, Node, Node] | str":
    """(x, mean node, sub node) when ``num`` is x − mean(x), else the reason."""
    sub = producer(num, "Sub")
    pair = tensor_pair(sub, "Sub")
    mean = producer(pair[1], "ReduceMean") if pair else None
    if mean is None or mean.inputs[0] is not pair[0]:
        return "the numerator is not x − mean(x)"
    return pair[0], mean, sub


def _variance(var: Value, x: Value, mean: Node, num: Value) -> "List[Node] | str":
    """The nodes computing ``var`` as the biased variance of ``x``, or the reason not."""
    rv = producer(var, "ReduceVar")
    if rv is not None:
        if rv.inputs[0] is not x:
            return f"the variance is of {rv.inputs[0]}, the mean of {x}"
        if rv.attrs.get("correction", 1) not in (0, 0.0):
            return (f"unbiased variance (correction={rv.attrs.get('correction', 1)}); "
                    "LayerNorm divides by N (correction=0)")
        return [rv] if rv.attrs.get("dim") == mean.attrs.get("dim") and \
            rv.attrs.get("keepdim") else "the variance reduces other axes than the mean"
    vm = producer(var, "ReduceMean")
    pw = producer(vm.inputs[0], "Pow") if vm is not None else None
    if pw is None or pw.attrs.get("exponent") != 2:
        return "the value under the root is not mean((x − μ)²) or var(x, correction=0)"
    d2 = pw.inputs[0]
    extra = []
    if d2 is not num:
        c = _centered(d2)
        if isinstance(c, str) or c[0] is not x or c[1] is not mean:
            return "the variance is not of the same x − μ as the numerator"
        extra = [c[2]]
    if vm.attrs.get("dim") != mean.attrs.get("dim") or not vm.attrs.get("keepdim"):
        return "the variance reduces other axes than the mean (or drops them)"
    return [vm, pw] + extra


class FuseLayerNorm(RewritePass):
    """Div(Sub(x, μ), Sqrt(Add(σ², ε))) or Mul(·, Rsqrt(·)) [→ Mul γ] [→ Add β], μ =
    ReduceMean(x, trailing, keepdim), σ² = ReduceMean(Pow(x − μ, 2)) ⇒ LayerNorm."""

    name, stage = "fuse_layer_norm", "fusion"
    ops = ("Div", "Mul")
    #: CANN graph fusion reference, "LayerNormFusionPass": ReduceMean/SquaredDifference... ⇒ LayerNorm
    switch_section, cann_names = "GraphFusion", ("LayerNormFusionPass",)

    def match(self, root: Node, graph: Graph, ctx: PassContext):
        """The matched nodes when ``node`` is the root of a hand-written LayerNorm over the
        last axes (biased variance, eps inside the root); a `Skip` with the reason for a
        near miss; None when ``node`` cannot be the root."""
        den = _denominator(root)
        if den is None:
            return None
        num, got = den
        if isinstance(got, Skip):
            return got
        var, eps, den_nodes = got
        c = _centered(num)
        if isinstance(c, str):
            return Skip(c)
        x, mean, sub = c
        k = _trailing(mean, x.desc.rank)
        if k is None:
            return Skip(f"the mean is over dims {mean.attrs.get('dim')} with keepdim="
                        f"{bool(mean.attrs.get('keepdim'))}; LayerNorm normalizes trailing "
                        "axes with keepdim")
        vn = _variance(var, x, mean, num)
        if isinstance(vn, str):
            return Skip(vn)
        if root.outputs[0].desc != x.desc:
            return Skip(f"the result {root.outputs[0].desc} is not shaped like x {x.desc}")
        if x.desc.dtype.torch == torch.float16:
            return Skip("computed in float16: eager's (x − μ)² overflows past |x − μ| = 256, "
                        "ATen's LayerNorm accumulates in float32 and does not")
        m = _LnMatch(root, x, k, eps, [root, *den_nodes, *vn, sub, mean],
                     "var" if vn[0].op == "ReduceVar" else "pow",
                     "sqrt" if den_nodes[0].op == "Sqrt" else "rsqrt")
        skip = read_outside(graph, m.nodes, root, "LayerNorm") \
            or special_values_differ(x, "layer_norm")
        if skip is not None:
            return skip
        if not all(isinstance(d, int) for d in x.desc.shape[-k:]):
            return Skip(f"the normalized dims {list(x.desc.shape[-k:])} are dynamic: "
                        "LayerNorm's normalized_shape must be static")
        _affine(graph, m)
        return m

    def rewrite(self, graph: Graph, m: _LnMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by one `LayerNormFormula` node (which keeps how σ² and
        the root were written); returns the number of rewrites (1)."""
        x = m.x
        ins = [x] + [v for v in (m.gamma, m.beta) if v is not None]
        ref = iter(range(1, 3))
        attrs = {"input": TensorRef(0), "normalized_shape": [int(s) for s in x.desc.shape[-m.dims:]],
                 "weight": TensorRef(next(ref)) if m.gamma is not None else None,
                 "bias": TensorRef(next(ref)) if m.beta is not None else None, "eps": m.eps,
                 "variance": m.variance, "root": m.root_form}
        new = graph.create_node("LayerNormFormula", ins, attrs, [m.root.outputs[0].desc],
                                name=f"{m.root.name}_layer_norm", source=m.root.source,
                                scope=m.root.scope, before=m.root)
        replace_with(graph, m.root, new, m.nodes)
        record_formula(graph, "layer_norm", x)
        ctx.applied(m.nodes[::-1], "spelled-out LayerNorm" + (" + γ" if m.gamma else "")
                    + (" + β" if m.beta else ""))
        for why in m.notes:
            ctx.skipped(new, why, "affine")
        return 1


def _affine(graph: Graph, m: _LnMatch) -> None:
    """Take a following ·γ and +β of the normalized shape into the match (the root moves
    to the last one taken); one of another shape stays, with a note why."""
    shape = tuple(m.x.desc.shape[-m.dims:])
    for op, attr in (("Mul", "gamma"), ("Add", "beta")):
        u = graph.sole_user(m.root.outputs[0])
        pair = tensor_pair(u, op)
        if pair is None:
            continue
        p = pair[1] if pair[0] is m.root.outputs[0] else pair[0]
        what = 'γ' if attr == 'gamma' else 'β'
        if tuple(p.desc.shape) != shape or u.outputs[0].desc != m.root.outputs[0].desc:
            m.notes.append(f"{what} {p} has shape {list(p.desc.shape)}, LayerNorm's is "
                           f"{list(shape)}: kept as a separate {op}")
            return
        if p.desc.dtype != m.x.desc.dtype:
            m.notes.append(f"{what} {p} is {p.desc.dtype.value}, x {m.x.desc.dtype.value} "
                           f"(ATen's LayerNorm takes x's dtype): kept as a separate {op}")
            return
        setattr(m, attr, p)
        m.root = u
        m.nodes.append(u)
