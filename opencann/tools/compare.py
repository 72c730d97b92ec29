"""Layer-by-layer accuracy of a compiled model against eager PyTorch (msprobe's
``compare``, without the dump files): every IR value that stands for a value of the
traced program (``node.meta["origin"]``, recorded at conversion and carried through
rewrites) is compared with that value computed by torch, op by op.

    res = compare(model, (x,), options={"precision_mode": "allow_mix_precision_bf16"})
    res.first_divergence      # the first layer whose status is not "pass" (or None)
    res.to_csv("layers.csv"); write_html(res, "layers.html")   # compare_html

The reference is torch.export's decomposed (core ATen) program run by eager torch on the
same inputs: the same graph opencann compiles, so each of its nodes has a counterpart.
Metrics (msprobe's definitions): cosine similarity, max absolute error, max relative
error, relative RMSE, and the one-thousandth / five-thousandth error ratios (the share of
elements whose relative error is below 0.001 / 0.005). Pass / warn / fail come from one
table per dtype, `THRESHOLDS`. NaN and inf positions must agree (else fail).
"""
from __future__ import annotations

import csv
from dataclasses import asdict, dataclass, field
from typing import Any, Dict, List, Optional, Sequence

import torch
import torch.utils._pytree as pytree

# dtype of the compiled value -> the bounds a layer must meet to "pass" and, failing
# that, to "warn" (else "fail"). Relative errors of one rounding: fp32 6e-8, bf16 4e-3,
# fp16 5e-4; reassociation (other GEMM kernels, folded BatchNorm) adds a few of those.
THRESHOLDS: Dict[str, Dict[str, Dict[str, float]]] = {
    "float64": {"pass": {"cosine": 0.999999, "rel_rmse": 1e-6},
                "warn": {"cosine": 0.9999, "rel_rmse": 1e-3}},
    "float32": {"pass": {"cosine": 0.99999, "rel_rmse": 1e-4},
                "warn": {"cosine": 0.999, "rel_rmse": 1e-2}},
    "float16": {"pass": {"cosine": 0.999, "rel_rmse": 1e-2},
                "warn": {"cosine": 0.99, "rel_rmse": 5e-2}},
    "bfloat16": {"pass": {"cosine": 0.999, "rel_rmse": 3e-2},
                 "warn": {"cosine": 0.99, "rel_rmse": 1e-1}},
}
# integer and bool values pass only when equal
EPS = 1e-12   # msprobe's guard in relative errors: |a - b| / (|b| + EPS)
METRICS = ("cosine", "max_abs", "max_rel", "rel_rmse", "thousandth", "five_thousandth")


@dataclass
class LayerResult:
    """One compared value: the IR node that computed it, the traced (FX) node it stands
    for, its module path and source line, its dtype and shape, the metrics and status."""

    index: int
    node: str
    op: str
    fx_node: str
    module: str
    source: str
    dtype: str
    shape: tuple
    cosine: float
    max_abs: float
    max_rel: float
    rel_rmse: float
    thousandth: float
    five_thousandth: float
    status: str
    note: str = ""


@dataclass
class CompareResult:
    """``layers`` in execution order; ``outputs``: the graph outputs compared the same
    way; ``first_divergence``: index into ``layers`` of the first "fail" (else the first
    "warn"), None when all pass; ``report``: the compile report."""

    model: str
    device: str
    options: Dict[str, Any]
    layers: List[LayerResult] = field(default_factory=list)
    outputs: List[LayerResult] = field(default_factory=list)
    first_divergence: Optional[int] = None
    report: Any = None

    @property
    def status(self) -> str:
        """The worst status of the outputs ("pass", "warn", "fail")."""
        return worst(o.status for o in self.outputs)

    def counts(self) -> Dict[str, int]:
        """Layers per status (``pass``/``warn``/``fail``)."""
        c = {"pass": 0, "warn": 0, "fail": 0}
        for r in self.layers:
            c[r.status] += 1
        return c

    def to_csv(self, path: str) -> None:
        """One row per compared layer (outputs last, ``index`` ``out<k>``)."""
        cols = list(LayerResult.__dataclass_fields__)
        with open(path, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=cols)
            w.writeheader()
            for r in self.layers:
                w.writerow(asdict(r))
            for k, r in enumerate(self.outputs):
                w.writerow(dict(asdict(r), index=f"out{k}"))

    def summary(self) -> str:
        """A few lines: layer counts per status, each output's metrics, the first divergence."""
        c = self.counts()
        lines = [f"{self.model} on {self.device}{_opts(self.options)}: {len(self.layers)} layers "
                 f"compared with eager: {c['pass']} pass, {c['warn']} warn, {c['fail']} fail; "
                 f"outputs {self.status}"]
        for k, o in enumerate(self.outputs):
            lines.append(f"  output {k}: cosine {o.cosine:.6f}, max abs {o.max_abs:.3g}, "
                         f"relative RMSE {o.rel_rmse:.3g} ({o.status})")
        if self.first_divergence is not None:
            r = self.layers[self.first_divergence]
            lines.append(f"  first divergence: {r.node} ({r.op}) = {r.fx_node} in "
                         f"{r.module or 'the model'} ({r.source or '?'}): cosine {r.cosine:.6f}, "
                         f"relative RMSE {r.rel_rmse:.3g} ({r.status})")
        return "\n".join(lines)


def _opts(options: Dict[str, Any]) -> str:
    shown = {k: v for k, v in (options or {}).items() if v}
    return f" with {shown}" if shown else ""


def worst(statuses) -> str:
    """The worst of ``statuses`` (fail > warn > pass); "pass" when empty."""
    order = {"pass": 0, "warn": 1, "fail": 2}
    return max(statuses, key=order.__getitem__, default="pass")


def metrics(actual: torch.Tensor, expected: torch.Tensor) -> Dict[str, Any]:
    """The comparison metrics of ``actual`` against ``expected`` (same shape, any
    dtypes; computed in float64). Positions that are NaN or ±inf in either must agree
    (``note`` says how many do not); the metrics cover the finite positions. Cosine of
    two all-zero tensors is 1. Raises ValueError for another shape."""
    if tuple(actual.shape) != tuple(expected.shape):
        raise ValueError(f"shapes differ: {tuple(actual.shape)} vs {tuple(expected.shape)}")
    a, b = actual.detach().double().flatten(), expected.detach().double().flatten()
    note = ""
    fin = torch.isfinite(a) & torch.isfinite(b)
    special = ~fin
    if special.any():
        bad = int((special & ~((a == b) | (torch.isnan(a) & torch.isnan(b)))).sum())
        if bad:
            note = f"{bad} NaN/inf positions differ"
        a, b = a[fin], b[fin]
    if a.numel() == 0:
        return dict(cosine=1.0, max_abs=0.0, max_rel=0.0, rel_rmse=0.0, thousandth=1.0,
                    five_thousandth=1.0, note=note)
    diff = (a - b).abs()
    rel = diff / (b.abs() + EPS)
    na, nb = a.norm(), b.norm()
    cos = 1.0 if na == 0 and nb == 0 else float((a @ b) / (na * nb).clamp_min(1e-300))
    rms_b = float(b.pow(2).mean().sqrt())
    rmse = float(diff.pow(2).mean().sqrt())
    return dict(cosine=cos, max_abs=float(diff.max()), max_rel=float(rel.max()),
                rel_rmse=rmse / rms_b if rms_b > 0 else (0.0 if rmse == 0 else float("inf")),
                thousandth=float((rel < 1e-3).double().mean()),
                five_thousandth=float((rel < 5e-3).double().mean()), note=note)


def status_of(m: Dict[str, Any], dtype: torch.dtype) -> str:
    """"pass", "warn" or "fail" for metrics ``m`` of a value of ``dtype`` (`THRESHOLDS`;
    non-float dtypes must be equal)."""
    if m.get("note"):
        return "fail"
    t = THRESHOLDS.get(str(dtype).replace("torch.", ""))
    if t is None:
        return "pass" if m["max_abs"] == 0 else "fail"
    for level in ("pass", "warn"):
        b = t[level]
        if m["cosine"] >= b["cosine"] and m["rel_rmse"] <= b["rel_rmse"]:
            return level
    return "fail"


class UnjudgeableInputs(ValueError):
    """Inputs on which the reference outputs have no finite value (`check_judgeable`)."""


def check_judgeable(outputs, what: str) -> None:
    """Raise `UnjudgeableInputs` (a ValueError, one line) when a floating-point tensor
    among ``outputs`` (a pytree) has no finite element: every accuracy rule passes
    vacuously on it (NaN/Inf positions agree, cosine and errors skip non-finite elements),
    so a comparison, a bisection or a precision search on such inputs would approve
    anything. ``what`` names the outputs in the message."""
    leaves = [o for o in pytree.tree_leaves(outputs) if isinstance(o, torch.Tensor)]
    for k, o in enumerate(leaves):
        if o.is_floating_point() and o.numel() and not bool(torch.isfinite(o).any()):
            raise UnjudgeableInputs(
                f"{what} have no finite value (output {k}, {tuple(o.shape)}, is all NaN/Inf): "
                f"an accuracy comparison would pass anything; give inputs the model computes "
                f"finite results for (random normal values or real data, no NaN)")


class Session:
    """A model captured once, with eager's value of every traced node on one set of
    inputs; `run` compiles and compares with any options (bisection reuses it).
    Raises CaptureError / ConversionError like ``opencann.compile``."""

    def __init__(self, model: torch.nn.Module, example_inputs, example_kwargs=None):
        from ..frontend.torch import capture
        self.model = model
        self.args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
        self.kwargs = example_kwargs or {}
        self.ep, _ = capture(model, self.args, self.kwargs)
        self.flat = pytree.tree_leaves((self.args, self.kwargs))
        self.eager, self.eager_outputs, self.fx = _run_eager(self.ep, self.flat)
        check_judgeable(self.eager_outputs, "the model's eager outputs on these inputs")

    def run(self, device: str = "cpu", options: Optional[Dict[str, Any]] = None,
            layers: bool = True, strict: bool = False) -> CompareResult:
        """Compile for ``device`` with ``options`` and compare (every layer when
        ``layers``, else the outputs only). Under a ``precision_mode`` that lowers to
        fp16/bf16, every float value is judged by that dtype's thresholds (what the mode
        allows), unless ``strict`` (each value by its own dtype's)."""
        from ..engine import compile_graph
        from ..devices import parse_device
        from ..frontend.torch import from_exported_program
        from ..runtime import Executor
        parse_device(device)   # one ValueError line naming the devices / vnpu presets
        graph = from_exported_program(self.ep, name=type(self.model).__name__)
        graph, plan, report = compile_graph(graph, str(device), dict(options or {}))
        res = CompareResult(type(self.model).__name__, str(device), dict(options or {}),
                            report=report)
        self._floor = None if strict else _floor(options)
        inputs = [t.contiguous() for t in self.flat if isinstance(t, torch.Tensor)]
        ex = Executor(graph, plan)
        with torch.no_grad():
            if layers:
                outs = ex.run_observed(inputs, lambda node, ts: self._observe(res, node, ts))
            else:
                outs = ex.run(inputs)
        refs = [o for o in self.eager_outputs if isinstance(o, torch.Tensor)]
        if len(refs) == len(outs):
            for k, (o, r) in enumerate(zip(outs, refs)):
                m = metrics(o, r)
                res.outputs.append(LayerResult(k, f"output {k}", "", "", "", "", _name(o.dtype),
                                               tuple(o.shape), status=status_of(m, self._judge(o.dtype)), **m))
        fails = [i for i, r in enumerate(res.layers) if r.status == "fail"]
        warns = [i for i, r in enumerate(res.layers) if r.status == "warn"]
        res.first_divergence = (fails or warns or [None])[0]
        return res

    def _observe(self, res: CompareResult, node, outs: Sequence[Any]) -> None:
        for k, t in enumerate(outs):
            if not isinstance(t, torch.Tensor):
                continue
            label = origin_of(node, k)
            if label is None:
                label, t = in_origin_layout(node, k, t)
            ref = self.eager.get(label) if label else None
            if ref is None or tuple(ref.shape) != tuple(t.shape) or not t.numel():
                continue
            m = metrics(t, ref)
            fx = self.fx.get(label.split(".")[0])
            src, scope = _where(fx) if fx is not None else (node.source, node.scope)
            res.layers.append(LayerResult(len(res.layers), node.name, node.op, label, scope or node.scope,
                                          src or node.source, _name(t.dtype),
                                          tuple(t.shape), status=status_of(m, self._judge(t.dtype)), **m))

    def _judge(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype whose thresholds judge a value of ``dtype``."""
        return self._floor if self._floor is not None and dtype.is_floating_point else dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _floor(options: Optional[Dict[str, Any]]) -> Optional[torch.dtype]:
    """The low dtype of ``options["precision_mode"]`` (None: no lowering)."""
    from ..passes.prepare.precision import low_dtype
    mode = (options or {}).get("precision_mode")
    low = low_dtype(mode) if mode else None
    return low.torch if low is not None else None


def origin_of(node, k: int) -> Optional[str]:
    """The traced value output ``k`` of IR ``node`` stands for, or None. A TransData back
    to ND (vnpu) stands for its input's value; values in an NPU storage format are None
    here (their layout is not eager's: `in_origin_layout` converts them back)."""
    from ..ir import Format
    v = node.outputs[k]
    if v.desc.format != Format.ND:
        return None
    if node.op == "TransData" and node.inputs and node.inputs[0].producer is not None:
        src = node.inputs[0]
        return (src.producer.meta.get("origin") or [None] * len(src.producer.outputs))[
            src.producer.outputs.index(src)]
    labels = node.meta.get("origin")
    return labels[k] if labels and k < len(labels) else None


def in_origin_layout(node, k: int, t: torch.Tensor):
    """(the traced value, ``t`` in its origin layout) for output ``k`` of IR ``node`` when
    it is stored in an NPU format (vnpu: NC1HWC0, FRACTAL_NZ...): the storage converted
    back to the value's origin format and shape (``TensorDesc.origin_format`` /
    ``origin_shape``) by `opencann.devices.vnpu.formats.trans_data`, dropping the C0 /
    fractal padding, so that it compares with eager's tensor; (None, t) otherwise."""
    from ..devices.vnpu.formats import trans_data
    from ..ir import Format
    d = node.outputs[k].desc
    labels = node.meta.get("origin")
    label = labels[k] if labels and k < len(labels) else None
    if label is None or d.format == Format.ND or not d.is_static or \
            any(isinstance(s, str) for s in d.origin_shape):
        return None, t
    try:
        return label, trans_data(t, d.format.value, d.origin_format.value,
                                 origin_shape=tuple(d.origin_shape))
    except ValueError:   # a layout trans_data cannot undo (grouped weights): not compared
        return None, t


def _where(fx_node) -> tuple:
    from ..frontend.torch.convert import source_of
    return source_of(fx_node)


def _run_eager(ep, flat: Sequence[Any]):
    """Run ``ep``'s graph with torch, keeping every call_function node's value (tuple
    results as ``name.k``). Returns (values, flat outputs, FX nodes by name)."""
    from torch.export.graph_signature import InputKind
    user = iter(flat)
    args = []
    for spec in ep.graph_signature.input_specs:
        if spec.kind == InputKind.USER_INPUT:
            args.append(next(user))
        elif spec.kind == InputKind.TOKEN:
            args.append(torch.empty(0))
        elif spec.target in ep.state_dict:
            args.append(ep.state_dict[spec.target])
        else:
            args.append(ep.constants[spec.target])
    values: Dict[str, torch.Tensor] = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, n):
            r = super().run_node(n)
            if n.op == "call_function":
                if isinstance(r, torch.Tensor):
                    values[n.name] = r.detach().clone()
                elif isinstance(r, (tuple, list)):
                    for k, x in enumerate(r):
                        if isinstance(x, torch.Tensor):
                            values[f"{n.name}.{k}"] = x.detach().clone()
            return r

    with torch.no_grad():
        outs = Recorder(ep.graph_module).run(*args)
    fx = {n.name: n for n in ep.graph.nodes}
    return values, list(pytree.tree_leaves(outs)), fx


def compare(model: torch.nn.Module, example_inputs, device: str = "cpu",
            options: Optional[Dict[str, Any]] = None, example_kwargs=None) -> CompareResult:
    """Compile ``model`` for ``device`` with ``options`` (e.g. ``{"precision_mode":
    "allow_mix_precision"}``) and compare every layer with eager on ``example_inputs``
    (a tensor or tuple). Returns a `CompareResult`. Raises CaptureError, ConversionError
    or ValueError (bad options or device) like ``opencann.compile``."""
    return Session(model, example_inputs, example_kwargs).run(device, options)



def compare_onnx(path: str, device: str = "cpu", options: Optional[Dict[str, Any]] = None,
                 input_shapes=None, seed: int = 0) -> CompareResult:
    """The outputs of the ONNX file ``path`` compiled for ``device`` with ``options``
    against the same file compiled for the cpu without options (fp32, what ``opencann
    run`` checks against ONNX Runtime), on random inputs of its input shapes
    (`run_inputs.random_inputs`, never all zeros; ``input_shapes`` name -> sizes for
    symbolic dims). ``layers`` stays empty: an ONNX graph has no eager layers to compare.
    Raises OnnxLoadError, ConversionError and ValueError like ``opencann.compile``."""
    from ..engine import compile_onnx
    from .run_inputs import input_specs, random_inputs
    ref_cm = compile_onnx(path, device="cpu", input_shapes=input_shapes)
    cm = compile_onnx(path, device=device, options=dict(options or {}), input_shapes=input_shapes)
    inputs = random_inputs(input_specs(ref_cm, None, path), seed)
    refs = [o for o in pytree.tree_leaves(ref_cm(*inputs)) if isinstance(o, torch.Tensor)]
    check_judgeable(refs, "the file's fp32 outputs on random inputs")
    outs = [o for o in pytree.tree_leaves(cm(*inputs)) if isinstance(o, torch.Tensor)]
    res = CompareResult(path, str(device), dict(options or {}), report=cm.report)
    floor = _floor(options)
    for k, (o, r) in enumerate(zip(outs, refs)):
        m = metrics(o, r)
        judge = floor if floor is not None and o.dtype.is_floating_point else o.dtype
        res.outputs.append(LayerResult(k, f"output {k}", "", "", "", "", _name(o.dtype),
                                       tuple(o.shape), status=status_of(m, judge), **m))
    return res
