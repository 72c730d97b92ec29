"""The runtime stage of the pipeline: constants made the compiled model's own, streams
assigned again by measured node times, kernels bound to the memory plan (`BindKernels`)."""
from __future__ import annotations

from typing import Any, Dict, Sequence

import torch

from ..ir import Graph
from ..ir.symbolic import graph_has_symbols
from ..log import logger
from ..passes import MemoryPlanning, Pass, PassContext, apply_schedule
from ..passes.schedule import multi_stream_schedule, stream_summary
from ..runtime import Executor
from ..runtime.streams import threads_per_stream
from .options import option


def snapshot_constants(graph: Graph, live: Sequence[torch.Tensor]) -> int:
    """Make the graph's constants its own: each constant that shares memory with one of
    the ``live`` tensors (the module's parameters and buffers, export's lifted constants)
    is re-pointed at a copy of that memory, so nothing done to the module later
    (``p.data.mul_``, an optimizer step) changes the compiled model's results. Constants
    sharing one storage (a weight and its folded transpose, tied weights) share one copy;
    derived constants (folded, cast, prepacked) are copies already and stay as they are.
    Returns the number of storages copied."""
    storages = {t.untyped_storage().data_ptr() for t in live
                if isinstance(t, torch.Tensor) and t.device.type != "meta" and t.numel()}
    copies: Dict[int, Any] = {}
    for c in graph.constants:
        t = c.const
        if not isinstance(t, torch.Tensor) or not t.numel():
            continue
        ptr = t.untyped_storage().data_ptr()
        if ptr in storages:
            if ptr not in copies:
                copies[ptr] = t.untyped_storage().clone()
            c.const = torch.empty(0, dtype=t.dtype).set_(copies[ptr], t.storage_offset(),
                                                         t.size(), t.stride())
    return len(copies)



def _sample_inputs(graph: Graph) -> list:
    """Inputs of ``graph``'s shapes and dtypes for timing: normal floats, zero ints
    (valid as indices), on the cpu."""
    return [torch.randn(v.desc.shape, dtype=v.desc.dtype.torch)
            if v.desc.dtype.torch.is_floating_point or v.desc.dtype.torch.is_complex
            else torch.zeros(v.desc.shape, dtype=v.desc.dtype.torch) for v in graph.inputs]


def measured_streams(graph: Graph, ctx: PassContext) -> str:
    """With the option ``streams`` N > 1 and ``stream_costs`` "measured" (the default)
    on the cpu: time every node (`Executor.node_seconds`: one warm-up and the least of
    5 calls on sample inputs, on the calling thread with the intra-op threads a stream's
    worker gets, `threads_per_stream`), assign the streams again with those times
    (`multi_stream_schedule`), replan memory for them (`MemoryPlanning`) and store the
    report's ``streams`` entry with the predicted busy time per stream. The cost model
    (FLOPs and bytes) misjudges host kernels by 10x and more (a max-pool on an NCHW
    input: ~2.4 ms measured vs ~20 µs modelled), and unbalanced streams overlap little.
    Returns a note ("" when the option is off or N is 1); a graph with symbolic
    shapes, another device, or a kernel failing on the sample inputs keeps the cost
    model's streams and the note says why. The global RNG state is restored."""
    n, how = option(ctx.options, "streams"), option(ctx.options, "stream_costs")
    if n <= 1 or how != "measured":
        return ""
    why = ("" if ctx.device.kind == "cpu" else f"measured only on the cpu, not {ctx.device}")
    if not why and graph_has_symbols(graph):
        why = "symbolic shapes"
    if not why:
        try:
            with torch.random.fork_rng(devices=[]):
                secs = Executor(graph, ctx.artifacts["memory_plan"]).node_seconds(
                    _sample_inputs(graph), threads=threads_per_stream(n))
        except (RuntimeError, ValueError, TypeError, IndexError) as e:
            why = f"timing on sample inputs failed ({str(e).splitlines()[0][:120]})"
    if why:
        logger.info("streams of %s by the cost model: %s", graph.name, why)
        return f"streams by the cost model: {why}"
    sched = ctx.artifacts["schedule"] = multi_stream_schedule(graph, n, secs)
    st = ctx.report.streams = stream_summary(graph, sched, secs)
    MemoryPlanning().run(graph, ctx)  # the plan for these streams
    text = (f"{st['streams']} streams by measured node times: busy "
            f"{' + '.join(f'{b / 1e3:.2f}' for b in st['predicted_busy_us'])} ms, predicted call "
            f"{st['predicted_call_us'] / 1e3:.2f} ms (one stream {st['estimated_serial_us'] / 1e3:.2f} ms)")
    logger.info("schedule %s: %s, nodes per stream %s, %d events", graph.name, text,
                st["nodes_per_stream"], st["events"])
    return text


class BindKernels(Pass):
    """The last stage, in the runtime: make the graph's constants its own
    (`snapshot_constants` of ``ctx.artifacts["live_tensors"]``; with the option
    ``share_weights`` they stay the module's memory), on several streams
    assign them again by measured node times (`measured_streams`), then bind every kernel
    to the memory plan (``ctx.artifacts["memory_plan"]``) in an `Executor`, stored as
    ``ctx.artifacts["executor"]``; returns the number of results copied out."""

    name, stage = "bind_kernels", "runtime"
    required, observed = True, False

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Snapshot the constants and build the `Executor` on the scheduled order
        (``ctx.artifacts["schedule"]``, as memory planning used it); returns its
        copy-out count."""
        if ctx.artifacts.get("schedule") is not None:
            apply_schedule(graph, ctx.artifacts["schedule"])
        shared = option(ctx.options, "share_weights")
        if not shared:
            snapshot_constants(graph, ctx.artifacts.get("live_tensors", ()))
        streams = measured_streams(graph, ctx)
        ex = Executor(graph, ctx.artifacts["memory_plan"],
                      check_aliasing=option(ctx.options, "check_aliasing"))
        ctx.artifacts["executor"] = ex
        ctx.note("arena allocated once; kernels pre-bound"
                 + ("; weights shared with the module (share_weights)" if shared else "")
                 + (f"; {streams}" if streams else ""))
        return len(ex.copy_out_nodes)
