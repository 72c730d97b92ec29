"""Stage 1, prepare: write a model's cache input in place (TorchAir's ``input_inplace_pass``).

torch.export functionalizes an in-place write into an input - transformers'
``StaticCache`` writes its layers with ``keys.index_copy_(2, pos, new)`` - into an
out-of-place op that builds a whole new cache, plus a copy of that result back into the
caller's tensor after the call: two cache-sized copies per decode step for a few new
rows. TorchAir undoes this for Ascend graphs (``input_inplace_pass``); this pass does the
same for the host fallback ops torch.export leaves (``index_put``, ``index_copy``).
"""
from __future__ import annotations

from typing import Optional

import torch

from ...ir import Graph, Node, TensorRef
from ..base import PassContext, RewritePass, Skip

aten = torch.ops.aten
#: the out-of-place ATen ops rewritten, and their in-place variants (same schema)
INPLACE_VARIANTS = {aten.index_put.default: aten.index_put_.default,
                    aten.index_copy.default: aten.index_copy_.default}


class InputInplace(RewritePass):
    """``new = index_put(cache, idx, rows)`` whose ``new`` the model writes back into its
    input ``cache`` ⇒ ``index_put_(cache, idx, rows)`` writing the caller's tensor (no new
    cache, no copy-back). Applies to a host fallback ``index_put``/``index_copy`` whose
    ``self`` is a graph input the calling convention says the model writes
    (``graph.signature.input_mutations``) with this node's result, when nothing else
    reads that input (its old contents would be gone). Devices: all (the host runs it)."""

    name, stage = "input_inplace", "prepare"
    ops = ("HostFallback",)

    def match(self, node: Node, graph: Graph, ctx: PassContext):
        """The node when it writes a graph input's new value in place of a copy; a `Skip`
        naming why not; None for other ATen ops."""
        if node.meta.get("aten") not in INPLACE_VARIANTS or "inplace_input" in node.attrs:
            return None
        ref = node.attrs.get("self")
        if not isinstance(ref, TensorRef):
            return Skip("its 'self' is not a tensor input")
        x = node.inputs[ref.index]
        j = _written_back(graph, x, node)
        if j is None:
            return Skip(f"its result is not what the model writes back into an input (a "
                        f"functional {node.meta['aten'].name()} keeps its copy)")
        others = [u for u in x.users if u is not node]
        if others:
            return Skip(f"graph input {x.name} is also read by {others[0].name} "
                        f"({others[0].op}): writing it in place would change what that reads")
        return node

    def rewrite(self, graph: Graph, node: Node, ctx: PassContext) -> int:
        """Switch the node to the in-place ATen variant, writing its ``self`` input
        (``attrs["inplace_input"]``), and record that the written-back output shares the
        input's storage, as the caller's tensor does in eager (so the runtime returns the
        input itself: no output copy, no copy-back); returns 1."""
        x = node.inputs[node.attrs["self"].index]
        j = _written_back(graph, x, node)
        node.meta["aten"] = INPLACE_VARIANTS[node.meta["aten"]]
        node.attrs["inplace_input"] = node.attrs["self"].index
        sig = graph.signature
        if sig.output_storage is not None:
            storage = list(sig.output_storage)
            storage[j] = storage[j] | {x.id}
            graph.signature = sig.replace(output_storage=tuple(storage))
        return 1


def _written_back(graph: Graph, x, node: Node) -> Optional[int]:
    """The index among the mutated inputs of ``x`` when ``x`` is a graph input the model
    writes back with ``node``'s output, else None."""
    if x not in graph.inputs:
        return None
    i = graph.inputs.index(x)
    muts = list(graph.signature.input_mutations)
    if i not in muts:
        return None
    j = muts.index(i)
    return j if j < len(graph.outputs) and graph.outputs[j] is node.outputs[0] else None


__all__ = ["INPLACE_VARIANTS", "InputInplace"]
