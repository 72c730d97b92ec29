"""The ``DecodeAttentionKvUpdate`` graph op: a decode step's two KV-cache writes and its
decode attention as one node (the pass ``fuse_decode_kv_update``): KvCacheUpdate of the
new key and value rows into their caches at ``positions`` (``torch_npu.scatter_update_``
semantics, in place), then DecodeAttention over the updated caches with the live
``lengths`` (``npu_incre_flash_attention``'s ``actual_seq_lengths``). torch_npu has no
single op for this; the three are fused because in a decode step each is a call on a
few hundred elements whose cost is the call, not the bytes.

Node layout (BNSD): inputs query [B, Hq, 1, D], key/value (the caches) [B, Hkv, S_max,
D], key_new/value_new [B, Hkv, 1, D], positions [B] and lengths [B] (integers); attrs
TensorRefs of those names and ``scale``. Outputs: the attention [B, Hq, 1, D] float32
(a planned buffer, ``out=``), then the key and value caches after the write, in their
own memory (``inplace_of={1: "key", 2: "value"}``, as KvCacheUpdate's output 0).
Kernel: `opencann.ops.kernels.decode_attention_cpu.decode_attention_update` (one numba
call at decode sizes). CPU only: the vnpu keeps the three ops.

With the optional inputs ``cos`` and ``sin`` (attrs TensorRefs of those names; the pass
``fuse_decode_rope``) the query and the new key are the rotary embedding's inputs, not
its outputs: the node rotates both first (``npu_apply_rotary_pos_emb``'s rotate-half
RoPE, eager's bits), in the same kernel call, so a decode layer's RoPE is no node of its
own.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ir import Node, TensorDesc, numel
from . import per_index
from .opdef import Cost, OpDef, OpKind, register

_NAMES = ("query", "key", "value", "key_new", "value_new", "positions", "lengths")


def decode_attention_kv_update_cost(node: Node) -> Cost:
    """DecodeAttention's FLOPs (4·B·Hq·S_max·D, an upper bound) and bytes (the caches
    read, q and the output) plus the KvCacheUpdates' (the new rows read and written)."""
    q, k = node.inputs[0].desc, node.inputs[1].desc
    b, hq, d, s = int(q.shape[0]), int(q.shape[1]), int(q.shape[-1]), int(k.shape[-2])
    moved = sum(numel(v.desc.shape) * v.desc.dtype.itemsize for v in node.inputs)
    moved += sum(numel(v.desc.shape) * v.desc.dtype.itemsize for v in node.inputs[3:5])
    out = node.outputs[0].desc
    rope = 3 * (numel(q.shape) + numel(node.inputs[3].desc.shape)) if "cos" in node.attrs else 0
    return Cost(4 * b * hq * s * d + rope, moved + numel(out.shape) * out.dtype.itemsize)


def make_decode_attention_kv_update_kernel(node: Node, in_descs: Sequence[TensorDesc],
                                           consts: Sequence) -> Callable:
    """Kernel factory: ``run(*inputs, out=None) -> (attention, key cache, value cache)``
    (`decode_attention_update`, bound to the operands' static descriptions by
    `bind_decode_attention_update`; ``out``: (attention buffer, None, None), the caches
    being written in place); raises its ValueErrors (one line each)."""
    from .kernels.decode_attention_cpu import bind_decode_attention_update
    idx = [node.attrs[k].index for k in _NAMES]
    rope = [node.attrs[k].index for k in ("cos", "sin") if k in node.attrs]
    bound = bind_decode_attention_update(*(in_descs[i] for i in idx), node.attrs.get("scale"),
                                         *(in_descs[i] for i in rope))
    idx += rope

    def run(*xs, out=None):
        return bound(*(xs[i] for i in idx), out=None if out is None else out[0])
    return run


register(OpDef("DecodeAttentionKvUpdate", OpKind.ATTENTION, aliases=((), ("key",), ("value",)),
               inplace_of={1: "key", 2: "value"}, cost_fn=decode_attention_kv_update_cost,
               kernel_factories={"cpu": make_decode_attention_kv_update_kernel},
               out_capable=lambda n: True, keep_fp32=True, fp32_kernel=True,
               per_index=per_index.decode_attention_kv_update,
               doc="KvCacheUpdate of the new key and value rows + DecodeAttention over the "
                   "updated caches, one node (decode step)"))
