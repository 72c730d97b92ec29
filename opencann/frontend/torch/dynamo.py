"""``torch.compile(model, backend="opencann")``.

Dynamo hands us each graph between graph breaks; AOTAutograd lowers it to ATen with our
decomposition table; each ATen graph goes through the same passes and runtime as
``opencann.compile``. A graph break therefore simply yields several compiled graphs.
Parameters arrive as graph inputs (not constants), so constant-only rewrites (Conv+BN
folding, weight prepacking) report "not constants" there; use ``opencann.compile`` for
frozen inference graphs. Source: PyTorch "Custom Backends" (torch.compiler docs).
"""
from __future__ import annotations

from typing import Any, Dict, List, Optional

import torch

from .capture import decomposition_table
from .convert import from_fx_graph

COMPILED_GRAPHS: List[Any] = []  # reports of the graphs compiled in this process


def _compile_fx(gm: torch.fx.GraphModule, example_inputs, options: Optional[Dict[str, Any]] = None):
    from ...compiler import compile_graph
    from ...runtime import DEFAULT_CONCURRENT_CALLS, Executor, ExecutorPool
    graph = from_fx_graph(gm, example_inputs, name=f"dynamo_graph_{len(COMPILED_GRAPHS)}")
    graph, plan, report = compile_graph(graph, "cpu", options)
    COMPILED_GRAPHS.append(report)
    # executors are built on the first real call (compilation runs under fake mode); each
    # overlapping call (threads) gets its own, up to the `concurrent_calls` option
    opts = options or {}
    pool = ExecutorPool(lambda: Executor(graph, plan, check_aliasing=opts.get("check_aliasing")),
                        opts.get("concurrent_calls", DEFAULT_CONCURRENT_CALLS))
    idx = [i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
           if isinstance(n.meta.get("val"), torch.Tensor)]
    lits = graph.meta.get("output_literals", {})
    n_out = graph.meta.get("n_outputs", len(graph.outputs))

    def run(*args):
        if len(args) == 1 and isinstance(args[0], list) and len(idx) != 1:
            args = tuple(args[0])
        outs = pool.run([args[i] for i in idx])
        it = iter(outs)
        return [lits[i] if i in lits else next(it) for i in range(n_out)]

    run._boxed_call = False
    return run


def _dynamic(example_inputs) -> bool:
    for t in example_inputs:
        if isinstance(t, torch.SymInt):
            return True
        if isinstance(t, torch.Tensor) and any(isinstance(d, torch.SymInt) for d in t.shape):
            return True
    return False


def opencann_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The dynamo backend: AOTAutograd → opencann passes → runtime. Inference graphs get
    the forward compiler only; when gradients are needed (a parameter or input requires
    grad and grad mode is on) the training backend compiles forward and backward.
    ``torch.compile(..., options={...})`` passes opencann's compile options."""
    from torch._dynamo.backends.common import aot_autograd
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    options = dict(options.pop("options", None) or {}, **options)
    if _dynamic(example_inputs):
        from ...log import logger
        logger.warning(
            "opencann: dynamo passed a graph with symbolic shapes (it recompiled for a new "
            "input shape); opencann compiles static shapes, so this graph runs eagerly. Use "
            "torch.compile(model, backend='opencann', dynamic=False) to get one static graph "
            "per shape (gears)")
        return gm.forward
    hops = sorted({n.target.name() for n in gm.graph.nodes if n.op == "call_function"
                   and isinstance(n.target, torch._ops.HigherOrderOperator)})
    if hops:
        from ...log import logger
        logger.warning(
            "opencann: this graph holds %s (control flow or a subgraph, a higher-order op "
            "opencann does not compile), so it runs eagerly; compute both branches and pick "
            "with torch.where(pred, a, b) to compile it", ", ".join(f"torch.{h}" for h in hops))
        return gm.forward
    if torch.is_grad_enabled() and any(isinstance(t, torch.Tensor) and t.requires_grad
                                       for t in example_inputs):
        from .training import opencann_training_backend
        return opencann_training_backend(gm, example_inputs, **options)

    def fw(g, inputs):
        with unset_fake_temporarily():  # constant folding must make real tensors
            return _compile_fx(g, inputs, options or None)

    return aot_autograd(fw_compiler=fw, decompositions=decomposition_table())(gm, example_inputs)


def register() -> None:
    """Register the ``"opencann"`` backend name with torch.compile (idempotent)."""
    from torch._dynamo import list_backends, register_backend
    if "opencann" not in list_backends(exclude_tags=()):
        register_backend(name="opencann")(opencann_backend)
