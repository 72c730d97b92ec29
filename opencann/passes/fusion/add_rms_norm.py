"""Stage 2, fusion: `FuseAddRmsNorm`, a residual Add whose sum an RmsNorm normalizes ⇒
AddRmsNorm (torch_npu's ``npu_add_rms_norm``; ONNX Runtime's SkipSimplifiedLayerNormalization,
``onnxruntime/core/optimizer/skip_layer_norm_fusion.cc``): one pass per row writing both
the sum (the residual stream, read on by the next residual Add) and the normalized
output (kernel: ``ops/kernels/add_rms_norm_cpu.py``).

Why: in a Llama decode step every RMSNorm but the first follows a residual Add (the last
through ``h[:, 0]``, a view dropping the size-1 token axis: matched through it); each is a
call on one 768-element row whose cost is the call (measured in the compiled 12-layer
step: Add 49 x ~10 µs, RmsNorm 25 x ~45 µs, after GEMMs that evict their caches). Rule:
an Add of two tensors of the result's shape (no broadcast, alpha 1), float32, read by an
RmsNorm over the last axis with a weight and without the float32 casts (``upcast``);
other readers of the sum are fine (it is an output). CPU only (a numba kernel; the vnpu
keeps Add + RmsNorm).
"""
from __future__ import annotations

import torch

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import contiguous_strides, residual_add


def _squeeze_view(v):
    """The view node producing ``v`` when it only drops size-1 dims of its input (SelectInt
    of index 0 on a size-1 dim, Squeeze, Reshape to the same sizes without the 1s): the
    same elements in the same order, so the fused kernel can write its rows there."""
    p = v.producer
    if p is None or p.op not in ("SelectInt", "Squeeze", "SqueezeDim", "Reshape") or not p.inputs:
        return None
    src = p.inputs[0].desc
    if not (src.is_static and v.desc.is_static) or src.dtype != v.desc.dtype:
        return None
    drop1 = [d for d in src.shape if d != 1] == [d for d in v.desc.shape if d != 1]
    if p.op == "SelectInt" and (src.shape[p.attrs.get("dim", 0)] != 1 or p.attrs.get("index") not in (0, -1)):
        return None
    return p if drop1 and src.shape[-1] == v.desc.shape[-1] else None


class FuseAddRmsNorm(CpuFusion):
    """RmsNorm([view dropping size-1 dims of] Add(a, b), w) over the last axis, float32, a
    and b of the sum's shape ⇒ AddRmsNorm(a, b, w) -> (y, a + b); the sum's other readers
    read output 1."""

    name, stage = "fuse_add_rms_norm", "fusion"
    ops = ("RmsNorm",)
    switch_section = "GraphFusion"
    off_device_note = "cpu-only fusion (a numba kernel): skipped on {device}"

    def match(self, rn: Node, graph: Graph, ctx: PassContext):
        """The (RmsNorm, Add) pair; None when no Add produces the RmsNorm's input; a `Skip`
        with the reason for a near miss (a scalar or broadcast Add, no weight, the float32
        casts, another dtype, several normalized axes)."""
        x = rn.inputs[rn.attrs["input"].index]
        view = _squeeze_view(x)
        if view is not None:   # Add -> h[:, 0] of [B, 1, H] -> RmsNorm (the last norm of a decode step)
            x = view.inputs[0]
        found = residual_add(x)
        if not isinstance(found, tuple):
            return found
        add, a, b = found
        if view is not None and (len(view.outputs[0].users) != 1 or view.outputs[0] in graph.outputs):
            return Skip(f"the view {view.name} of the sum is read elsewhere too")
        if x.desc.dtype.torch != torch.float32:
            return Skip(f"dtype {x.desc.dtype.value}: the fused kernel is float32")
        if rn.attrs.get("weight") is None:
            return Skip("RmsNorm without a weight")
        if rn.attrs.get("upcast"):
            return Skip("the RmsNorm casts to float32 and back (upcast); the fused kernel "
                        "takes float32 input")
        if len(rn.attrs["normalized_shape"]) != 1:
            return Skip(f"normalizes {len(rn.attrs['normalized_shape'])} trailing axes; the "
                        "fused kernel normalizes the last one")
        w = rn.inputs[rn.attrs["weight"].index]
        if w.desc.dtype != x.desc.dtype:
            return Skip(f"the weight is {w.desc.dtype.value}, x {x.desc.dtype.value}")
        if not x.desc.is_static:
            return Skip(f"dynamic shape {x.desc}: the fused kernel's rows are static here")
        return rn, add, view

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the Add and the RmsNorm by one AddRmsNorm node (output 0 the norm's,
        output 1 the sum, for the sum's other readers). Returns 1."""
        rn, add, view = m
        a, b = add.inputs
        w = rn.inputs[rn.attrs["weight"].index]
        new = graph.create_node(
            "AddRmsNorm", [a, b, w],
            {"x1": TensorRef(0), "x2": TensorRef(1), "gamma": TensorRef(2),
             "epsilon": rn.attrs["eps"]},
            [rn.outputs[0].desc, add.outputs[0].desc], name=f"{rn.name}_add", source=rn.source,
            scope=rn.scope, before=add)
        if add.meta.get("strides") or rn.meta.get("strides"):   # the traced layouts kept
            new.meta["strides"] = [(n.meta.get("strides") or [None])[0]
                                   or contiguous_strides(n.outputs[0].desc.shape) for n in (rn, add)]
        graph.replace_all_uses_with(rn.outputs[0], new.outputs[0])
        graph.replace_all_uses_with(add.outputs[0], new.outputs[1])
        graph.erase_node(rn)
        if view is not None:
            graph.erase_node(view)
        graph.erase_node(add)
        ctx.applied([add, rn], "residual Add + RMSNorm" + (" (through a squeezed view)" if view else ""))
        return 1
