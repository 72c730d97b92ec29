"""Compiling with dynamic dims: capture once, optimise once, plan per concrete shape.

``opencann.compile(model, inputs, dynamic_shapes={"input_ids": {0: "batch", 1: "seq"}})``
exports the model once with torch.export's dynamic shapes, converts it to an IR whose
shapes carry the shape environment's symbols (``float32[s0,s1,384]``), and runs the
optimisation passes once on that symbolic graph (a pass whose condition depends on a
dim skips with the guard it needs). The memory stage is deferred: on the first call
with a new concrete shape the graph is specialised (`opencann.ir.specialise`: symbols
bound, descs re-derived), its memory planned and its kernels bound (the compiler's own
`MemoryPlanning` and `BindKernels` stages), and the resulting executor pool cached in a
bounded LRU (`opencann.runtime.shape_cache`, option ``plan_cache_size``). No call
re-captures or re-runs a pass. The example inputs' shape is planned at compile time.
`compile_symbolic_fx` does the same for dynamo's symbolic graphs (``torch.compile``);
`opencann.gears` builds ATC-style gears on top.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Callable, Dict, Mapping, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..devices import parse_device
from ..frontend.torch import CaptureError, capture
from ..frontend.torch.dynamic import (
    dynamic_dims,
    export_dynamic_shapes,
    required_ranges,
)
from ..ir import Graph, MemoryPlan, Schedule
from ..ir.specialise import specialise
from ..ir.symbolic import (
    SymExpr,
    bind,
    bind_tree,
    holds,
    is_symbol,
    linear_in,
    parse,
    shape_symbols,
    symbols_of,
)
from ..log import logger
from ..ops import frozen_graph, get_op
from ..passes import (
    MemoryPlanning,
    Pass,
    PassContext,
    PassManager,
    SingleStreamSchedule,
    default_pipeline,
)
from ..report import CompileReport
from ..runtime import DEFAULT_CONCURRENT_CALLS, Executor, ExecutorPool
from ..runtime.call_binding import forward_arg_names
from ..runtime.shape_cache import ShapePlanCache
from .binding import BindKernels, snapshot_constants
from .compiled_model import CompiledModel, example_convention
from .entry import convert_exported
from .options import check_options, complete, option
from .pipeline import graph_cost, run_pipeline
from .shapes import ShapePolicy


class DeferredMemoryPlanning(Pass):
    """The memory stage of a graph with dynamic dims: nothing to plan until the dims
    have values; `DynamicShapes` plans each concrete shape on first use."""

    name, stage = "memory_plan", "memory"
    required, observed = True, False

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Note the deferral; plans nothing (returns 0)."""
        ctx.note("deferred: planned per concrete shape on its first call (dynamic dims)")
        return 0


def symbolic_pipeline() -> PassManager:
    """The default pipeline with its memory stage deferred (`DeferredMemoryPlanning`)."""
    return PassManager([p if not isinstance(p, MemoryPlanning) else DeferredMemoryPlanning()
                        for p in default_pipeline().passes])


def plan_shape(graph: Graph, values: Mapping[str, int], options: Dict[str, Any],
               schedule: Optional[Schedule] = None) -> Tuple[Graph, MemoryPlan, Executor]:
    """`specialise` ``graph`` to ``values`` (symbol -> int), then run the compiler's
    schedule (the memory-aware order needs concrete sizes), memory and binding stages
    on it. With ``schedule`` (an earlier shape's, the graph being the same) the nodes
    take that order (and streams) and the schedule stage does not run: the order is valid
    at every shape, and the plan's lower bound is that order's own. Returns (concrete
    graph, plan, first executor); the concrete graph's nodes are in the order used."""
    g = specialise(graph, values)
    # the pass switches named the optimisation passes, which ran once already
    options = {k: v for k, v in options.items() if k not in ("disable", "enable")}
    ctx = PassContext(options=complete(options), report=CompileReport(model=graph.name),
                      artifacts={"live_tensors": (), "schedule": schedule})
    stages = [MemoryPlanning(), BindKernels()]
    with frozen_graph():   # no pass changes the nodes from here: each node's aliases once
        PassManager(stages if schedule is not None else [SingleStreamSchedule()] + stages
                    ).run(g, ctx)
    return g, ctx.artifacts["memory_plan"], ctx.artifacts["executor"]


def compile_shape(graph: Graph, values: Mapping[str, int], device: str, options: Dict[str, Any],
                  report: Optional[CompileReport] = None, live: Sequence[torch.Tensor] = ()
                  ) -> Tuple[Graph, MemoryPlan, Executor]:
    """`specialise` the unoptimised ``graph`` to ``values``, then run the whole pipeline
    (optimisation, layout, memory, binding) for ``device`` on it: a device whose layout
    stage needs static storage shapes (the vnpu's NC1HWC0 blocks) compiles each concrete
    shape, as ATC compiles each gear. ``report`` (a fresh one if None) records the passes.
    Returns (concrete graph, plan, first executor)."""
    g = specialise(graph, values)
    report = report or CompileReport(model=graph.name, device=device)
    ctx = run_pipeline(g, device, options, report,
                       PassManager(default_pipeline().passes + [BindKernels()]),
                       artifacts={"live_tensors": list(live)})
    return g, ctx.artifacts["memory_plan"], ctx.artifacts["executor"]


def pin_kernel_choices(graph: Graph, bound: Graph) -> Tuple[int, int]:
    """Copy the kernel choices binding made on ``bound`` (a specialised copy of
    ``graph``: ``node.meta["kernel"]``, the GEMM measured per shape) onto ``graph``'s
    nodes, so every later specialisation binds the same kernels without measuring. oneDNN's
    prepacked weight (``onednn_packed``) serves every row count and is kept. A
    GEMM that chose MKL's packed weight (``mkl_packed``) gets ``addmm`` at the other
    shapes: MKL packs an fp32 weight for one row count m (``cblas_sgemm_pack`` takes m;
    ``torch.ops.mkl._mkl_linear`` runs unpacked when m differs), so each new shape would
    repack every weight (BERT-base: 48 weights, ~340 MB, 0.3-1.5 s per shape measured)
    and keep one more copy per cached shape; Inductor likewise packs fp32 weights for
    static shapes only. An op whose choice holds for one shape only (``OpDef.kernel_per_shape``:
    attention's SDPA or bmm + softmax) is not pinned: each shape measures its own.
    Returns (nodes given a choice, packed GEMMs moved to addmm)."""
    chosen = {n.name: n.meta["kernel"] for n in bound.nodes
              if "kernel" in n.meta and not get_op(n.op).kernel_per_shape}
    unpacked = 0
    for n in graph.nodes:
        if n.name in chosen:
            n.meta["kernel"] = "addmm" if chosen[n.name] == "mkl_packed" else chosen[n.name]
            unpacked += chosen[n.name] == "mkl_packed"
    return len(chosen), unpacked


class ShapeBinder:
    """Binds a call's input shapes to the graph's symbols and checks them: ranges,
    dims shared between inputs, and the model's own shape conditions (``guards``).

    ``dims``: symbol -> {"name", "min", "max", "sources"} (`dynamic_dims`);
    ``names``: one label per graph input for messages."""

    def __init__(self, graph: Graph, dims: Dict[str, Dict[str, Any]], guards: Sequence[str],
                 names: Sequence[str], scalars: Sequence[str] = ()):
        self.dims, self.guards, self.names = dims, list(guards), list(names)
        self.shapes = [v.desc.shape for v in graph.inputs]
        self.scalars = list(scalars)   # symbols passed as int arguments (dynamo's SymInts)
        #: (option, dim names, gears, gear keys, why no padding) once `opencann.gears` set it
        self.gears: Optional[tuple] = None
        self.order = sorted(dims)
        # per input: its plain-symbol dims (bound from the call) and compound ones
        # ("s0*s1": a backward graph's saved view, checked once the symbols are bound)
        self._dims = [[(i, d, is_symbol(d)) for i, d in enumerate(shape) if isinstance(d, str)]
                      for shape in self.shapes]
        loose = shape_symbols(self.shapes) - {d for s in self.shapes for d in s if is_symbol(d)}
        loose -= set(self.scalars)
        self._derived = self._derived_dims(loose)
        loose -= {d[3] for d in self._derived}
        if loose:
            raise ValueError(f"input dims {sorted(loose)} are only known as expressions "
                             "(e.g. 2*s0): declare each dynamic dim of the inputs on its own")

    def _derived_dims(self, loose: set) -> list:
        """(input, dim, expression, root, (a, b)) for each loose symbol (one no input dim
        is on its own) that an input dim ``a * root + b`` determines, ``b`` free of loose
        symbols: torch.export's derived dims (``seq = 2 * Dim("_seq")``), the root solved
        from the size at each call."""
        found = []
        for k, shape in enumerate(self.shapes):
            for i, d in enumerate(shape):
                if not isinstance(d, str) or is_symbol(d):
                    continue
                for sym in sorted(symbols_of(d) & loose - {f[3] for f in found}):
                    ab = linear_in(d, sym)
                    if ab is not None and not symbols_of(ab[1]) & loose:
                        found.append((k, i, d, sym, ab))
        return found

    def _solve_derived(self, inputs: Sequence[torch.Tensor], values: Dict[str, int]) -> None:
        """Bind each derived dim's root from its input's size (`_derived_dims`); ValueError
        (one line) for a size the expression cannot take or a root outside its range."""
        for k, i, d, sym, (a, b) in self._derived:
            n = int(inputs[k].shape[i])
            off = int(bind(b, values)) if isinstance(b, str) else b
            root, rem = divmod(n - off, a)
            name = self.dims.get(sym, {}).get("name", sym)
            if rem or root < 0:
                raise ValueError(f"{self.names[k]} dim {i} is {n}, which is not {self.readable(d)} "
                                 f"for any integer {name} (torch.export's derived dim): call with "
                                 "a size of that form")
            if values.setdefault(sym, root) == root and self.gears is None and sym in self.dims:
                self._check_range(sym, root, f"{self.names[k]} dim {i} ({n} = {self.readable(d)})")

    def values(self, inputs: Sequence[torch.Tensor], scalars: Sequence[int] = ()
               ) -> Dict[str, int]:
        """The symbols' values for these inputs (and the int arguments standing for
        ``self.scalars``), checked for ranges (not with gears), shared dims and the
        model's shape conditions. Raises ValueError naming the input, the dim, its range
        and the fix."""
        values: Dict[str, int] = dict(zip(self.scalars, (int(v) for v in scalars)))
        where: Dict[str, str] = {s: "its size argument" for s in values}
        compound = []
        for name, dims, t in zip(self.names, self._dims, inputs):
            for i, d, plain in dims:
                n = int(t.shape[i])
                if not plain:
                    compound.append((name, i, d, n))
                    continue
                if d in values and values[d] != n:
                    raise ValueError(
                        f"{name} dim {i} is {n} but {where[d]} is {values[d]}: both are the "
                        f"dynamic dim {self.dims[d]['name']}, so they must be equal")
                values[d], where[d] = n, f"{name} dim {i}"
                if self.gears is None:   # with gears, the gear check names the gears
                    self._check_range(d, n, f"{name} dim {i}")
        self._solve_derived(inputs, values)
        for name, i, d, n in compound:
            if bind(d, values) != n:
                raise ValueError(f"{name} dim {i} is {n} but the graph computes it as "
                                 f"{self.readable(d)} = {bind(d, values)} "
                                 f"({self.describe(values)}): call with consistent shapes")
        for g in self.guards:
            if not holds(g, values):
                raise ValueError(f"the shapes {self.describe(values)} break the model's shape "
                                 f"condition {self.readable(g)} (found by torch.export); call "
                                 "it with shapes that satisfy it")
        return values

    def shape_values(self, shapes: Sequence[Sequence[int]]) -> Dict[str, int]:
        """`values` for the graph inputs' shapes (one sequence of ints per graph input, in
        graph-input order) rather than tensors: derived dims (``2 * s``) solved for their
        root, ranges, shared dims and shape conditions checked alike (ValueError, one line).
        For callers that hold shapes only (the ACL facade's tensor descriptions)."""
        class _Shaped:   # the one attribute `values` reads
            def __init__(self, shape):
                self.shape = tuple(int(n) for n in shape)
        return self.values([_Shaped(s) for s in shapes])

    def bind(self, inputs: Sequence[torch.Tensor], scalars: Sequence[int] = ()) -> Tuple[int, ...]:
        """The values of the symbols (in ``self.order``) for these inputs (see `values`);
        with gears, a shape that is not a gear raises ValueError naming the gears."""
        return self.bind_key(self.values(inputs, scalars))

    def bind_key(self, values: Mapping[str, int]) -> Tuple[int, ...]:
        """The key (in ``self.order``) of symbol ``values``; with gears, values that are
        not a gear raise ValueError naming the gears."""
        key = tuple(values[s] for s in self.order)
        if self.gears is not None and key not in self.gears[3]:
            opt, names, gears, _, why = self.gears
            shown = [g[0] if len(g) == 1 else list(g) for g in gears]
            raise ValueError(f"{self.describe(values)} is not one of the gears compiled with "
                             f"{opt}={shown} ({', '.join(names)}); {why}: call with a gear's "
                             f"shape, or recompile with a gear for it")
        return key

    def _check_range(self, sym: str, n: int, what: str) -> None:
        d = self.dims[sym]
        lo, hi = d["min"], d["max"]
        if n < lo or (hi is not None and n > hi):
            rng = f"[{lo}, {hi if hi is not None else 'inf'}]"
            raise ValueError(
                f"{what} ({d['name']}) is {n}, outside the compiled range {rng} of "
                f"{d['name']}: call with {lo} <= {d['name']} <= {hi if hi is not None else 'inf'}, "
                f"or recompile with a range that holds it (a torch.export.Dim's min / max, or "
                f"for a dim named by a string dim_ranges={{'{d['name']}': "
                f"({min(lo, n)}, {None if hi is None else max(hi, n)})}}) if the model allows it")

    def describe(self, values: Mapping[str, int]) -> str:
        """``batch=2, seq=40`` for symbol values."""
        return ", ".join(f"{self.dims[s]['name']}={values[s]}" for s in self.order if s in values)

    def readable(self, expr: str) -> str:
        """``expr`` with the user's dim names for the symbols."""
        import sympy
        e = parse(expr)
        return str(e.xreplace({s: sympy.Symbol(self.dims[str(s)]["name"]) for s in e.free_symbols
                               if str(s) in self.dims}))


class PlanBuilder:
    """Builds the `ExecutorPool` of one concrete shape of a symbolic ``graph``
    (`plan_shape`; on a device other than cpu `compile_shape`, ``graph`` being the
    unoptimised one), records it in ``report.dynamic["plans"]`` (the cached plans only:
    an evicted plan's entry is dropped; ``report.dynamic["plan_counts"]`` counts the
    plans ``built`` and ``evicted``) and the log, and after the first build pins its
    kernel choices on ``graph`` (`pin_kernel_choices`, cpu)."""

    def __init__(self, graph: Graph, report: CompileReport, binder: "ShapeBinder",
                 options: Dict[str, Any], device: str = "cpu"):
        self.graph, self.report, self.binder, self.options = graph, report, binder, options
        self.concurrent = option(options, "concurrent_calls")
        self.device = device
        self.pinned = None if device == "cpu" else 0
        self.first_report: Optional[CompileReport] = report if device != "cpu" else None
        #: the node order (and streams) of the first shape planned, kept for the others
        self.schedule: Optional[Schedule] = None
        self._entries: Dict[Tuple[int, ...], Dict[str, Any]] = {}   # key -> its plans entry
        self._lock = threading.Lock()

    def __call__(self, key: Tuple[int, ...]) -> ExecutorPool:
        """The executor pool for symbol values ``key`` (in ``binder.order``)."""
        t0 = time.perf_counter()
        values = dict(zip(self.binder.order, key))
        if self.device == "cpu":
            g, plan, ex = plan_shape(self.graph, values, self.options, self.schedule)
            self.schedule = self.schedule or Schedule([n.name for n in g.nodes],
                                                      {n.name: n.stream for n in g.nodes})
        else:   # the first shape's passes fill the model's report
            rep, self.first_report = self.first_report, None
            g, plan, ex = compile_shape(self.graph, values, self.device, self.options, rep)
        check = option(self.options, "check_aliasing")
        pool = ExecutorPool(lambda: Executor(g, plan, check_aliasing=check), self.concurrent,
                            first=ex)
        pool.plan, pool.graph = plan, g
        dt = time.perf_counter() - t0
        self._record(key, {"dims": {self.binder.dims[s]["name"]: v for s, v in values.items()},
                           "arena_bytes": plan.arena_bytes, "lower_bound_bytes": plan.lower_bound,
                           "arena_over_lower_bound": round(plan.ratio, 4),
                           "build_ms": round(dt * 1e3, 2)})
        logger.info("dynamic shapes: planned %s in %.1f ms (arena %d bytes, %.3fx its lower "
                    "bound)", self.binder.describe(values), dt * 1e3, plan.arena_bytes, plan.ratio)
        if self.pinned is None:
            self.pinned, unpacked = pin_kernel_choices(self.graph, g)
            note = ("kernel choices measured at the first shape planned ({} GEMMs) are kept "
                    "at every shape: a new shape costs no measurement").format(self.pinned)
            if unpacked:
                note += (f"; {unpacked} GEMMs on MKL-packed weights there run addmm at the other "
                         "shapes (a packed fp32 weight serves one row count: no repacking per "
                         "shape)")
            if self.pinned and note not in self.report.notes:
                self.report.notes.append(note)
        return pool

    def _record(self, key: Tuple[int, ...], entry: Dict[str, Any]) -> None:
        """Add ``entry`` to ``report.dynamic["plans"]`` and count the build."""
        with self._lock:
            dyn = self.report.dynamic
            dyn.setdefault("plans", []).append(entry)
            counts = dyn.setdefault("plan_counts", {"built": 0, "evicted": 0})
            counts["built"] += 1
            self._entries[key] = entry

    def evicted(self, key: Tuple[int, ...]) -> None:
        """The cache dropped ``key``'s plan: drop its entry from ``report.dynamic["plans"]``
        (which lists the cached plans, so it stays bounded) and count the eviction."""
        with self._lock:
            dyn = self.report.dynamic
            entry = self._entries.pop(key, None)
            plans = dyn.get("plans", [])
            if entry is not None and any(e is entry for e in plans):
                plans[:] = [e for e in plans if e is not entry]
            counts = dyn.setdefault("plan_counts", {"built": 0, "evicted": 0})
            counts["evicted"] += 1

    def cache(self) -> ShapePlanCache:
        """A `ShapePlanCache` building with this builder (capacity: ``plan_cache_size``)."""
        return ShapePlanCache(self.binder.bind, self, option(
            self.options, "plan_cache_size"), self.concurrent, on_evict=self.evicted)


class DynamicShapes(ShapePolicy):
    """The shape policy of a model with dynamic dims: called like any `CompiledModel`
    with any shape in the declared ranges. ``graph`` is the optimised symbolic graph;
    each new concrete shape is specialised, planned and bound on its first call and
    cached (at most ``plan_cache_size`` shapes, least recently used dropped).
    ``plan``/``executor`` are the example shape's (``example_inputs``, planned now). A
    shape outside a range raises ValueError naming the input, the dim, its range and the
    fix. ``plans`` (also ``pool``) is the `ShapePlanCache` (its counters: ``hits``,
    ``misses``, ``evictions``); ``binder`` the `ShapeBinder`; ``report.dynamic`` lists
    the dims, their ranges, the guards and each plan built. Thread-safe. Saved by
    `opencann.save` with its symbolic graph, dims and guards (`saved`); `from_saved`
    rebuilds it (`opencann.load`)."""

    name = "dynamic"

    def __init__(self, graph: Graph, report: CompileReport, binder: ShapeBinder,
                 options: Dict[str, Any], example_inputs: Sequence[torch.Tensor],
                 device: str = "cpu"):
        self.graph, self.binder, self.device = graph, binder, parse_device(device)
        build = PlanBuilder(graph, report, binder, options, device)
        key = binder.bind(example_inputs)
        self.example_key = key
        # every option the model was compiled with (saved in model files: a loaded model
        # plans and, on a vnpu, compiles each new shape with them), but the graph dump
        self.options = {k: v for k, v in options.items()
                        if v is not None and k not in ("dump_graph", "concurrent_calls")}
        pool = build(key)
        report.memory = pool.plan.summary()   # the example shape's plan
        self.plan, self.executor = pool.plan, pool.first
        self.plans = build.cache()
        self.plans.put(key, pool)
        self.pool = self.plans
        #: gear padding (`opencann.engine.gears.Gears`): None here
        self.padder = None
        #: the gear option, dim names and gears (`Gears`), None without gears
        self.gear_spec: Optional[Dict[str, Any]] = None

    def literal(self, value, user):
        """A non-tensor output depending on the dims (``x.shape[0]``, ``3*s0 + 1``)
        bound to this call's real sizes (before any gear padding)."""
        if user is None or not any(isinstance(v, SymExpr) for v in pytree.tree_leaves(value)):
            return value
        return bind_tree(value, self.binder.values(user))

    def shown(self, desc) -> str:
        """``desc`` with the user's dim names (``float32[batch,seq,16]``), not symbols."""
        dims = ",".join(self.binder.readable(d) if isinstance(d, str) else str(d)
                        for d in desc.shape)
        return f"{desc.dtype.value}[{dims}]"

    def views(self, views, user) -> Dict[int, list]:
        """The views of mutated inputs the outputs are, bound to this call's shapes."""
        if not views:
            return views
        values = dict(zip(self.binder.order, self.binder.bind(user)))
        memo: Dict[str, int] = {}
        return {j: [v[0]] + [bind_tree(x, values, memo) if not isinstance(x, (str, list))
                             else [bind(d, values, memo) for d in x] if isinstance(x, list)
                             else bind(x, values, memo) for x in v[1:]]
                for j, v in views.items()}

    def saved(self) -> Dict[str, Any]:
        """``dynamic`` (the dims: symbol -> name, range, sources; the model's shape
        conditions; the example's dim values, planned first; the compile options but
        ``dump_graph``; the device) and ``gears`` (the gear spec
        or None), all JSON-able (symbols and conditions as sympy strings)."""
        return {"gears": self.gear_spec, "dynamic": {
            "dims": self.binder.dims, "guards": list(self.binder.guards),
            "example": dict(zip(self.binder.order, self.example_key)),
            "options": dict(self.options), "device": str(self.device)}}

    @classmethod
    def saved_args(cls, graph: Graph, report: CompileReport, dynamic: Dict[str, Any],
                   concurrent_calls: int = DEFAULT_CONCURRENT_CALLS) -> Dict[str, Any]:
        """The constructor's arguments from a model file's ``dynamic`` field (`saved`) and
        its symbolic ``graph`` and ``report`` (`opencann.load`): the example's shape is
        planned again, with the kernel choices the graph's nodes carry. Resets the
        report's per-process plan records. Raises KeyError/TypeError for a malformed
        ``dynamic``."""
        binder = ShapeBinder(graph, dynamic["dims"], dynamic["guards"],
                             [v.name for v in graph.inputs])
        example = dynamic["example"]
        tensors = [torch.empty([bind(d, example) for d in v.desc.shape], dtype=v.desc.dtype.torch)
                   for v in graph.inputs]
        options = {**dynamic.get("options", {}), "concurrent_calls": concurrent_calls}
        report.dynamic["plans"] = []   # the plans built in this process
        report.dynamic.pop("plan_counts", None)
        return dict(graph=graph, report=report, binder=binder, options=options,
                    example_inputs=tensors, device=dynamic.get("device", "cpu"))


def _report_dims(report: CompileReport, binder: ShapeBinder, capacity: int) -> None:
    """``report.dynamic``: dims (name -> symbol, range, sources), guards and cache size."""
    dims = {d["name"]: {"symbol": s, "min": d["min"], "max": d["max"], "sources": d["sources"]}
            for s, d in binder.dims.items()}
    guards = [f"{d['min']} <= {d['name']}" + (f" <= {d['max']}" if d["max"] is not None else "")
              for d in binder.dims.values()]
    guards += [f"{' == '.join(d['sources'])} ({d['name']})" for d in binder.dims.values()
               if len(d["sources"]) > 1]
    guards += [binder.readable(g) for g in binder.guards]
    report.dynamic.update({"dims": dims, "guards": guards, "plan_cache_size": capacity})
    report.notes.append("dynamic dims: " + ", ".join(
        f"{n} in [{d['min']}, {d['max'] if d['max'] is not None else 'inf'}]"
        for n, d in dims.items()) + f"; memory planned per shape (cache of {capacity})")


def _capture(model, args, kwargs, dynamic_shapes, dim_ranges):
    """`capture` with dynamic dims; a dim given no range whose default range holds sizes
    the model rejects (a position table bounds ``seq``) is narrowed to torch.export's
    requirement and captured again. Returns (ep, times, labels, the narrowed ranges)."""
    spec, labels, free = export_dynamic_shapes(model, args, kwargs, dynamic_shapes, dim_ranges)
    try:
        return capture(model, args, kwargs, dynamic_shapes=spec) + (labels, {})
    except CaptureError as e:
        fix = required_ranges(str(e))
        if not fix or not set(fix) <= free:
            raise
    ranges = {**dict(dim_ranges or {}), **fix}
    logger.info("dynamic dims %s narrowed to what the model accepts: %s", sorted(fix), fix)
    spec, labels, _ = export_dynamic_shapes(model, args, kwargs, dynamic_shapes, ranges)
    return capture(model, args, kwargs, dynamic_shapes=spec) + (labels, fix)


def compile_dynamic(model: torch.nn.Module, example_inputs, dynamic_shapes: Any,
                    device: str = "cpu", options: Optional[Dict[str, Any]] = None,
                    example_kwargs: Optional[Dict[str, Any]] = None,
                    dim_ranges: Optional[Mapping[str, Tuple[int, int]]] = None,
                    policy: Callable[..., DynamicShapes] = DynamicShapes) -> CompiledModel:
    """Capture ``model`` once with dynamic dims (``dynamic_shapes``, see
    `opencann.frontend.torch.dynamic`), optimise the symbolic graph once, plan the
    example's shape; returns a `CompiledModel` whose shape policy is ``policy(graph,
    report, binder, options, example_inputs, device)`` (`DynamicShapes`; `opencann.gears`
    passes its `Gears`). On a device other than cpu (the
    vnpu, whose layout stage needs static storage shapes) the graph is captured once and
    each concrete shape is compiled whole on its first use (`compile_shape`, cached the
    same way), its report and vnpu costs per shape. Raises CaptureError (the model
    cannot run with these dims: torch.export's reason), ValueError (bad spec, options,
    device)."""
    device = parse_device(device)
    options = check_options(options)
    if isinstance(example_inputs, list):
        raise ValueError("example_inputs must be a tensor or a tuple of the model's positional "
                         "inputs, got a list: pass tuple(example_inputs)")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    ep, times, labels, narrowed = _capture(model, args, example_kwargs, dynamic_shapes, dim_ranges)
    graph, report, frozen, live = convert_exported(model, ep, times, device, "FX → IR with symbolic dims")
    binder = ShapeBinder(graph, dynamic_dims(ep, labels), graph.signature.shape_guards,
                         [v.name for v in graph.inputs])
    flat, in_spec = pytree.tree_flatten((args, example_kwargs or {}))
    from torch.export.graph_signature import InputKind
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    positions = [i for i, s in enumerate(user) if isinstance(flat[i], torch.Tensor)]
    tensors = [flat[i] for i in positions]
    example = dict(zip(binder.order, binder.bind(tensors)))
    if device.kind == "cpu":
        before = graph_cost(specialise(graph, example))
        run_pipeline(graph, device, options, report, symbolic_pipeline())
        report.cost_before, report.cost_after = before, graph_cost(specialise(graph, example))
    else:
        report.notes.append(f"dynamic dims on {device}: the layout stage needs static storage "
                            "shapes, so each concrete shape is compiled whole (all passes) on "
                            "its first use, as ATC compiles each gear; this report's passes "
                            "and costs are the example shape's")
    snapshot_constants(graph, live)
    _report_dims(report, binder, option(options, "plan_cache_size"))
    if narrowed:
        report.notes.append(f"dims given no range narrowed to what the model accepts "
                            f"(torch.export's guards): {narrowed}")
    shapes = policy(graph, report, binder, options, tensors, device)
    return CompiledModel(graph, report, shapes, in_spec=in_spec, out_spec=ep.call_spec.out_spec,
                         input_positions=positions, frozen=frozen, module=model,
                         arg_names=forward_arg_names(model), **example_convention(flat))


def compile_symbolic_fx(graph: Graph, placeholders: Sequence[Any], options: Dict[str, Any],
                        report: CompileReport):
    """The torch.compile path for a graph with symbolic shapes (dynamo's ``dynamic``
    graphs): optimise ``graph`` once, plan each concrete shape on first use (cached as
    for `compile_dynamic`). ``placeholders``: the FX graph's placeholder values (tensors
    and SymInts, in calling order). Returns ``run(args) -> flat outputs`` taking the
    graph's call arguments (tensors and the ints dynamo passes for its SymInts), with
    ``run.plans`` (the `ShapePlanCache`) and ``run.values(args)`` (symbol -> int, to bind
    the sizes a training forward returns for its backward). dynamo's own guards keep calls within the shapes this graph is valid for."""
    run_pipeline(graph, "cpu", options, report, symbolic_pipeline())
    tensors = [i for i, v in enumerate(placeholders) if isinstance(v, torch.Tensor)]
    sizes = [(i, str(v.node.expr)) for i, v in enumerate(placeholders)
             if isinstance(v, torch.SymInt) and v.node.expr.is_Symbol]
    dims: Dict[str, Dict[str, Any]] = {}
    for name, shape in zip([v.name for v in graph.inputs], [v.desc.shape for v in graph.inputs]):
        for k, d in enumerate(shape):
            if is_symbol(d):
                dims.setdefault(d, {"name": d, "min": 0, "max": None, "sources": []})[
                    "sources"].append(f"{name}.shape[{k}]")
    for _, s in sizes:
        dims.setdefault(s, {"name": s, "min": 0, "max": None, "sources": ["a size argument"]})
    binder = ShapeBinder(graph, dims, graph.signature.shape_guards,
                         [v.name for v in graph.inputs], scalars=[s for _, s in sizes])
    _report_dims(report, binder, option(options, "plan_cache_size"))
    plans = PlanBuilder(graph, report, binder, options).cache()

    def run(args):
        ts = [args[i] for i in tensors]
        key = binder.bind(ts, [args[i] for i, _ in sizes])
        return plans.pool_for_key(key).run(ts)

    def values(args) -> Dict[str, int]:
        """The symbols' values for these call arguments (to bind size outputs)."""
        ts = [args[i] for i in tensors]
        return dict(zip(binder.order, binder.bind(ts, [args[i] for i, _ in sizes])))
    run.plans, run.values = plans, values
    return run
