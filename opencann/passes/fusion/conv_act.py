"""Stage 2, fusion: `FuseConvAct`, Conv2D(+bias) → Relu/Gelu/Sigmoid/Tanh/Swish ⇒
ConvBiasAct (a oneDNN convolution with a fused post-op); a lone Conv2D ⇒
ConvBiasAct(none), which gets oneDNN's prepacked weight. The activation is fused only
where the fused kernel gives eager's values: eager's activation kernel at eager's layout
of the conv output (its traced strides), probed on this CPU
(`ops.parity.conv_probes.conv_post_op_differs`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ...ir import Graph, Node
from ...ops.parity import conv_post_op_differs, eager_layout
from ..base import PassContext, Skip
from .common import CpuFusion, _act, _conv_check, _make_conv


@dataclass
class _ConvMatch:
    conv: Node
    act: Optional[Node]          # the activation fused, None: the conv alone
    why_not_act: str = ""        # why the user activation was not fused


class FuseConvAct(CpuFusion):
    """Conv2D → activation ⇒ ConvBiasAct(act); a lone Conv2D ⇒ ConvBiasAct(none) so it
    also gets oneDNN's prepacked weight."""

    name, stage = "fuse_conv_act", "fusion"
    ops = ("Conv2D",)
    #: CANN UB fusion reference, "TbeConv2DReluv2Pass": Conv2D+ReluV2 ⇒ one Conv2D
    switch_section, cann_names = "UBFusion", ("TbeConv2DReluv2Pass",)

    def match(self, conv: Node, graph: Graph, ctx: PassContext):
        """A `Skip` when the Conv2D cannot be a oneDNN convolution (`_conv_check`),
        else a `_ConvMatch` with the activation (Relu, Gelu (erf), Sigmoid, Tanh, Swish) that
        is the output's sole user, or with none (and the reason when the output has several
        users, the Gelu is the tanh approximation, or the fused kernel gives other values
        than eager's activation at eager's layout of the conv output on this CPU:
        `conv_post_op_differs`, e.g. AVX-512's oneDNN GELU vs ATen's on channels-last)."""
        why = _conv_check(conv)
        if why:
            return Skip(why)
        user = graph.sole_user(conv.outputs[0])
        if user is None:
            several = len(conv.outputs[0].users) > 1
            return _ConvMatch(conv, None, "the convolution's output has several users" if several else "")
        if not _act(user) or user.inputs[0] is not conv.outputs[0]:
            return _ConvMatch(conv, None)
        if user.op == "Gelu" and user.attrs.get("approximate", "none") != "none":
            return _ConvMatch(conv, None, f"Gelu(approximate={user.attrs['approximate']!r}): the "
                              "fused oneDNN convolution here applies only the exact (erf) GELU")
        out = conv.outputs[0]
        why = conv_post_op_differs(_act(user), out.desc.dtype.torch, eager_layout(out))
        if why:
            return _ConvMatch(conv, None, f"{user.op} stays eager's op at eager's layout: {why}")
        return _ConvMatch(conv, user)

    def rewrite(self, graph: Graph, m: _ConvMatch, ctx: PassContext) -> int:
        """Replace the conv (and its activation) by one ConvBiasAct node; the reason an
        activation was not fused is recorded as a skip at the conv. Returns 1."""
        conv, user = m.conv, m.act
        if m.why_not_act:
            ctx.skipped(conv, m.why_not_act)
        if user is not None:
            fused = _make_conv(graph, conv, _act(user), user, conv.name + "_" + user.op.lower())
            graph.replace_all_uses_with(user.outputs[0], fused.outputs[0])
            graph.erase_node(user)
            graph.erase_node(conv)
            ctx.applied([conv, user], f"Conv+{user.op}")
        else:
            fused = _make_conv(graph, conv, "none", conv, conv.name)
            graph.replace_all_uses_with(conv.outputs[0], fused.outputs[0])
            graph.erase_node(conv)
        return 1
