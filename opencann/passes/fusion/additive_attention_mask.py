"""Stage 2, fusion: `AdditiveAttentionMask`, the bool ``attn_mask`` of CPU
ScaledDotProductAttention nodes ⇒ one additive mask in the query's dtype, computed once
per call and read by every attention node of the graph.

Why: torch's SDPA turns a bool mask into an additive one on every call (ATen's
``convert_boolean_attn_mask``: zeros in the query's dtype, ``-inf`` where the mask is
False), and opencann's ``bmm_softmax`` path does the same (``ops/kernels/attention_cpu``):
a BERT-style model builds one mask and feeds it to every layer, so a 12-layer model made
the same [B, 1, S, S] tensor 12 times per call (~8-15 µs each at S = 128 on the 2-core
host, docs/performance.md). Here a Select (``torch.where``) makes it once: ``where(mask,
0, -inf)`` in the query's dtype, the values ATen's conversion gives, so each attention
node computes what it computed before, bit for bit (tests/unit/test_additive_attention_mask.py).
"""
from __future__ import annotations

import torch

from ...ir import DataType, Graph, Node, TensorRef, Value
from ..base import PassContext, RewritePass, Skip

_FLOATS = (DataType.FLOAT, DataType.BF16, DataType.FLOAT16)


def _is_scalar(v: Value, value: float, dtype: DataType) -> bool:
    """Whether ``v`` is a 0-d constant equal to ``value`` in ``dtype``."""
    return (v.is_const and v.const.dim() == 0 and v.desc.dtype == dtype
            and float(v.const) == value)


def _existing(mask: Value, dtype: DataType):
    """An additive form of ``mask`` in ``dtype`` already in the graph (this pass's Select:
    ``where(mask, 0, -inf)`` on 0-d constants), else None."""
    for user in mask.users:
        if (user.op == "Select" and user.inputs[0] is mask and len(user.inputs) == 3
                and user.outputs[0].desc.dtype == dtype
                and _is_scalar(user.inputs[1], 0.0, dtype)
                and _is_scalar(user.inputs[2], float("-inf"), dtype)):
            return user.outputs[0]
    return None


class AdditiveAttentionMask(RewritePass):
    """ScaledDotProductAttention(q, k, v, attn_mask=m) with m bool and q floating ⇒
    ScaledDotProductAttention(q, k, v, attn_mask=Select(m, 0, -inf)) in q's dtype; one
    Select per (mask, dtype), placed before the first attention node that reads it."""

    name, stage = "additive_attention_mask", "fusion"
    ops = ("ScaledDotProductAttention",)
    devices = ("cpu",)
    off_device_note = "cpu-only (torch's SDPA converts the mask per call): skipped on {device}"

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """``(node, mask index, q dtype)`` for a bool tensor mask and a floating query; a
        `Skip` when the query is not floating; None without a bool tensor mask."""
        ref = node.attrs.get("attn_mask")
        if not isinstance(ref, TensorRef) or node.inputs[ref.index].desc.dtype != DataType.BOOL:
            return None
        q = node.attrs.get("query")
        dtype = node.inputs[q.index].desc.dtype if isinstance(q, TensorRef) else None
        if dtype not in _FLOATS:
            return Skip(f"the query is {dtype}, not a float: SDPA's own conversion stays")
        return node, ref.index, dtype

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Let the node read the mask's additive form (made here when no earlier node
        made it); returns 1."""
        node, i, dtype = m
        mask = node.inputs[i]
        add = _existing(mask, dtype)
        if add is None:
            zero = graph.add_const(torch.zeros((), dtype=dtype.torch), "mask_keep")
            ninf = graph.add_const(torch.full((), float("-inf"), dtype=dtype.torch), "mask_drop")
            sel = graph.create_node(
                "Select", [mask, zero, ninf],
                {"condition": TensorRef(0), "self": TensorRef(1), "other": TensorRef(2)},
                [mask.desc.with_(dtype=dtype)], f"{node.name}_additive_mask", before=node)
            add = sel.outputs[0]
        node.set_input(i, add)
        ctx.applied([node], "bool mask ⇒ additive, once")
        return 1
