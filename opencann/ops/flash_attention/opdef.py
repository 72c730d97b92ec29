"""The ``FlashAttention`` graph op: its `OpDef` (cost without the S×S score matrix) and
its bind-time CPU kernel factory (the OpDef's ``kernel_factories["cpu"]``).

Node layout (made by ``opencann.passes.fusion.attention.FuseFlashAttention``): inputs
q (B, H, S_q, D), k and v (B, H_kv, S_k, D) in BNSD order, optionally a mask
broadcastable to (B, H, S_q, S_k) (bool, True = keep, or float, added to the scores);
attrs ``query``/``key``/``value``/``attn_mask`` (TensorRefs; ``attn_mask`` absent when
there is none), ``causal`` (False/True = top-left, like SDPA's ``is_causal``),
``scale`` (None = D ** -0.5), ``masked_rows`` ("zero": a row that sees no key gives 0,
as torch's SDPA; "nan": it gives NaN, as ``softmax`` of an all ``-inf`` row in the
spelled-out form). Output: (B, H, S_q, D) in q's dtype. NaN/Inf: see
``flash_attention``.

The kernel is ``flash_attention_forward`` (FlashAttention-2, Dao 2023,
arXiv:2307.08691); its tiles are planned once at bind time from this CPU's L2
(``plan_tiles(cpu_l2())``, FlashAttention Algorithm 1, Dao et al. 2022,
arXiv:2205.14135). Only the output is returned; the row log-sum-exp is dropped
(inference graphs).
"""
from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch

from ...ir import Node, TensorDesc, numel
from ..kernels import vnpu_cost
from .. import per_index as pi
from ..opdef import Cost, OpDef, OpKind, register
from .api import bind_forward, flash_attention_forward
from .planner import cpu_l2, plan_tiles
from .vnpu import make_vnpu_flash_attention_kernel


def flash_attention_cost(node: Node) -> Cost:
    """FLOPs 4·B·H·S_q·S_k·D (Q·Kᵀ and P·V); bytes = q, k, v, mask read + output written.

    The S_q×S_k score/probability matrix never leaves the tile buffer, so it is not
    counted (the point of FlashAttention, Dao et al. 2022, §3.2 IO analysis)."""
    q = node.arg("query").desc
    k = node.arg("key").desc
    bh = numel(q.shape[:-2])
    sq, d, sk = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2])
    moved = sum(numel(v.desc.shape) * v.desc.dtype.itemsize for v in node.inputs)
    out = node.outputs[0].desc
    moved += numel(out.shape) * out.dtype.itemsize
    return Cost(4 * bh * sq * sk * d, moved)


def cpu_tiles(head_dim: int, seq_q: Optional[int] = None, seq_k: Optional[int] = None):
    """The CPU tile plan (block_q, block_k) for this machine's L2; raises ValueError when
    the L2 cannot hold 16×16 tiles at ``head_dim`` (see ``plan_tiles``)."""
    return plan_tiles(cpu_l2()[0], head_dim, torch.float32, seq_q=seq_q, seq_k=seq_k, target="cpu")


def make_flash_attention_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory: ``run(q, k, v[, mask]) -> out`` (q's dtype, BNSD).

    Tiles: the API's forward-only default (this CPU's L2 plan, 256-row query blocks for
    long sequences; the Triton plan on CUDA); the fusion pass has already checked with
    `cpu_tiles` that the head dim fits."""
    q = in_descs[0]
    causal = bool(node.attrs.get("causal", False))
    scale = node.attrs.get("scale")
    has_mask = "attn_mask" in node.attrs
    nan_rows = node.attrs.get("masked_rows", "zero") == "nan"
    out_dtype = q.dtype.torch
    shape = tuple(int(s) for s in q.shape)
    # the output layout the replaced node had in eager (SDPA may return BSND memory seen
    # as BNSD); views after it were captured against those strides, so honour them
    strides = (node.meta.get("strides") or [None])[0]
    if strides is not None and tuple(strides) == torch.empty(shape, device="meta").stride():
        strides = None

    # the kernel writes eager's layout itself where it can (float32 on the CPU kernel,
    # rows of D unit-stride): no copy after it
    direct = (strides is not None and out_dtype == torch.float32 and strides[-1] == 1
              and min(strides) >= 0
              and os.environ.get("OPENCANN_FA_BACKEND", "numba") in ("", "numba"))

    bound = None if has_mask or not all(d.is_static for d in in_descs[:3]) else bind_forward(
        shape, tuple(int(s) for s in in_descs[1].shape), causal=causal, scale=scale)

    def run(q, k, v, mask=None):
        out = None
        if direct and q.device.type == "cpu" and q.dtype == torch.float32:
            out = torch.empty_strided(shape, strides, dtype=out_dtype)
        if bound is not None:
            o, lse = bound(q, k, v, out=out)
        else:
            o, lse = flash_attention_forward(q, k, v, attn_mask=mask if has_mask else None,
                                             causal=causal, scale=scale, out=out)
        if nan_rows:  # rows that saw no key (lse -inf): NaN, as eager's softmax
            o.masked_fill_((lse == float("-inf")).unsqueeze(-1), float("nan"))
        if strides is not None and out is None:
            return torch.empty_strided(shape, strides, dtype=out_dtype, device=o.device).copy_(o)
        return o if o.dtype == out_dtype else o.to(out_dtype)
    return run


register(OpDef("FlashAttention", OpKind.ATTENTION, aliases=((),), cost_fn=flash_attention_cost,
               kernel_factories={"cpu": make_flash_attention_kernel, "vnpu": make_vnpu_flash_attention_kernel},
               device_cost={"vnpu": vnpu_cost.flash_attention}, per_index=pi.attention,
               doc="exact attention softmax(scale·QKᵀ + mask)·V without the S×S matrix "
                   "(FlashAttention-2, numba CPU kernel)"))
