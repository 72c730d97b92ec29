"""Stage 2, fusion (first set). One class per rewrite, each with a match condition and
a one-line statement of what it rewrites (as ONNX Runtime's optimizers). Every match
that is not rewritten is reported with its reason.

- `FoldBatchNorm`: Conv2D → BatchNorm(eval) ⇒ Conv2D with W·γ/σ and (b−μ)·γ/σ+β.
  (Ioffe & Szegedy 2015; the standard inference-time fold, as in torch.fx's
  ``fuse_conv_bn_eval``). Changes rounding: within 1e-5 relative in fp32.
- `FuseConvAct`: Conv2D(+bias) → Relu/Gelu/Sigmoid/Tanh/Swish ⇒ ConvBiasAct.
- `FuseConvAddAct`: ConvBiasAct(none) → Add(·, r) [→ Relu] ⇒ ConvAddAct (oneDNN sum
  post-op, in place into r when r's memory dies there: no view or other alias of r is
  read later or returned).
- `FuseLinearAct`: MatMulV2 [→ Reshape] → activation ⇒ LinearAct [→ Reshape]: the
  activation runs in place on the GEMM's output; a MatMulV2 with a constant fp32 weight
  also becomes a LinearAct, whose kernel (addmm or MKL's packed GEMM) is measured per
  shape at bind time.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from ..ir import Graph, Node, TensorRef, Value
from ..ops import aliases_of, storage_roots
from ..ops.fused import mkl_packed_available, mkldnn_available
from .base import PassContext, RewritePass, Skip

_ACT_OPS = {"Relu": "relu", "Gelu": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Swish": "silu"}


@dataclass
class _BnMatch:
    conv: Node
    bn: Node
    params: List[Value]      # weight, bias, running_mean, running_var (constants)
    w: Value
    b: Optional[Value]


class FoldBatchNorm(RewritePass):
    """Conv2D → BatchNorm (inference) ⇒ Conv2D with folded weight and bias."""

    name, stage = "fold_batchnorm", "fusion"
    ops = ("BatchNorm", "HostFallback")
    switch_section, cann_names = "GraphFusion", ("ConvBatchnormFusionPass",)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        n = super().run(graph, ctx)
        graph.prune_constants()
        return n

    def match(self, bn: Node, graph: Graph, ctx: PassContext):
        if bn.op == "HostFallback":
            if "batch_norm" in str(bn.meta.get("aten", "")):
                return Skip("BatchNorm in training mode (batch statistics); call model.eval() "
                            "for inference")
            return None
        x = bn.arg("input")
        conv = x.producer
        if conv is None or conv.op != "Conv2D":
            return Skip(f"input is produced by {conv.op if conv else 'a graph input'}, not Conv2D")
        if graph.sole_user(x) is None:
            return Skip("the convolution's output is also used elsewhere")
        if conv.attrs.get("transposed"):
            return Skip("transposed convolution")
        params = [bn.arg(k) for k in ("weight", "bias", "running_mean", "running_var")]
        w, b = conv.arg("weight"), conv.arg("bias")
        if not all(isinstance(p, Value) and p.is_const for p in params) or not w.is_const \
                or (b is not None and not b.is_const):
            return Skip("weights or statistics are not constants")
        if any(o.users or o in graph.outputs for o in bn.outputs[1:]):
            return Skip("the saved mean/variance outputs are used")
        return _BnMatch(conv, bn, params, w, b)

    def rewrite(self, graph: Graph, m: _BnMatch, ctx: PassContext) -> int:
        conv, bn, w, b = m.conv, m.bn, m.w, m.b
        gamma, beta, mean, var = (p.const.double() for p in m.params)
        scale = gamma / torch.sqrt(var + bn.attrs["eps"])
        wf = (w.const.double() * scale.reshape(-1, 1, 1, 1)).to(w.const.dtype)
        b0 = b.const.double() if b is not None else torch.zeros_like(mean)
        bf = ((b0 - mean) * scale + beta).to(w.const.dtype)
        wv, bv = graph.add_const(wf, f"{conv.name}_w_bnfolded"), graph.add_const(bf, f"{conv.name}_b_bnfolded")
        conv.replace_input(w, wv)
        if b is not None:
            conv.replace_input(b, bv)
        else:
            conv.attrs["bias"] = TensorRef(conv.add_input(bv))
        graph.replace_all_uses_with(bn.outputs[0], conv.outputs[0])
        graph.erase_node(bn)
        ctx.applied([conv, bn])
        return 1


def _conv_check(conv: Node) -> Optional[str]:
    if not mkldnn_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    if conv.attrs.get("transposed"):
        return "transposed convolution (no fused oneDNN kernel used here)"
    if conv.outputs[0].desc.dtype.torch != torch.float32:
        return f"dtype {conv.outputs[0].desc.dtype.value}: fused oneDNN conv path is fp32 only here"
    if conv.outputs[0].desc.rank != 4:
        return "not a 2-D convolution"
    if any(p != 0 for p in conv.attrs.get("output_padding", [0])):
        return "output padding"
    return None


def _make_conv(graph: Graph, conv: Node, act: str, before: Node, name: str) -> Node:
    ins = [conv.arg("input"), conv.arg("weight")]
    b = conv.arg("bias")
    attrs = {k: conv.attrs[k] for k in ("stride", "padding", "dilation", "groups")}
    attrs.update(input=TensorRef(0), weight=TensorRef(1), act=act)
    if b is not None:
        ins.append(b)
        attrs["bias"] = TensorRef(2)
    fused = graph.create_node("ConvBiasAct", ins, attrs, [before.outputs[0].desc], name=name,
                              source=conv.source, scope=conv.scope, before=before)
    return _stands_for(fused, before)


def _stands_for(fused: Node, replaced: Node) -> Node:
    """``fused`` replaces ``replaced``'s output: it keeps that output's traced strides
    (``meta["strides"]``), which views after it and the caller (eager's strides) rely on."""
    if replaced.meta.get("strides"):
        fused.meta["strides"] = replaced.meta["strides"][:1]
    return fused


class CpuFusion(RewritePass):
    """A fusion into CPU kernels (oneDNN post-ops, BLAS GEMMs): on other devices it does
    nothing and says so in the report."""

    devices = ("cpu",)
    off_device_note = "cpu-only fusion (oneDNN/BLAS kernels): skipped on {device}"


@dataclass
class _ConvMatch:
    conv: Node
    act: Optional[Node]          # the activation fused, None: the conv alone
    why_not_act: str = ""        # why the user activation was not fused


class FuseConvAct(CpuFusion):
    """Conv2D → activation ⇒ ConvBiasAct(act); a lone Conv2D ⇒ ConvBiasAct(none) so it
    also gets oneDNN's prepacked weight."""

    name, stage = "fuse_conv_act", "fusion"
    ops = ("Conv2D",)
    switch_section = "UBFusion"

    def match(self, conv: Node, graph: Graph, ctx: PassContext):
        why = _conv_check(conv)
        if why:
            return Skip(why)
        user = graph.sole_user(conv.outputs[0])
        if user is None:
            several = len(conv.outputs[0].users) > 1
            return _ConvMatch(conv, None, "the convolution's output has several users" if several else "")
        if user.op not in _ACT_OPS or user.inputs[0] is not conv.outputs[0]:
            return _ConvMatch(conv, None)
        if user.op == "Gelu" and user.attrs.get("approximate", "none") != "none":
            return _ConvMatch(conv, None, f"Gelu(approximate={user.attrs['approximate']!r}): the "
                              "fused oneDNN convolution here applies only the exact (erf) GELU")
        return _ConvMatch(conv, user)

    def rewrite(self, graph: Graph, m: _ConvMatch, ctx: PassContext) -> int:
        conv, user = m.conv, m.act
        if m.why_not_act:
            ctx.skipped(conv, m.why_not_act)
        if user is not None:
            fused = _make_conv(graph, conv, _ACT_OPS[user.op], user, conv.name + "_" + user.op.lower())
            graph.replace_all_uses_with(user.outputs[0], fused.outputs[0])
            graph.erase_node(user)
            graph.erase_node(conv)
            ctx.applied([conv, user], f"Conv+{user.op}")
        else:
            fused = _make_conv(graph, conv, "none", conv, conv.name)
            graph.replace_all_uses_with(conv.outputs[0], fused.outputs[0])
            graph.erase_node(conv)
        return 1


@dataclass
class _AddMatch:
    conv: Node
    add: Node
    other: Value                 # the addend
    relu: Optional[Node]


class FuseConvAddAct(CpuFusion):
    """ConvBiasAct(none) → Add(·, r) [→ Relu] ⇒ ConvAddAct (sum post-op into r)."""

    name, stage = "fuse_conv_add_act", "fusion"
    ops = ("Add",)
    switch_section = "UBFusion"

    def match(self, add: Node, graph: Graph, ctx: PassContext):
        if not any(v.producer is not None and v.producer.op in ("ConvBiasAct", "Conv2D")
                   for v in add.inputs):
            return None   # no convolution feeds it: not this pattern's root
        if add.attrs.get("alpha", 1) != 1:
            return Skip(f"Add with alpha={add.attrs['alpha']} (x + alpha·y); oneDNN's sum "
                        "post-op adds with scale 1")
        if len(add.inputs) != 2:
            return Skip("adds a scalar, not a tensor; oneDNN's sum post-op adds a tensor")
        for a, b in ((0, 1), (1, 0)):
            p = add.inputs[a].producer
            if p is not None and p.op == "ConvBiasAct" and p.attrs["act"] == "none" \
                    and graph.sole_user(p.outputs[0]) is add and add.inputs[b] is not add.inputs[a]:
                conv, other = p, add.inputs[b]
                break
        else:
            return Skip("the convolution already has a fused activation or its output has "
                        "other users")
        out = conv.outputs[0].desc
        if other.desc.shape != out.shape or other.desc.dtype != out.dtype:
            return Skip(f"addend {other.desc} is broadcast (not the conv's full output {out}); "
                        "oneDNN's sum post-op needs equal shapes")
        relu = graph.sole_user(add.outputs[0])
        return _AddMatch(conv, add, other, relu if relu is not None and relu.op == "Relu" else None)

    def rewrite(self, graph: Graph, m: _AddMatch, ctx: PassContext) -> int:
        conv, add, other, relu = m.conv, m.add, m.other, m.relu
        last = relu or add
        why = _why_not_in_place(graph, conv, add, other)
        if why:
            ctx.skipped(add, why + "; using the out-of-place sum", "in place")
        ins = list(conv.inputs) + [other]
        attrs = dict(conv.attrs, other=TensorRef(len(ins) - 1), inplace=not why,
                     act="relu" if relu else "none")
        if not why:
            attrs["inplace_input"] = len(ins) - 1
        fused = graph.create_node("ConvAddAct", ins, attrs, [last.outputs[0].desc],
                                  name=conv.name + "_add" + ("_relu" if relu else ""),
                                  source=conv.source, scope=conv.scope, before=last)
        _stands_for(fused, last)
        graph.replace_all_uses_with(last.outputs[0], fused.outputs[0])
        for nd in ([relu] if relu else []) + [add, conv]:
            graph.erase_node(nd)
        ctx.applied([conv, add] + ([relu] if relu else []), "Conv+Add" + ("+Relu" if relu else ""))
        return 1


def _why_not_in_place(graph: Graph, conv: Node, add: Node, other: Value) -> str:
    """Why the sum cannot be written in place into the addend ("" if it can): the addend
    must own its memory (not a graph input, constant or view) and nothing that may
    share that memory (the addend, its views, views of those, split outputs...) may be
    read after ``add``, be returned or feed the convolution."""
    step = {nd: i for i, nd in enumerate(graph.nodes)}
    roots = storage_roots(graph, writes_as_fresh=True)
    if other.producer is None or roots.get(other.id) != frozenset((other.id,)):
        return "the addend is a graph input, constant or view"
    sharing = [other] + aliases_of(graph, other, roots)
    if any(u is not add and step.get(u, -1) > step[add] for v in sharing for u in v.users):
        return "the addend (or a view of it) is read again later"
    if any(v in graph.outputs for v in sharing):
        return "the addend (or a view of it) is a graph output"
    if any(v in conv.inputs for v in sharing):
        return "the addend is also the convolution's input"
    return ""


@dataclass
class _LinearMatch:
    mm: Node
    view: Optional[Node]         # a Reshape between the GEMM and the activation
    act_node: Optional[Node]
    act: str


class FuseLinearAct(CpuFusion):
    """MatMulV2(b, x, Wᵀ) [→ Reshape] → activation ⇒ LinearAct(act) [→ Reshape]."""

    name, stage = "fuse_linear_act", "fusion"
    ops = ("MatMulV2",)
    switch_section = "UBFusion"

    def match(self, mm: Node, graph: Graph, ctx: PassContext):
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
        if u is not None and u.op in _ACT_OPS and u.inputs[0] is (view or mm).outputs[0]:
            tanh = u.op == "Gelu" and u.attrs.get("approximate", "none") == "tanh"
            return _LinearMatch(mm, view, u, "gelu_tanh" if tanh else _ACT_OPS[u.op])
        if not (w.is_const and w.desc.dtype.torch == torch.float32 and mkl_packed_available()):
            return Skip("no activation follows and the weight is not a constant fp32 tensor "
                        "for MKL's packed GEMM: plain addmm already writes into the arena")
        return _LinearMatch(mm, None, None, "none")

    def rewrite(self, graph: Graph, m: _LinearMatch, ctx: PassContext) -> int:
        mm, u, act = m.mm, m.act_node, m.act
        bias, x, w = mm.inputs
        fused = graph.create_node("LinearAct", [bias, x, w],
                                  {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2), "act": act},
                                  [mm.outputs[0].desc], name=f"{mm.name}_{act}",
                                  source=mm.source, scope=mm.scope, before=mm)
        _stands_for(fused, mm)
        graph.replace_all_uses_with(mm.outputs[0], fused.outputs[0])
        graph.erase_node(mm)
        if u is None:
            ctx.applied([mm], "Linear GEMM autotune")
            return 1
        src = m.view.outputs[0] if m.view is not None else fused.outputs[0]
        graph.replace_all_uses_with(u.outputs[0], src)
        graph.erase_node(u)
        ctx.applied([mm, u], f"Linear+bias+{act}")
        return 1
