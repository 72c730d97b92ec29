"""Stage 2, fusion: `FuseRotaryMul`, rotary position embedding as transformers' Llama
attention writes it, ``x * cos + rotate_half(x) * sin`` with ``rotate_half(x) =
cat((-x[..., D/2:], x[..., :D/2]), -1)`` ⇒ RotaryMul(x, cos, sin) (torch_npu's
``npu_rotary_mul``; kernel ``ops/kernels/rotary_mul_cpu.py``, eager's bits). Source: Su
et al. 2021, "RoFormer" (arXiv:2104.09864); transformers ``modeling_llama.py``
(``apply_rotary_pos_emb``, ``rotate_half``).

Why: the seven ops (two slices, Neg, ConcatD, two Muls, Add) run per query and key tensor
in every layer; in a Llama decode step each is a call on a few hundred elements, and the
chain costs ~50 µs in the compiled 12-layer step where the fused kernel costs ~8.

Matched exactly or not at all: the two halves of the same x along its last axis (step
1, D even), the negated upper half first; x·cos and rotate_half(x)·sin added; x a 4-D
float32 tensor [B, N, S, D]; cos and sin float32, 4-D (or fewer dims), equal to x's
dims or 1 in each (broadcast along the leading dims, never along D); the intermediate
values read by nothing else. CPU only (a numba kernel; the vnpu keeps the ops).
"""
from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from ...ir import Graph, Node, TensorRef, Value
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import producer, read_outside, replace_with, tensor_pair

_END = 2 ** 62   # a slice end at or past this reads to the end (ATen's INT64_MAX)


def _slice(v: Value, x: Optional[Value] = None) -> Optional[Tuple[Value, int, int]]:
    """(source, start, end) of a step-1 slice along the last axis producing ``v`` (of
    ``x`` when given), else None; end clipped to the axis."""
    sl = producer(v, "StridedSlice")
    if sl is None:
        return None
    src = sl.inputs[0]
    a, rank = sl.attrs, src.desc.rank
    if (x is not None and src is not x) or a.get("step", 1) != 1 or a.get("dim", 0) % max(rank, 1) != rank - 1:
        return None
    d = src.desc.shape[-1]
    if not isinstance(d, int):
        return None
    start, end = a.get("start") or 0, a.get("end")
    end = d if end is None or end >= _END else min(end, d)
    return src, start, end


def _rotate_half(v: Value) -> Optional[Tuple[Value, List[Node]]]:
    """(x, nodes) when ``v`` is cat((-x[..., D/2:], x[..., :D/2]), -1), else None."""
    cat = producer(v, "ConcatD")
    if cat is None or len(cat.inputs) != 2 or cat.attrs.get("dim") not in (-1, v.desc.rank - 1):
        return None
    neg = producer(cat.inputs[0], "Neg")
    hi = _slice(neg.inputs[0]) if neg is not None else None
    if hi is None:
        return None
    x, start, end = hi
    d = x.desc.shape[-1]
    lo = _slice(cat.inputs[1], x)
    if d % 2 or (start, end) != (d // 2, d) or lo is None or lo[1:] != (0, d // 2):
        return None
    return x, [cat, neg, neg.inputs[0].producer, cat.inputs[1].producer]


def _broadcasts(t: Value, x: Value) -> bool:
    """``t``'s shape is x's or 1 along each leading dim (fewer dims allowed), D equal."""
    ts, xs = list(t.desc.shape), list(x.desc.shape)
    if len(ts) > len(xs) or not ts or ts[-1] != xs[-1]:
        return False
    return all(a in (1, b) for a, b in zip(ts, xs[len(xs) - len(ts):]))


class FuseRotaryMul(CpuFusion):
    """Add(Mul(x, cos), Mul(ConcatD(Neg(x[..., D/2:]), x[..., :D/2]), sin)) ⇒
    RotaryMul(x, cos, sin)."""

    name, stage = "fuse_rotary_mul", "fusion"
    ops = ("Add",)
    switch_section = "GraphFusion"
    off_device_note = "cpu-only fusion (a numba kernel): skipped on {device}"

    def match(self, add: Node, graph: Graph, ctx: PassContext):
        """(add, x, cos, sin, nodes) when ``add`` is the root of x·cos + rotate_half(x)·sin;
        None when it is no rotary embedding; a `Skip` with the reason for a near miss."""
        pair = tensor_pair(add, "Add")
        if pair is None:
            return None
        for m_x, m_rot in (pair, pair[::-1]):
            mx, mr = tensor_pair(producer(m_x, "Mul"), "Mul"), tensor_pair(producer(m_rot, "Mul"), "Mul")
            if mx is None or mr is None:
                continue
            for rot, sin in (mr, mr[::-1]):
                hit = _rotate_half(rot)
                if hit is None:
                    continue
                x, nodes = hit
                if x not in mx:
                    return Skip(f"rotate_half of {x} is added to a product without it ({mx[0]} · {mx[1]})")
                cos = mx[1] if mx[0] is x else mx[0]
                found = (add, x, cos, sin, [add, m_x.producer, m_rot.producer] + nodes)
                why = self._check(*found[1:4], add)
                if why:
                    return Skip(why)
                return read_outside(graph, found[4], add, "rotary embedding") or found
        return None

    @staticmethod
    def _check(x: Value, cos: Value, sin: Value, add: Node) -> Optional[str]:
        if x.desc.rank != 4:
            return f"x is {x.desc.rank}-D; the fused kernel takes [B, N, S, D]"
        if any(v.desc.dtype.torch != torch.float32 for v in (x, cos, sin)):
            return (f"dtypes {[v.desc.dtype.value for v in (x, cos, sin)]}: the fused kernel is "
                    "float32")
        if not all(v.desc.is_static for v in (x, cos, sin)):
            return "a dynamic shape: the fused kernel's broadcast is checked on static shapes"
        if not (_broadcasts(cos, x) and _broadcasts(sin, x)):
            return (f"cos {cos.desc} / sin {sin.desc} do not broadcast to x {x.desc} along its "
                    "leading dims only")
        out = add.outputs[0].desc
        if tuple(out.shape) != tuple(x.desc.shape) or out.dtype != x.desc.dtype:
            return f"the result {out} is not shaped and typed like x {x.desc}"
        return None

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the matched nodes by one RotaryMul node. Returns 1."""
        add, x, cos, sin, nodes = m
        new = graph.create_node("RotaryMul", [x, cos, sin],
                                {"input": TensorRef(0), "r1": TensorRef(1), "r2": TensorRef(2)},
                                [add.outputs[0].desc], name=f"{add.name}_rotary_mul",
                                source=add.source, scope=add.scope, before=add)
        replace_with(graph, add, new, nodes)
        ctx.applied(nodes, "rotary embedding x·cos + rotate_half(x)·sin")
        return 1
