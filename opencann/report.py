"""The compile report: what each pass did, fusions applied and skipped (with reasons
and source locations), host fallbacks, the memory plan, and FLOPs / bytes moved
before and after optimization. Rendered as JSON and as readable text."""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List


def fmt_bytes(n: float) -> str:
    """Bytes with a binary unit that keeps 3 significant figures (B, KiB, MiB, GiB)."""
    for unit in ("B", "KiB", "MiB"):
        if abs(n) < 1024:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.3g} {unit}"
        n /= 1024
    return f"{n:.3g} GiB"


def fmt_flops(n: float) -> str:
    """FLOPs with a decimal unit (FLOP, MFLOP, GFLOP, TFLOP)."""
    for unit, d in (("TFLOP", 1e12), ("GFLOP", 1e9), ("MFLOP", 1e6)):
        if n >= d:
            return f"{n / d:.3g} {unit}"
    return f"{n:.0f} FLOP"


def _rewrite(entry: Dict[str, str]) -> str:
    """An applied/skipped entry's rewrite: the pass name, with its variant if any."""
    return entry["pass"] + (f" ({entry['detail']})" if entry.get("detail") else "")


def _streams_line(st: Dict[str, Any]) -> str:
    """The summary's line for the report's ``streams`` entry."""
    busy = st.get("predicted_busy_us")
    return (f"  streams: {st['streams']} ({', '.join(map(str, st['nodes_per_stream']))} "
            f"nodes), {st['events']} events for {st['cross_stream_dependences']} "
            "cross-stream dependences"
            + (f"; {st['costs']} busy {' + '.join(f'{b / 1e3:.2f}' for b in busy)} ms, "
               f"predicted call {st['predicted_call_us'] / 1e3:.2f} ms" if busy else ""))


@dataclass
class PassRecord:
    """One pass run of a compile: its name and stage, node counts before and after, wall time in
    seconds, the number of changes, whether it was enabled, and a note."""
    name: str
    stage: str
    nodes_before: int
    nodes_after: int
    seconds: float
    changed: int
    enabled: bool = True
    note: str = ""


@dataclass
class CompileReport:
    """What a compile did: capture times (s), every pass run, rewrites applied and skipped (each
    with its reason and source location), host fallbacks, the memory plan's summary (bytes), the
    graph's cost (FLOPs, bytes) and op counts before and after, and notes. Serialized by
    `to_json`; printed by `summary` and `to_text`."""
    model: str = ""
    device: str = "cpu"   # the device string (a `Device` given is kept as its string)
    capture_seconds: Dict[str, float] = field(default_factory=dict)
    passes: List[PassRecord] = field(default_factory=list)
    #: rewrites made and matches not rewritten: {"pass": the pass's one name, "detail":
    #: the variant ("" if none), "nodes": node names joined by "+", "where": source
    #: location, and for skips "reason"}
    applied: List[Dict[str, str]] = field(default_factory=list)
    skipped: List[Dict[str, str]] = field(default_factory=list)
    host_fallbacks: Dict[str, Dict[str, Any]] = field(default_factory=dict)
    memory: Dict[str, Any] = field(default_factory=dict)
    cost_before: Dict[str, int] = field(default_factory=dict)
    cost_after: Dict[str, int] = field(default_factory=dict)
    op_counts_before: Dict[str, int] = field(default_factory=dict)
    op_counts_after: Dict[str, int] = field(default_factory=dict)
    notes: List[str] = field(default_factory=list)
    #: a model compiled with dynamic dims: "dims" (name -> symbol, min, max, sources),
    #: "guards" (conditions each call's shapes must meet), "plan_cache_size" and "plans"
    #: (one entry per concrete shape planned: dims, arena bytes, ratio, build ms); with
    #: gears also "gears" (option, dims, values) and "padding" ("applies", "fill", and per
    #: dim "padded" and "blocked_by": node, op, source, where, reason)
    dynamic: Dict[str, Any] = field(default_factory=dict)
    #: a graph compiled under torch.compile: "code" (the function dynamo compiled),
    #: "compile" (1 = its first compile), "compile_id" (dynamo's "frame/compile"),
    #: "reason" (why dynamo recompiled: its guard failure) and "source" (the user's
    #: line owning that guard); see `opencann.dynamo.recompiles`
    torch_compile: Dict[str, Any] = field(default_factory=dict)
    #: with the option ``streams`` > 1: "streams", "events", "cross_stream_dependences",
    #: "nodes_per_stream", "costs" ("measured" or "model"), "estimated_serial_us",
    #: "predicted_busy_us" (per stream), "predicted_call_us"
    #: (`opencann.passes.schedule.stream_summary`);
    #: empty (and left out of `to_dict`) on one stream
    streams: Dict[str, Any] = field(default_factory=dict)
    #: a model compiled by ``opencann.tune``: the chosen per-node precision, measured
    #: speed-up, each node's own error and why nodes stay in higher precision
    #: (`opencann.tools.tune.TuneResult.to_dict`); empty (and left out of `to_dict`) otherwise
    precision: Dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.device = str(self.device)

    @property
    def opencann_seconds(self) -> float:
        """Time spent in opencann's own passes and planning (excludes capture)."""
        return sum(p.seconds for p in self.passes)

    def to_dict(self) -> Dict[str, Any]:
        """The report as plain data (``dataclasses.asdict``) plus ``opencann_seconds``."""
        d = asdict(self)
        for k in ("streams", "precision"):
            if not d[k]:
                del d[k]
        d["opencann_seconds"] = self.opencann_seconds
        return d

    def to_json(self, indent: int = 2) -> str:
        """`to_dict` as JSON text (non-JSON values as ``str``), indented by ``indent``."""
        return json.dumps(self.to_dict(), indent=indent, default=str)

    def summary(self) -> str:
        """A few lines: fusions, fallbacks, memory, cost, compile time."""
        m = self.memory
        lines = [f"opencann compile report: {self.model} on {self.device}"]
        cap = sum(self.capture_seconds.values())
        lines.append(f"  compile time: capture {cap:.2f} s, opencann passes {self.opencann_seconds:.3f} s")
        lines.append(f"  nodes: {sum(self.op_counts_before.values())} -> {sum(self.op_counts_after.values())}")
        kinds: Dict[str, int] = {}
        for a in self.applied:
            kinds[_rewrite(a)] = kinds.get(_rewrite(a), 0) + 1
        lines.append("  fusions applied: " + (", ".join(f"{k} x{v}" for k, v in kinds.items()) or "none"))
        sk: Dict[str, int] = {}
        for s in self.skipped:
            key = f"{_rewrite(s)}: {s['reason']}"
            sk[key] = sk.get(key, 0) + 1
        if sk:
            lines.append("  skipped:")
            lines += [f"    - {k} (x{v})" for k, v in sk.items()]
        if self.host_fallbacks:
            lines.append("  host fallbacks: " + ", ".join(
                f"{k} x{v['count']}" for k, v in self.host_fallbacks.items()))
        if m.get("arena_bytes") is not None:
            lines.append(f"  memory: arena {fmt_bytes(m['arena_bytes'])}, lower bound "
                         f"{fmt_bytes(m['lower_bound_bytes'])} ({m['arena_over_lower_bound']:.3f}x), "
                         f"naive {fmt_bytes(m['naive_bytes'])}"
                         + (f"; {m['kernel_allocated_values']} values kernel-allocated"
                            if m.get("kernel_allocated_values") else ""))
        if self.streams:
            lines.append(_streams_line(self.streams))
        rec = m.get("recompute") if m else None
        if rec:
            bns = rec.get("batch_norm_outputs_recomputable") or []
            lines.append(f"  recomputation: {rec.get('saved_count', 0)} tensors saved "
                         f"({fmt_bytes(rec.get('saved_bytes', 0))}), "
                         f"{len(rec.get('recomputed', []))} recomputed "
                         f"({fmt_flops(rec.get('recompute_flops', 0))}), planned peak "
                         f"{fmt_bytes(rec['peak'])} vs {fmt_bytes(rec['peak_without_recompute'])} "
                         f"without recomputation"
                         + (f", budget {rec['memory_budget']}" if rec.get("memory_budget") else "")
                         + (f"; {len(bns)} BatchNorm outputs recomputed from saved statistics"
                            if bns else ""))
            lines += [f"  BatchNorm output recompute not applied at {bn}: {why}"
                      for bn, why in (rec.get("batch_norm_outputs_kept") or {}).items()]
        if self.cost_before:
            cb, ca = self.cost_before, self.cost_after
            lines.append(f"  work {fmt_flops(cb['flops'])} -> {fmt_flops(ca['flops'])}; "
                         f"bytes moved {fmt_bytes(cb['bytes'])} -> {fmt_bytes(ca['bytes'])}")
        tc = self.torch_compile
        if tc:
            lines.append(f"  torch.compile: {tc['code']}, compile {tc['compile']} "
                         f"({tc['compile_id']})" + (f", recompiled because {tc['reason']} "
                                                    f"(guard at {tc['source']})"
                                                    if tc.get("reason") else ""))
        lines += [f"  note: {n}" for n in self.notes]
        return "\n".join(lines)

    def _dynamic_text(self) -> List[str]:
        """The dynamic dims, their guards and the per-shape plans, as lines."""
        d = self.dynamic
        if not d:
            return []
        lines = ["dynamic dims:"]
        lines += [f"  {n} ({v['symbol']}) in [{v['min']}, {v['max'] if v['max'] is not None else 'inf'}]"
                  f" from {', '.join(v['sources'])}" for n, v in d.get("dims", {}).items()]
        lines.append("  guards: " + "; ".join(d.get("guards", [])))
        lines.append(f"  plans (at most {d.get('plan_cache_size')} kept):")
        lines += [f"    {', '.join(f'{k}={v}' for k, v in p['dims'].items())}: arena "
                  f"{fmt_bytes(p['arena_bytes'])} ({p['arena_over_lower_bound']:.3f}x lower bound), "
                  f"built in {p['build_ms']:.1f} ms" for p in d.get("plans", [])]
        if d.get("gears"):
            g = d["gears"]
            lines.append(f"  gears ({g['option']}, {', '.join(g['dims'])}): "
                         f"{[v[0] if len(v) == 1 else v for v in g['values']]}")
            for name, row in d.get("padding", {}).get("dims", {}).items():
                b = row["blocked_by"]
                lines.append(f"    {name}: padded to the smallest gear holding a call" if row["padded"]
                             else f"    {name}: exact gears only, padding stopped by {b['node']} "
                             f"({b['op']}) at {b['where']}: {b['reason']}")
        return lines

    def to_text(self) -> str:
        """The full readable report: summary, every pass, every fusion and skip."""
        lines = [self.summary(), "", "passes:"]
        for p in self.passes:
            state = "" if p.enabled else " (disabled)"
            lines.append(f"  {p.stage:9s} {p.name:28s} nodes {p.nodes_before:5d} -> {p.nodes_after:5d}"
                         f"  changed {p.changed:4d}  {p.seconds * 1e3:8.1f} ms{state}"
                         + (f"  [{p.note}]" if p.note else ""))
        if self.applied:
            lines.append("fusions applied:")
            lines += [f"  {_rewrite(a)}: {a['nodes']} at {a['where']}" for a in self.applied]
        if self.skipped:
            lines.append("optimizations not applied:")
            lines += [f"  {_rewrite(s)} at {s['nodes']} ({s['where']}): {s['reason']}" for s in self.skipped]
        if self.host_fallbacks:
            lines.append("host fallbacks (ATen ops with no opencann converter, run on the host):")
            for k, v in self.host_fallbacks.items():
                lines.append(f"  {k} x{v['count']} at " + "; ".join(v["where"][:5]))
        lines += self._dynamic_text()
        ka = (self.memory or {}).get("kernel_allocated") or {}
        if ka:
            lines.append("values outside the arena (allocated by their kernel), by reason:")
            lines += [f"  {v['count']} x {reason}: {', '.join(v['values'][:4])}"
                      + (" ..." if v["count"] > 4 else "") for reason, v in ka.items()]
        return "\n".join(lines)
