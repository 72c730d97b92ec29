"""Stage 2, fusion: `FuseApplyRotaryPosEmb`, the two RotaryMuls of one attention layer (its
query and its key, rotated by the same cos and sin) ⇒ ApplyRotaryPosEmb (torch_npu's
``npu_apply_rotary_pos_emb(query, key, cos, sin)``, computed out of place here): one node
and one numba call instead of two (kernel ``ops/kernels/rotary_mul_cpu.py``).

Why: in a Llama decode step each RotaryMul is a call on a few hundred elements, and the
first of them runs right after the q/k/v GEMMs with cold caches (measured in the compiled
3-layer step: 22-27 µs, then 9-10 µs for the second). Rule: two RotaryMuls reading the
same cos and sin values with different inputs; the merged node takes the later one's
place, so no reader of the earlier one's result may come between them. Runs after
``fuse_decode_kv_update``, whose fused node reads the key's rotation after the query's.
CPU only (the vnpu keeps the unfused ops).
"""
from __future__ import annotations

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, Skip
from .common import CpuFusion


class FuseApplyRotaryPosEmb(CpuFusion):
    """RotaryMul(q, cos, sin), RotaryMul(k, cos, sin) ⇒ ApplyRotaryPosEmb(q, k, cos, sin)
    -> (q', k')."""

    name, stage = "fuse_apply_rotary_pos_emb", "fusion"
    ops = ("RotaryMul",)
    switch_section = "GraphFusion"
    off_device_note = "cpu-only fusion (a numba kernel): skipped on {device}"

    def match(self, r: Node, graph: Graph, ctx: PassContext):
        """(first, second): ``r`` and the next RotaryMul in graph order reading the same
        cos and sin; None when there is none after ``r``; a `Skip` when a reader of ``r``'s
        result sits between them."""
        c, s, x = r.arg("r1"), r.arg("r2"), r.arg("input")
        others = [u for u in c.users if u is not r and u.op == "RotaryMul"
                  and u.arg("r1") is c and u.arg("r2") is s and u.arg("input") is not x]
        if not others:
            return None
        order = {n: i for i, n in enumerate(graph.nodes)}
        later = [o for o in others if order[o] > order[r]]
        if not later:
            return None   # matched from the earlier node
        o = min(later, key=order.__getitem__)
        between = [u.name for u in r.outputs[0].users if order[u] < order[o]]
        if between:
            return Skip(f"{', '.join(between)} reads {r.name}'s rotation before {o.name} runs; "
                        "the merged node would come after that read")
        return r, o

    def rewrite(self, graph: Graph, m, ctx: PassContext) -> int:
        """Replace the two RotaryMuls by one ApplyRotaryPosEmb node at the second's place.
        Returns 1."""
        r, o = m
        new = graph.create_node(
            "ApplyRotaryPosEmb", [r.arg("input"), o.arg("input"), r.arg("r1"), r.arg("r2")],
            {"query": TensorRef(0), "key": TensorRef(1), "cos": TensorRef(2), "sin": TensorRef(3)},
            [r.outputs[0].desc, o.outputs[0].desc], name=f"{o.name}_pair", source=o.source,
            scope=o.scope, before=o)
        if r.meta.get("strides") or o.meta.get("strides"):
            new.meta["strides"] = [(n.meta.get("strides") or [None])[0] for n in (r, o)]
        graph.replace_all_uses_with(r.outputs[0], new.outputs[0])
        graph.replace_all_uses_with(o.outputs[0], new.outputs[1])
        graph.erase_node(r)
        graph.erase_node(o)
        ctx.applied([r, o], "RotaryMul x2 sharing cos/sin")
        return 1
