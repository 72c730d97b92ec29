"""`Pass` and `PassManager`: ordered, named, switchable, timed, logged passes, with
optional verification after each. A pass reports what it changed and, for every match
it did not rewrite, why (a `Skip`); the pass manager records both in the compile
report and the log under the pass's one ``name`` (also the name ``disable``/``enable``
and the fusion switch file take).

A rewrite is a rule (as ONNX Runtime's rewrite rules and Inductor's patterns): a
`RewritePass` looks at the live nodes whose op is in its ``ops``; ``match`` returns a
match, a `Skip` with the reason, or None only when the node is not the pattern's root;
``rewrite`` applies a match.

Every rewrite has a stable id, ``"<pass>@<root node>"`` (the root: the node ``match``
was given; for a plain `Pass`, the first node it names), in its report entry (``id``).
Root names are the traced (FX) node names or names derived from them, so the same model
compiled with the same options gets the same ids. ``options["disable_rewrites"]`` (ids)
makes a `RewritePass` skip exactly those sites, each recorded as a Skip with reason
`DISABLED_REASON`; a plain pass that sets ``site_switchable`` asks `PassContext.site_off`.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Tuple

from ..devices import CPU, Device, parse_device
from ..ir import Graph, Node, verify
from ..log import logger
from ..report import CompileReport, PassRecord

#: the reason recorded for a site switched off by ``options["disable_rewrites"]``
DISABLED_REASON = "disabled by option disable_rewrites"


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
    #: the target (`opencann.devices.Device`; a device string is parsed once, here)
    device: Device = CPU
    artifacts: Dict[str, Any] = field(default_factory=dict)
    #: called as ``observe(stage, graph)`` after the last pass of each run of same-stage
    #: passes (``--dump_graph``); it must not change the graph
    observe: Optional[Callable[[str, Graph], None]] = None
    events: List[Tuple[str, Any]] = field(default_factory=list)
    #: the running pass's name and the root of the match being rewritten (the rewrite's id)
    pass_name: str = ""
    root: Optional[Node] = None
    #: "<pass>@<node>" ids of the sites the running passes could switch off (validation)
    sites_seen: set = field(default_factory=set)

    def __post_init__(self) -> None:
        self.device = parse_device(self.device)   # DeviceError naming what to write

    @property
    def device_kind(self) -> str:
        """``vnpu`` for ``vnpu:ascend910b``, ``cpu`` for ``cpu`` (``device.kind``)."""
        return self.device.kind

    def applied(self, nodes: List[Node], detail: str = "") -> None:
        """Record a rewrite of ``nodes`` (``detail``: the variant, e.g. "Conv+Relu")."""
        self.events.append(("applied", (list(nodes), detail, self.root)))

    def skipped(self, node: Node, reason: str, detail: str = "") -> None:
        """Record a match at ``node`` that was not rewritten, and why."""
        self.skip(Skip(reason, node, detail))

    def skip(self, s: Skip) -> None:
        """Record the `Skip` ``s`` of the running pass (its ``node`` set: where the
        report shows it), under the running rewrite's root (its id)."""
        self.events.append(("skipped", (s, self.root)))

    def site_off(self, node: Node) -> bool:
        """Whether ``options["disable_rewrites"]`` switches off the running pass's rewrite
        rooted at ``node``; if so, records the Skip (`DISABLED_REASON`)."""
        rid = f"{self.pass_name}@{node.name}"
        self.sites_seen.add(rid)
        if rid not in self.options["disable_rewrites"]:
            return False
        self.events.append(("skipped", (Skip(DISABLED_REASON, node), node)))
        return True

    def note(self, text: str) -> None:
        """The running pass's one-line note in the report."""
        self.artifacts["note"] = text


class Pass:
    """One transformation. Subclasses set ``name`` (the one name of the rewrite) and
    ``stage`` and implement ``run``, returning the number of rewrites.

    ``ops``: the root ops it looks at (empty: any); ``devices``: the device kinds it
    runs on (empty: every one; elsewhere it is not run and ``off_device_note``, with
    ``{device}``, is its note); ``required``: a stage that cannot be disabled;
    ``observed``: the graph is dumped after its stage (``--dump_graph``);
    ``site_switchable``: ``options["disable_rewrites"]`` can switch its rewrites off one by
    one (every `RewritePass`; a plain pass that calls `PassContext.site_off`)."""

    name = "pass"
    stage = "prepare"
    ops: Tuple[str, ...] = ()
    devices: Tuple[str, ...] = ()
    off_device_note = ""
    default_enabled = True
    required = False
    observed = True
    site_switchable = False
    #: the section of CANN's fusion switch file that switches this pass ("GraphFusion",
    #: "UBFusion"; None: not a fusion pass) and CANN's names for the same rewrite
    switch_section: Optional[str] = None
    cann_names: tuple = ()

    def runs_on(self, device) -> bool:
        """True when ``devices`` is empty or holds the kind of ``device`` (a `Device`, or a
        device string read by `parse_device`: `DeviceError` for an unknown one)."""
        return not self.devices or parse_device(device, load=False).kind in self.devices

    def run(self, graph: Graph, ctx: PassContext) -> int:  # pragma: no cover - abstract
        """Transform ``graph`` in place; returns the number of rewrites (0: unchanged).
        Rewrites and skips are recorded with ``ctx.applied``/``ctx.skipped``, a one-line
        summary with ``ctx.note``."""
        raise NotImplementedError


class RewritePass(Pass):
    """A rule: ``match`` each live node whose op is in ``ops`` (in graph order, as they
    were when the pass started), ``rewrite`` each match; skips are recorded. A site in
    ``options["disable_rewrites"]`` is matched but not rewritten (a Skip); a rewrite that
    recorded nothing is recorded as one of its root. Each rewrite runs in
    `Graph.rewriting`: the nodes it creates record the names of those it replaced
    (``meta["replaces"]``)."""

    site_switchable = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Call `match` on each node of the node list as it is when the pass starts
        (graph order; nodes erased since, and nodes whose op is not in ``ops``, passed over),
        record each `Skip` (at the root when it names no node) and `rewrite` each match.
        Returns the sum of the rewrites' counts."""
        n = 0
        for node in list(graph.nodes):
            if self.ops and node.op not in self.ops:
                continue
            ctx.sites_seen.add(f"{ctx.pass_name}@{node.name}")
            if node.erased:
                continue
            ctx.root = node
            m = self.match(node, graph, ctx)
            if isinstance(m, Skip):
                ctx.skip(m if m.node is not None else Skip(m.reason, node, m.detail))
            elif m is not None and not ctx.site_off(node):
                recorded = len(ctx.events)
                with graph.rewriting():   # new nodes record what they replace
                    k = self.rewrite(graph, m, ctx)
                if k and not any(e[0] == "applied" for e in ctx.events[recorded:]):
                    ctx.applied([node])
                n += k
        ctx.root = None
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
        """The passes' names in run order (the names ``disable``/``enable`` take)."""
        return [p.name for p in self.passes]

    def stages(self) -> List[str]:
        """The passes' stages, each once, in order of first appearance."""
        return list(dict.fromkeys(p.stage for p in self.passes))

    def run(self, graph: Graph, ctx: PassContext) -> Graph:
        """Run the passes in order on ``graph`` (in place); returns ``graph``.

        A switched-off pass is recorded (``enabled=False``) without running; a pass whose
        ``devices`` exclude ``ctx.device`` is recorded with its ``off_device_note``. Each pass
        adds a `PassRecord` to ``ctx.report.passes`` and its rewrites and skips to
        ``report.applied``/``report.skipped``; ``ctx.observe`` sees the graph after the last
        pass of each run of same-stage passes (if that pass is ``observed``). Raises
        ValueError for an unknown name in ``disable``/``enable`` (listing the names) or a
        ``required`` pass disabled, and `GraphError` when ``options["verify"]`` finds a
        broken invariant after a pass."""
        self.check_switches(ctx.options)
        disable = set(ctx.options["disable"])
        enable = set(ctx.options["enable"])
        ran = set()
        for i, p in enumerate(self.passes):
            on = (p.default_enabled or p.name in enable) and p.name not in disable
            self._run_one(p, on, graph, ctx)
            if on and p.runs_on(ctx.device):
                ran.add(p.name)
            if ctx.observe is not None and p.observed and (
                    i + 1 == len(self.passes) or self.passes[i + 1].stage != p.stage):
                ctx.observe(p.stage, graph)
        check_rewrite_ids(ctx, ran)
        return graph

    def check_switches(self, options: Mapping[str, Any]) -> None:
        """Raise ValueError (one line) for a name in ``options``' ``disable`` / ``enable``
        that is no pass of this pipeline (listing the names), a ``required`` pass
        disabled, or a ``disable_rewrites`` id whose pass does not switch rewrite by
        rewrite (`run` checks this first; an entry point checks it before any capture)."""
        disable = set(options.get("disable") or ())
        enable = set(options.get("enable") or ())
        unknown = (disable | enable) - set(self.names())
        if unknown:
            raise ValueError(f"unknown pass name(s) {sorted(unknown)}; passes are {self.names()}")
        fixed = sorted(p.name for p in self.passes if p.required and p.name in disable)
        if fixed:
            raise ValueError(f"pass(es) {fixed} cannot be disabled: later stages need their result")
        self._check_rewrite_passes(options.get("disable_rewrites") or ())

    def _check_rewrite_passes(self, ids) -> None:
        """Each ``disable_rewrites`` id names a pass of this pipeline whose sites switch
        one by one (ValueError naming them otherwise)."""
        switchable = list(dict.fromkeys(p.name for p in self.passes if p.site_switchable))
        for rid in ids:
            name = rid.partition("@")[0]
            if name not in switchable:
                why = "is not a pass of this pipeline" if name not in self.names() else \
                    "switches only whole (option disable)"
                raise ValueError(f"option 'disable_rewrites': {rid!r}: pass {name!r} {why}; "
                                 f"passes whose rewrites switch one by one: {switchable}")

    @staticmethod
    def _run_one(p: Pass, on: bool, graph: Graph, ctx: PassContext) -> None:
        before = len(graph.nodes)
        ctx.events = []
        ctx.pass_name, ctx.root = p.name, None
        t0 = time.perf_counter()
        if on and not p.runs_on(ctx.device):
            ctx.note(p.off_device_note.format(device=ctx.device))
            changed = 0
        else:
            changed = p.run(graph, ctx) if on else 0
        dt = time.perf_counter() - t0
        if on and ctx.options["verify"]:
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
    empty), ``nodes`` (node names joined by "+"), ``where``, ``id`` ("<pass>@<root
    node>"; on skips, when a rewrite rule's match was the root) and, for skips, ``reason``."""
    for kind, e in ctx.events:
        if kind == "applied":
            nodes, detail, root = e
            names = "+".join(n.name for n in nodes)
            where = nodes[0].where() if nodes else ""
            root = root or (nodes[0] if nodes else None)
            ctx.report.applied.append({"pass": name, "detail": detail, "nodes": names,
                                       "where": where, "id": f"{name}@{root.name}" if root else name})
            logger.info("applied %s%s: %s at %s", name, f" ({detail})" if detail else "",
                        names, where)
        else:
            s, root = e
            node = s.node
            entry = {"pass": name, "detail": s.detail, "nodes": node.name,
                     "where": node.where(), "reason": s.reason}
            if root is not None:
                entry["id"] = f"{name}@{root.name}"
            ctx.report.skipped.append(entry)
            logger.info("%s%s not applied at %s (%s): %s", name,
                        f" ({s.detail})" if s.detail else "", node.name, node.where(), s.reason)
    ctx.events = []


def check_rewrite_ids(ctx: PassContext, ran) -> None:
    """Raise ValueError (one line, listing ids of this compile) when an id in
    ``options["disable_rewrites"]`` of a pass that ran names no site that pass looked at."""
    wrong = [r for r in ctx.options["disable_rewrites"]
             if r.partition("@")[0] in ran and r not in ctx.sites_seen]
    if not wrong:
        return
    mine = [a["id"] for a in ctx.report.applied if a["pass"] in {w.partition("@")[0] for w in wrong}]
    ids = list(dict.fromkeys(mine or [a["id"] for a in ctx.report.applied]))
    raise ValueError(f"option 'disable_rewrites': no rewrite site {wrong} in this compile; ids are "
                     f"'<pass>@<root node>' as in the compile report's applied entries, here "
                     f"e.g. {ids[:6]}" + (f" ({len(ids)} in all)" if len(ids) > 6 else ""))
