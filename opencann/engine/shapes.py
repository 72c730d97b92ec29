"""Shape policies: how a `CompiledModel` turns a call's input tensors into outputs.

A compiled model holds one policy (``cm.shapes``), chosen when it is built:

- `StaticShapes` (here): one graph of fixed shapes, one memory plan, one `ExecutorPool`;
- `opencann.engine.dynamic.DynamicShapes`: a symbolic graph, a plan per concrete shape
  built on its first call and kept in a bounded cache;
- `opencann.engine.gears.Gears`: dynamic shapes restricted to ATC-style gears, a call
  padded to the smallest gear that holds it where padding cannot change results.

The interface is small on purpose; a policy is where a stateful generator (an LLM's
KV cache as graph state, selecting a prefill or decode plan per call) plugs in:

- ``run(inputs) -> tuple``: the flat graph outputs for the checked, contiguous graph
  inputs (fresh tensors; thread-safe);
- ``profile(inputs, path)``: one recorded run (Chrome trace events); ``run_observed(inputs,
  observe)``: one run calling ``observe(node, outputs)`` after each node;
- ``plan``, ``executor``, ``pool``: the example shape's memory plan, first executor and
  the object ``run`` borrows executors from (``size``, ``count``);
- ``shown(desc)``: a compiled input description as errors show it;
- ``literal(value, user)`` and ``views(views, user)``: a non-tensor output and the
  geometry of the outputs that are views of inputs, with symbolic sizes bound to this
  call's inputs ``user`` (as they are for static shapes);
- ``saved()``: the policy's fields for the model file's calling convention
  (``dynamic``, ``gears``; none for static shapes).
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..ir import Graph, MemoryPlan
from ..passes import PassContext, PassManager
from ..report import CompileReport
from ..runtime import DEFAULT_CONCURRENT_CALLS, Executor, ExecutorPool
from .binding import BindKernels
from .options import complete


class ShapePolicy:
    """The base of shape policies (see the module docstring for the interface)."""

    name = "policy"
    plan: MemoryPlan
    executor: Executor
    pool: Any

    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """Flat outputs for graph ``inputs`` (see the module docstring)."""
        return self.pool.run(inputs)

    def profile(self, inputs: Sequence[torch.Tensor], path: Optional[str] = None
                ) -> List[Dict[str, Any]]:
        """Run once recording per-op times (`ExecutorPool.profile`)."""
        return self.pool.profile(inputs, path)

    def run_observed(self, inputs: Sequence[torch.Tensor], observe: Callable[[Any, tuple], None]) -> tuple:
        """One run calling ``observe(node, outputs)`` after each node, on the plan that
        serves these inputs' shapes (`Executor.run_observed`)."""
        return self.pool.run_observed(inputs, observe)

    def shown(self, desc) -> str:
        """``desc`` (a TensorDesc) as input errors show it."""
        return str(desc)

    def literal(self, value: Any, user: Sequence[torch.Tensor]) -> Any:
        """A non-tensor output for the call's inputs ``user`` (static: ``value``)."""
        return value

    def views(self, views: Dict[int, list], user: Sequence[torch.Tensor]) -> Dict[int, list]:
        """``graph.signature.input_views`` for the call's inputs ``user`` (static: as is)."""
        return views

    def saved(self) -> Dict[str, Any]:
        """The policy's fields in the calling convention (static: none)."""
        return {}


class StaticShapes(ShapePolicy):
    """Fixed shapes: ``plan`` for ``graph``, one `ExecutorPool` of at most
    ``concurrent_calls`` executors (the first is ``executor``; None for a loaded model:
    the binding stage runs here). ``check_aliasing``: the compile option (debug)."""

    name = "static"

    def __init__(self, graph: Graph, plan: MemoryPlan, report: CompileReport,
                 concurrent_calls: int = DEFAULT_CONCURRENT_CALLS,
                 check_aliasing: Optional[bool] = None, executor: Optional[Executor] = None):
        if executor is None:   # a loaded model: run the binding stage alone
            given = None if check_aliasing is None else {"check_aliasing": check_aliasing}
            ctx = PassContext(options=complete(given), report=report,
                              artifacts={"memory_plan": plan})
            PassManager([BindKernels()]).run(graph, ctx)
            executor = ctx.artifacts["executor"]
        self.plan, self.executor = plan, executor
        self.pool = ExecutorPool(lambda: Executor(graph, plan, check_aliasing=check_aliasing),
                                 concurrent_calls, first=executor)
        self.run = self.pool.run   # the hot path: no extra frame per call

    def share_arena(self, arena: torch.Tensor) -> bool:
        """Run in ``arena`` (`ExecutorPool.share_arena`: for graphs whose calls never
        overlap); returns whether the executor was rebound."""
        done = self.pool.share_arena(arena)
        if done:
            self.executor = self.pool.first
        return done


__all__ = ["ShapePolicy", "StaticShapes"]
