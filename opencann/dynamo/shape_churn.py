"""Shape churn: a torch.compile graph with symbolic shapes whose every call is a new shape.

A graph dynamo hands over with symbolic shapes is optimised once and memory-planned per
concrete shape (`opencann.engine.dynamic.compile_symbolic_fx`: the plan, the kernel
binding and the generated code of each shape, kept in a bounded LRU of
``plan_cache_size`` shapes). That pays off when shapes repeat. When a dimension takes a
new value on every call, such as the KV length under transformers' ``DynamicCache``
(the cache grows by one position per generated token), every call builds a plan that is
never used again: a random-weight 12-layer Llama of 125M parameters decoded 5.7
tokens/s that way against eager's 30.1 (``bench/llm.py --backends eager torch-compile``,
2 threads), ~100 ms of planning per token.

`ShapeChurn` watches the calls' shapes: after ``limit`` consecutive calls each at a shape
this graph never saw before the graph runs its FX graph eagerly from then on (ATen's kernels, eager's
values), is counted as an eager fallback with its reason (`opencann.dynamo.recompiles`)
and says so once, naming the fix: `opencann.llm.compile` (one decode graph for every
position, the KV cache as graph state) or a static cache (``cache_implementation=
"static"``: the shapes stop changing). Compare vllm-ascend#588, where a service
recompiled at every token.

A shape seen before never counts, even when the LRU had evicted its plan and builds it
again: shapes cycling among a few sizes (a small ``plan_cache_size``, or more sizes than
it) repeat, so they are not churn (each rebuild is the LRU's documented cost; a larger
``plan_cache_size`` avoids it). Counting plan builds instead turned a graph eager after
its very first call with ``plan_cache_size=1``, whatever its shapes. `compile_fx` takes
``limit`` as at least `MIN_NEW_SHAPES` (the default ``plan_cache_size``), so a graph
whose first calls meet a few distinct sizes keeps its plans.
"""
from __future__ import annotations

import threading
from typing import Hashable, Optional, Set

from ..log import logger
from .recompiles import Compile, note_eager

MIN_NEW_SHAPES = 8   # fewest new shapes in a row that make churn (the default plan_cache_size)


class ShapeChurn:
    """Counts consecutive calls of one symbolic graph (``graph``: its name, for the
    message) at shapes it never saw before. `after` (key) is told each call's shape key
    (any hashable: the bound dim values); once ``limit`` (a positive int) calls in a row
    were new, `eager` turns True for good and the
    switch is logged and counted (`note_eager`, under ``compile``: the dynamo compile that
    made the graph, None when unknown) with the reason in `reason`."""

    def __init__(self, graph: str, limit: int, compile: Optional[Compile] = None):
        self.graph, self.limit, self.compile = graph, max(int(limit), 1), compile
        self.eager = False
        self.reason = ""
        self._run = 0
        self._seen: Set[Hashable] = set()
        self._lock = threading.Lock()

    def call(self, execute, args):
        """``execute(args)`` (`compile_symbolic_fx`'s runner), recorded: a call served by a
        cached plan is a seen shape; only a call that built one binds its key (the dims'
        values) to ask whether the shape is new, so a cached shape costs no second bind."""
        built = execute.plans.misses
        outs = execute(args)
        self.after(tuple(execute.values(args).values()) if execute.plans.misses > built else None)
        return outs

    def after(self, key: Optional[Hashable]) -> None:
        """Record one call at the shape ``key`` (None: served by a cached plan, so seen):
        new when no earlier call had it."""
        with self._lock:
            if self.eager:
                return
            new = key is not None and key not in self._seen
            if new:
                self._seen.add(key)
            self._run = self._run + 1 if new else 0
            if self._run < self.limit:
                return
            self.eager = True
            self.reason = (f"a new input shape on each of its last {self.limit} calls (a dim "
                           "that grows every call, e.g. a DynamicCache's KV length): planning "
                           "each shape cost more than the call")
        note_eager(self.compile, self.graph, self.reason)
        logger.warning("opencann: %s saw %s, so it runs eagerly from now on; for LLM decoding "
                       "use opencann.llm.compile, or a static cache (generate(..., "
                       "cache_implementation=\"static\")) so the shapes stop changing",
                       self.graph, self.reason)


__all__ = ["MIN_NEW_SHAPES", "ShapeChurn"]
