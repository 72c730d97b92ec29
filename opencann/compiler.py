"""The graph engine's front door: capture → passes → memory plan → `CompiledModel`.

`compile_module` is what ``opencann.compile`` calls; `compile_graph` takes an IR graph
(used by the ``torch.compile`` backend). The artifact keeps the graph, memory plan,
schedule, bound kernels and the compile report.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from .frontend.torch import capture, from_exported_program
from .ir import Graph, MemoryPlan
from .log import logger
from .ops import Cost, get_op, is_random
from .passes import PassContext, default_pipeline, plan_memory
from .report import CompileReport, PassRecord
from .runtime import DEFAULT_CONCURRENT_CALLS, Executor, ExecutorPool

SUPPORTED_DEVICES = ("cpu", "vnpu")
KNOWN_OPTIONS = {"disable", "enable", "verify", "alignment", "inplace", "copy_out",
                 "precision_mode", "keep_fp32", "host_fallback", "concurrent_calls"}
# opencann.compile runs one at a time: torch.export is not thread-safe (concurrent exports
# corrupt its mode stack and leave builtins patched), and compiling is CPU-bound anyway
_COMPILE_LOCK = threading.RLock()


def graph_cost(graph: Graph) -> Dict[str, int]:
    """Total FLOPs and bytes moved (read + written) of the graph's nodes."""
    total = Cost()
    for n in graph.nodes:
        total = total + get_op(n.op).cost(n)
    return {"flops": int(total.flops), "bytes": int(total.bytes)}


def _fallbacks(graph: Graph) -> Dict[str, Dict[str, Any]]:
    out: Dict[str, Dict[str, Any]] = {}
    for n in graph.nodes:
        if n.op == "HostFallback":
            k = str(n.meta["aten"])
            e = out.setdefault(k, {"count": 0, "where": []})
            e["count"] += 1
            e["where"].append(n.where())
    return out


_BOOL_OPTIONS = ("verify", "inplace", "copy_out", "host_fallback")
_LIST_OPTIONS = ("disable", "enable", "keep_fp32")


def _check_options(options: Optional[Dict[str, Any]]) -> Dict[str, Any]:
    """Validate compile options; raises ValueError naming the option and what it takes."""
    if options is not None and not isinstance(options, dict):
        raise ValueError(f"options must be a dict such as {{'verify': True}}, got "
                         f"{type(options).__name__} {options!r}")
    options = dict(options or {})
    unknown = set(options) - KNOWN_OPTIONS
    if unknown:
        raise ValueError(f"unknown compile option(s) {sorted(unknown)}; known options: "
                         f"{sorted(KNOWN_OPTIONS)}")
    for k in _BOOL_OPTIONS:
        if k in options and not isinstance(options[k], bool):
            raise ValueError(f"option {k!r} takes True or False, got {options[k]!r}")
    for k in _LIST_OPTIONS:
        v = options.get(k)
        if v is not None and (isinstance(v, str) or not all(isinstance(x, str) for x in v)):
            raise ValueError(f"option {k!r} takes a list of names, e.g. [{v!r}], got {v!r}")
    if "keep_fp32" in options:
        from .ops import get_op
        for name in options["keep_fp32"]:
            try:
                get_op(name)
            except KeyError as e:
                raise ValueError(f"option 'keep_fp32': {e.args[0]}; it takes opencann op names "
                                 "such as 'SoftmaxV2' or 'LayerNorm'") from None
    c = options.get("concurrent_calls")
    if c is not None and (isinstance(c, bool) or not isinstance(c, int) or c < 1):
        raise ValueError(f"option 'concurrent_calls' takes a positive int (the most calls "
                         f"run at once, each with its own arena; e.g. 4), got {c!r}")
    a = options.get("alignment")
    if a is not None and (isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1)):
        raise ValueError(f"option 'alignment' takes a power of two in bytes (e.g. 64), got {a!r}")
    return options


def _check_device(device: str) -> str:
    device = str(device)
    if device.split(":")[0] not in SUPPORTED_DEVICES:
        raise ValueError(f"device {device!r} is not supported by the compiler yet; use one of "
                         f"{list(SUPPORTED_DEVICES)} (vnpu as vnpu:<preset> or vnpu:<spec file>)")
    if device.split(":")[0] == "cpu" and device not in ("cpu", "cpu:0"):
        raise ValueError(f"device {device!r}: the host is one device, 'cpu'")
    if device.startswith("vnpu"):
        from .passes.vnpu_layout import npu_spec_for
        npu_spec_for(device)   # ValueError listing the presets for vnpu:<unknown>
    return device


def compile_graph(graph: Graph, device: str = "cpu", options: Optional[Dict[str, Any]] = None,
                  report: Optional[CompileReport] = None) -> "tuple[Graph, MemoryPlan, CompileReport]":
    """Optimize ``graph`` in place and plan its memory. Returns (graph, plan, report)."""
    options = _check_options(options)
    report = report or CompileReport(model=graph.name, device=device)
    report.op_counts_before = graph.op_counts()
    report.cost_before = graph_cost(graph)
    report.host_fallbacks = _fallbacks(graph)
    if report.host_fallbacks and not options.get("host_fallback", True):
        listed = "; ".join(f"{k} x{v['count']} at {v['where'][0]}" for k, v in report.host_fallbacks.items())
        raise ValueError(f"ops without an opencann converter: {listed}. With "
                         "options={'host_fallback': True} (the default) they run on the host")
    for k, v in report.host_fallbacks.items():
        logger.warning("host fallback: %s x%d (no opencann converter) at %s", k, v["count"],
                       "; ".join(v["where"][:3]))
    ctx = PassContext(options=options, report=report, device=device)
    default_pipeline().run(graph, ctx)
    t0 = time.perf_counter()
    plan = plan_memory(graph, alignment=options.get("alignment", 64),
                       inplace=options.get("inplace", True),
                       copy_out=options.get("copy_out", False), log=logger.debug)
    report.passes.append(PassRecord("memory_plan", "memory", len(graph.nodes), len(graph.nodes),
                                    time.perf_counter() - t0, len(plan.inplace),
                                    note=plan.strategy))
    report.memory = plan.summary()
    randoms = sorted({str(n.meta["aten"]) if n.op == "HostFallback" else n.op
                      for n in graph.nodes if is_random(n)})
    if randoms:
        report.notes.append(f"random ops drawn anew on every call ({', '.join(randoms)}); they "
                            "are never folded, merged or recomputed")
    report.op_counts_after = graph.op_counts()
    report.cost_after = graph_cost(graph)
    logger.info("%s", report.summary())
    return graph, plan, report


class CompiledModel:
    """A compiled model: call it like the original module.

    Inputs must have the shapes and dtypes of the example inputs (the graph is static);
    a mismatch raises ValueError naming the input and the expected description, as do
    another number or nesting of inputs, a non-tensor argument with another value than
    at compile time (it is baked into the graph), an input not on the cpu, and a
    parameter or buffer modified in place since compiling (weights are frozen).
    Non-contiguous inputs are made contiguous; constant outputs are fresh per call.
    It may be called from several threads at once: each call borrows an executor (its
    own arena) from a pool of at most ``concurrent_calls`` (compile option, default
    `DEFAULT_CONCURRENT_CALLS`); further calls wait for one to be free.
    Attributes: ``graph``, ``plan`` (MemoryPlan), ``report`` (CompileReport),
    ``executor`` (the first executor), ``pool`` (ExecutorPool).
    """

    def __init__(self, graph: Graph, plan: MemoryPlan, report: CompileReport,
                 in_spec=None, out_spec=None, input_positions: Optional[Sequence[int]] = None,
                 example_flat: Optional[Sequence[Any]] = None,
                 frozen: Optional[Sequence[Tuple[str, torch.Tensor]]] = None,
                 concurrent_calls: int = DEFAULT_CONCURRENT_CALLS):
        self.graph, self.plan, self.report = graph, plan, report
        self._in_spec, self._out_spec = in_spec, out_spec
        self._positions = list(input_positions) if input_positions is not None else None
        flat = list(example_flat or [])
        # non-tensor arguments are baked into the graph: calls must repeat them
        self._baked = {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)}
        self._contig = [t.is_contiguous() for t in flat if isinstance(t, torch.Tensor)]
        # weights are frozen into the graph (folded, prepacked): detect in-place changes
        self._frozen = [(n, t, t._version) for n, t in (frozen or [])]
        consts = {id(c) for c in graph.constants}
        self._const_outputs = [i for i, v in enumerate(graph.outputs) if id(v) in consts]
        t0 = time.perf_counter()
        self.executor = Executor(graph, plan)
        self.pool = ExecutorPool(lambda: Executor(graph, plan), concurrent_calls, first=self.executor)
        report.passes.append(PassRecord("bind_kernels", "runtime", len(graph.nodes), len(graph.nodes),
                                        time.perf_counter() - t0, len(self.executor.copy_out_nodes),
                                        note="arena allocated once; kernels pre-bound"))

    def calling_convention(self) -> Dict[str, Any]:
        """How calls map onto the graph, for `opencann.save`: ``in_spec``/``out_spec``
        (pytree TreeSpecs or None), ``input_positions`` (flat indices of the tensor
        inputs), ``baked`` (flat index -> non-tensor value fixed at compile time),
        ``contiguous`` (per tensor input: was the example contiguous) and
        ``concurrent_calls`` (the executor pool's size)."""
        return {"in_spec": self._in_spec, "out_spec": self._out_spec,
                "input_positions": self._positions, "baked": dict(self._baked),
                "contiguous": list(self._contig), "concurrent_calls": self.pool.size}

    @classmethod
    def from_parts(cls, graph: Graph, plan: MemoryPlan, report: CompileReport, in_spec, out_spec,
                   input_positions: Optional[Sequence[int]], baked: Dict[int, Any],
                   contiguous: Sequence[bool],
                   concurrent_calls: int = DEFAULT_CONCURRENT_CALLS) -> "CompiledModel":
        """A compiled model from saved parts (`opencann.load`): the arguments of
        `calling_convention` plus graph, plan and report. Binds kernels; no capture.
        Weights are not watched for in-place changes (the file holds its own copy)."""
        cm = cls(graph, plan, report, in_spec=in_spec, out_spec=out_spec,
                 input_positions=input_positions, concurrent_calls=concurrent_calls)
        cm._baked, cm._contig = dict(baked), list(contiguous)
        return cm

    def _flat_inputs(self, args, kwargs) -> list:
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            want_args, want_kw = pytree.tree_unflatten([None] * self._in_spec.num_leaves,
                                                       self._in_spec)
            raise ValueError(
                f"the model was compiled for {len(want_args)} positional input(s) and keyword "
                f"input(s) {sorted(want_kw)}, with the example's nesting; got {len(args)} "
                f"positional and {sorted(kwargs)} (or a different nesting of lists, tuples and "
                "dicts). Call it like the example inputs, or recompile")
        for i, want in self._baked.items():
            got = flat[i]
            if type(got) is not type(want) or not _same_value(got, want):
                raise ValueError(
                    f"non-tensor input #{i} was {want!r} when the model was compiled and is "
                    f"{got if not isinstance(got, torch.Tensor) else 'a tensor'!r} now: non-tensor "
                    "arguments are baked into the compiled graph. Recompile with this value, or "
                    "make it a tensor input")
        for name, t, version in self._frozen:
            if t._version != version:
                raise ValueError(
                    f"parameter or buffer {name!r} was modified in place after compiling: the "
                    "compiled graph holds the weights it was compiled with (folded, prepacked). "
                    "Recompile after changing weights")
        tensors = [flat[i] for i in self._positions] if self._positions is not None else flat
        if len(tensors) != len(self.graph.inputs):
            raise ValueError(f"expected {len(self.graph.inputs)} tensor inputs, got {len(tensors)}")
        for i, (t, v) in enumerate(zip(tensors, self.graph.inputs)):
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"input {i} ({v.name}) must be a tensor, got {type(t).__name__}")
            if tuple(t.shape) != v.desc.shape or t.dtype != v.desc.dtype.torch:
                what = "shape" if tuple(t.shape) != v.desc.shape else "dtype"
                raise ValueError(
                    f"input {i} ({v.name}) is {str(t.dtype).replace('torch.', '')}{list(t.shape)} "
                    f"but the model was compiled for {v.desc}; the {what} differs: recompile with "
                    f"example inputs of this {what}" + (" or cast the input" if what == "dtype" else ""))
            if t.device.type != "cpu":
                raise ValueError(f"input {i} ({v.name}) is on {t.device}; the compiled model "
                                 "runs on the host (cpu): move the input with .cpu()")
        # the graph was traced on contiguous examples: its views assume those strides
        return [t.contiguous() if i < len(self._contig) and self._contig[i] else t
                for i, t in enumerate(tensors)]

    def __call__(self, *args, **kwargs):
        tensors = self._flat_inputs(args, kwargs)
        with torch.no_grad():
            outs = self.pool.run(tensors)
        if self._const_outputs:  # a folded constant is one tensor: give each call its own
            outs = tuple(o.clone() if i in self._const_outputs else o for i, o in enumerate(outs))
        return self._structure(outs)

    def _structure(self, outs):
        lits = self.graph.meta.get("output_literals", {})
        n = self.graph.meta.get("n_outputs", len(outs))
        it = iter(outs)
        flat = [lits[i] if i in lits else next(it) for i in range(n)]
        if self._out_spec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return pytree.tree_unflatten(flat, self._out_spec)

    def profile(self, *args, path: Optional[str] = None, **kwargs):
        """Run once recording per-op times; returns Chrome trace events, writes JSON to
        ``path`` if given (open in chrome://tracing or ui.perfetto.dev)."""
        return self.pool.profile(self._flat_inputs(args, kwargs), path)


def compile_module(model: torch.nn.Module, example_inputs, device: str = "cpu",
                   options: Optional[Dict[str, Any]] = None, example_kwargs=None) -> CompiledModel:
    """Capture ``model`` with torch.export on ``example_inputs`` (a tensor or tuple) and
    compile it for ``device``. Raises CaptureError (capture), ValueError (bad options,
    device or dtype) with what to change. Thread-safe: concurrent calls run one at a
    time (torch.export is not thread-safe)."""
    with _COMPILE_LOCK:
        return _compile_module(model, example_inputs, device, options, example_kwargs)


def _compile_module(model, example_inputs, device, options, example_kwargs) -> CompiledModel:
    device = _check_device(device)
    options = _check_options(options)
    if isinstance(example_inputs, list):
        raise ValueError("example_inputs must be a tensor or a tuple of the model's positional "
                         "inputs, got a list: pass tuple(example_inputs), or (my_list,) when "
                         "the model takes one list argument")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    ep, times = capture(model, args, example_kwargs)
    t0 = time.perf_counter()
    graph = from_exported_program(ep, name=type(model).__name__)
    report = CompileReport(model=type(model).__name__, device=device, capture_seconds=times)
    report.passes.append(PassRecord("convert_and_infer", "construct", 0, len(graph.nodes),
                                    time.perf_counter() - t0, len(graph.nodes),
                                    note="FX → IR, shape/dtype inference checked against FX"))
    graph, plan, report = compile_graph(graph, device, options, report)
    flat, in_spec = pytree.tree_flatten((args, example_kwargs or {}))
    from torch.export.graph_signature import InputKind
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    positions = [i for i, s in enumerate(user) if isinstance(flat[i], torch.Tensor)]
    frozen = list(model.named_parameters()) + list(model.named_buffers())
    return CompiledModel(graph, plan, report, in_spec=in_spec, out_spec=ep.call_spec.out_spec,
                         input_positions=positions, example_flat=flat, frozen=frozen,
                         concurrent_calls=options.get("concurrent_calls", DEFAULT_CONCURRENT_CALLS))


def _same_value(a: Any, b: Any) -> bool:
    """Equality for baked non-tensor arguments (NaN equals NaN; never raises)."""
    try:
        return bool(a == b) or (isinstance(a, float) and a != a and b != b)
    except Exception:  # noqa: BLE001 - exotic objects: identity only
        return a is b
