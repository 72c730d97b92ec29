"""Stage 2, fusion: `FoldBatchNorm`, Conv2D → BatchNorm(eval) ⇒ Conv2D with W·α and b·α+β'
(α = γ/√(var+eps), β' = β−μ·α as eager's BatchNorm computes them; Ioffe & Szegedy 2015,
the standard inference-time fold, as in torch.fx's ``fuse_conv_bn_eval``). Changes
rounding: within 1e-5 relative in fp32. Not applied (Skip with the reason) where the fold
could move inf/NaN positions near the dtype's limit (`ops.parity.batchnorm_fold.fold_values`)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

from ...ir import Graph, Node, TensorRef, Value
from ..base import PassContext, RewritePass, Skip
from ...ops.parity import fold_values


@dataclass
class _BnMatch:
    conv: Node
    bn: Node
    params: List[Value]      # weight, bias, running_mean, running_var (constants)
    w: Value
    b: Optional[Value]
    folded: tuple            # (W', b') tensors


class FoldBatchNorm(RewritePass):
    """Conv2D → BatchNorm (inference) ⇒ Conv2D with folded weight and bias."""

    name, stage = "fold_batchnorm", "fusion"
    ops = ("BatchNorm", "HostFallback")
    switch_section, cann_names = "GraphFusion", ("ConvBatchnormFusionPass",)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """The rule over every BatchNorm (and HostFallback) node, then drop the
        constants the folds left unused; returns the number of folds."""
        n = super().run(graph, ctx)
        graph.prune_constants()
        return n

    def match(self, bn: Node, graph: Graph, ctx: PassContext):
        """A `_BnMatch` for an inference BatchNorm whose input is a (non-transposed)
        Conv2D read by it alone, with constant weight, bias and statistics and unused saved
        mean/var outputs, whose fold keeps eager's values (`fold_values`); otherwise a
        `Skip` naming the first condition that fails. A
        HostFallback running ``batch_norm`` (training mode) is a `Skip` telling to call
        ``model.eval()``; another HostFallback is None."""
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
        folded = fold_values(w.const, b.const if b is not None else None,
                             *(p.const for p in params), bn.attrs["eps"])
        if isinstance(folded, str):
            return Skip(f"{folded}; BatchNorm kept unfused")
        return _BnMatch(conv, bn, params, w, b, folded)

    def rewrite(self, graph: Graph, m: _BnMatch, ctx: PassContext) -> int:
        """Put the folded weight and bias computed by the match in (W' = W·α per output
        channel, b' = b·α + β', b = 0 when the conv has no bias; then the bias input is
        added); the BatchNorm node is erased. Returns 1."""
        conv, bn, w, b = m.conv, m.bn, m.w, m.b
        wf, bf = m.folded
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
