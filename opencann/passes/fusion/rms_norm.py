"""Stage 2, fusion: `FuseRMSNorm`, Llama's RMSNorm as transformers' ``LlamaRMSNorm`` writes
it, ``w · (h · rsqrt(mean(h², -1, keepdim) + eps)).to(dtype)`` with ``h = x.to(float32)``
(the casts vanish in an fp32 model) ⇒ RmsNorm(x, w): one ATen ``rms_norm`` kernel instead
of six passes. Source: Zhang & Sennrich 2019, "Root Mean Square Layer Normalization"
(arXiv:1910.07467); transformers ``models/llama/modeling_llama.py``.

Matched exactly or not at all: the mean over the last axis with keepdim, exponent 2, eps
added before the rsqrt, the same tensor squared and scaled, a weight of shape [D]; casts
only as the pair float32-in / back-to-the-input's-dtype. In fp32 the fused kernel is
bit-for-bit eager's; with the casts it repeats them (the weight multiplies after the cast
back, as transformers does).

Special values: ATen's ``rms_norm`` is today the same ops as the spelled-out form, so it
overflows where eager does (|x| ≈ 1e20 gives a row of zeros). A fused kernel that
accumulated differently would not; the rewrite asks the probe of this CPU and torch
(`special_values_differ`, "rms_norm", in the dtype the norm computes in) first, keeps the
spelled-out form with its reason otherwise, and a model file holding the fusion is
re-checked at load."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import List, Optional

import torch

from ...ir import Graph, Node, TensorRef, Value
from ..base import PassContext, RewritePass, Skip
from .match import (producer, read_outside, record_formula, replace_with, scalar_operand,
                    special_values_differ, tensor_pair)


@dataclass
class _RmsMatch:
    root: Node                  # the last matched node (weight Mul, cast back, or h·r)
    x: Value
    weight: Optional[Value]
    eps: float
    upcast: bool
    nodes: List[Node] = field(default_factory=list)
    h: Optional[Value] = None   # the normalized tensor (float32 after an upcast)


def _last_axis(mean: Node, rank: int) -> Optional[str]:
    dims = [d % rank for d in (mean.attrs.get("dim") or [])]
    if dims != [rank - 1]:
        return f"the mean is over dims {mean.attrs.get('dim')}, RMSNorm's over the last axis"
    if not mean.attrs.get("keepdim"):
        return "the mean drops the reduced axis (keepdim=False)"
    return None


def _denominator(h: Value, r: Value) -> "tuple | Skip":
    """(eps, nodes) when ``r`` is rsqrt(mean(h², -1, keepdim) + eps), else a Skip."""
    rs = producer(r, "Rsqrt")
    add = scalar_operand(producer(rs.inputs[0]), "Add", "Adds")
    if add is None:
        return Skip("no constant eps is added to the mean square before the rsqrt")
    mean = producer(add[0], "ReduceMean")
    pw = producer(mean.inputs[0], "Pow") if mean is not None else None
    if mean is None or pw is None:
        return Skip("the rsqrt's argument is not mean(h²) + eps")
    if pw.attrs.get("exponent") != 2:
        return Skip(f"the mean is of h^{pw.attrs.get('exponent')}, RMSNorm's of h²")
    if pw.inputs[0] is not h:
        return Skip(f"scales {h} by the RMS of another tensor, {pw.inputs[0]}")
    why = _last_axis(mean, h.desc.rank)
    if why:
        return Skip(why)
    return add[1], [rs, producer(rs.inputs[0]), mean, pw]


def _exact(m: _RmsMatch) -> Optional[str]:
    """Why RmsNorm(x) would not give the matched result (None when it does): a result of
    another shape or dtype than x (an eps tensor that broadcasts), or float16 without the
    float32 casts (eager's h² overflows to inf past |h| = 256 where ATen's kernel
    accumulates in float32)."""
    if m.root.outputs[0].desc != m.x.desc:
        return (f"the result {m.root.outputs[0].desc} is not shaped and typed like x "
                f"{m.x.desc}")
    if not m.upcast and m.x.desc.dtype.torch == torch.float16:
        return ("computed in float16 without casting to float32: eager's h² overflows past "
                "|h| = 256, the fused kernel's float32 does not")
    return None


class FuseRMSNorm(RewritePass):
    """[Mul(w, ·)] [Cast] Mul(h, Rsqrt(Add(ReduceMean(Pow(h, 2), -1, keepdim), eps))),
    h = [Cast(float32)] x ⇒ RmsNorm(x, [D], w, eps)."""

    name, stage = "fuse_rms_norm", "fusion"
    ops = ("Mul",)
    switch_section = "GraphFusion"

    def match(self, mul: Node, graph: Graph, ctx: PassContext):
        """The matched nodes when ``node`` is the root of Llama's RMSNorm ``x · rsqrt(mean(x²,
        -1, keepdim) + eps) · w``; a `Skip` with the reason for a near miss; None when
        ``node`` cannot be the root."""
        pair = tensor_pair(mul, "Mul")
        if pair is None:
            return None
        hit = [(h, r) for h, r in (pair, pair[::-1]) if producer(r, "Rsqrt") is not None]
        if not hit:
            return None
        h, r = hit[0]
        den = _denominator(h, r)
        if isinstance(den, Skip):
            return den
        eps, nodes = den
        m = _RmsMatch(mul, h, None, eps, False, [mul] + nodes, h)
        why = self._casts(graph, m) or self._weight(graph, m) or _exact(m)
        if why:
            return Skip(why)
        skip = read_outside(graph, m.nodes, m.root, "RMSNorm") \
            or special_values_differ(h, "rms_norm")     # h: the dtype the norm computes in
        if skip is not None:
            return skip
        if not isinstance(m.x.desc.shape[-1], int):
            return Skip(f"the normalized dim {m.x.desc.shape[-1]} is dynamic: RMSNorm's "
                        "normalized_shape must be static")
        return m

    @staticmethod
    def _casts(graph: Graph, m: _RmsMatch) -> Optional[str]:
        up = producer(m.x, "Cast")
        if up is None:
            return None
        down = graph.sole_user(m.root.outputs[0])
        x = up.inputs[0]
        if m.x.desc.dtype.torch != torch.float32 or down is None or down.op != "Cast" \
                or down.outputs[0].desc.dtype != x.desc.dtype:
            return (f"casts {x.desc.dtype.value} to {m.x.desc.dtype.value} without casting "
                    "the result back (transformers' LlamaRMSNorm computes in float32 and "
                    "casts back)")
        m.x, m.upcast, m.root = x, True, down
        m.nodes += [up, down]
        return None

    @staticmethod
    def _weight(graph: Graph, m: _RmsMatch) -> Optional[str]:
        u = graph.sole_user(m.root.outputs[0])
        pair = tensor_pair(u, "Mul")
        if pair is None:
            return None
        w = pair[1] if pair[0] is m.root.outputs[0] else pair[0]
        d = m.x.desc.shape[-1]
        if tuple(w.desc.shape) != (d,) or u.outputs[0].desc != m.root.outputs[0].desc:
            return None   # not a per-feature weight: the product is left alone
        m.weight, m.root = w, u
        m.nodes.append(u)
        return None

    def rewrite(self, graph: Graph, m: _RmsMatch, ctx: PassContext) -> int:
        """Replace the matched nodes by one `RmsNorm` node; returns the number of rewrites (1)."""
        ins = [m.x] + ([m.weight] if m.weight is not None else [])
        attrs = {"input": TensorRef(0), "normalized_shape": [int(m.x.desc.shape[-1])],
                 "weight": TensorRef(1) if m.weight is not None else None, "eps": m.eps,
                 "upcast": m.upcast}
        new = graph.create_node("RmsNorm", ins, attrs, [m.root.outputs[0].desc],
                                name=f"{m.root.name}_rms_norm", source=m.root.source,
                                scope=m.root.scope, before=m.root)
        replace_with(graph, m.root, new, m.nodes)
        record_formula(graph, "rms_norm", m.h)
        ctx.applied(m.nodes, "Llama RMSNorm" + (" (float32 casts)" if m.upcast else ""))
        return 1
