"""Stage 2, fusion (a cleanup run after the pattern fusions): `EliminateNopReshape`, a
Reshape to its input's own shape and strides ⇒ its input (ONNX's optimizer calls this
rule ``eliminate_nop_reshape``).

Why: traced attention code views SDPA's ``[B, H, S, D]`` result as ``[B, H, S, D]`` before
transposing it back (HF's ``attn_output.view(...)`` after ``scaled_dot_product_attention``
in BERT / MiniLM): a view that changes nothing still costs a Python call per run when
its input is a kernel's fresh result (not hoisted, `runtime.codegen`; ~1.3 µs), and
`FuseConsecutiveReshapes` leaves such a Reshape where two reshapes cancel
(``[S, F]`` → ``[1, S, F]`` → ``[S, F]`` around a GEMM).
"""
from __future__ import annotations

from ...ir import Graph, Node
from ..base import PassContext, RewritePass, Skip
from .consecutive_reshapes import static_shape, strides_of


class EliminateNopReshape(RewritePass):
    """Reshape(x) whose result has x's static shape and x's strides, not a graph output
    ⇒ x (its readers read x; the Reshape is erased)."""

    name, stage = "eliminate_nop_reshape", "fusion"
    ops = ("Reshape",)
    devices = ("cpu",)
    off_device_note = "cpu-only cleanup (the CPU executor's per-view Python): skipped on {device}"

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """``node`` when it changes neither shape nor strides; a `Skip` when it is a graph
        output (results must not alias inputs or each other) or eager's strides of its
        result differ from its input's; None when the shape changes."""
        x, y = node.inputs[0], node.outputs[0]
        shape = static_shape(y)
        if shape is None or shape != static_shape(x):
            return None
        if any(o is y for o in graph.outputs):
            return Skip("the view is a graph output (results must not alias inputs or each other)")
        if strides_of(x) != strides_of(y):
            return Skip(f"eager's strides of the view {strides_of(y)} differ from its input's "
                        f"{strides_of(x)}")
        return node

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext) -> int:
        """Let the Reshape's readers read its input; erase it; returns 1."""
        graph.replace_all_uses_with(node.outputs[0], node.inputs[0])
        graph.erase_node(node)
        return 1
