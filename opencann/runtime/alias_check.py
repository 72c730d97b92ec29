"""Debug mode ``check_aliasing``: after every kernel, check that no output shares memory
with another live value unless the op declares it.

The planner and the in-place rewrites trust each op's aliasing facts (`output_aliases`:
the ATen schema's alias annotations or the OpDef's ``aliases``). A kernel that returns a
view where its op is declared fresh (a host op's shortcut, a layout kernel that needs no
copy) silently corrupts results: its buffer is reused or overwritten while the view is
still read. This check finds such kernels. Two values may overlap in memory when their
storage roots (`storage_roots`) meet, or when the memory plan put them in one buffer
(in-place reuse). Graph inputs and constants stay live for the whole run; any other
value is live until the last read of its memory through any alias.

Switched on by the compile option ``check_aliasing=True`` or the environment variable
``OPENCANN_CHECK_ALIASING=1``. It costs a scan of the live values per node: debug only.
"""
from __future__ import annotations

import os
from typing import Dict, FrozenSet, List, Optional, Sequence, Tuple

import torch

from ..ir import Graph, MemoryPlan, Value
from ..ops import last_reads, storage_roots

ENV_VAR = "OPENCANN_CHECK_ALIASING"


class AliasingError(RuntimeError):
    """A kernel's output shares memory with another live value without declaring it."""


def enabled_by_env() -> bool:
    """Whether ``OPENCANN_CHECK_ALIASING`` is set to anything but '', '0', 'false' or 'no'
    (case-insensitive)."""
    return os.environ.get(ENV_VAR, "").strip().lower() not in ("", "0", "false", "no")


def _span(t) -> Optional[Tuple[int, int]]:
    """Bytes [lo, hi) that tensor ``t`` may touch; None for an empty or non-tensor value."""
    if not isinstance(t, torch.Tensor) or t.numel() == 0:
        return None
    n = 1 + sum((s - 1) * abs(st) for s, st in zip(t.shape, t.stride()))
    lo = t.data_ptr()
    return lo, lo + n * t.element_size()


class AliasChecker:
    """Called by the generated code: ``begin(inputs)`` once per run, then
    ``after(node_index, outputs)`` after each node; raises `AliasingError` naming the node."""

    def __init__(self, graph: Graph, plan: MemoryPlan):
        self.graph = graph
        roots = storage_roots(graph)
        step = {n: i for i, n in enumerate(graph.nodes)}
        last = last_reads(graph, roots, step)
        forever = len(graph.nodes) + 1
        self.keys: Dict[int, FrozenSet] = {}
        self.until: Dict[int, int] = {}
        self.values: Dict[int, Value] = {}
        for v in list(graph.inputs) + list(graph.constants):
            self.until[v.id] = forever
        for v in self._all(graph):
            self.values[v.id] = v
            ks = set(roots.get(v.id, (v.id,)))
            if v.id in plan.value_buffer:            # in-place reuse: one planned buffer
                ks.add(("buffer", plan.value_buffer[v.id]))
            self.keys[v.id] = frozenset(ks)
            if v.id not in self.until:
                self.until[v.id] = max((last.get(r, -1) for r in roots.get(v.id, ())), default=-1)
        self._consts = [(c.id, c.const) for c in graph.constants]
        self._live: List[Tuple[int, Tuple[int, int]]] = []

    @staticmethod
    def _all(graph: Graph):
        yield from graph.inputs
        yield from graph.constants
        for n in graph.nodes:
            yield from n.outputs

    def begin(self, inputs: Sequence[torch.Tensor]) -> None:
        """Start a run: graph inputs (``inputs``, in graph-input order) and constants are the
        values live so far."""
        self._live = []
        for v, t in list(zip((v.id for v in self.graph.inputs), inputs)) + self._consts:
            s = _span(t)
            if s is not None:
                self._live.append((v, s))

    def after(self, idx: int, outs: Sequence) -> None:
        """Check node ``idx``'s outputs ``outs``: each may overlap in memory only values it may
        share storage with (the op's declared aliasing or its planned buffer) or values no
        longer read. Raises `AliasingError` naming the node, the output and the other value."""
        node = self.graph.nodes[idx]
        self._live = [(v, s) for v, s in self._live if self.until[v] >= idx]
        for k, (o, t) in enumerate(zip(node.outputs, outs)):
            s = _span(t)
            if s is None:
                continue
            for v, sv in self._live:
                if sv[0] < s[1] and s[0] < sv[1] and not (self.keys[v] & self.keys[o.id]):
                    other = self.values[v]
                    by = (f"{other.producer.name} ({other.producer.op})" if other.producer
                          else "a graph input" if other in self.graph.inputs else "a constant")
                    raise AliasingError(
                        f"check_aliasing: {node.name} ({node.op}) at {node.where()}: output {k} "
                        f"shares memory with {other!r} (from {by}), which is still in use, but "
                        f"{node.op} does not declare that its output may alias it. Fix: declare "
                        "it (the op's ATen schema alias annotation, or OpDef.aliases), or make "
                        "the kernel return fresh memory")
            self._live.append((o.id, s))
