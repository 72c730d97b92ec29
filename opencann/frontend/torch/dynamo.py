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
    from ...runtime import Executor
    graph = from_fx_graph(gm, example_inputs, name=f"dynamo_graph_{len(COMPILED_GRAPHS)}")
    graph, plan, report = compile_graph(graph, "cpu", options)
    COMPILED_GRAPHS.append(report)
    ex: List[Executor] = []  # built on the first real call: compilation runs under fake mode
    idx = [i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))
           if isinstance(n.meta.get("val"), torch.Tensor)]
    lits = graph.meta.get("output_literals", {})
    n_out = graph.meta.get("n_outputs", len(graph.outputs))

    def run(*args):
        if len(args) == 1 and isinstance(args[0], list) and len(idx) != 1:
            args = tuple(args[0])
        if not ex:
            ex.append(Executor(graph, plan))
        outs = ex[0].run([args[i] for i in idx])
        it = iter(outs)
        return [lits[i] if i in lits else next(it) for i in range(n_out)]

    run._boxed_call = False
    return run


def opencann_backend(gm: torch.fx.GraphModule, example_inputs, **options):
    """The dynamo backend: AOTAutograd (forward graph) → opencann passes → runtime."""
    from torch._dynamo.backends.common import aot_autograd

    def fw(g, inputs):
        return _compile_fx(g, inputs, options or None)

    return aot_autograd(fw_compiler=fw, decompositions=decomposition_table())(gm, example_inputs)


def register() -> None:
    """Register the ``"opencann"`` backend name with torch.compile (idempotent)."""
    from torch._dynamo import list_backends, register_backend
    if "opencann" not in list_backends(exclude_tags=()):
        register_backend(name="opencann")(opencann_backend)
