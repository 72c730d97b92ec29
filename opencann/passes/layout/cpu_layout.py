"""Stage 3, layout: choose a storage format per node for the target device.

On ``cpu`` every tensor stays in ND/NCHW: oneDNN's fused kernels keep their blocked
layouts internal (weights are reordered once at bind time), so no TransData is needed.
The pass records that decision (what it chose and why) as its note in the report; a
real CPU layout stage (blocked activations between oneDNN kernels) is future work. The
vnpu's layout stage is `NpuLayoutSelection` (``npu_layout``)."""
from __future__ import annotations

from ...ir import Graph
from ..base import Pass, PassContext


class LayoutSelection(Pass):
    """cpu: keep every tensor in ND/NCHW and say why (the report's note)."""

    name, stage = "layout_selection", "layout"
    devices = ("cpu",)
    off_device_note = "no layout rules for device {device}"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Leave the graph as it is and note why; returns 0."""
        ctx.note("cpu keeps ND/NCHW; oneDNN reorders conv weights to its "
                 "blocked layout once at bind time, so no TransData is inserted")
        return 0
