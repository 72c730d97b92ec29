"""Stage 1, prepare: constant folding."""
from __future__ import annotations

import torch

from ...ir import Graph
from ...ir.symbolic import dynamic_skip_reason
from ...ops import OpKind, call_args, get_op, is_random, output_aliases
from ..base import Pass, PassContext

FOLD_LIMIT_BYTES = 64 << 20  # don't materialise folded constants larger than this


class ConstantFolding(Pass):
    """Evaluate nodes whose inputs are all constants (weight permutes, masks built from
    arange/full...) once at compile time; outputs become graph constants. Random nodes
    (`is_random`: rand, randn(4, 6) with no inputs at all...) are never folded: they
    draw anew on every call. A view of a constant (a weight's transpose) is folded at any
    size: it holds no memory of its own (an LM head's ``Wᵀ``, 98 MB at vocab 32000 x 768,
    then reaches the GEMM choice as a constant weight)."""

    name, stage = "constant_folding", "prepare"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Fold, in graph order, every non-fused, non-random node whose inputs are all
        constants and whose outputs total at most `FOLD_LIMIT_BYTES` or are views of its
        inputs (larger and not views: a skip), by calling the host kernel (a user's ``OpDef.kernels["cpu"]``, else the ATen overload)
        under ``torch.no_grad``; then drop unused constants. Returns the number of nodes
        folded. Raises ValueError naming the node and its source when the kernel fails on
        its constant inputs (the model would fail on every input of these shapes)."""
        n = 0
        for node in list(graph.nodes):
            op = get_op(node.op)
            if op.kind == OpKind.FUSED or is_random(node):
                continue
            if not all(v.is_const for v in node.inputs):
                continue
            dynamic = dynamic_skip_reason(node, "folding at compile time")
            if dynamic:
                ctx.skipped(node, dynamic)
                continue
            large = sum(o.desc.nbytes for o in node.outputs) > FOLD_LIMIT_BYTES
            if large and not all(output_aliases(node)):
                ctx.skipped(node, f"output larger than {FOLD_LIMIT_BYTES >> 20} MiB")
                continue
            # the host's kernel: a user's OpDef.kernels["cpu"], else the ATen overload
            target = op.kernel("cpu") or node.meta.get("aten")
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
            if large and not _views_of(res, node):
                ctx.skipped(node, f"output larger than {FOLD_LIMIT_BYTES >> 20} MiB and not a "
                                  "view of its input")
                continue
            for o, r in zip(node.outputs, res):
                c = graph.add_const(r, name=f"{node.name}_folded")
                graph.replace_all_uses_with(o, c)
            graph.erase_node(node)
            n += 1
        graph.prune_constants()
        return n


def _views_of(results, node) -> bool:
    """Whether every tensor in ``results`` shares storage with one of ``node``'s constant
    inputs (a view: folding it allocates nothing)."""
    ptrs = {v.const.untyped_storage().data_ptr() for v in node.inputs
            if isinstance(v.const, torch.Tensor)}
    return all(isinstance(r, torch.Tensor) and r.untyped_storage().data_ptr() in ptrs
               for r in results)
