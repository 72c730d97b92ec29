"""Stage 2, fusion: `FuseAddLayerNormCast`, the Casts mixed precision puts around a
transformer block's kept-fp32 LayerNorm ⇒ AddLayerNormCast (the LayerNorm counterpart of
CANN's AddRmsNormCast, ``aclnnAddRmsNormCast``; kernel
``ops/kernels/add_layer_norm_cast_cpu.py``).

Why: under ``precision_mode="allow_mix_precision_bf16"`` (`MixedPrecision`) the GEMMs run
in bf16 and LayerNorm in fp32, so the residual stream is fp32 and every norm of a BERT
block reads Cast(bf16 → fp32) of the GEMM's output, adds the residual, normalizes, and is
cast down again (through a Reshape) for the next GEMM: 2 Casts, 1 Add and 1 LayerNorm per
norm, 4 kernels. Here one node: the Add promotes the bf16 addend inside ATen's ``add``,
ATen's LayerNorm normalizes, and the node writes both the float32 result (the residual
stream, the caller's output) and its bf16 cast: exactly the chain's values (kernel
docstring). Runs before `FuseAddLayerNorm` (off by default), which would take the Add and
LayerNorm of the same chain into its float32-only numba kernel.
"""
from __future__ import annotations

from typing import List, Optional, Tuple


from ...ir import DataType, Graph, Node, TensorRef, Value
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import contiguous_strides, residual_layer_norm

_LOW = (DataType.BF16, DataType.FLOAT16)
#: views the down-cast may be reached through (same elements, same order)
_VIEWS = ("Reshape",)


def _down_cast(y: Value) -> Optional[Tuple[List[Node], Node]]:
    """(the Reshape views, the Cast) when a Cast of ``y`` (or of a chain of Reshapes of
    ``y``, each read only by the next) to bf16/fp16 reads it; else None."""
    for user in y.users:
        views: List[Node] = []
        node = user
        while node.op in _VIEWS and len(node.outputs[0].users) == 1:
            views.append(node)
            node = next(iter(node.outputs[0].users))
        if node.op == "Cast" and node.outputs[0].desc.dtype in _LOW \
                and node.inputs[0].desc.dtype == DataType.FLOAT:
            return views, node
    return None


def _up_cast(v: Value) -> Optional[Value]:
    """The bf16/fp16 source of ``v`` when a Cast to float32 produces it, else None."""
    p = v.producer
    if p is not None and p.op == "Cast" and p.inputs[0].desc.dtype in _LOW \
            and v.desc.dtype == DataType.FLOAT:
        return p.inputs[0]
    return None


class FuseAddLayerNormCast(CpuFusion):
    """Cast(fp32 → low)([Reshape of] LayerNorm(Add([Cast(low → fp32)](a), b), γ, β)) over
    the last axis, the sum read only by the norm and the statistics unread ⇒
    AddLayerNormCast(a, b, γ, β) -> (y fp32, y low); y's other readers read output 0, the
    Cast's readers output 1 (through the same Reshapes)."""

    name, stage = "fuse_add_layer_norm_cast", "fusion"
    ops = ("LayerNorm",)
    switch_section = "GraphFusion"
    off_device_note = "cpu-only fusion (ATen's CPU LayerNorm): skipped on {device}"

    def match(self, ln: Node, graph: Graph, ctx: PassContext):
        """(LayerNorm, Add, (views, down-cast)); None when nothing casts the norm's output
        to bf16/fp16 (no mixed precision here); a `Skip` with the reason for a near miss
        (no residual Add or a broadcast one, the sum or the statistics read elsewhere,
        several normalized axes, a float16/bf16 norm)."""
        y = ln.outputs[0]
        down = _down_cast(y)
        if down is None:
            return None
        add = residual_layer_norm(ln, graph, "its cast", missing=(
            "no residual Add produces the LayerNorm's input (the embeddings' norm): the fused "
            "node adds two tensors"))
        if isinstance(add, Skip):
            return add
        return ln, add, down

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the up-Casts (when read by nothing else), the Add, the LayerNorm and
        the down-Cast by one AddLayerNormCast node; the Reshapes between the norm and the
        Cast are rebuilt on the low output. Returns 1."""
        ln, add, (views, cast) = m
        ups = [_up_cast(v) for v in add.inputs]
        if ups[0] is not None and ups[1] is not None:   # bf16 + bf16 would add in bf16
            ups[1] = None
        up_nodes = [v.producer for u, v in zip(ups, add.inputs) if u is not None]
        ins = [u if u is not None else v for u, v in zip(ups, add.inputs)]
        attrs = {"x1": TensorRef(0), "x2": TensorRef(1), "eps": ln.attrs["eps"],
                 "dtype": cast.attrs["dtype"]}
        for k in ("weight", "bias"):
            if ln.attrs.get(k) is not None:
                attrs[k] = TensorRef(len(ins))
                ins.append(ln.inputs[ln.attrs[k].index])
        y = ln.outputs[0]
        low = cast.outputs[0].desc.dtype
        new = graph.create_node("AddLayerNormCast", ins, attrs,
                                [y.desc, y.desc.with_(dtype=low)], name=f"{ln.name}_add_cast",
                                source=ln.source, scope=ln.scope, before=ln)
        if ln.meta.get("strides"):
            s = ln.meta["strides"][0] or contiguous_strides(y.desc.shape)
            new.meta["strides"] = [s, s]
        last = new.outputs[1]
        for v in views:   # the same views, on the low output
            nv = graph.create_node(v.op, [last], dict(v.attrs),
                                   [v.outputs[0].desc.with_(dtype=low)], name=f"{v.name}_{low.value}",
                                   source=v.source, scope=v.scope, before=cast)
            if v.meta.get("strides"):
                nv.meta["strides"] = list(v.meta["strides"])
            last = nv.outputs[0]
        graph.replace_all_uses_with(cast.outputs[0], last)
        graph.erase_node(cast)
        for v in reversed(views):
            graph.erase_node(v)
        graph.replace_all_uses_with(y, new.outputs[0])
        graph.erase_node(ln)
        graph.erase_node(add)
        for c in {id(n): n for n in up_nodes}.values():   # up-Casts now unread
            if not c.outputs[0].users and c.outputs[0] not in graph.outputs:
                graph.erase_node(c)
        ctx.applied([add, ln, cast], "Cast + Add + LayerNorm + Cast"
                    if any(u is not None for u in ups) else "Add + LayerNorm + Cast")
        return 1
