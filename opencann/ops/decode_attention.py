"""The ``DecodeAttention`` graph op: one query per sequence against a KV cache with live
lengths as data (FlashDecoding split-KV; Dao et al. 2023, "Flash-Decoding for
long-context inference"), the decode-step counterpart of ``FlashAttention`` and of
Ascend's ``npu_incre_flash_attention`` (``actual_seq_lengths``).

Node layout (BNSD, as FlashAttention): inputs q [B, Hq, 1, D], k and v [B, Hkv, S_max, D]
(the KV cache; Hq a multiple of Hkv, GQA), lengths [B] (integer: keys at positions >=
lengths[b] are ignored, never read); attrs ``query``/``key``/``value``/``lengths``
(TensorRefs) and ``scale`` (None = D ** -0.5). Output [B, Hq, 1, D] float32. Kernel:
`opencann.ops.kernels.decode_attention_cpu.decode_attention` (numba, imported at bind
time so ``import opencann`` does not load numba); fp32 only, so every precision mode
keeps the op in fp32 (``keep_fp32``, ``fp32_kernel``). vnpu:
`opencann.ops.kernels.vnpu_cost.decode_attention` (memory-bound on the cache read).
Captured from the torch custom op ``torch.ops.opencann.decode_attention(q, k_cache,
v_cache, lengths, scale)`` (`opencann.ops.llm_torch`), its arguments renamed to the
attributes above.
"""
from __future__ import annotations

from typing import Callable, Sequence

from ..ir import Node, TensorDesc, numel
from .kernels import vnpu_cost, vnpu_nd
from . import per_index
from .opdef import Cost, OpDef, OpKind, register


def decode_attention_cost(node: Node) -> Cost:
    """FLOPs 4·B·Hq·S_max·D (q·Kᵀ and P·V over the whole cache: an upper bound, the live
    lengths are data); bytes = q, k, v, lengths read + output written (the KV cache read
    dominates: the op is memory-bound)."""
    q = node.inputs[0].desc
    k = node.inputs[1].desc
    b, hq, d = int(q.shape[0]), int(q.shape[1]), int(q.shape[-1])
    s = int(k.shape[-2])
    moved = sum(numel(v.desc.shape) * v.desc.dtype.itemsize for v in node.inputs)
    out = node.outputs[0].desc
    moved += numel(out.shape) * out.dtype.itemsize
    return Cost(4 * b * hq * s * d, moved)


def make_decode_attention_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory: ``run(q, k, v, lengths, out=None) -> out`` [B, Hq, 1, D] float32
    (module docstring), written into ``out`` (the planned buffer) when given (on the cpu:
    the op's ``out_capable``); raises ValueError on bad shapes, dtypes or lengths (one line each)."""
    from .kernels.decode_attention_cpu import decode_attention
    scale = node.attrs.get("scale")
    iq, ik, iv, il = (node.attrs[k].index for k in ("query", "key", "value", "lengths"))

    def run(*xs, out=None):
        return decode_attention(xs[iq], xs[ik], xs[iv], xs[il], scale=scale, out=out)
    return run


register(OpDef("DecodeAttention", OpKind.ATTENTION, aliases=((),), cost_fn=decode_attention_cost,
               out_capable=lambda n: n.device.kind == "cpu",   # the vnpu kernel returns its own
               kernel_factories={"cpu": make_decode_attention_kernel, "vnpu": vnpu_nd.make_decode_attention},
               device_cost={"vnpu": vnpu_cost.decode_attention}, keep_fp32=True, fp32_kernel=True,
               custom_op="opencann::decode_attention", per_index=per_index.decode_attention,
               custom_op_args={"q": "query", "k_cache": "key", "v_cache": "value"},
               doc="one query per sequence over its live KV-cache keys (FlashDecoding split-KV, "
                   "GQA, lengths as data; numba CPU kernel)"))
