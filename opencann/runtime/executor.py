"""CPU executor: binds a planned graph to one arena and runs pre-bound kernels.

The graph is turned into one straight-line Python function (as torch.fx's codegen
does), so each op costs one Python call: kernels, constants and literal arguments are
bound once, intermediates are views into a single arena allocated once per input
shape, and ops with an ATen ``.out`` overload write straight into their planned buffer.
Ops without one (oneDNN fused convolutions, casts, host fallbacks) return a fresh tensor
that is copied into its buffer ("copy-out"), so the arena stays the only storage of
intermediates. Per-op times can be recorded as a Chrome trace (Trace Event Format,
viewable in chrome://tracing or ui.perfetto.dev). This module runs; the code is generated
by `opencann.runtime.codegen` and the trace built by `opencann.runtime.trace`.

A graph scheduled on several streams (``node.stream``, compile option ``streams``) runs
each stream's nodes on a worker thread of its own, joined by events
(`opencann.runtime.streams`); the memory plan keeps values of concurrent nodes apart.

An executor runs one call at a time (its arena is the call's scratch); concurrent calls
each borrow their own from an `ExecutorPool` (``opencann.runtime.pool``), whose further
executors are `Executor.clone`s: bound kernels, constants and code are shared (kernels
keep no per-call state), only the arena and its views are new.
"""
from __future__ import annotations

import threading
import time
from collections import OrderedDict
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..ir import Graph, MemoryPlan, Value
from .alias_check import AliasChecker, AliasingError, enabled_by_env
from .codegen import CodeGen, arena_view, independent_outputs, output_copies  # noqa: F401
from .streams import StreamRunner
from .thread_count import restore_this_thread, set_this_thread
from .trace import Stamps, chrome_trace_events, stream_trace_events, write_chrome_trace


def _bind_runner(glb: Dict[str, Any], runner: StreamRunner) -> None:
    """Bind the names the multi-stream code calls: ``_go`` (run all streams), ``_W``
    (wait on an event) and ``_E`` (the events, recorded with ``.set()``)."""
    glb["_go"], glb["_W"], glb["_E"] = runner.run, runner.wait, runner.events


class ExecutionError(RuntimeError):
    """A kernel failed at run time; the message names the node and its source."""


_CODE_CACHE: "OrderedDict[tuple, Any]" = OrderedDict()
_CODE_CACHE_SIZE = 64
_CODE_LOCK = threading.Lock()


def _compiled(src: str, filename: str):
    """``compile(src)``, cached by source text (at most 64 code objects, least recently
    used dropped): an executor pool's further arenas, and a dynamic model's plans for
    other shapes, generate the same source (sizes are bound as globals, not inlined), so
    they skip Python's compiler (10-60 ms for BERT-base's ~1000 lines). Code objects are
    immutable; each executor execs one into its own globals."""
    key = (src, filename)
    with _CODE_LOCK:
        code = _CODE_CACHE.get(key)
        if code is not None:
            _CODE_CACHE.move_to_end(key)
            return code
    code = compile(src, filename, "exec")
    with _CODE_LOCK:
        _CODE_CACHE[key] = code
        while len(_CODE_CACHE) > _CODE_CACHE_SIZE:
            _CODE_CACHE.popitem(last=False)
    return code


class Executor:
    """Runs ``graph`` with ``plan`` on the CPU. Planned values are views into one arena
    (uint8, ``plan.arena_bytes``); values outside the plan keep their kernel's allocation.
    ``profile=True`` builds the variant that time-stamps every op. ``check_aliasing``
    (default: the ``OPENCANN_CHECK_ALIASING`` environment variable) checks after every
    kernel that its outputs share memory only as declared (`AliasChecker`)."""

    def __init__(self, graph: Graph, plan: MemoryPlan, profile: bool = False,
                 check_aliasing: Optional[bool] = None):
        self.graph = graph
        self.plan = plan
        self.arena = torch.empty(max(plan.arena_bytes, 1), dtype=torch.uint8)
        self.check_aliasing = enabled_by_env() if check_aliasing is None else check_aliasing
        self.copy_out_nodes: List[str] = []
        self._src = ""
        self.trace_events: List[Dict[str, Any]] = []
        self._bound: List[tuple] = []  # (global name, value) of each arena view in the code
        self._fn = self._build(profile)

    def clone(self, arena: Optional[torch.Tensor] = None) -> "Executor":
        """Another executor of the same graph and plan with its own arena: kernels,
        constants and generated code are shared (built once, kernels are stateless per
        call), the arena views are rebound. Cheap: one allocation and one view per
        planned buffer. ``arena``: the buffer to run in instead of a new one (uint8,
        contiguous, at least ``plan.arena_bytes``; e.g. one buffer shared by graphs that
        never run at the same time, `ExecutorPool.share_arena`). Raises ValueError for
        an arena of another dtype or too small."""
        if arena is not None and (arena.dtype != torch.uint8 or not arena.is_contiguous()
                                  or arena.numel() < self.plan.arena_bytes):
            raise ValueError(f"an executor's arena must be a contiguous uint8 tensor of at least "
                             f"{self.plan.arena_bytes} bytes (the plan's), got "
                             f"{arena.dtype} of {arena.numel()} elements")
        ex = Executor.__new__(Executor)
        ex.__dict__.update(self.__dict__)
        ex.arena = torch.empty_like(self.arena) if arena is None else arena
        ex.copy_out_nodes = list(self.copy_out_nodes)
        ex.trace_events = []
        glb = dict(self._glb)
        if "_chk" in glb:  # the debug checker keeps per-run state: one per executor
            glb["_chk"] = AliasChecker(self.graph, self.plan)
        for name, v in self._bound:
            glb[name] = ex._view(v)
        with torch.no_grad():   # static views of the new arena's buffers (`CodeGen`)
            for name, call, local in self._hoisted:
                glb[name] = eval(call, glb, {k: glb[g] for k, g in local.items()})  # noqa: S307
        if self._runner is not None:  # its own events, slots and stream threads
            ex._runner = self._runner.copy()
            _bind_runner(glb, ex._runner)
        exec(self._code, glb)  # noqa: S102 - our codegen, compiled once in _build
        ex._glb, ex._fn = glb, glb["_run"]
        if ex._runner is not None:
            ex._runner.fns = [glb[f"_s{k}"] for k in range(ex._runner.nstreams)]
        return ex

    # -- binding ------------------------------------------------------------------
    def _view(self, v: Value) -> torch.Tensor:
        typed = self.__dict__.get("_typed")
        if typed is None or typed[0] is not self.arena:   # the arena's per-dtype views
            typed = self._typed = (self.arena, {})
        return arena_view(self.arena, self.plan, v, typed[1])

    def _build(self, profile: bool, observe: Optional[Callable] = None,
               serial: bool = False) -> Callable:
        """Generate, compile and bind ``_run`` (`CodeGen`); ``profile`` adds stamps;
        ``observe(node, outputs)`` is called after every kernel (`run_observed`);
        ``serial`` runs every stream's nodes in order on the calling thread."""
        gen = CodeGen(self.graph, self.plan, self._view, self.check_aliasing, profile,
                      observe=observe is not None, serial=serial)
        src, glb = gen.generate()
        self._bound.extend(gen.bound)
        self._hoisted = gen.hoisted
        self.copy_out_nodes.extend(gen.copy_out_nodes)
        self._src = src
        self._runner = None
        if gen.nstreams > 1:  # one function per stream, run at once (`StreamRunner`)
            self._runner = StreamRunner(gen.nstreams, gen.nevents, gen.nslots)
            _bind_runner(glb, self._runner)
        if profile:
            glb["_rec"] = self._stamps = Stamps()
        if observe is not None:
            glb["_obs"] = lambda i, outs, _g=self.graph: observe(_g.nodes[i], outs)
        self._code = _compiled(src, f"<opencann:{self.graph.name}>")
        exec(self._code, glb)  # noqa: S102 - our codegen
        self._glb = glb
        if self._runner is not None:
            self._runner.fns = [glb[f"_s{k}"] for k in range(self._runner.nstreams)]
        return glb["_run"]

    # -- running ------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """Run once; ``inputs`` flat, in graph-input order. Returns the flat outputs."""
        try:
            return self._fn(inputs)
        except AliasingError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise ExecutionError(self._locate(e)) from e

    def run_observed(self, inputs: Sequence[torch.Tensor],
                     observe: Callable[[Any, tuple], None]) -> tuple:
        """Run once, calling ``observe(node, outputs)`` right after each node's kernel with
        its output tensors (arena views, overwritten later: copy what you keep; values in
        an NPU storage format as stored). Used for layer-by-layer comparison with eager
        (``opencann.tools.compare``). Runs on an arena of its own; this executor is left
        as it is. Returns the flat outputs; raises ExecutionError like `run`."""
        ex = Executor.__new__(Executor)
        ex.__dict__.update(self.__dict__)
        ex.arena = torch.empty_like(self.arena)
        ex.copy_out_nodes, ex._bound = [], []
        ex._fn = ex._build(profile=False, observe=observe)
        return ex.run(inputs)

    def _locate(self, e: Exception) -> str:
        import re
        import traceback
        tb = traceback.extract_tb(e.__traceback__)
        for fr in reversed(tb):
            if fr.filename.startswith("<opencann"):
                line = self._src.splitlines()[fr.lineno - 1]
                k = re.search(r"\bK(\d+)\(", line)  # kernel K<i> is node i
                if k is not None and int(k.group(1)) < len(self.graph.nodes):
                    node = self.graph.nodes[int(k.group(1))]
                    return f"{node.name} ({node.op}) at {node.where()} failed: {e}"
                defined = set(re.findall(r"\bv(\d+)\b", line.split("=")[0]))
                for node in self.graph.nodes:
                    if any(str(o.id) in defined for o in node.outputs):
                        return f"{node.name} ({node.op}) at {node.where()} failed: {e}"
        return str(e)

    def node_seconds(self, inputs: Sequence[torch.Tensor], reps: int = 5,
                     threads: Optional[int] = None) -> Dict[str, float]:
        """Node name -> seconds its step takes (its kernel, copy-out and the generated
        code's Python between the previous node's end and its own), measured on the
        calling thread with ``threads`` intra-op threads (default: as set) in a timed
        variant that runs every stream's nodes in order, on an arena of its own (this
        executor is left as it is): one warm-up call, then the least of ``reps`` calls
        per node (the call least disturbed by other processes, as `timeit` advises).
        ``inputs`` flat, in graph-input order, of the graph's shapes and dtypes. The
        stream assignment weighs nodes by these (`opencann.passes.schedule`). Changes
        the calling thread's count only for the duration (`thread_count.set_this_thread`;
        the process default and other threads keep theirs) and restores it; raises what the
        kernels raise (ExecutionError naming the node) and ValueError for ``reps < 1``."""
        if reps < 1:
            raise ValueError(f"reps must be >= 1, got {reps}")
        prof = Executor.__new__(Executor)
        prof.__dict__.update(self.__dict__)
        prof.arena = torch.empty_like(self.arena)
        prof.copy_out_nodes, prof._bound = [], []
        prof._fn = prof._build(profile=True, serial=True)
        best: Dict[int, int] = {}
        saved = set_this_thread(threads) if threads else None
        try:
            with torch.no_grad():
                for r in range(reps + 1):
                    prof._stamps.clear()
                    prev = time.perf_counter_ns()
                    prof.run(inputs)
                    for i, t in (prof._stamps if r else ()):
                        best[i] = min(best.get(i, t - prev), t - prev)
                        prev = t
        finally:
            restore_this_thread(saved)
        return {n.name: best.get(i, 0) / 1e9 for i, n in enumerate(self.graph.nodes)}

    def profile(self, inputs: Sequence[torch.Tensor], path: Optional[str] = None) -> List[Dict[str, Any]]:
        """Run once with per-op timing; returns Chrome trace events (µs) and writes them
        to ``path`` as Trace Event Format JSON when given. On several streams the timed
        variant's worker threads are new: they are started before the timed call (their
        start would otherwise show as a late first kernel)."""
        prof = Executor.__new__(Executor)
        prof.__dict__.update(self.__dict__)
        prof.copy_out_nodes = []  # rebuilt below; keep this executor's list as it is
        prof._bound = []
        fn = prof._build(profile=True)
        if prof._runner is not None:  # start its stream threads outside the timed call
            prof._runner.start()
        prof._stamps.clear()
        t0 = time.perf_counter_ns()
        fn(inputs)
        events = chrome_trace_events(self.graph, prof._stamps, t0)
        if prof._runner is not None:
            events += stream_trace_events(self.graph, events)
        write_chrome_trace(events, path)
        return events
