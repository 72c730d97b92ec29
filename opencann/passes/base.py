"""`Pass` and `PassManager`: ordered, named, switchable, timed, logged passes, with
optional verification after each. A pass reports what it changed and, for every match
it did not rewrite, why (a `Skip`); the pass manager records both in the compile
report and the log under the pass's one ``name`` (also the name ``disable``/``enable``
and the fusion switch file take).

A rewrite is a rule (as ONNX Runtime's rewrite rules and Inductor's patterns): a
`RewritePass` looks at the live nodes whose op is in its ``ops``; ``match`` returns a
match, a `Skip` with the reason, or None only when the node is not the pattern's root;
``rewrite`` applies a match.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

from ..ir import Graph, Node, verify
from ..log import logger
from ..report import CompileReport, PassRecord


@dataclass(frozen=True)
class Skip:
    """Why a pattern whose root matched was not rewritten. ``node``: where to report it
    (default: the root); ``detail``: which variant of the rewrite (e.g. "in place")."""

    reason: str
    node: Optional[Node] = None
    detail: str = ""


@dataclass
class PassContext:
    """What a pass may read and write besides the graph.

    ``artifacts`` holds what stages hand on (``memory_plan``, ``schedule``, ``executor``,
    ``note``: the running pass's one-line note for the report); ``events`` the rewrites
    and skips of the running pass, which the `PassManager` records under its name."""

    options: Dict[str, Any]
    report: CompileReport
    device: str = "cpu"
    artifacts: Dict[str, Any] = field(default_factory=dict)
    #: called as ``observe(stage, graph)`` after the last pass of each run of same-stage
    #: passes (``--dump_graph``); it must not change the graph
    observe: Optional[Callable[[str, Graph], None]] = None
    events: List[Tuple[str, Any]] = field(default_factory=list)

    @property
    def device_kind(self) -> str:
        """``vnpu`` for ``vnpu:ascend910b``, ``cpu`` for ``cpu``."""
        return str(self.device).partition(":")[0]

    def applied(self, nodes: List[Node], detail: str = "") -> None:
        """Record a rewrite of ``nodes`` (``detail``: the variant, e.g. "Conv+Relu")."""
        self.events.append(("applied", (list(nodes), detail)))

    def skipped(self, node: Node, reason: str, detail: str = "") -> None:
        """Record a match at ``node`` that was not rewritten, and why."""
        self.skip(Skip(reason, node, detail))

    def skip(self, s: Skip) -> None:
        self.events.append(("skipped", s))

    def note(self, text: str) -> None:
        """The running pass's one-line note in the report."""
        self.artifacts["note"] = text


class Pass:
    """One transformation. Subclasses set ``name`` (the one name of the rewrite) and
    ``stage`` and implement ``run``, returning the number of rewrites.

    ``ops``: the root ops it looks at (empty: any); ``devices``: the device kinds it
    runs on (empty: every one; elsewhere it is not run and ``off_device_note``, with
    ``{device}``, is its note); ``required``: a stage that cannot be disabled;
    ``observed``: the graph is dumped after its stage (``--dump_graph``)."""

    name = "pass"
    stage = "prepare"
    ops: Tuple[str, ...] = ()
    devices: Tuple[str, ...] = ()
    off_device_note = ""
    default_enabled = True
    required = False
    observed = True
    #: the section of CANN's fusion switch file that switches this pass ("GraphFusion",
    #: "UBFusion"; None: not a fusion pass) and CANN's names for the same rewrite
    switch_section: Optional[str] = None
    cann_names: tuple = ()

    def runs_on(self, device: str) -> bool:
        return not self.devices or str(device).partition(":")[0] in self.devices

    def run(self, graph: Graph, ctx: PassContext) -> int:  # pragma: no cover - abstract
        raise NotImplementedError


class RewritePass(Pass):
    """A rule: ``match`` each live node whose op is in ``ops`` (in graph order, nodes
    added by earlier rewrites included), ``rewrite`` each match; skips are recorded."""

    def run(self, graph: Graph, ctx: PassContext) -> int:
        n = 0
        for node in list(graph.nodes):
            if node.erased or (self.ops and node.op not in self.ops):
                continue
            m = self.match(node, graph, ctx)
            if isinstance(m, Skip):
                ctx.skip(m if m.node is not None else Skip(m.reason, node, m.detail))
            elif m is not None:
                n += self.rewrite(graph, m, ctx)
        return n

    def match(self, node: Node, graph: Graph, ctx: PassContext) -> Any:  # pragma: no cover
        """A match, a `Skip`, or None when ``node`` is not the pattern's root."""
        raise NotImplementedError

    def rewrite(self, graph: Graph, m: Any, ctx: PassContext) -> int:  # pragma: no cover
        """Apply match ``m`` (recording it with ``ctx.applied``); returns rewrites made."""
        raise NotImplementedError


class PassManager:
    """Runs passes in order. ``options["disable"]`` (names) switches passes off;
    ``options["enable"]`` switches on passes that are off by default;
    ``options["verify"]`` runs the IR verifier after each pass. Raises ValueError for
    an unknown name or a required stage (memory planning) switched off."""

    def __init__(self, passes: List[Pass]):
        self.passes = passes

    def names(self) -> List[str]:
        return [p.name for p in self.passes]

    def stages(self) -> List[str]:
        return list(dict.fromkeys(p.stage for p in self.passes))

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        disable = set(ctx.options.get("disable", ()))
        enable = set(ctx.options.get("enable", ()))
        unknown = (disable | enable) - set(self.names())
        if unknown:
            raise ValueError(f"unknown pass name(s) {sorted(unknown)}; passes are {self.names()}")
        fixed = sorted(p.name for p in self.passes if p.required and p.name in disable)
        if fixed:
            raise ValueError(f"pass(es) {fixed} cannot be disabled: later stages need their result")
        for i, p in enumerate(self.passes):
            on = (p.default_enabled or p.name in enable) and p.name not in disable
            self._run_one(p, on, graph, ctx)
            if ctx.observe is not None and p.observed and (
                    i + 1 == len(self.passes) or self.passes[i + 1].stage != p.stage):
                ctx.observe(p.stage, graph)
        return graph

    @staticmethod
    def _run_one(p: Pass, on: bool, graph: Graph, ctx: PassContext) -> None:
        before = len(graph.nodes)
        ctx.events = []
        t0 = time.perf_counter()
        if on and not p.runs_on(ctx.device):
            ctx.note(p.off_device_note.format(device=ctx.device))
            changed = 0
        else:
            changed = p.run(graph, ctx) if on else 0
        dt = time.perf_counter() - t0
        if on and ctx.options.get("verify", False):
            verify(graph)
        record_events(p.name, ctx)
        ctx.report.passes.append(PassRecord(p.name, p.stage, before, len(graph.nodes), dt,
                                            int(changed or 0), enabled=on,
                                            note=ctx.artifacts.pop("note", "")))
        logger.debug("pass %s: %d -> %d nodes, %d changes, %.1f ms", p.name, before,
                     len(graph.nodes), changed or 0, dt * 1e3)


def record_events(name: str, ctx: PassContext) -> None:
    """Move the running pass's rewrites and skips into the report and the log, under
    the pass's ``name``. Report entries: ``pass``, ``detail`` (the variant, may be
    empty), ``nodes`` (node names joined by "+"), ``where`` and, for skips, ``reason``."""
    for kind, e in ctx.events:
        if kind == "applied":
            nodes, detail = e
            names = "+".join(n.name for n in nodes)
            where = nodes[0].where() if nodes else ""
            ctx.report.applied.append({"pass": name, "detail": detail, "nodes": names,
                                       "where": where})
            logger.info("applied %s%s: %s at %s", name, f" ({detail})" if detail else "",
                        names, where)
        else:
            node = e.node
            ctx.report.skipped.append({"pass": name, "detail": e.detail, "nodes": node.name,
                                       "where": node.where(), "reason": e.reason})
            logger.info("%s%s not applied at %s (%s): %s", name,
                        f" ({e.detail})" if e.detail else "", node.name, node.where(), e.reason)
    ctx.events = []
