"""`Pass` and `PassManager`: ordered, named, switchable, timed, logged passes, with
optional verification after each. A pass reports what it changed and, for every match
it did not rewrite, why (recorded in the compile report and logged)."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional

from ..ir import Graph, Node, verify
from ..log import logger
from ..report import CompileReport, PassRecord


@dataclass
class PassContext:
    """What a pass may read and write besides the graph."""

    options: Dict[str, Any]
    report: CompileReport
    device: str = "cpu"
    artifacts: Dict[str, Any] = field(default_factory=dict)
    #: called as ``observe(stage, graph)`` after the last pass of each run of same-stage
    #: passes (``--dump_graph``); it must not change the graph
    observe: Optional[Callable[[str, Graph], None]] = None

    def applied(self, pattern: str, nodes: List[Node]) -> None:
        where = nodes[0].where() if nodes else ""
        self.report.applied.append({"pattern": pattern, "nodes": "+".join(n.name for n in nodes),
                                    "where": where})
        logger.info("applied %s: %s at %s", pattern, "+".join(n.name for n in nodes), where)

    def skipped(self, pattern: str, node: Node, reason: str) -> None:
        self.report.skipped.append({"pattern": pattern, "node": node.name,
                                    "where": node.where(), "reason": reason})
        logger.info("%s not applied at %s (%s): %s", pattern, node.name, node.where(), reason)


class Pass:
    """One transformation. Subclasses set ``name`` and ``stage`` and implement ``run``,
    returning the number of rewrites."""

    name = "pass"
    stage = "prepare"
    default_enabled = True
    #: the section of CANN's fusion switch file that switches this pass ("GraphFusion",
    #: "UBFusion"; None: not a fusion pass) and CANN's names for the same rewrite
    switch_section: Optional[str] = None
    cann_names: tuple = ()

    def run(self, graph: Graph, ctx: PassContext) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class PassManager:
    """Runs passes in order. ``options["disable"]`` (names) switches passes off;
    ``options["enable"]`` switches on passes that are off by default;
    ``options["verify"]`` runs the IR verifier after each pass."""

    def __init__(self, passes: List[Pass]):
        self.passes = passes

    def names(self) -> List[str]:
        return [p.name for p in self.passes]

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        disable = set(ctx.options.get("disable", ()))
        enable = set(ctx.options.get("enable", ()))
        unknown = (disable | enable) - set(self.names())
        if unknown:
            raise ValueError(f"unknown pass name(s) {sorted(unknown)}; passes are {self.names()}")
        check = ctx.options.get("verify", False)
        for i, p in enumerate(self.passes):
            on = (p.default_enabled or p.name in enable) and p.name not in disable
            before = len(graph.nodes)
            t0 = time.perf_counter()
            first = len(ctx.report.applied)
            changed = p.run(graph, ctx) if on else 0
            for a in ctx.report.applied[first:]:   # which pass made each rewrite
                a.setdefault("pass", p.name)
            dt = time.perf_counter() - t0
            if on and check:
                verify(graph)
            ctx.report.passes.append(PassRecord(p.name, p.stage, before, len(graph.nodes), dt,
                                                int(changed or 0), enabled=on,
                                                note=ctx.artifacts.pop("note", "")))
            logger.debug("pass %s: %d -> %d nodes, %d changes, %.1f ms", p.name, before,
                          len(graph.nodes), changed or 0, dt * 1e3)
            if ctx.observe is not None and (i + 1 == len(self.passes)
                                            or self.passes[i + 1].stage != p.stage):
                ctx.observe(p.stage, graph)
        return graph
