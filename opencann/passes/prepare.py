"""Stage 1, prepare: constant folding, dead-code elimination, common-subexpression
elimination. (Shape/dtype inference runs at conversion, checked against FX.)"""
from __future__ import annotations

from typing import Any, Dict, Tuple

import torch

from ..ir import Graph, Node, TensorListRef, TensorRef
from ..ops import OpKind, call_args, get_op, is_random
from .base import Pass, PassContext, RewritePass, Skip

FOLD_LIMIT_BYTES = 64 << 20  # don't materialise folded constants larger than this


class ConstantFolding(Pass):
    """Evaluate nodes whose inputs are all constants (weight permutes, masks built from
    arange/full...) once at compile time; outputs become graph constants. Random nodes
    (`is_random`: rand, randn(4, 6) with no inputs at all...) are never folded: they
    draw anew on every call."""

    name, stage = "constant_folding", "prepare"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        n = 0
        for node in list(graph.nodes):
            op = get_op(node.op)
            if op.kind == OpKind.FUSED or is_random(node):
                continue
            if not all(v.is_const for v in node.inputs):
                continue
            if sum(o.desc.nbytes for o in node.outputs) > FOLD_LIMIT_BYTES:
                ctx.skipped(node, f"output larger than {FOLD_LIMIT_BYTES >> 20} MiB")
                continue
            target = op.aten or node.meta.get("aten")
            args, kwargs = call_args(node, [v.const for v in node.inputs])
            try:
                with torch.no_grad():
                    res = target(*args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the model itself fails: say where
                raise ValueError(
                    f"{node.name} ({node.op}) at {node.where()} fails on its constant inputs "
                    f"at compile time ({type(e).__name__}: {(str(e).splitlines() or [''])[0]}), "
                    "so the model fails on every input of these shapes, as in eager; fix: check "
                    "the example inputs' shapes (e.g. a sequence longer than the model's "
                    "position table)") from None
            res = list(res) if isinstance(res, (tuple, list)) else [res]
            for o, r in zip(node.outputs, res):
                c = graph.add_const(r, name=f"{node.name}_folded")
                graph.replace_all_uses_with(o, c)
            graph.erase_node(node)
            n += 1
        graph.prune_constants()
        return n


class DeadCodeElimination(Pass):
    """Remove nodes none of whose outputs are used. Unused random ops are removed too:
    their values are unobservable. The compiled model then advances torch's RNG by
    fewer draws than eager would; its random stream is its own (reproducible under
    ``torch.manual_seed``), not eager's bit for bit."""

    name, stage = "dce", "prepare"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        outs = {id(v) for v in graph.outputs}
        n = 0
        for node in reversed(list(graph.nodes)):
            if not any(o.users or id(o) in outs for o in node.outputs):
                graph.erase_node(node)
                n += 1
        graph.prune_constants()
        return n


def _key(node) -> Tuple:
    def freeze(a: Any):
        if isinstance(a, (list, tuple)):
            return tuple(freeze(x) for x in a)
        if isinstance(a, (TensorRef, TensorListRef)):
            return a
        return repr(a)
    return (node.op, tuple(v.id for v in node.inputs),
            tuple(sorted((k, freeze(v)) for k, v in node.attrs.items())),
            str(node.meta.get("aten", "")))


class CommonSubexpressionElimination(Pass):
    """Replace a node by an earlier identical one (same op, inputs, attributes).
    Random nodes (`is_random`) are never merged: each draws its own values."""

    name, stage = "cse", "prepare"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        seen: Dict[Tuple, Any] = {}
        n = 0
        for node in list(graph.nodes):
            if is_random(node):
                continue
            k = _key(node)
            prev = seen.get(k)
            if prev is None:
                seen[k] = node
                continue
            for a, b in zip(node.outputs, prev.outputs):
                graph.replace_all_uses_with(a, b)
            graph.erase_node(node)
            n += 1
        return n


def _contiguous(shape, strides) -> bool:
    expect = 1
    for size, st in zip(reversed(shape), reversed(strides)):
        if size != 1 and st != expect:
            return False
        expect *= size
    return True


class IdentityElimination(RewritePass):
    """Drop copies that change nothing: ``clone`` (dropout in eval mode becomes one) of a
    value that is already laid out as the copy would be. Kept when the copy is a graph
    output (results must not alias inputs or each other) or when the input's strides are
    unknown or not contiguous and the copy makes them so (a view may depend on it)."""

    name, stage = "identity_elimination", "prepare"
    ops = ("Identity", "Alias")

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        src, dst = node.inputs[0], node.outputs[0]
        if any(o is dst for o in graph.outputs):
            return Skip("the copy is a graph output (results must not alias inputs or each other)")
        fmt = node.attrs.get("memory_format")
        if node.op == "Identity" and fmt not in (None, torch.preserve_format):
            p = src.producer
            st = (p.meta.get("strides") or [None] * len(p.outputs))[p.outputs.index(src)] if p else None
            if src.is_const:
                st = tuple(src.const.stride())
            if st is None or not _contiguous(src.desc.shape, st):
                return Skip(f"the copy makes its input contiguous ({fmt}); its strides are "
                            + ("unknown" if st is None else f"{tuple(st)}"))
        return node

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext) -> int:
        graph.replace_all_uses_with(node.outputs[0], node.inputs[0])
        graph.erase_node(node)
        return 1
