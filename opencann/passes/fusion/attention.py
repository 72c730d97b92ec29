"""Stage 2, fusion: attention → FlashAttention.

- `FuseFlashAttention`: ScaledDotProductAttention(q, k, v, mask) ⇒ FlashAttention, and
  the spelled-out form BatchMatMul(SoftmaxV2(Add(Muls|Div(BatchMatMul(q, kᵀ)), mask)), v)
  (scale and mask optional), seen through the BroadcastTo/Reshape views the core-ATen
  decomposition puts around each bmm ⇒ FlashAttention. Kernel: FlashAttention-2
  (Dao 2023, arXiv:2307.08691), see ``opencann.ops.flash_attention.opdef``.

Off by default (``default_enabled = False``): on CPU, torch's own SDPA kernel is about
as fast today; enable with ``options={"enable": ["fuse_flash_attention"]}``.
Numerics: fp32 accumulation with a different summation order than eager; within
1e-5 relative (max|a-b|/max|ref|) in fp32. NaN/Inf follow eager: a NaN or +inf score
(NaN in q/k, NaN or +inf in the mask) makes its row NaN; a row that sees no key gives
0 for SDPA (as torch's SDPA) but NaN for the spelled-out softmax (as ``torch.softmax``
of an all ``-inf`` row): the node's ``masked_rows`` attribute ("zero" or "nan").
Every SDPA node that is not rewritten is reported with its reason.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

import torch

from ...devices import Device, parse_device
from ...ir import Graph, Node, TensorRef, Value
from ...ir.symbolic import dynamic_skip_reason
from ...ops.flash_attention import cpu_l2, plan_tiles
from ..base import PassContext, RewritePass, Skip

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_RESHAPES = ("Reshape", "UnsafeReshape", "ReshapeCopy")


def _broadcasts(shape, target) -> bool:
    if len(shape) > len(target):
        return False
    shape = (1,) * (len(target) - len(shape)) + tuple(int(s) for s in shape)
    return all(h in (1, w) for h, w in zip(shape, target))


def _tile_check(dev: Device, d: int, sq: int, sk: int) -> Optional[str]:
    """None if the target's tile buffer holds 16×16 tiles at head dim ``d``."""
    if dev.kind == "vnpu":
        buf, src = dev.tile_buffer()   # the vnpu's Unified Buffer
        target, dtype = "cube", torch.float16
    else:
        buf, src = cpu_l2()
        target, dtype = "cpu", torch.float32
    try:
        plan_tiles(buf, d, dtype, seq_q=sq, seq_k=sk, target=target)
    except ValueError as e:
        return f"head dim {d} is larger than the tile plan supports ({e}; buffer from {src})"
    return None


def _check(q: Value, k: Value, v: Value, mask: Optional[Value], dropout_p: float,
           enable_gqa: bool, device: Device) -> Optional[str]:
    """Why (q, k, v, mask) cannot run as FlashAttention on ``device`` (a `Device`, or its
    string form), or None."""
    device = parse_device(device)
    if dropout_p and dropout_p > 0:
        return (f"dropout_p={dropout_p} > 0 (dropout in training): FlashAttention here has no "
                "dropout; use model.eval() or dropout_p=0 for inference")
    descs = [t.desc for t in (q, k, v)]
    if not all(d.is_static for d in descs) or (mask is not None and not mask.desc.is_static):
        return "dynamic (symbolic) shapes: the tile plan needs static sizes"
    if any(d.rank != 4 for d in descs):
        return (f"q/k/v have ranks {[d.rank for d in descs]}; FlashAttention needs 4-D "
                "(batch, heads, seq, head_dim)")
    dts = {d.dtype.torch for d in descs}
    if len(dts) != 1 or next(iter(dts)) not in _DTYPES:
        return f"dtype {sorted(str(t) for t in dts)}: FlashAttention supports float32, float16, bfloat16"
    (B, H, Sq, D), (Bk, Hk, Sk, Dk), vs = (tuple(int(s) for s in d.shape) for d in descs)
    if Dk != D or vs[3] != D:
        return f"head dims differ (q {D}, k {Dk}, v {vs[3]}); FlashAttention needs one head dim"
    if vs != (Bk, Hk, Sk, Dk):
        return f"k {descs[1].shape} and v {descs[2].shape} differ in shape"
    if Bk != B:
        return f"batch of k/v ({Bk}) differs from q's ({B}) (broadcast batch)"
    if Hk != H:
        if enable_gqa and Hk > 0 and H % Hk != 0:
            return f"enable_gqa with {H} query heads not a multiple of {Hk} key/value heads"
        if not enable_gqa and Hk != 1:
            return f"k/v have {Hk} heads and q has {H} without enable_gqa"
    if mask is not None:
        md = mask.desc
        if not (md.dtype.torch == torch.bool or md.dtype.torch in _DTYPES):
            return f"mask dtype {md.dtype.torch}: FlashAttention takes a bool or float mask"
        if not _broadcasts(md.shape, (B, H, Sq, Sk)):
            return f"mask of shape {tuple(md.shape)} does not broadcast to (B, H, S_q, S_k) = {(B, H, Sq, Sk)}"
    return _tile_check(device, D, Sq, Sk)


def _make(graph: Graph, q, k, v, mask, causal, scale, out_desc, at: Node, name: str,
          masked_rows: str = "zero") -> Node:
    ins = [q, k, v]
    attrs = {"query": TensorRef(0), "key": TensorRef(1), "value": TensorRef(2),
             "causal": bool(causal), "scale": scale, "masked_rows": masked_rows}
    if mask is not None:
        ins.append(mask)
        attrs["attn_mask"] = TensorRef(3)
    fa = graph.create_node("FlashAttention", ins, attrs, [out_desc], name=name,
                           source=at.source, scope=at.scope, before=at)
    if "strides" in at.meta:
        # keep the replaced node's output layout (eager SDPA may return BSND memory seen
        # as BNSD): later views were captured against it; the kernel's contiguous result
        # is copied into a buffer with these strides
        fa.meta["strides"] = at.meta["strides"]
    return fa


# -- the spelled-out pattern --------------------------------------------------------

def _strip_to_4d(v: Value) -> Tuple[Value, List[Node]]:
    """Walk up the no-op views the decomposition puts in front of a bmm operand:
    Reshape merging (B, H) into B·H, BroadcastTo to the same shape, Identity (a
    contiguous clone). Returns the 4-D
    root (or the value where the walk stopped) and the views passed."""
    views = []
    while v.producer is not None:
        p = v.producer
        src = p.inputs[0] if p.inputs else None
        if p.op in _RESHAPES and src is not None and src.desc.rank == 4 and v.desc.rank == 3 \
                and tuple(src.desc.shape[-2:]) == tuple(v.desc.shape[-2:]):
            views.append(p)
            v = src
        elif p.op in ("BroadcastTo", "Identity") and src is not None \
                and tuple(src.desc.shape) == tuple(v.desc.shape):
            views.append(p)
            v = src
        else:
            break
    return v, views


def _bmm_4d_out(bmm: Node, graph: Graph) -> Optional[Node]:
    """The Reshape (B·H, S, X) → (B, H, S, X) that follows a bmm, if it is the sole user."""
    r = graph.sole_user(bmm.outputs[0])
    if r is not None and r.op in _RESHAPES and r.outputs[0].desc.rank == 4 and \
            tuple(r.outputs[0].desc.shape[-2:]) == tuple(bmm.outputs[0].desc.shape[-2:]):
        return r
    return None


def _scalar(node: Node) -> Optional[float]:
    other = node.attrs.get("other")
    if isinstance(other, (int, float)) and not isinstance(other, bool):
        return float(other)
    return None


def _is_kt(v: Value) -> Optional[Value]:
    """k if ``v`` is kᵀ (last two axes swapped) of a 4-D k, else None."""
    p = v.producer
    if p is None or v.desc.rank != 4:
        return None
    if p.op == "Transpose" and list(p.attrs.get("dims", ())) in ([0, 1, 3, 2], [0, 1, -1, -2]):
        return p.inputs[0]
    if p.op == "Swapaxes" and sorted(int(d) % 4 for d in (p.attrs.get("dim0"), p.attrs.get("dim1"))) == [2, 3]:
        return p.inputs[0]
    return None


def _leads_to_scores(v: Value) -> bool:
    """v = [scalar scale ·] Reshape(BatchMatMul(...))."""
    p = v.producer
    if p is not None and p.op in ("Muls", "Mul", "Div") and _scalar(p) is not None:
        p = p.inputs[0].producer
    return p is not None and p.op in _RESHAPES and p.inputs[0].producer is not None \
        and p.inputs[0].producer.op == "BatchMatMul"


@dataclass
class _Attention:
    q: Value
    k: Value
    v: Value
    mask: Optional[Value]
    scale: Optional[float]
    chain: List[Node]            # nodes replaced (erased once unused)
    last: Node                   # the node whose output the FlashAttention stands for
    sdpa: bool = False           # a ScaledDotProductAttention node, not the spelled-out form


def _match_spelled_out(bmm2: Node, graph: Graph):
    """Match BatchMatMul(P, V) with P = SoftmaxV2(Add(scale·(q kᵀ), mask)).

    Returns None when P (through no-op views) is not a softmax (not this pattern's
    root), a `Skip` saying which part of the pattern differs, or an `_Attention`. Only
    no-op views are passed; every intermediate must have this chain as its only user."""
    p4, pviews = _strip_to_4d(bmm2.inputs[0])
    sm = p4.producer
    if sm is None or sm.op != "SoftmaxV2":
        return None
    out4 = _bmm_4d_out(bmm2, graph)
    if out4 is None:
        return Skip("the P·V BatchMatMul's result is not reshaped back to 4-D (B, H, S, D) "
                    "by its only user")
    v4, _ = _strip_to_4d(bmm2.inputs[1])
    why = _softmax_check(sm, p4, v4, pviews, graph)
    if why:
        return Skip(why)
    scores = _match_scores(sm.inputs[0], graph)
    if isinstance(scores, Skip):
        return scores
    x, mask, scale, chain, bmm1 = scores
    q4, _ = _strip_to_4d(bmm1.inputs[0])
    kt4, _ = _strip_to_4d(bmm1.inputs[1])
    k4 = _is_kt(kt4)
    if k4 is None:
        return Skip("the second operand of Q·Kᵀ is not K with its last two axes swapped")
    if q4.desc.rank != 4:
        return Skip(f"Q is {q4.desc.rank}-D behind the bmm's views; FlashAttention needs 4-D")
    s = tuple(int(d) for d in x.desc.shape)
    if s != (*(int(d) for d in q4.desc.shape[:3]), int(k4.desc.shape[2])) or \
            tuple(k4.desc.shape) != tuple(v4.desc.shape) or tuple(k4.desc.shape[:2]) != tuple(q4.desc.shape[:2]):
        return Skip(f"broadcast heads/batch or mismatched shapes (scores {list(s)}, q "
                    f"{list(q4.desc.shape)}, k {list(k4.desc.shape)}, v {list(v4.desc.shape)})")
    return _Attention(q4, k4, v4, mask, scale, [bmm2, out4, sm] + pviews + chain, out4)


def _softmax_check(sm: Node, p4: Value, v4: Value, pviews: List[Node], graph: Graph) -> str:
    """Why the softmax feeding P·V is not attention's ("" when it is)."""
    if sm.attrs.get("half_to_float"):
        return "the softmax changes dtype (half_to_float)"
    if int(sm.attrs.get("dim", 0)) not in (-1, 3):
        return f"the softmax runs over dim {sm.attrs.get('dim')}, not the key axis (-1)"
    if p4.desc.rank != 4 or v4.desc.rank != 4:
        return (f"P and V are {p4.desc.rank}-D and {v4.desc.rank}-D behind the bmm's views; "
                "FlashAttention needs 4-D (batch, heads, seq, head_dim)")
    if any(graph.sole_user(n.outputs[0]) is None for n in pviews) or graph.sole_user(p4) is None:
        return "the softmax's output (or a view of it) has other users"
    return ""


def _match_scores(x: Value, graph: Graph):
    """The softmax's input as [mask +] [scale ·] Reshape(BatchMatMul(q, kᵀ)): returns
    (scores value, mask, scale, nodes passed, the bmm) or a `Skip`."""
    mask, scale, chain = None, 1.0, []
    node = x.producer
    if node is not None and node.op == "Add" and len(node.inputs) == 2 and node.attrs.get("alpha", 1) == 1:
        if graph.sole_user(x) is None:
            return Skip("the masked scores have other users")
        side = [i for i in (0, 1) if _leads_to_scores(node.inputs[i])]
        if not side:
            return Skip("neither operand of the Add before the softmax is [scale ·] Q·Kᵀ")
        x, mask = node.inputs[side[0]], node.inputs[1 - side[0]]
        if tuple(node.outputs[0].desc.shape) != tuple(x.desc.shape):
            return Skip("the mask broadcasts the scores to a larger shape")
        chain.append(node)
        node = x.producer
    if node is not None and node.op in ("Muls", "Mul", "Div") and _scalar(node) is not None:
        if graph.sole_user(x) is None:
            return Skip("the scaled scores have other users")
        c = _scalar(node)
        if node.op == "Div" and c == 0:
            return Skip("the scores are divided by 0")
        scale = 1.0 / c if node.op == "Div" else c
        chain.append(node)
        x = node.inputs[0]
        node = x.producer
    if node is None or node.op not in _RESHAPES:
        return Skip(f"the softmax's input is {node.op if node else 'a graph input'} "
                    "[after mask and scale], not Q·Kᵀ reshaped to 4-D")
    if graph.sole_user(x) is None:
        return Skip("the scores Q·Kᵀ have other users")
    bmm1 = node.inputs[0].producer
    if bmm1 is None or bmm1.op != "BatchMatMul" or _bmm_4d_out(bmm1, graph) is not node:
        return Skip("the scores are not a BatchMatMul reshaped to 4-D by its only user")
    return x, mask, scale, chain + [node, bmm1], bmm1


def _erase_dead(graph: Graph, nodes: List[Node]) -> None:
    """Erase ``nodes`` (and the views feeding them) that became unused."""
    changed = True
    pending = list(nodes)
    while changed:
        changed = False
        for n in list(pending):
            if not n.erased and not any(o.users or o in graph.outputs for o in n.outputs):
                ins = [v.producer for v in n.inputs if v.producer is not None]
                graph.erase_node(n)
                pending.remove(n)
                pending += [p for p in ins if p not in pending and p.op in
                            ("Reshape", "UnsafeReshape", "BroadcastTo", "Identity", "Transpose",
                             "Swapaxes")]
                changed = True


class FuseFlashAttention(RewritePass):
    """ScaledDotProductAttention, or its spelled-out softmax(scale·q kᵀ + mask)·v ⇒ FlashAttention."""

    name, stage = "fuse_flash_attention", "fusion"
    ops = ("ScaledDotProductAttention", "BatchMatMul")
    #: Ascend msprof-analyze's fusion rules (``advisor/rules/op_fusion_pass.yaml``):
    #: "FlashAttentionFusionPass", BatchMatMul → Mul → Softmax → BatchMatMul
    switch_section, cann_names = "UBFusion", ("FlashAttentionFusionPass",)
    default_enabled = False

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """ScaledDotProductAttention: an `_Attention` match, or a `Skip` with the first
        reason FlashAttention cannot take it (dropout, ranks, dtypes, head dims, shapes, heads,
        mask, tile plan: `_check`). BatchMatMul: None unless its first operand is (through
        no-op views) a SoftmaxV2, else the spelled-out softmax(scale·q kᵀ + mask)·v chain
        (`_match_spelled_out`) or a `Skip` saying which part differs; a bool mask added to the
        scores is refused (it adds 0/1)."""
        if node.op == "ScaledDotProductAttention":
            return self._match_sdpa(node, ctx)
        dynamic = dynamic_skip_reason(node, "matching spelled-out attention")
        if dynamic:   # its shape checks compare sizes
            return Skip(dynamic)
        m = _match_spelled_out(node, graph)
        if m is None or isinstance(m, Skip):
            return m
        why = _check(m.q, m.k, m.v, m.mask, 0.0, False, ctx.device)
        if why is None and m.mask is not None and m.mask.desc.dtype.torch == torch.bool:
            why = ("a bool tensor added to the scores adds 0/1 (type promotion), not a keep "
                   "mask; FlashAttention would read it as True = keep")
        return Skip(why) if why else m

    @staticmethod
    def _match_sdpa(node: Node, ctx: PassContext):
        q, k, v = node.arg("query"), node.arg("key"), node.arg("value")
        mask = node.arg("attn_mask") if "attn_mask" in node.attrs else None
        if mask is not None and not isinstance(mask, Value):
            mask = None
        why = _check(q, k, v, mask, node.attrs.get("dropout_p", 0.0) or 0.0,
                     bool(node.attrs.get("enable_gqa", False)), ctx.device)
        if why:
            return Skip(why)
        return _Attention(q, k, v, mask, node.attrs.get("scale"), [node], node, sdpa=True)

    def rewrite(self, graph: Graph, m: _Attention, ctx: PassContext) -> int:
        """Replace the SDPA node, or the whole spelled-out chain, by one FlashAttention
        node (spelled-out: rows whose mask is all -inf give NaN, as softmax does); returns 1."""
        last = m.last
        if m.sdpa:
            fa = _make(graph, m.q, m.k, m.v, m.mask, last.attrs.get("is_causal", False), m.scale,
                       last.outputs[0].desc, last, last.name + "_flash")
            graph.replace_all_uses_with(last.outputs[0], fa.outputs[0])
            graph.erase_node(last)
            ctx.applied([last], "SDPA→FlashAttention")
            return 1
        # inserted in place of the last node: every operand feeds the chain, so it is
        # already defined there
        bmm2 = m.chain[0]
        fa = _make(graph, m.q, m.k, m.v, m.mask, False, m.scale, last.outputs[0].desc, last,
                   bmm2.name + "_flash", masked_rows="nan")  # softmax(all -inf) is NaN
        graph.replace_all_uses_with(last.outputs[0], fa.outputs[0])
        _erase_dead(graph, m.chain)
        ctx.applied([n for n in m.chain if n.op != "Reshape"], "softmax(QKᵀ)V→FlashAttention")
        return 1
