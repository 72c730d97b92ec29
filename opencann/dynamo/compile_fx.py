"""The one path from an AOTAutograd FX graph to a runnable opencann graph, shared by the
inference and the training backends: FX (ATen) → IR → `compile_graph` → an executor pool."""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from ..engine import compile_graph
from ..engine.dynamic import compile_symbolic_fx
from ..engine.options import check_options, option
from ..report import CompileReport
from ..frontend.torch import from_fx_graph
from ..ir.symbolic import SymExpr, bind
from ..log import logger
from ..runtime import Executor, ExecutorPool
from .recompiles import Compile, compile_in_progress, note_eager
from .shape_churn import MIN_NEW_SHAPES, ShapeChurn
from .symbolic import graph_symbols

COMPILED_GRAPHS: List[Any] = []  # reports of the graphs compiled in this process


def aot_input_mutations(n_placeholders: int, idx: List[int]) -> tuple:
    """The graph inputs AOTAutograd's graph writes, one per leading graph output (the new
    values of mutated inputs come first, in ``fw_metadata.mutated_inp_runtime_indices``
    order; AOTAutograd copies them back into the caller's tensors after the call, a no-op
    for a tensor an op wrote in place, e.g. KvCacheUpdate on a KV cache passed in).
    ``idx``: the placeholder positions that are graph inputs, in order. ``()`` when this
    graph has no AOTAutograd metadata (then no graph input may be written in place)."""
    from torch._guards import TracingContext
    ctx = TracingContext.try_get()
    meta = ctx.fw_metadata if ctx is not None else None
    if meta is None or len(meta.input_info) != n_placeholders:
        return ()
    muts = list(meta.mutated_inp_runtime_indices)
    return tuple(idx.index(i) for i in muts) if all(i in idx for i in muts) else ()


def compile_fx(gm: torch.fx.GraphModule, example_inputs, options: Optional[Dict[str, Any]] = None,
               constants: Optional[Dict[int, torch.Tensor]] = None, entry: Optional[Compile] = None):
    """Compile one ATen-level FX graph (from AOTAutograd: an inference graph, or one half
    of a partitioned training graph) with opencann's passes; returns the callable that
    runs it (``run(*tensors) -> list``, not boxed), with its compile report as
    ``run.report`` (also appended to `COMPILED_GRAPHS`). Executors are built on the
    first real call (compilation runs under fake mode); overlapping calls (threads) each
    get their own arena, up to the ``concurrent_calls`` option. ``constants``:
    placeholder position -> real tensor made a graph constant (frozen weights,
    `opencann.dynamo.freezing`); ``run`` is still called with every argument and ignores
    those positions. What is symbolic is read from every value of the graph
    (`opencann.dynamo.symbolic.graph_symbols`): a graph with symbolic shapes or size
    arguments (a symbolic int argument with static tensors included) is optimised once
    and planned per concrete shape, and after max(``plan_cache_size``, 8) new shapes in
    a row runs its FX graph eagerly (`ShapeChurn`); a graph computing a data-dependent
    size or scalar runs eagerly (`run_eagerly`). ``entry``: the torch.compile compile it
    belongs to (default: the one in progress), for `opencann.dynamo.eager_fallbacks`."""
    syms = graph_symbols(gm, example_inputs)
    entry = entry or compile_in_progress()
    if syms.data_dependent:
        return run_eagerly(gm, syms.why_eager(), entry)
    constants = constants or {}
    holders = gm.graph.find_nodes(op="placeholder")
    graph = from_fx_graph(gm, example_inputs, name=f"dynamo_graph_{len(COMPILED_GRAPHS)}",
                          constants={holders[i].name: t for i, t in constants.items()})
    vals = [None if i in constants else n.meta.get("val") for i, n in enumerate(holders)]
    idx = [i for i, v in enumerate(vals) if isinstance(v, torch.Tensor)]
    graph.signature = graph.signature.replace(input_mutations=aot_input_mutations(len(holders), idx))
    graph, report, execute, churn = _executor(graph, vals, idx, syms.dynamic, options, entry)
    COMPILED_GRAPHS.append(report)
    lits = graph.signature.output_literals
    n_out = graph.signature.n_flat(len(graph.outputs))

    sym_lits = {i for i, v in lits.items() if isinstance(v, SymExpr)}

    def run(*args):
        if len(args) == 1 and isinstance(args[0], list) and len(idx) != 1:
            args = tuple(args[0])
        if churn is not None:
            if churn.eager:   # every call was a new shape: eager's kernels, no plan per call
                return list(gm(*args))
            outs = churn.call(execute, args)
        else:
            outs = execute(args)
        it = iter(outs)
        if sym_lits:   # sizes a training forward saves for its backward, bound per call
            values, memo = execute.values(args), {}
            return [bind(lits[i], values, memo) if i in sym_lits else lits[i] if i in lits
                    else next(it) for i in range(n_out)]
        return [lits[i] if i in lits else next(it) for i in range(n_out)]

    run._boxed_call = False
    run.report = report
    return run


def _executor(graph, vals: List[Any], idx: List[int], dynamic: bool,
              options: Optional[Dict[str, Any]], entry: Optional[Compile]):
    """(compiled graph, report, ``execute(args) -> flat outputs``, `ShapeChurn` or None):
    a ``dynamic`` graph (symbolic shapes, strides or size arguments) is optimised once and
    planned per concrete shape; a static one is compiled whole, run by an `ExecutorPool`.
    ``vals``: the placeholders' FX values (None for constants), ``idx``: the tensor ones."""
    if dynamic:
        report = CompileReport(model=graph.name)
        options = check_options(options)
        execute = compile_symbolic_fx(graph, vals, options, report)
        return graph, report, execute, ShapeChurn(
            graph.name, max(option(options, "plan_cache_size"), MIN_NEW_SHAPES), entry)
    graph, plan, report = compile_graph(graph, "cpu", options)
    pool = ExecutorPool(lambda: Executor(graph, plan,
                                         check_aliasing=option(options, "check_aliasing")),
                        option(options, "concurrent_calls"))

    def execute(args):
        return pool.run([args[i] for i in idx])
    return graph, report, execute, None


def run_eagerly(gm: torch.fx.GraphModule, why: str, entry: Optional[Compile]):
    """The runner of an AOTAutograd graph opencann does not compile (``why``, one line):
    ``run(*args) -> list`` calls ``gm`` itself, as ``aot_eager`` does; logged at WARNING
    and counted in `opencann.dynamo.eager_fallbacks` under ``entry``. ``run.report`` is
    a report holding the reason (not added to `COMPILED_GRAPHS`: nothing was compiled)."""
    name = f"dynamo_graph_{len(COMPILED_GRAPHS)}"
    logger.warning("opencann: %s, so it runs eagerly; keep shapes independent of the data "
                   "to compile it", why)
    note_eager(entry, name, why)
    report = CompileReport(model=name)
    report.notes.append(f"run eagerly: {why}")

    def run(*args):
        if len(args) == 1 and isinstance(args[0], list):   # boxed: AOT graphs take no lists
            args = tuple(args[0])
        return list(gm(*args))

    run._boxed_call = False
    run.report = report
    return run
