"""Stage 2, fusion: `FuseQKVLinear`, sibling Linears on one input ⇒ one GEMM: the
LinearAct nodes that read the same x with constant weights (attention's Q, K and V
projections) become one LinearAct over the weights concatenated once at compile time,
[m, k] @ [k, n₁ + n₂ + n₃], and one StridedSlice view per former result (columns
[oᵢ, oᵢ + nᵢ) of the [m, Σn] buffer, read in place). ONNX Runtime does the same in its
attention fusion (``onnxruntime/core/optimizer/attention_fusion.cc`` merges the Q/K/V
MatMuls' weights into one), OpenVINO in its ``FullyConnected`` horizontal fusion.

Numerics: each column block is the same dot products as before; the GEMM's blocking
over n may differ, well within 1e-6 relative in fp32. The slices are views: their
strides are (Σn, 1), not contiguous; every view op after them takes strided input, and
the memory plan keeps the merged buffer alive while any slice (or view of one) is read
(StridedSlice's OpDef aliases its input).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List

import torch

from ...ir import Graph, Node, TensorDesc, TensorRef
from ...ops import output_aliases
from ..base import PassContext, Skip
from .common import CpuFusion


@dataclass
class _QKVMatch:
    nodes: List[Node]            # the sibling LinearActs, in graph order


def _returned(graph: Graph, nodes) -> set:
    """Ids of the outputs of ``nodes`` that are returned, themselves or through ops whose
    output may alias them (views): a local walk over their users."""
    outs = {v.id for v in graph.outputs}
    found = set()
    for n in nodes:
        todo, seen = [n.outputs[0]], set()
        while todo:
            v = todo.pop()
            if v.id in outs:
                found.add(n.outputs[0].id)
                break
            for u in v.users:
                for o, idx in zip(u.outputs, output_aliases(u)):
                    if any(u.inputs[i] is v for i in idx) and o.id not in seen:
                        seen.add(o.id)
                        todo.append(o)
    return found


def _why_not(n: Node, act: str, dtype, returned: set) -> str:
    """Why sibling LinearAct ``n`` cannot join the group, or "" when it can."""
    b, _, w = n.inputs
    if n.outputs[0].id in returned:
        return (f"{n.name}: its result (or a view of it) is a graph output; eager returns "
                "memory of its own, contiguous, not a column slice of a shared buffer")
    if not (w.is_const and b.is_const):
        return f"{n.name}: its weight or bias is not a constant (the concatenation is made once, at compile time)"
    if n.attrs.get("act", "none") != act:
        return f"{n.name}: activation {n.attrs.get('act')!r}, the first sibling's is {act!r}"
    if w.desc.dtype != dtype or b.desc.dtype != dtype:
        return f"{n.name}: weight dtype {w.desc.dtype.value}, the first sibling's is {dtype.value}"
    if b.desc.rank != 1 or w.desc.rank != 2:
        return f"{n.name}: bias {b.desc} or weight {w.desc} is not [n] / [k, n]"
    return ""


class FuseQKVLinear(CpuFusion):
    """LinearAct(bᵢ, x, Wᵢ) for i = 1..n (n ≥ 2, same x, constant Wᵢ, bᵢ, same act) ⇒
    LinearAct(b₁‖…‖bₙ, x, W₁‖…‖Wₙ) → StridedSlice(dim 1, [oᵢ, oᵢ + nᵢ)) each."""

    name, stage = "fuse_qkv_linear", "fusion"
    ops = ("LinearAct",)
    switch_section = "GraphFusion"

    def match(self, root: Node, graph: Graph, ctx: PassContext):
        """A `_QKVMatch` when ``root`` is the first of ≥ 2 LinearAct nodes reading the same
        2-D x as ``mat1`` that can be merged (constant weight and bias of one dtype, same
        activation); None when ``root`` is not the first such sibling or has none; a
        `Skip` naming the sibling that cannot join (and why) when no two can."""
        x = root.inputs[1]
        sibs = [u for u in x.users if u.op == "LinearAct" and u.inputs[1] is x
                and u.inputs[0] is not x and u.inputs[2] is not x]
        if len(sibs) < 2:
            return None
        order = {n: i for i, n in enumerate(graph.nodes)}
        sibs.sort(key=order.__getitem__)
        if sibs[0] is not root:
            return None
        if x.desc.rank != 2:
            return Skip(f"the shared input {x} is {x.desc}, not a 2-D [m, k] matrix")
        returned = _returned(graph, sibs)
        if root.outputs[0].id in returned:   # the next sibling may lead a group
            sibs = [n for n in sibs if n.outputs[0].id not in returned]
            why = (f"{root.name}: its result (or a view of it) is a graph output; eager "
                   "returns memory of its own, contiguous, not a column slice of a shared buffer")
            if len(sibs) < 2:
                return Skip(f"not merged with its sibling Linears on {x}: {why}")
            ctx.skipped(root, f"left out of the merged GEMM: {why}", "sibling")
            root = sibs[0]
        first = root.inputs[2].desc.dtype
        why = _why_not(root, root.attrs.get("act", "none"), first, returned)
        if why:
            return Skip(f"the first of {len(sibs)} Linears reading {x}: {why}")
        group, reasons = [root], []
        for n in sibs[1:]:
            why = _why_not(n, root.attrs.get("act", "none"), first, returned)
            (reasons.append(why) if why else group.append(n))
        if len(group) < 2:
            return Skip(f"no sibling Linear of {root.name} on {x} can share its GEMM: "
                        + "; ".join(reasons))
        for why in reasons:
            ctx.skipped(root, f"left out of the merged GEMM: {why}", "sibling")
        return _QKVMatch(group)

    def rewrite(self, graph: Graph, m: _QKVMatch, ctx: PassContext) -> int:
        """Add the concatenated weight [k, Σn] and bias [Σn] as constants (stored as the
        transpose of a contiguous [Σn, k], the layout of the weights it replaces), create
        the merged LinearAct before the first sibling and one StridedSlice per sibling,
        rewire the siblings' users to the slices and erase the siblings. Returns 1."""
        first = m.nodes[0]
        x = first.inputs[1]
        ws = [n.inputs[2].const for n in m.nodes]
        bs = [n.inputs[0].const for n in m.nodes]
        wcat = torch.cat([w.t() for w in ws], dim=0).t()          # [k, Σn], column-major
        bcat = torch.cat([b.reshape(-1) for b in bs])
        wv = graph.add_const(wcat, f"{first.name}_qkv_w")
        bv = graph.add_const(bcat, f"{first.name}_qkv_b")
        total = int(wcat.shape[1])
        mdim = x.desc.shape[0]
        out_dtype = first.outputs[0].desc.dtype
        merged = graph.create_node(
            "LinearAct", [bv, x, wv],
            {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2),
             "act": first.attrs.get("act", "none")},
            [TensorDesc((mdim, total), out_dtype)], name=f"{first.name}_qkv",
            source=first.source, scope=first.scope, before=first)
        start = 0
        for n in m.nodes:
            width = int(n.inputs[2].desc.shape[1])
            sl = graph.create_node(
                "StridedSlice", [merged.outputs[0]],
                {"self": TensorRef(0), "dim": 1, "start": start, "end": start + width, "step": 1},
                [n.outputs[0].desc], name=f"{n.name}_slice", source=n.source, scope=n.scope,
                before=first)
            start += width
            graph.replace_all_uses_with(n.outputs[0], sl.outputs[0])
        for n in m.nodes:
            graph.erase_node(n)
        graph.prune_constants()
        ctx.applied(m.nodes, f"{len(m.nodes)} Linears on one input as one GEMM [.., {total}]")
        return 1
