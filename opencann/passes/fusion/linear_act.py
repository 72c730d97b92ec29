"""Stage 2, fusion: `FuseLinearAct`, MatMulV2 or MatMul [→ Reshape] → activation ⇒
LinearAct [→ Reshape]: the activation runs in place on the GEMM's output; a MatMulV2 or
MatMul with a constant fp32 or bf16 weight also becomes a LinearAct, whose kernel (addmm /
mm, oneDNN's prepacked inner product, and for fp32 MKL's packed GEMM or the decode GEMV)
is measured per shape at bind time (``ops/kernels/cpu.py`` `gemm_kernel`).

A MatMul is a bias-free Linear (Llama's, Mistral's and Qwen2's projections, LM heads:
core ATen decomposes ``F.linear(x, W)`` without a bias into ``mm(x, Wᵀ)``); its LinearAct
has no ``self`` (bias) input, and its ``addmm`` kernel is eager's ``mm`` (same bits)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from ...devices.cpu import mkl_packed_available, onednn_linear_available
from ...ir import Graph, Node, TensorRef
from ...ops.kernels.cpu import LINEAR_DTYPES
from ..base import PassContext, Skip
from .common import CpuFusion, _act, _stands_for, carry_keep_dtype


@dataclass
class _LinearMatch:
    mm: Node
    view: Optional[Node]         # a Reshape between the GEMM and the activation
    act_node: Optional[Node]
    act: str


class FuseLinearAct(CpuFusion):
    """MatMulV2(b, x, Wᵀ) or MatMul(x, Wᵀ) [→ Reshape] → activation ⇒ LinearAct(act)
    [→ Reshape]."""

    name, stage = "fuse_linear_act", "fusion"
    ops = ("MatMulV2", "MatMul")
    #: CANN fe ``fusion_pass_name.h`` "MatMulBiasAddFusionPass" (MatMul + BiasAdd) and the UB
    #: fusion reference's "ATbeMatMulElemwiseFusionPass" (MatMul/GEMM + Elemwise)
    switch_section = "UBFusion"
    cann_names = ("MatMulBiasAddFusionPass", "ATbeMatMulElemwiseFusionPass")

    def match(self, mm: Node, graph: Graph, ctx: PassContext):
        """A `_LinearMatch` for MatMulV2 (addmm) with alpha = beta = 1 and a 1-D bias, or
        a MatMul (mm, no bias), followed (through at most one Reshape, each the sole user)
        by an activation reading it; without one, a match with act "none" when the weight
        is a constant fp32 or bf16 tensor and a kernel can race eager's (a prepacked GEMM,
        oneDNN's, or MKL's for fp32, for an addmm; also the fp32 decode GEMV for a bias-free
        mm, whose shapes with 1..4 rows it serves); else a `Skip` with the reason."""
        if mm.op == "MatMul":
            bias, (x, w) = None, mm.inputs
        else:
            if mm.attrs.get("beta", 1) != 1 or mm.attrs.get("alpha", 1) != 1:
                return Skip("addmm with alpha/beta != 1")
            bias, x, w = mm.inputs
            if bias.desc.rank != 1:
                return Skip(f"bias {bias.desc} is not per-output-channel")
        view = None
        u = graph.sole_user(mm.outputs[0])
        if u is not None and u.op == "Reshape":
            view = u
            u = graph.sole_user(u.outputs[0])
        if _act(u) and u.inputs[0] is (view or mm).outputs[0]:
            tanh = u.op == "Gelu" and u.attrs.get("approximate", "none") == "tanh"
            return _LinearMatch(mm, view, u, "gelu_tanh" if tanh else _act(u))
        gemm = "mm" if bias is None else "addmm"
        dt = w.desc.dtype.torch
        raced = onednn_linear_available() or (
            dt == torch.float32 and (bias is None or mkl_packed_available()))
        if not (w.is_const and dt in LINEAR_DTYPES and w.desc.rank == 2 and raced):
            return Skip("no activation follows and the weight is not a constant fp32 or bf16 "
                        f"tensor for a prepacked GEMM: plain {gemm} already writes into the arena")
        return _LinearMatch(mm, None, None, "none")

    def rewrite(self, graph: Graph, m: _LinearMatch, ctx: PassContext) -> int:
        """Replace the MatMulV2 or MatMul (and the activation) by one LinearAct node
        (inputs [bias, x, w], or [x, w] without a bias; Gelu with approximate="tanh" as act
        "gelu_tanh"); a Reshape in between is kept and reads the activated result.
        Returns 1."""
        mm, u, act = m.mm, m.act_node, m.act
        if mm.op == "MatMul":
            ins, attrs = list(mm.inputs), {"mat1": TensorRef(0), "mat2": TensorRef(1)}
        else:
            ins = list(mm.inputs)
            attrs = {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2)}
        fused = graph.create_node("LinearAct", ins, dict(attrs, act=act),
                                  [mm.outputs[0].desc], name=f"{mm.name}_{act}",
                                  source=mm.source, scope=mm.scope, before=mm)
        carry_keep_dtype(_stands_for(fused, mm), mm)
        graph.replace_all_uses_with(mm.outputs[0], fused.outputs[0])
        graph.erase_node(mm)
        if u is None:
            ctx.applied([mm], "Linear GEMM autotune" if mm.op == "MatMulV2"
                        else "bias-free Linear GEMM autotune")
            return 1
        src = m.view.outputs[0] if m.view is not None else fused.outputs[0]
        graph.replace_all_uses_with(u.outputs[0], src)
        if m.view is not None:  # the GEMM's result is activated before the view: no eager value
            fused.meta.pop("origin", None)
        graph.erase_node(u)
        ctx.applied([mm, u], f"Linear+bias+{act}" if mm.op == "MatMulV2" else f"Linear+{act}")
        return 1
