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

`ShapeChurn` watches the plan cache: after ``limit`` consecutive calls that each built a
plan (the LRU served none of them, so no cycle of up to ``plan_cache_size`` shapes is
repeating) the graph runs its FX graph eagerly from then on (ATen's kernels, eager's
values), is counted as an eager fallback with its reason (`opencann.dynamo.recompiles`)
and says so once, naming the fix: `opencann.llm.compile` (one decode graph for every
position, the KV cache as graph state) or a static cache (``cache_implementation=
"static"``: the shapes stop changing). Compare vllm-ascend#588, where a service
recompiled at every token.
"""
from __future__ import annotations

import threading
from typing import Optional

from ..log import logger
from .recompiles import Compile, note_eager


class ShapeChurn:
    """Counts consecutive plan-building calls of one symbolic graph (``graph``: its name,
    for the message). `after` (built) is told whether a call built a new plan; once
    ``limit`` (a positive int) calls in a row did, `eager` turns True for good and the
    switch is logged and counted (`note_eager`, under ``compile``: the dynamo compile that
    made the graph, None when unknown) with the reason in `reason`."""

    def __init__(self, graph: str, limit: int, compile: Optional[Compile] = None):
        self.graph, self.limit, self.compile = graph, max(int(limit), 1), compile
        self.eager = False
        self.reason = ""
        self._run = 0
        self._lock = threading.Lock()

    def after(self, built: bool) -> None:
        """Record one call: ``built`` when it had to build a plan for a new shape."""
        with self._lock:
            if self.eager:
                return
            self._run = self._run + 1 if built else 0
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


__all__ = ["ShapeChurn"]
