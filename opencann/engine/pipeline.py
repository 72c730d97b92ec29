"""The pipeline driver: run the passes on an IR graph (`run_pipeline`, `compile_graph`),
with the compile report's before/after counts, costs and host fallbacks."""
from __future__ import annotations

from typing import Any, Dict, Optional

from ..devices import Device, parse_device
from ..ir import Graph, MemoryPlan
from ..log import logger
from ..ops import Cost, get_op, is_random
from ..passes import PassContext, PassManager, default_pipeline
from ..report import CompileReport
from .binding import BindKernels
from .options import check_options, complete, option


def graph_cost(graph: Graph) -> Dict[str, int]:
    """Total FLOPs and bytes moved (read + written) of the graph's nodes (nodes with
    symbolic shapes left out: `opencann.dynamic` costs a specialised copy)."""
    total = Cost()
    for n in graph.nodes:
        if not all(v.desc.is_static for v in (*n.inputs, *n.outputs)):
            continue
        total = total + get_op(n.op).cost(n)
    return {"flops": int(total.flops), "bytes": int(total.bytes)}



def _fallbacks(graph: Graph) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for n in graph.nodes:
        if n.op in ("HostFallback", "OnnxHostFallback"):
            k = str(n.meta["aten"]) if n.op == "HostFallback" else f"onnx::{n.attrs['op_type']}"
            e = out.setdefault(k, {"count": 0, "where": []})
            e["count"] += 1
            e["where"].append(n.where())
    return out


def _check_device(device) -> Device:
    """The `Device` of ``device`` (a device string, parsed once here by
    `devices.parse_device`: ValueError naming what to write; or a `Device`)."""
    return parse_device(device)



def compile_graph(graph: Graph, device: str = "cpu", options: Optional[Dict[str, Any]] = None,
                  report: Optional[CompileReport] = None,
                  pipeline: Optional[PassManager] = None) -> "tuple[Graph, MemoryPlan, CompileReport]":
    """Optimize ``graph`` in place and plan its memory. Returns (graph, plan, report).

    ``pipeline``: the passes to run (default `default_pipeline`); it must end with the
    memory stage (`MemoryPlanning`), else ValueError."""
    ctx = run_pipeline(graph, device, options, report, pipeline or default_pipeline())
    return graph, ctx.artifacts["memory_plan"], ctx.report


def run_pipeline(graph: Graph, device: str, options: Optional[Dict[str, Any]],
                 report: Optional[CompileReport], pipeline: PassManager,
                 artifacts: Optional[Dict[str, Any]] = None) -> PassContext:
    """Run ``pipeline`` on ``graph`` (in place) for ``device``; returns the pass context,
    whose ``artifacts`` hold what the stages made (``memory_plan``, ``executor``...).
    Raises ValueError for bad options, host fallbacks when they are off, or a pipeline
    without a memory stage."""
    if "memory" not in pipeline.stages():
        raise ValueError(f"pipeline {pipeline.names()} has no memory stage; end it with "
                         "opencann.passes.MemoryPlanning()")
    options, device = check_options(options), _check_device(device)
    report = report or CompileReport(model=graph.name, device=str(device))
    report.op_counts_before = graph.op_counts()
    report.cost_before = graph_cost(graph)
    report.host_fallbacks = _fallbacks(graph)
    if report.host_fallbacks and not option(options, "host_fallback"):
        listed = "; ".join(f"{k} x{v['count']} at {v['where'][0]}" for k, v in report.host_fallbacks.items())
        raise ValueError(f"ops without an opencann converter: {listed}. With "
                         "options={'host_fallback': True} (the default) they run on the host")
    for k, v in report.host_fallbacks.items():
        logger.warning("host fallback: %s x%d (no opencann converter) at %s", k, v["count"],
                       "; ".join(v["where"][:3]))
    ctx = PassContext(options=complete(options), report=report, device=device,
                      artifacts=dict(artifacts or {}))
    if option(options, "dump_graph"):
        from ..ir.dump import write_stage
        stages = [0]

        def dump(stage: str, g: Graph) -> None:
            write_stage(options["dump_graph"], stages[0], stage, g)
            stages[0] += 1
        dump("input", graph)
        ctx.observe = dump
    pipeline.run(graph, ctx)
    effects = sorted(set(graph.meta.get("dropped_effects", ())))
    if effects:
        report.notes.append(f"side-effect checks dropped ({', '.join(effects)}): e.g. linalg.inv "
                            "of a singular matrix gives inf/NaN instead of eager's error")
    randoms = sorted({str(n.meta["aten"]) if n.op == "HostFallback" else n.op
                      for n in graph.nodes if is_random(n)})
    if randoms:
        report.notes.append(f"random ops drawn anew on every call ({', '.join(randoms)}); they "
                            "are never folded, merged or recomputed")
    report.op_counts_after = graph.op_counts()
    report.cost_after = graph_cost(graph)
    logger.info("%s", report.summary())
    return ctx


def _bind_pipeline() -> PassManager:
    """The default pipeline with kernel binding as its last stage."""
    return PassManager(default_pipeline().passes + [BindKernels()])


def check_compile_options(options: Optional[Dict[str, Any]],
                          pipeline: Optional[PassManager] = None) -> Dict[str, Any]:
    """The checks ``opencann.compile`` makes of its ``options`` before it runs a pass,
    without a model: `check_options` (names, types, values), then the pass switches
    (``disable``, ``enable``, ``disable_rewrites``) against ``pipeline`` (default: the
    compile pipeline, binding included; `PassManager.check_switches`). For an
    application that compiles later (opencann.llm builds its step graphs on first use):
    its bad option is one ValueError line at its own compile. Returns the checked
    options (`check_options`)."""
    options = check_options(options)
    (pipeline or _bind_pipeline()).check_switches(complete(options))
    return options
