"""Stage 2, fusion (a cleanup run after the pattern fusions): `FuseConsecutiveReshapes`,
Reshape(Reshape(x, a), b) ⇒ Reshape(x, b) (ONNX's optimizer calls this rule
``fuse_consecutive_reshapes``).

Why: a view whose input is a kernel's fresh result is not hoisted out of the generated
call (`runtime.codegen`: only views of tensors that are the same object every call are),
so each costs a Python call per run, ~1.3 µs (torch's ``view`` through the bound
callable). Transformers' attention and FFN code reshapes twice in a row around each GEMM
(``[S, 3·H·D]`` slice → ``[1, S, H·D]`` → ``[1, S, H, D]``; ``[1, S, F]`` → ``[S, F]``):
MiniLM at batch 1 runs 90 Reshapes per call, BERT-base 180. Values are the same
(a view reads the same elements in the same order); the merged view's strides are
checked against eager's for the second Reshape's output (``meta["strides"]``), so the
views after it and the caller see eager's layout.
"""
from __future__ import annotations

from typing import Optional, Tuple

import torch

from ...ir import Graph, Node, Value
from ..base import PassContext, RewritePass, Skip


def static_shape(v: Value) -> Optional[Tuple[int, ...]]:
    """``v``'s shape as ints, None when a dim is symbolic."""
    if not v.desc.is_static:
        return None
    return tuple(int(s) for s in v.desc.shape)


def strides_of(v: Value) -> Optional[Tuple[int, ...]]:
    """The strides ``v`` has at run time as far as the graph knows: a constant's own,
    eager's traced ones (`Value.traced_strides`), else contiguous (a graph input, a value
    a pass created without recording any); None when its shape is symbolic."""
    shape = static_shape(v)
    if shape is None:
        return None
    if v.is_const:
        return tuple(v.const.stride())
    st = v.traced_strides
    return tuple(st) if st is not None else torch.empty(shape, device="meta").stride()


def view_strides(x: Value, shape: Tuple[int, ...]) -> Optional[Tuple[int, ...]]:
    """The strides ``x.view(shape)`` gives for ``x``'s known strides (`strides_of`), None
    when ``x``'s layout is unknown or the view is impossible (ATen's ``computeStride``,
    run on a meta tensor)."""
    st = strides_of(x)
    if st is None:
        return None
    try:
        return tuple(torch.empty_strided(static_shape(x), st, device="meta").view(shape).stride())
    except RuntimeError:
        return None


class FuseConsecutiveReshapes(RewritePass):
    """Reshape(Reshape(x, a), b), the first Reshape read by the second alone and not a
    graph output, static shapes ⇒ Reshape(x, b) with ``size`` = b's shape as ints; the
    first is erased."""

    name, stage = "fuse_consecutive_reshapes", "fusion"
    ops = ("Reshape",)
    devices = ("cpu",)
    off_device_note = "cpu-only cleanup (the CPU executor's per-view Python): skipped on {device}"

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """``(node, first)`` when ``node`` reshapes the result of another Reshape
        ``first``; a `Skip` when the first has other readers or is returned, a shape is
        symbolic, or the merged view's strides would not be eager's; None otherwise."""
        first = node.inputs[0].producer
        if first is None or first.op != "Reshape":
            return None
        mid = first.outputs[0]
        if len(mid.users) != 1 or any(o is mid for o in graph.outputs):
            return Skip("the first Reshape's result is read elsewhere (or returned): "
                        "both views stay")
        shape = static_shape(node.outputs[0])
        if shape is None or static_shape(first.inputs[0]) is None:
            return Skip("symbolic shape: the merged size would not be a constant")
        want = strides_of(node.outputs[0])
        got = view_strides(first.inputs[0], shape)
        if got is None or got != want:
            return Skip(f"a view of the first Reshape's input to {list(shape)} would have "
                        f"strides {got}, eager's are {want}")
        return node, first

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Let the second Reshape read the first's input at its own static size; erase
        the first; returns 1."""
        node, first = m
        node.set_input(0, first.inputs[0])
        node.attrs["size"] = list(static_shape(node.outputs[0]))
        graph.erase_node(first)
        ctx.applied([node, first], "Reshape ∘ Reshape")
        return 1
