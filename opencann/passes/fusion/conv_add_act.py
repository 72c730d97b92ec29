"""Stage 2, fusion: `FuseConvAddAct`, ConvBiasAct(none) → Add(·, r) [→ Relu] ⇒
ConvAddAct (oneDNN sum post-op, in place into r when r's memory dies there: no view or
other alias of r is read later or returned)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from ...ir import Graph, Node, TensorRef, Value
from ...ops import aliases_of, storage_roots
from ...ops.parity import conv_sum_differs, eager_layout
from ..base import PassContext, Skip
from .common import CpuFusion, _stands_for, carry_keep_dtype


@dataclass
class _AddMatch:
    conv: Node
    add: Node
    other: Value                 # the addend
    relu: Optional[Node]


class FuseConvAddAct(CpuFusion):
    """ConvBiasAct(none) → Add(·, r) [→ Relu] ⇒ ConvAddAct (sum post-op into r)."""

    name, stage = "fuse_conv_add_act", "fusion"
    ops = ("Add",)
    #: CANN UB fusion reference, "TbeConvDoubleInFusionPass": Conv2D + Elemwise + Elemwise
    #: (a residual Add, then an activation) ⇒ one Conv2D
    switch_section, cann_names = "UBFusion", ("TbeConvDoubleInFusionPass",)

    def match(self, add: Node, graph: Graph, ctx: PassContext):
        """None unless a Conv2D/ConvBiasAct feeds the Add; a `_AddMatch` when one
        input is a ConvBiasAct(none) read only by this Add and the other (the addend) a
        different value of the conv output's shape and dtype (with the Relu that is the Add's
        sole user, if any); else a `Skip` (alpha ≠ 1, a scalar addend, a fused or shared
        conv, a broadcast addend, or a fused kernel giving other values than eager's add
        [+ relu] at eager's layouts on this CPU: `conv_sum_differs`)."""
        if not any(v.producer is not None and v.producer.op in ("ConvBiasAct", "Conv2D")
                   for v in add.inputs):
            return None   # no convolution feeds it: not this pattern's root
        if add.attrs.get("alpha", 1) != 1:
            return Skip(f"Add with alpha={add.attrs['alpha']} (x + alpha·y); oneDNN's sum "
                        "post-op adds with scale 1")
        if len(add.inputs) != 2:
            return Skip("adds a scalar, not a tensor; oneDNN's sum post-op adds a tensor")
        for a, b in ((0, 1), (1, 0)):
            p = add.inputs[a].producer
            if p is not None and p.op == "ConvBiasAct" and p.attrs["act"] == "none" \
                    and graph.sole_user(p.outputs[0]) is add and add.inputs[b] is not add.inputs[a]:
                conv, other = p, add.inputs[b]
                break
        else:
            return Skip("the convolution already has a fused activation or its output has "
                        "other users")
        out = conv.outputs[0].desc
        if other.desc.shape != out.shape or other.desc.dtype != out.dtype:
            return Skip(f"addend {other.desc} is broadcast (not the conv's full output {out}); "
                        "oneDNN's sum post-op needs equal shapes")
        relu = graph.sole_user(add.outputs[0])
        relu = relu if relu is not None and relu.op == "Relu" else None
        out = conv.outputs[0]
        why = conv_sum_differs(relu is not None, out.desc.dtype.torch, eager_layout(out),
                               eager_layout(other))
        if why:
            return Skip(f"the Add stays eager's op at eager's layout: {why}")
        return _AddMatch(conv, add, other, relu)

    def rewrite(self, graph: Graph, m: _AddMatch, ctx: PassContext) -> int:
        """Replace conv, Add (and Relu) by one ConvAddAct, in place into the addend
        unless `_why_not_in_place` gives a reason (recorded as a skip, detail "in place", and
        the out-of-place sum used). Returns 1."""
        conv, add, other, relu = m.conv, m.add, m.other, m.relu
        last = relu or add
        why = _why_not_in_place(graph, conv, add, other)
        if why:
            ctx.skipped(add, why + "; using the out-of-place sum", "in place")
        ins = list(conv.inputs) + [other]
        attrs = dict(conv.attrs, other=TensorRef(len(ins) - 1), inplace=not why,
                     act="relu" if relu else "none")
        if not why:
            attrs["inplace_input"] = len(ins) - 1
        fused = graph.create_node("ConvAddAct", ins, attrs, [last.outputs[0].desc],
                                  name=conv.name + "_add" + ("_relu" if relu else ""),
                                  source=conv.source, scope=conv.scope, before=last)
        carry_keep_dtype(_stands_for(fused, last), conv)
        graph.replace_all_uses_with(last.outputs[0], fused.outputs[0])
        for nd in ([relu] if relu else []) + [add, conv]:
            graph.erase_node(nd)
        ctx.applied([conv, add] + ([relu] if relu else []), "Conv+Add" + ("+Relu" if relu else ""))
        return 1


def _why_not_in_place(graph: Graph, conv: Node, add: Node, other: Value,
                      conv_reads: Optional[Sequence[Value]] = None) -> str:
    """Why the sum cannot be written in place into the addend ("" if it can): the addend
    must own its memory (not a graph input, constant or view) and nothing that may
    share that memory (the addend, its views, views of those, split outputs...) may be
    read after ``add``, be returned or feed the convolution. ``conv_reads``: the values
    the convolution reads (default ``conv.inputs``); a fused node that already takes the
    addend as an input (QuantConvAddAct) passes its activation input only."""
    step = {nd: i for i, nd in enumerate(graph.nodes)}
    roots = storage_roots(graph, writes_as_fresh=True)
    if other.producer is None or roots.get(other.id) != frozenset((other.id,)):
        return "the addend is a graph input, constant or view"
    sharing = [other] + aliases_of(graph, other, roots)
    if any(u is not add and step.get(u, -1) > step[add] for v in sharing for u in v.users):
        return "the addend (or a view of it) is read again later"
    if any(v in graph.outputs for v in sharing):
        return "the addend (or a view of it) is a graph output"
    reads = conv.inputs if conv_reads is None else list(conv_reads)
    if any(v in reads for v in sharing):
        return "the addend is also the convolution's input"
    return ""
