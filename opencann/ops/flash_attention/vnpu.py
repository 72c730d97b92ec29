"""The vnpu kernel factory of ``FlashAttention`` (its OpDef's ``kernel_factories["vnpu"]``):
the tiled kernel `opencann.devices.vnpu.attention_kernels.flash_attention_tiled` with the
tiles `plan_npu_tiles` derives from the node's preset (Unified Buffer, L1, L0A/L0B/L0C),
each tile's working set checked against those buffers at run time.

The plan is recorded at bind time in ``node.meta["tiles"]`` (block_q, block_k, and bytes
used / capacity per buffer), which the profiler's Chrome trace shows in the event's args
and the estimate report in the node's row.
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...devices import parse_device
from ...devices.vnpu.attention_kernels import flash_attention_tiled
from ...ir import Node, TensorDesc, TensorRef
from .planner import npu_capacity, plan_npu_tiles


def tiles_meta(plan) -> dict:
    """The plan as ``node.meta["tiles"]``: block_q, block_k and, per buffer, "used/cap B"."""
    return {"block_q": plan.block_q, "block_k": plan.block_k,
            **{b: f"{u}/{c} B" for b, (u, c) in plan.occupancy.items()}}


def make_vnpu_flash_attention_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory: ``run(q, k, v[, mask]) -> out`` (q's dtype, BNSD) tile by tile on
    the node's vnpu preset. Raises ValueError (bind time) when the preset's buffers cannot
    hold a 16×16 tile at this head dim; `BufferOverflowError` at run time if a tile does
    not fit (never with the planned tiles)."""
    spec = getattr(node.device, "spec", None) or parse_device(str(node.device)).spec
    q = in_descs[0]
    d, sq, sk = int(q.shape[-1]), int(q.shape[-2]), int(in_descs[1].shape[-2])
    plan = plan_npu_tiles(spec, d, q.dtype.torch, seq_q=sq, seq_k=sk)
    node.meta["tiles"] = tiles_meta(plan)
    cap = npu_capacity(spec)
    causal = bool(node.attrs.get("causal", False))
    scale = node.attrs.get("scale")
    nan_rows = node.attrs.get("masked_rows", "zero") == "nan"
    idx = [node.attrs[k].index for k in ("query", "key", "value")]
    mi = node.attrs["attn_mask"].index if isinstance(node.attrs.get("attn_mask"), TensorRef) else None
    shape = tuple(int(s) for s in q.shape[:-1]) + (int(in_descs[2].shape[-1]),)
    strides = (node.meta.get("strides") or [None])[0]
    if strides is not None and tuple(strides) == torch.empty(shape, device="meta").stride():
        strides = None

    def run(*ins):
        o, _ = flash_attention_tiled(ins[idx[0]], ins[idx[1]], ins[idx[2]], plan.block_q, plan.block_k, cap,
                                     ins[mi] if mi is not None else None, causal, scale, nan_rows)
        if strides is not None:
            return torch.empty_strided(shape, strides, dtype=o.dtype).copy_(o)
        return o
    return run


__all__ = ["make_vnpu_flash_attention_kernel", "tiles_meta"]
