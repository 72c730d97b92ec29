"""Stage 3, layout: choose a storage format per node for the target device.

On ``cpu`` every tensor stays in ND/NCHW: oneDNN's fused kernels keep their blocked
layouts internal (weights are reordered once at bind time), so no TransData is needed
and the pass says so in the report."""
from __future__ import annotations

from ..ir import Graph
from .base import Pass, PassContext


class LayoutSelection(Pass):
    name, stage = "layout_selection", "layout"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        if ctx.device.startswith("cpu"):
            ctx.artifacts["note"] = ("cpu keeps ND/NCHW; oneDNN reorders conv weights to its "
                                     "blocked layout once at bind time, so no TransData is inserted")
            return 0
        ctx.artifacts["note"] = f"no layout rules for device {ctx.device}"
        return 0
