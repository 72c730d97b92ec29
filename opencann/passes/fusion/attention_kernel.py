"""attention_kernel_choice: let each CPU ScaledDotProductAttention node race torch's SDPA
against bmm + softmax + bmm at bind time (`opencann.ops.kernels.attention_cpu`).

Off by default (``default_enabled = False``): on this project's 2-core AVX-512 host the
explicit path was slower than SDPA at every shape measured (sdpa / bmm_softmax 0.77–0.97,
MiniLM's [1, 12, 128, 32] 0.89 at 1 thread; docs/performance.md, "Attention choice"), and
the race costs 13–17 ms of compile time per shape at seq 128. Switch it on with
``options={"enable": ["attention_kernel_choice"]}`` on CPUs where the explicit path
wins; the race then keeps SDPA wherever it does not win by 3% and most rounds.
"""
from __future__ import annotations

from ...ir import Graph
from ..base import Pass, PassContext

MARK = "attention_choice"  # node.meta key the attention kernel factory reads


class ChooseAttentionKernel(Pass):
    """Marks ScaledDotProductAttention nodes for the bind-time attention kernel race."""

    name, stage = "attention_kernel_choice", "fusion"
    ops = ("ScaledDotProductAttention",)
    devices = ("cpu",)
    off_device_note = "attention kernels are raced on cpu only, not on {device}"
    default_enabled = False

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Set ``node.meta["attention_choice"]`` on every ScaledDotProductAttention node;
        returns how many."""
        nodes = [n for n in graph.nodes if n.op == "ScaledDotProductAttention"]
        for n in nodes:
            n.meta[MARK] = True
        if nodes:
            ctx.applied(nodes, "raced at bind: sdpa vs bmm_softmax")
        ctx.note(f"{len(nodes)} attention node(s) raced at bind time")
        return len(nodes)
