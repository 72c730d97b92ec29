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

from typing import Optional

import torch

from ..ir import Graph, Node, TensorRef, Value
from ..ops import aliases_of, storage_roots
from ..ops.fused import mkl_packed_available, mkldnn_available
from .base import Pass, PassContext

_ACT_OPS = {"Relu": "relu", "Gelu": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Swish": "silu"}


class FoldBatchNorm(Pass):
    """Conv2D → BatchNorm (inference) ⇒ Conv2D with folded weight and bias."""

    name, stage = "fold_batchnorm", "fusion"
    switch_section, cann_names = "GraphFusion", ("ConvBatchnormFusionPass",)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        n = 0
        for bn in list(graph.nodes):
            if bn.op == "HostFallback" and "batch_norm" in str(bn.meta.get("aten", "")):
                ctx.skipped("FoldBatchNorm", bn, "BatchNorm in training mode (batch statistics); "
                            "call model.eval() for inference")
                continue
            if bn.op != "BatchNorm":
                continue
            x = bn.arg("input")
            conv = x.producer
            if conv is None or conv.op != "Conv2D":
                ctx.skipped("FoldBatchNorm", bn, f"input is produced by {conv.op if conv else 'a graph input'}, not Conv2D")
                continue
            if graph.sole_user(x) is None:
                ctx.skipped("FoldBatchNorm", bn, "the convolution's output is also used elsewhere")
                continue
            if conv.attrs.get("transposed"):
                ctx.skipped("FoldBatchNorm", bn, "transposed convolution")
                continue
            params = [bn.arg(k) for k in ("weight", "bias", "running_mean", "running_var")]
            w = conv.arg("weight")
            b = conv.arg("bias")
            if not all(isinstance(p, Value) and p.is_const for p in params) or not w.is_const \
                    or (b is not None and not b.is_const):
                ctx.skipped("FoldBatchNorm", bn, "weights or statistics are not constants")
                continue
            gamma, beta, mean, var = (p.const.double() for p in params)
            eps = bn.attrs["eps"]
            scale = gamma / torch.sqrt(var + eps)
            wf = (w.const.double() * scale.reshape(-1, 1, 1, 1)).to(w.const.dtype)
            b0 = b.const.double() if b is not None else torch.zeros_like(mean)
            bf = ((b0 - mean) * scale + beta).to(w.const.dtype)
            wv, bv = graph.add_const(wf, f"{conv.name}_w_bnfolded"), graph.add_const(bf, f"{conv.name}_b_bnfolded")
            conv.replace_input(w, wv)
            if b is not None:
                conv.replace_input(b, bv)
            else:
                conv.attrs["bias"] = TensorRef(conv.add_input(bv))
            if any(o.users or o in graph.outputs for o in bn.outputs[1:]):
                ctx.skipped("FoldBatchNorm", bn, "the saved mean/variance outputs are used")
                continue
            graph.replace_all_uses_with(bn.outputs[0], conv.outputs[0])
            graph.erase_node(bn)
            ctx.applied("Conv+BN fold", [conv, bn])
            n += 1
        graph.prune_constants()
        return n


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


class CpuFusion(Pass):
    """A fusion into CPU kernels (oneDNN post-ops, BLAS GEMMs): on other devices it does
    nothing and says so in the report."""

    def run(self, graph: Graph, ctx: PassContext) -> int:
        if not ctx.device.startswith("cpu"):
            ctx.artifacts["note"] = f"cpu-only fusion (oneDNN/BLAS kernels): skipped on {ctx.device}"
            return 0
        return self.rewrite(graph, ctx)

    def rewrite(self, graph: Graph, ctx: PassContext) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class FuseConvAct(CpuFusion):
    """Conv2D → activation ⇒ ConvBiasAct(act); a lone Conv2D ⇒ ConvBiasAct(none) so it
    also gets oneDNN's prepacked weight."""

    name, stage = "fuse_conv_act", "fusion"
    switch_section = "UBFusion"

    def rewrite(self, graph: Graph, ctx: PassContext) -> int:
        n = 0
        for conv in list(graph.nodes):
            if conv.op != "Conv2D":
                continue
            why = _conv_check(conv)
            if why:
                ctx.skipped("Conv+activation", conv, why)
                continue
            user = graph.sole_user(conv.outputs[0])
            if user is not None and user.op in _ACT_OPS and user.inputs[0] is conv.outputs[0] \
                    and not (user.op == "Gelu" and user.attrs.get("approximate", "none") != "none"):
                fused = _make_conv(graph, conv, _ACT_OPS[user.op], user, conv.name + "_" + user.op.lower())
                graph.replace_all_uses_with(user.outputs[0], fused.outputs[0])
                graph.erase_node(user)
                graph.erase_node(conv)
                ctx.applied(f"Conv+{user.op}", [conv, user])
            else:
                if user is None and len(conv.outputs[0].users) > 1:
                    ctx.skipped("Conv+activation", conv, "the convolution's output has several users")
                fused = _make_conv(graph, conv, "none", conv, conv.name)
                graph.replace_all_uses_with(conv.outputs[0], fused.outputs[0])
                graph.erase_node(conv)
            n += 1
        return n


class FuseConvAddAct(CpuFusion):
    """ConvBiasAct(none) → Add(·, r) [→ Relu] ⇒ ConvAddAct (sum post-op into r)."""

    name, stage = "fuse_conv_add_act", "fusion"
    switch_section = "UBFusion"

    def rewrite(self, graph: Graph, ctx: PassContext) -> int:
        n = 0
        step = {nd: i for i, nd in enumerate(graph.nodes)}
        for add in list(graph.nodes):
            if add.op != "Add" or add.attrs.get("alpha", 1) != 1 or len(add.inputs) != 2:
                continue
            conv = other = None
            for a, b in ((0, 1), (1, 0)):
                p = add.inputs[a].producer
                if p is not None and p.op == "ConvBiasAct" and p.attrs["act"] == "none" \
                        and graph.sole_user(p.outputs[0]) is add and add.inputs[b] is not add.inputs[a]:
                    conv, other = p, add.inputs[b]
                    break
            if conv is None:
                if any(v.producer is not None and v.producer.op in ("ConvBiasAct", "Conv2D")
                       for v in add.inputs):
                    ctx.skipped("Conv+Add", add, "the convolution already has a fused activation "
                                "or its output has other users")
                continue
            if other.desc.shape != conv.outputs[0].desc.shape or other.desc.dtype != conv.outputs[0].desc.dtype:
                ctx.skipped("Conv+Add", add, f"addend {other.desc} is broadcast (not the conv's "
                            f"full output {conv.outputs[0].desc}); oneDNN's sum post-op needs equal shapes")
                continue
            relu = graph.sole_user(add.outputs[0])
            relu = relu if relu is not None and relu.op == "Relu" else None
            last = relu or add
            # in place into the addend only if it owns its memory (not a graph input,
            # constant or view) and nothing that may share that memory (the addend, its
            # views, views of those, split outputs...) is read after this node or returned
            roots = storage_roots(graph, writes_as_fresh=True)
            owns = other.producer is not None and roots.get(other.id) == frozenset((other.id,))
            sharing = [other] + aliases_of(graph, other, roots)
            later = [u for v in sharing for u in v.users if u is not add and step.get(u, -1) > step[add]]
            returned = any(v in graph.outputs for v in sharing)
            feeds_conv = any(v in conv.inputs for v in sharing)
            inplace = owns and not later and not returned and not feeds_conv
            if not inplace:
                reason = ("the addend is a graph input, constant or view" if not owns else
                          "the addend (or a view of it) is read again later" if later else
                          "the addend (or a view of it) is a graph output" if returned else
                          "the addend is also the convolution's input")
                ctx.skipped("Conv+Add in place", add, reason + "; using the out-of-place sum")
            ins = list(conv.inputs) + [other]
            attrs = dict(conv.attrs, other=TensorRef(len(ins) - 1), inplace=inplace,
                         act="relu" if relu else "none")
            if inplace:
                attrs["inplace_input"] = len(ins) - 1
            fused = graph.create_node("ConvAddAct", ins, attrs, [last.outputs[0].desc],
                                      name=conv.name + "_add" + ("_relu" if relu else ""),
                                      source=conv.source, scope=conv.scope, before=last)
            _stands_for(fused, last)
            graph.replace_all_uses_with(last.outputs[0], fused.outputs[0])
            for nd in ([relu] if relu else []) + [add, conv]:
                graph.erase_node(nd)
            ctx.applied("Conv+Add" + ("+Relu" if relu else ""), [conv, add] + ([relu] if relu else []))
            step = {nd: i for i, nd in enumerate(graph.nodes)}
            n += 1
        return n


class FuseLinearAct(CpuFusion):
    """MatMulV2(b, x, Wᵀ) [→ Reshape] → activation ⇒ LinearAct(act) [→ Reshape]."""

    name, stage = "fuse_linear_act", "fusion"
    switch_section = "UBFusion"

    def rewrite(self, graph: Graph, ctx: PassContext) -> int:
        n = 0
        for mm in list(graph.nodes):
            if mm.op != "MatMulV2":
                continue
            if mm.attrs.get("beta", 1) != 1 or mm.attrs.get("alpha", 1) != 1:
                ctx.skipped("Linear+activation", mm, "addmm with alpha/beta != 1")
                continue
            bias, x, w = mm.inputs
            if bias.desc.rank != 1:
                ctx.skipped("Linear+activation", mm, f"bias {bias.desc} is not per-output-channel")
                continue
            view = None
            u = graph.sole_user(mm.outputs[0])
            if u is not None and u.op == "Reshape":
                view = u
                u = graph.sole_user(u.outputs[0])
            if u is None or u.op not in _ACT_OPS or u.inputs[0] is not (view or mm).outputs[0]:
                act, u = "none", None
                if not (w.is_const and w.desc.dtype.torch == torch.float32 and mkl_packed_available()):
                    continue  # nothing to gain: plain addmm already writes into the arena
            else:
                act = _ACT_OPS[u.op]
                if u.op == "Gelu" and u.attrs.get("approximate", "none") == "tanh":
                    act = "gelu_tanh"
            fused = graph.create_node("LinearAct", [bias, x, w],
                                      {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2), "act": act},
                                      [mm.outputs[0].desc], name=f"{mm.name}_{act}",
                                      source=mm.source, scope=mm.scope, before=mm)
            _stands_for(fused, mm)
            graph.replace_all_uses_with(mm.outputs[0], fused.outputs[0])
            graph.erase_node(mm)
            if u is None:
                ctx.applied("Linear GEMM autotune", [mm])
                n += 1
                continue
            src = view.outputs[0] if view is not None else fused.outputs[0]
            graph.replace_all_uses_with(u.outputs[0], src)
            graph.erase_node(u)
            ctx.applied(f"Linear+bias+{act}", [mm, u])
            n += 1
        return n
