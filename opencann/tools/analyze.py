"""Op-support audit (``opencann analyze``): what of a model opencann compiles, without
running the compiled model. The model is captured (torch.export, core ATen) and
converted to IR; each op is then one of:

- ``converted``: an opencann op (OpDef);
- ``host_fallback``: an ATen op without a converter, run by torch on the host;
- ``custom_op``: a user or third-party op (``torch.library``; namespace not aten/prims),
  run on the host;
- ``no_device_kernel``: converted, but the device (vnpu) has no kernel for it, so it runs
  on the host there (views need none: they are ``converted``);
- ``dynamic_shape``: an output with symbolic dims;
- ``data_dependent``: a shape or branch that depends on tensor values (``if x.sum() > 0``,
  ``nonzero``): torch.export cannot capture it; the model is then traced by dynamo
  (``torch._dynamo.explain``), which names each graph break, and the graphs between breaks
  are audited as above (they are what ``torch.compile(backend="opencann")`` compiles);
  a captured graph whose conversion stops on a data-dependent value is one finding too;
- ``conversion_error``: the captured graph cannot be converted for another reason, by the
  error's kind (``ConversionError.kind``, `opencann.frontend.errors.KINDS`): a parameter
  or buffer written in forward, control flow, arithmetic on sizes, a generator object, an
  op or ONNX opset without a converter...; the finding's op is the kind's title, its
  detail the kind's fix, its message the error's own line (node, source, name).

Ops are counted after constant folding and dead-code elimination (the compile's first
two passes, `opencann.passes.ConstantFolding`): an op whose inputs are all constants (a
Transpose of a weight, a mask built from ``arange``) is evaluated once at compile time and
never runs, so it is neither a host op nor an op without a device kernel; ``folded``
counts them. Every finding carries its count, source lines and module paths. ONNX files
are audited through the ONNX frontend (``OnnxHostFallback``: no converter).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional

import torch

from ..devices import Device, parse_device
from ..ops import get_op

KINDS = ("converted", "host_fallback", "custom_op", "no_device_kernel", "dynamic_shape",
         "data_dependent", "conversion_error")
# kinds that keep a model from compiling into one device graph: exit code 1 in CI
BLOCKING = ("host_fallback", "custom_op", "data_dependent", "dynamic_shape", "conversion_error")
# ConversionError kinds that are mistakes in the call, not findings about the model: raised
_CALL_ERRORS = ("bad_argument",)
_CORE_NAMESPACES = ("aten", "prims")


@dataclass
class OpFinding:
    """One op (or graph break) of one kind: ``count`` occurrences at ``sources``
    (file:line) in ``modules`` (module paths)."""

    op: str
    kind: str
    count: int = 0
    sources: List[str] = field(default_factory=list)
    modules: List[str] = field(default_factory=list)
    detail: str = ""
    message: str = ""

    def add(self, source: str, module: str) -> None:
        """Count one more occurrence at ``source`` (``file:line``) in ``module`` (module path)."""
        self.count += 1
        if source and source not in self.sources:
            self.sources.append(source)
        if module and module not in self.modules:
            self.modules.append(module)


@dataclass
class Analysis:
    """``findings`` by (op, kind); ``graphs``: graphs audited (more than one after graph
    breaks); ``readiness``: "ready", "ready with host fallbacks" or "not ready"."""

    model: str
    device: Device   # prints as the device string
    findings: Dict[str, OpFinding] = field(default_factory=dict)
    graphs: int = 1
    capture: str = "torch.export"
    #: ops removed by constant folding and dead-code elimination before the audit
    folded: int = 0

    def note(self, op: str, kind: str, source: str = "", module: str = "", detail: str = "",
             message: str = "") -> None:
        """Record one occurrence of ``op`` classified as ``kind`` (one of `KINDS`)."""
        f = self.findings.setdefault(f"{kind}:{op}", OpFinding(op, kind, detail=detail,
                                                               message=message))
        f.add(source, module)

    def note_conversion_error(self, e) -> None:
        """Record a `ConversionError` by its ``kind``: data-dependent ones as
        ``data_dependent``, the others as ``conversion_error``; op = the kind's title,
        detail = its fix, message = the error's text. Re-raises errors in the call's own
        arguments (``bad_argument``)."""
        if e.kind in _CALL_ERRORS:
            raise e
        kind = "data_dependent" if e.kind == "data_dependent" else "conversion_error"
        self.note(e.title, kind, detail=f"fix: {e.fix}", message=str(e))

    def by_kind(self, kind: str) -> List[OpFinding]:
        """The findings of ``kind``, most frequent first."""
        return sorted((f for f in self.findings.values() if f.kind == kind), key=lambda f: -f.count)

    def counts(self) -> Dict[str, int]:
        """Occurrences per kind, every kind of `KINDS` present."""
        return {k: sum(f.count for f in self.by_kind(k)) for k in KINDS}

    @property
    def readiness(self) -> str:
        """"ready", "ready with host fallbacks" or "not ready" (dynamic or data-dependent
        ops, or a graph that does not convert)."""
        c = self.counts()
        if c["data_dependent"] or c["dynamic_shape"] or c["conversion_error"]:
            return "not ready"
        if c["host_fallback"] or c["custom_op"] or c["no_device_kernel"]:
            return "ready with host fallbacks"
        return "ready"

    @property
    def exit_code(self) -> int:
        """0 when every op compiles for the device graph, 1 otherwise (CI)."""
        return 1 if any(self.counts()[k] for k in BLOCKING) else 0

    def to_dict(self) -> Dict[str, Any]:
        """JSON-ready form (``opencann analyze --json``)."""
        return {"model": self.model, "device": str(self.device), "capture": self.capture,
                "graphs": self.graphs, "readiness": self.readiness, "counts": self.counts(),
                "folded": self.folded,
                "findings": [vars(f) for k in KINDS for f in self.by_kind(k)]}

    def to_text(self) -> str:
        """Readable form: readiness, counts, then each finding with its sources."""
        c = self.counts()
        lines = [f"{self.model} on {self.device}: {self.readiness} ({self.capture}, "
                 f"{self.graphs} graph{'s' if self.graphs != 1 else ''})",
                 "  " + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in c.items())
                 + f" (after constant folding removed {self.folded} op"
                 + f"{'s' if self.folded != 1 else ''})"]
        for kind in KINDS[1:]:
            for f in self.by_kind(kind):
                where = "; ".join(f.sources[:3]) or "?"
                mods = ", ".join(f.modules[:3])
                lines.append(f"  {kind.replace('_', ' ')}: {f.op} x{f.count} at {where}"
                             + (f" in {mods}" if mods else "") + (f" ({f.detail})" if f.detail else ""))
                if f.message:
                    lines.append(f"    {f.message}")
        return "\n".join(lines)


def analyze(model: torch.nn.Module, example_inputs, device: str = "cpu",
            example_kwargs=None, name: Optional[str] = None) -> Analysis:
    """Audit ``model`` on ``example_inputs`` (tensor or tuple) for ``device`` ("cpu" or
    "vnpu[:preset]"). Returns an `Analysis`; a graph that does not convert is a finding
    of its error's kind (`Analysis.note_conversion_error`). Raises TypeError (not a
    module) and ValueError (unknown device); capture failures other than data-dependent
    control flow raise CaptureError as ``opencann.compile`` does."""
    from ..frontend.errors import ConversionError
    from ..frontend.torch import CaptureError, capture, from_exported_program
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    res = Analysis(name or type(model).__name__, _check_device(device))
    try:
        ep, _ = capture(model, args, example_kwargs)
    except CaptureError as e:
        if "depends on tensor values" not in str(e) and "data-dependent" not in str(e):
            raise
        return _analyze_with_breaks(model, args, example_kwargs or {}, res)
    try:
        graph = from_exported_program(ep, name=res.model, check=False)
    except ConversionError as e:
        res.note_conversion_error(e)
        return res
    audit_graph(graph, res)
    return res


def analyze_onnx(path: str, device: str = "cpu", input_shapes=None) -> Analysis:
    """Audit an ONNX file (converted, not run); a graph that does not convert is a
    finding of its error's kind. Raises OnnxLoadError (unreadable file, old opset) and
    ConversionError of kind ``bad_argument`` (``input_shapes`` wrong)."""
    from ..frontend.errors import ConversionError
    from ..frontend.onnx import from_onnx, load_model
    res = Analysis(path, _check_device(device), capture="ONNX")
    model = load_model(path)
    try:
        graph = from_onnx(model, input_shapes)
    except ConversionError as e:
        res.note_conversion_error(e)
        return res
    audit_graph(graph, res)
    return res


def _check_device(device) -> Device:
    return parse_device(device)   # one ValueError line: unknown device, or the vnpu presets


def fold_constants(graph, device: Device) -> int:
    """Constant folding then dead-code elimination on ``graph`` (in place), as the
    compile's prepare stage runs them; returns the number of nodes removed. Raises the
    ValueError of `ConstantFolding` when an op fails on its constant inputs (the model
    fails on every input of these shapes)."""
    from ..engine.options import complete
    from ..passes import ConstantFolding, DeadCodeElimination, PassContext
    from ..report import CompileReport
    before = len(graph.nodes)
    ctx = PassContext(options=complete({}), report=CompileReport(model=graph.name,
                                                                 device=str(device)),
                      device=device)
    ConstantFolding().run(graph, ctx)
    DeadCodeElimination().run(graph, ctx)
    return before - len(graph.nodes)


def audit_graph(graph, res: Analysis) -> None:
    """Classify every node of an IR ``graph`` into ``res``, after constant folding
    (`fold_constants`; the nodes it removes count in ``res.folded``)."""
    res.folded += fold_constants(graph, res.device)
    on_npu = res.device.kind == "vnpu"
    for n in graph.nodes:
        src, mod = n.source, n.scope
        if any(isinstance(d, str) for o in n.outputs for d in o.desc.shape):
            res.note(n.op, "dynamic_shape", src, mod)
        if n.op == "OnnxHostFallback":
            res.note(f"onnx::{n.attrs.get('op_type')}", "host_fallback", src or n.name, mod)
        elif n.op == "HostFallback":
            target = n.meta.get("aten")
            ns = getattr(target, "namespace", "aten")
            kind = "host_fallback" if ns in _CORE_NAMESPACES else "custom_op"
            res.note(str(target), kind, src, mod)
        elif on_npu and not get_op(n.op).is_view and "vnpu" not in get_op(n.op).kernel_factories:
            res.note(n.op, "no_device_kernel", src, mod, detail="runs on the host")
        else:
            res.note(n.op, "converted", src, mod)


def _analyze_with_breaks(model, args, kwargs, res: Analysis) -> Analysis:
    """torch.export failed on data-dependent control flow: name each graph break
    (dynamo's explain) and audit the graphs between them (AOTAutograd's ATen graphs)."""
    import torch._dynamo as dynamo
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    from ..frontend.torch import decomposition_table, from_fx_graph
    res.capture = "dynamo (torch.export failed: data-dependent control flow)"
    dynamo.reset()
    explained = dynamo.explain(model)(*args, **kwargs)
    for b in explained.break_reasons:
        frames = [f for f in b.user_stack if "/torch/" not in f.filename]
        fr = frames[-1] if frames else (b.user_stack[-1] if b.user_stack else None)
        src = f"{fr.filename.rsplit('/', 1)[-1]}:{fr.lineno}" if fr is not None else ""
        res.note("graph break", "data_dependent", src,
                 detail=_short_reason(b.reason))
    graphs = []

    def fw(gm, inputs):
        with unset_fake_temporarily():
            graphs.append(from_fx_graph(gm, inputs, name=f"{res.model}_part{len(graphs)}",
                                        check=False))
        return gm

    dynamo.reset()
    backend = aot_autograd(fw_compiler=fw, decompositions=decomposition_table())
    with torch.no_grad():
        torch.compile(model, backend=backend, dynamic=False)(*args, **kwargs)
    dynamo.reset()
    for g in graphs:
        audit_graph(g, res)
    res.graphs = len(graphs)
    return res


def _short_reason(reason: str) -> str:
    r = (reason or "").splitlines()[0] if reason else ""
    if "generic_jump" in r or "jump" in r:
        return "Python control flow on a tensor value (if/while on a tensor)"
    return r[:120]
