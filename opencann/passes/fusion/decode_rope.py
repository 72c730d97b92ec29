"""Stage 2, fusion: `FuseDecodeRope`, a decode step's rotary embedding of the query and
the new key (ApplyRotaryPosEmb, torch_npu's ``npu_apply_rotary_pos_emb``) read only by
the DecodeAttentionKvUpdate it feeds ⇒ that node with the rotation's inputs and its cos
and sin (op ``ops/decode_attention_kv_update.py``): the RoPE runs inside the attention's
kernel call, with eager's bits, and is no node of its own.

Why: in a Llama decode step the rotation is a call on a few hundred elements right after
the Q/K/V GEMM streamed its weight through the caches, so its cost is the call (measured
in the compiled 12-layer step on the 2-core host: 28 µs a call in the step). Rule: the
ApplyRotaryPosEmb's rotated query is the node's query and its rotated key the node's new
key, neither read by anything else; float32; cos and sin one row per sequence or one for
all ([B or 1, 1, 1, D] after leading 1s: the decode step's one position). Runs after
``fuse_decode_kv_update`` and ``fuse_apply_rotary_pos_emb``. CPU only (the vnpu keeps the
unfused ops).
"""
from __future__ import annotations

import torch

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion
from .decode_kv_update import _NAMES
from .match import producer


def _row_per_sequence(shape, batch: int, d: int) -> bool:
    shape = (1,) * (4 - len(shape)) + tuple(int(x) for x in shape)
    return len(shape) == 4 and shape[0] in (1, batch) and shape[1:] == (1, 1, d)


class FuseDecodeRope(CpuFusion):
    """DecodeAttentionKvUpdate(ApplyRotaryPosEmb(q, k, cos, sin) -> (q', k'), kc, vc, k', v,
    pos, lengths) ⇒ DecodeAttentionKvUpdate(q, kc, vc, k, v, pos, lengths, cos, sin)."""

    name, stage = "fuse_decode_rope", "fusion"
    ops = ("DecodeAttentionKvUpdate",)
    switch_section = "GraphFusion"
    off_device_note = "cpu-only fusion (a numba kernel): skipped on {device}"

    def match(self, att: Node, graph: Graph, ctx: PassContext):
        """(att, rope); None when the query is not a rotation of the same node as the new
        key; a `Skip` with the reason for a near miss."""
        if "cos" in att.attrs:
            return None
        q, kn = att.arg("query"), att.arg("key_new")
        rope = producer(q, "ApplyRotaryPosEmb")
        if rope is None or producer(kn, "ApplyRotaryPosEmb") is not rope:
            return None
        if rope.outputs[0] is not q or rope.outputs[1] is not kn:
            return Skip(f"{rope.name}'s outputs are not {att.name}'s query and new key in that order")
        for v in rope.outputs:
            others = [u.name for u in v.users if u is not att]
            if others or any(o is v for o in graph.outputs):
                return Skip(f"{rope.name}'s rotation is read by "
                            f"{', '.join(others) or 'the caller'} too")
        b, d = int(q.desc.shape[0]), int(q.desc.shape[-1])
        c, s = rope.arg("cos"), rope.arg("sin")
        if not all(x.desc.is_static and _row_per_sequence(x.desc.shape, b, d) for x in (c, s)):
            return Skip(f"cos/sin {c.desc} are not one row per sequence ([B or 1, 1, 1, D])")
        if any(x.desc.dtype.torch != torch.float32 for x in (c, s, rope.arg("query"))):
            return Skip("the rotation is not float32; the fused kernel is")
        return att, rope

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the ApplyRotaryPosEmb and the DecodeAttentionKvUpdate by one
        DecodeAttentionKvUpdate with cos and sin. Returns 1."""
        att, rope = m
        ins = [att.arg(n) for n in _NAMES]
        ins[0], ins[3] = rope.arg("query"), rope.arg("key")
        ins += [rope.arg("cos"), rope.arg("sin")]
        attrs = {n: TensorRef(i) for i, n in enumerate(_NAMES + ("cos", "sin"))}
        attrs["scale"] = att.attrs.get("scale")
        new = graph.create_node("DecodeAttentionKvUpdate", ins, attrs,
                                [o.desc for o in att.outputs], name=f"{att.name}_rope",
                                source=att.source, scope=att.scope, before=att)
        if att.meta.get("strides"):
            new.meta["strides"] = list(att.meta["strides"])
        for old, o in zip(att.outputs, new.outputs):
            graph.replace_all_uses_with(old, o)
        graph.erase_node(att)
        graph.erase_node(rope)
        ctx.applied([rope, att], "ApplyRotaryPosEmb + DecodeAttentionKvUpdate")
        return 1
