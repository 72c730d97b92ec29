"""Recomputable BatchNorm outputs for training (part of the recomputation stage).

A training-mode BatchNorm reads the running statistics that the step then overwrites,
so the BatchNorm op itself is never recomputed (`recompute.is_stateful`). Its *output*,
however, is a per-channel affine map of its input once the batch statistics are known:

    y = x * scale + shift,  scale = rstd * weight,  shift = bias - mean * scale

with ``mean`` and ``rstd`` (shape [C], fp32) the statistics the op already returns and
the backward already saves. `rewrite_batch_norm_outputs` rewires every user of the
output to that affine form (``aten.addcmul``, one elementwise pass, plus [C]-sized ops),
so the minimum cut may save the BatchNorm *input* (which the BatchNorm backward reads
anyway) and recompute the output and what follows it (ReLU, residual Add, even the next
convolution under a budget) in the backward, instead of saving a second activation per
layer. Sources: the BatchNorm definition (Ioffe & Szegedy 2015, arXiv:1502.03167,
Algorithm 1); dropping the outputs of cheap operators such as BatchNorm and activations
and recomputing them in the backward is Chen et al. 2016's (arXiv:1604.06174) first
memory-saving heuristic.

After the partition, `forward_uses_native_outputs` puts the op's own output back in the
forward graph, so the forward pays nothing; the affine form runs only where the backward
recomputes. The two agree to float rounding (bitwise on ResNet-50 on this machine).
"""
from __future__ import annotations

import operator
from typing import Dict, List, Tuple

import torch
import torch.fx as fx

aten = torch.ops.aten

# training BatchNorm overloads with (input, weight, bias, running_mean, running_var,
# training, momentum, eps) and outputs (out, save_mean, save_rstd, ...)
TRAINING_BATCH_NORMS = (aten._native_batch_norm_legit_functional.default,
                        aten._native_batch_norm_legit.default,
                        aten.native_batch_norm.default)
TAG = "opencann_bn_recompute"  # node.meta key: the BatchNorm node's name


def _getitem(bn: fx.Node, i: int):
    for u in bn.users:
        if u.target is operator.getitem and u.args[1] == i:
            return u
    return None


def _call(g: fx.Graph, target, args, val):
    n = g.call_function(target, args)
    n.meta["val"] = val
    return n


def rewrite_batch_norm_outputs(gm: fx.GraphModule) -> Tuple[List[str], Dict[str, str]]:
    """Rewire the users of each training BatchNorm's output to ``addcmul(shift, x,
    scale)`` built from the op's saved mean/rstd (see the module docstring). Returns
    (names of the rewritten BatchNorm nodes, {name: why it was left as is} for the
    others: unused output or statistics, an input that is not fp32/fp64 of rank >= 2
    matching the statistics' dtype). The graph is recompiled when anything changed."""
    done, kept = [], {}
    g = gm.graph
    pos = {n: i for i, n in enumerate(g.nodes)}
    for bn in list(g.nodes):
        if bn.op != "call_function" or bn.target not in TRAINING_BATCH_NORMS or not bn.args[5]:
            continue
        x, w, b = bn.args[0], bn.args[1], bn.args[2]
        out, mean, rstd = (_getitem(bn, i) for i in range(3))
        if out is None or not out.users or mean is None or rstd is None:
            kept[bn.name] = "its output or statistics are unused"
            continue
        xv, mv = x.meta.get("val"), mean.meta.get("val")
        if not isinstance(xv, torch.Tensor) or xv.dim() < 2:
            kept[bn.name] = "its input is not a tensor of rank >= 2"
            continue
        if xv.dtype != mv.dtype or xv.dtype not in (torch.float32, torch.float64):
            kept[bn.name] = (f"input {xv.dtype} with {mv.dtype} statistics: the rewrite is "
                             "for fp32/fp64 only (in low precision the affine form would round "
                             "differently from the op's own output)")
            continue
        shape = [xv.shape[1]] + [1] * (xv.dim() - 2)
        with g.inserting_before(max(out, mean, rstd, key=pos.__getitem__).next):
            scale = rstd if w is None else _call(g, aten.mul.Tensor, (rstd, w), mv * w.meta["val"])
            ms = _call(g, aten.mul.Tensor, (mean, scale), mv * scale.meta["val"])
            if b is None:
                shift = _call(g, aten.neg.default, (ms,), -ms.meta["val"])
            else:
                shift = _call(g, aten.sub.Tensor, (b, ms), b.meta["val"] - ms.meta["val"])
            sv = _call(g, aten.view.default, (scale, shape), scale.meta["val"].view(shape))
            hv = _call(g, aten.view.default, (shift, shape), shift.meta["val"].view(shape))
            y = _call(g, aten.addcmul.default, (hv, x, sv), out.meta["val"].clone())
        y.meta[TAG] = bn.name
        out.replace_all_uses_with(y)
        done.append(bn.name)
    if done:
        g.lint()
        gm.recompile()
    return done, kept


def forward_uses_native_outputs(fw: fx.GraphModule) -> int:
    """In a partitioned forward graph, replace each affine recomputation made by
    `rewrite_batch_norm_outputs` with the BatchNorm op's own output (which the forward
    computes anyway); dead [C]-sized helpers are removed. Returns how many were
    replaced."""
    g = fw.graph
    by_name = {n.name: n for n in g.nodes}
    count = 0
    for y in list(g.nodes):
        bn = by_name.get(y.meta.get(TAG, ""))
        if bn is None:
            continue
        out = _getitem(bn, 0)
        if out is None:
            with g.inserting_after(bn):
                out = _call(g, operator.getitem, (bn, 0), y.meta["val"])
        y.replace_all_uses_with(out)
        g.erase_node(y)
        count += 1
    if count:
        g.eliminate_dead_code()
        fw.recompile()
    return count


def drop_running_stats_from_backward(gm: fx.GraphModule) -> int:
    """``native_batch_norm_backward(..., running_mean, running_var, ..., train=True, ...)``
    ignores the running statistics (it uses the saved batch statistics), but as
    arguments they would be saved for the backward, and AOTAutograd's epilogue then
    overwrites them in place, failing autograd's version check. Pass None instead
    (both are optional in the schema). Returns how many nodes changed."""
    count = 0
    for n in gm.graph.nodes:
        if n.target is aten.native_batch_norm_backward.default and n.args[7] is True \
                and (n.args[3] is not None or n.args[4] is not None):
            n.args = n.args[:3] + (None, None) + n.args[5:]
            count += 1
    if count:
        gm.graph.eliminate_dead_code()
        gm.recompile()
    return count
