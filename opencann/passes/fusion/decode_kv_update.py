"""Stage 2, fusion: `FuseDecodeKvUpdate`, a decode step's two KvCacheUpdates (the new
key and value rows written into their caches) read only by the DecodeAttention that
attends over them ⇒ DecodeAttentionKvUpdate (op ``ops/decode_attention_kv_update.py``):
one node, one numba call at decode sizes, instead of three.

Why: a Llama decode step runs these per layer; each KvCacheUpdate moves 1 KiB and
costs its call (measured in the compiled 4-layer step on the 2-core host: 8 x 15 µs).
Rule: both caches updated at the same ``positions`` value, one new row per sequence
(T = 1), float32, each updated cache read by no other node than the DecodeAttention (a
reader between the write and the attention would see the write move; the caller, which
gets the updated caches as graph outputs, reads them after the step). CPU only (the vnpu keeps the
three ops).
"""
from __future__ import annotations

import torch

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion
from .match import producer

_NAMES = ("query", "key", "value", "key_new", "value_new", "positions", "lengths")


class FuseDecodeKvUpdate(CpuFusion):
    """DecodeAttention(q, KvCacheUpdate(kc, k, pos), KvCacheUpdate(vc, v, pos), lengths) ⇒
    DecodeAttentionKvUpdate(q, kc, vc, k, v, pos, lengths) -> (out, kc', vc')."""

    name, stage = "fuse_decode_kv_update", "fusion"
    ops = ("DecodeAttention",)
    switch_section = "GraphFusion"
    off_device_note = "cpu-only fusion (a numba kernel): skipped on {device}"

    def match(self, att: Node, graph: Graph, ctx: PassContext):
        """(att, key update, value update); None when the caches are not KvCacheUpdate
        outputs; a `Skip` with the reason for a near miss."""
        a = att.attrs
        kv = [producer(att.inputs[a[n].index], "KvCacheUpdate") for n in ("key", "value")]
        if kv[0] is None or kv[1] is None or kv[0] is kv[1]:
            return None
        ku, vu = kv
        if ku.arg("positions") is not vu.arg("positions"):
            return Skip("the key and value caches are written at different positions values")
        for u in kv:
            new = u.arg("new").desc
            if new.rank != 4 or new.shape[2] != 1:
                return Skip(f"{u.name} writes {new.shape[2] if new.rank == 4 else '?'} rows per "
                            "sequence; the fused kernel writes the decode step's one")
            if new.dtype.torch != torch.float32:
                return Skip(f"the cache is {new.dtype.value}; the fused kernel is float32")
            c = u.outputs[0]
            others = [r.name for r in c.users if r is not att]
            if others:   # the caller (a graph output) reads it after the whole step: fine
                return Skip(f"the cache {u.name} writes is read by {', '.join(others)} too; "
                            "fusing would move the write after that read")
        return att, ku, vu

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the two KvCacheUpdates and the DecodeAttention by one node. Returns 1."""
        att, ku, vu = m
        a = att.attrs
        ins = [att.inputs[a["query"].index], ku.arg("cache"), vu.arg("cache"), ku.arg("new"),
               vu.arg("new"), ku.arg("positions"), att.inputs[a["lengths"].index]]
        attrs = {n: TensorRef(i) for i, n in enumerate(_NAMES)}
        attrs["scale"] = a.get("scale")
        new = graph.create_node("DecodeAttentionKvUpdate", ins, attrs,
                                [att.outputs[0].desc, ku.outputs[0].desc, vu.outputs[0].desc],
                                name=f"{att.name}_kv_update", source=att.source,
                                scope=att.scope, before=att)
        if any(n.meta.get("strides") for n in (att, ku, vu)):   # the traced layouts kept
            new.meta["strides"] = [(n.meta.get("strides") or [None])[0] for n in (att, ku, vu)]
        graph.replace_all_uses_with(att.outputs[0], new.outputs[0])
        graph.replace_all_uses_with(ku.outputs[0], new.outputs[1])
        graph.replace_all_uses_with(vu.outputs[0], new.outputs[2])
        for n in (att, vu, ku):
            graph.erase_node(n)
        ctx.applied([ku, vu, att], "KvCacheUpdate x2 + DecodeAttention")
        return 1
