"""Inference-only lowering: ops whose secondary outputs nobody reads run as the op that
computes the primary output alone (the op's ``OpDef.primary_only``).

    MaxPoolWithArgmax(x) -> (y, indices unread)  ⇒  MaxPool(x) -> y
    ReduceMaxD(x, dim)   -> (y, indices unread)  ⇒  ReduceMax(x, dim) -> y

In an inference graph the indices are unread; in a training forward graph
(AOTAutograd) they are graph outputs saved for the backward, so the op is kept.
Measured (2 threads, AVX2): ResNet-50's stem pool [1, 64, 112, 112] 1.0 ms ⇒ 0.2 ms
(no strided copy of values and int64 indices into planned NCHW buffers; the values stay
in the convolution's channels-last layout); ``max(x, -1)`` on [8, 128, 768] 0.41 ms ⇒
0.04 ms (amax). Values and NaN positions are eager's: both forms propagate NaN.

Other training-only outputs, checked and left as they are (nothing to save):
BatchNorm in inference (``_native_batch_norm_legit_no_training``) returns empty saved
statistics; LayerNorm's and GroupNorm's mean/rstd ([B, S, 1]) are computed by the one
ATen kernel either way and are 1/hidden of the output; dropout in eval is no op in the
captured graph (a clone that ``identity_elimination`` drops); FlashAttentionScore's
logsumexp ([B, H, S]) is a by-product of its online softmax.
"""
from __future__ import annotations

from ...ir import Graph, Node
from ...ops import get_op, infer
from ..base import PassContext, RewritePass, Skip


class DropUnusedOutputs(RewritePass):
    """X(...) -> (y, unread...) ⇒ X.primary_only(...) -> y (same attributes); cpu only
    (the vnpu's layout rules name the multi-output ops)."""

    name, stage = "drop_unused_outputs", "prepare"
    devices = ("cpu",)
    off_device_note = "cpu-only lowering: not run on {device}"

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """(node, lean op) when only output 0 is read; a `Skip` saying which output is read."""
        lean = get_op(node.op).primary_only
        if lean is None:
            return None
        why = self._unread_rest(node, graph)
        return Skip(why, detail=f"{node.op}→{lean}") if why else (node, lean)

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the node by its ``primary_only`` op."""
        node, lean = m
        detail = f"{node.op}→{lean}"
        self._rewrite(graph, node, lean)
        ctx.applied([node], detail)
        return 1

    @staticmethod
    def _unread_rest(node: Node, graph: Graph) -> str:
        """'' when only output 0 is read, else why not (for the report)."""
        for k, o in enumerate(node.outputs[1:], 1):
            if o in graph.outputs:
                return f"output {k} is a graph output (saved for the backward in training)"
            if o.users:
                u = next(iter(o.users))
                return f"output {k} is read by {u.name} ({u.op})"
        return ""

    @staticmethod
    def _rewrite(graph: Graph, node: Node, lean: str) -> Node:
        new = graph.create_node(lean, node.inputs, node.attrs, [node.outputs[0].desc],
                                name=node.name, source=node.source, scope=node.scope,
                                before=node)
        new.device, new.stream = node.device, node.stream
        new.meta.update(node.meta)
        if node.meta.get("strides"):
            new.meta["strides"] = list(node.meta["strides"][:1])
        # symbolic dims (dynamic shapes): meta inference needs ints; the desc is kept
        desc = infer(new)[0] if all(v.desc.is_static for v in node.inputs) else node.outputs[0].desc
        if tuple(desc.shape) != tuple(node.outputs[0].desc.shape) or desc.dtype != node.outputs[0].desc.dtype:
            raise AssertionError(f"{lean} infers {desc} for {node.name}, {node.op} gave "
                                 f"{node.outputs[0].desc}")  # the OpDef's primary_only is wrong
        graph.replace_all_uses_with(node.outputs[0], new.outputs[0])
        graph.erase_node(node)
        return new
