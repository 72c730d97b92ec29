"""CPU executor: binds a planned graph to one arena and runs pre-bound kernels.

The graph is turned into one straight-line Python function (as torch.fx's codegen
does), so each op costs one Python call: kernels, constants and literal arguments are
bound once, intermediates are views into a single arena allocated once per input
shape, and ops with an ATen ``.out`` overload write straight into their planned buffer.
Ops without one (oneDNN fused convolutions, casts, host fallbacks) return a fresh tensor
that is copied into its buffer ("copy-out"), so the arena stays the only storage of
intermediates. Per-op times can be recorded as a Chrome trace (Trace Event Format,
viewable in chrome://tracing or ui.perfetto.dev).

An executor runs one call at a time (its arena is the call's scratch); concurrent calls
each borrow their own from an `ExecutorPool` (``opencann.runtime.pool``), whose further
executors are `Executor.clone`s: bound kernels, constants and code are shared (kernels
keep no per-call state), only the arena and its views are new.
"""
from __future__ import annotations

import json
import math
import time
from typing import Any, Callable, Dict, List, Optional, Sequence

import torch

from ..ir import Graph, MemoryPlan, TensorListRef, TensorRef, Value, is_dense
from ..ops import call_args, get_op, output_aliases, storage_roots
from ..ops.fused import KERNEL_FACTORIES, OUT_CAPABLE
from ..ops.opdef import DEVICE_KERNEL_FACTORIES
from .alias_check import AliasChecker, AliasingError, enabled_by_env
from .fast_call import fast_callable


def _traced_strides(v: Value) -> Optional[tuple]:
    """The strides ATen gave ``v`` when the graph was traced (``node.meta["strides"]``),
    canonicalized; None when unrecorded or not dense (then ``v`` is laid out
    contiguously)."""
    strides = v.producer.meta.get("strides") if v.producer is not None else None
    st = strides[v.producer.outputs.index(v)] if strides else None
    if st is None or not is_dense(v.desc.shape, st):
        return None
    return _canonical(v.desc.shape, st)


def _canonical(shape, strides) -> tuple:
    """``strides`` with each size-1 dim's stride set to what a contiguous layout of the
    following dims gives. Size-1 strides address nothing, but ATen's input/output
    overlap check compares them: two views of one buffer that differ only there (an
    in-place op's input and output, from different FX strides) count as partial overlap."""
    out = list(strides)
    for i in range(len(shape) - 1, -1, -1):
        if shape[i] == 1:
            out[i] = out[i + 1] * max(int(shape[i + 1]), 1) if i + 1 < len(shape) else 1
    return tuple(out)


def _conform(t: torch.Tensor, strides: tuple) -> torch.Tensor:
    """``t`` laid out with ``strides`` (canonical, dense): ``t`` itself when it already is,
    else a copy. Kernels that choose their own layout (oneDNN's channels-last, elementwise
    ops propagating it) are brought back to the traced layout where it matters."""
    if t.stride() == strides or _canonical(t.shape, t.stride()) == strides:
        return t
    return torch.empty_strided(t.shape, strides, dtype=t.dtype, device=t.device).copy_(t)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in memory of its own, with ``t``'s exact strides (also expanded or
    overlapping ones): the span of storage ``t`` covers is copied and viewed the same way."""
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride())


def independent_outputs(graph: Graph) -> List[int]:
    """Indices of graph outputs the runtime must copy (`output_copies`), ascending."""
    return sorted(output_copies(graph))


def output_copies(graph: Graph) -> Dict[int, Optional[int]]:
    """Graph outputs the runtime must copy so that outputs are as independent as eager's,
    each mapped to None (a copy of its own) or to an earlier copied output whose copy it
    shares: eager returned one tensor there (``return a, b, b`` after CSE merged ``a``
    and ``b``: outputs 1 and 2 are one copy, as in eager). An output is copied when it
    is backed by a constant (the compiled model's own weights: a caller must not be able
    to change them), by a graph input eager did not return a view of, or shares memory
    with an earlier kept output where eager's did not (CSE merged ``x + 1, x + 1``).
    Eager's aliasing comes from ``graph.meta["output_storage"]``, recorded at conversion;
    without it, outputs are assumed distinct unless they are the same value."""
    roots = storage_roots(graph)
    eager = graph.meta.get("output_storage")
    consts = {c.id for c in graph.constants}
    inputs = {v.id for v in graph.inputs}

    def eager_of(j: int) -> frozenset:
        return eager[j] if eager is not None else frozenset((graph.outputs[j].id,))

    copies: Dict[int, Optional[int]] = {}
    kept: List[int] = []
    for i, v in enumerate(graph.outputs):
        mine = roots.get(v.id, frozenset((v.id,)))
        e_i = eager_of(i)
        if (mine & consts or (mine & inputs) - e_i
                or any(mine & roots.get(graph.outputs[j].id, frozenset())
                       and not (e_i & eager_of(j)) for j in kept)):
            copies[i] = next((j for j, src in copies.items() if src is None
                              and graph.outputs[j] is v and e_i & eager_of(j)), None)
        else:
            kept.append(i)
    return copies


class ExecutionError(RuntimeError):
    """A kernel failed at run time; the message names the node and its source."""


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

    def clone(self) -> "Executor":
        """Another executor of the same graph and plan with its own arena: kernels,
        constants and generated code are shared (built once, kernels are stateless per
        call), the arena views are rebound. Cheap: one allocation and one view per
        planned buffer."""
        ex = Executor.__new__(Executor)
        ex.__dict__.update(self.__dict__)
        ex.arena = torch.empty_like(self.arena)
        ex.copy_out_nodes = list(self.copy_out_nodes)
        ex.trace_events = []
        glb = dict(self._glb)
        if "_chk" in glb:  # the debug checker keeps per-run state: one per executor
            glb["_chk"] = AliasChecker(self.graph, self.plan)
        for name, v in self._bound:
            glb[name] = ex._view(v)
        exec(self._code, glb)  # noqa: S102 - our codegen, compiled once in _build
        ex._glb, ex._fn = glb, glb["_run"]
        return ex

    # -- binding ------------------------------------------------------------------
    def _view(self, v: Value) -> torch.Tensor:
        r = self.plan.value_buffer[v.id]
        b = self.plan.buffers[r]
        d = v.desc
        t = self.arena[b.offset:b.offset + d.nbytes].view(d.dtype.torch)
        st = _traced_strides(v)
        return t.view(d.shape) if st is None else t.as_strided(d.shape, st)

    def _build(self, profile: bool) -> Callable:
        g = self.graph
        glb: Dict[str, Any] = {}
        names: Dict[int, str] = {}
        lines: List[str] = []
        for i, v in enumerate(g.inputs):
            names[v.id] = f"x{i}"
        for i, c in enumerate(g.constants):
            names[c.id] = f"c{i}"
            glb[f"c{i}"] = c.const
        lit = [0]

        def literal(x) -> str:
            """Inline plain literals; bind everything else (lists, dtypes, inf/nan) as a global."""
            if (x is None or isinstance(x, (bool, int, str))
                    or (isinstance(x, float) and math.isfinite(x))):
                return repr(x)
            k = f"L{lit[0]}"
            lit[0] += 1
            glb[k] = x
            return k

        def render(a) -> str:
            if isinstance(a, TensorRef):
                return names[node.inputs[a.index].id]
            if isinstance(a, TensorListRef):
                return "[" + ", ".join(names[v.id] for v in node.inputs[a.start:a.start + a.length]) + "]"
            if isinstance(a, (list, tuple)) and any(isinstance(y, (TensorRef, list, tuple)) for y in a):
                inner = ", ".join(render(y) for y in a)
                return f"[{inner}]"
            return literal(a)

        in_descs_of = lambda n: [v.desc for v in n.inputs]  # noqa: E731
        layout_bound = self._layout_sensitive(g)
        glb["_conform"] = _conform
        if self.check_aliasing:
            glb["_chk"] = AliasChecker(g, self.plan)
        for idx, node in enumerate(g.nodes):
            op = get_op(node.op)
            aliased = output_aliases(node)
            outs = []
            for o in node.outputs:
                names[o.id] = f"v{o.id}"
                outs.append(names[o.id])
            bufnames = []
            for k, o in enumerate(node.outputs):
                if o.id in self.plan.value_buffer and not aliased[k]:
                    bn = f"B{o.id}"
                    glb[bn] = self._view(o)
                    self._bound.append((bn, o))
                    bufnames.append(bn)
                else:
                    bufnames.append(None)
            target = f"K{idx}"
            lhs = ", ".join(outs) + ("," if len(outs) == 1 and len(node.outputs) > 1 else "")
            factory = (DEVICE_KERNEL_FACTORIES.get(node.device.split(":")[0], {}).get(node.op)
                       or KERNEL_FACTORIES.get(node.op))
            if factory is not None:
                consts = [v.const for v in node.inputs]
                glb[target] = factory(node, in_descs_of(node), consts)
                call = f"{target}({', '.join(names[v.id] for v in node.inputs)}"
                if (node.op in OUT_CAPABLE and OUT_CAPABLE[node.op](node) and len(bufnames) == 1
                        and bufnames[0] is not None):
                    lines.append(f"    {outs[0]} = {call}, out={bufnames[0]})")
                else:
                    self._emit_result(lines, node, lhs, outs, bufnames, call + ")")
            else:
                aten = op.aten or node.meta["aten"]
                schema = aten._schema
                pos, kw = [], []
                for a in schema.arguments:
                    if a.name not in node.attrs:
                        continue
                    s = render(node.attrs[a.name])
                    (kw.append(f"{a.name}={s}") if a.kwarg_only else pos.append(s))
                args = ", ".join(pos + kw)
                use_out = (op.out_kernel is not None and not any(aliased)
                           and len(bufnames) == len(op.out_names)
                           and not node.meta.get("none_outputs")
                           and not node.meta.get("no_out_kernel"))
                if use_out:
                    # outputs outside the arena (graph outputs) get a fresh tensor each run
                    # in the traced layout (eager's strides), so a multi-output kernel still
                    # writes its planned outputs in place
                    for j, o in enumerate(node.outputs):
                        if bufnames[j] is None:
                            bufnames[j] = f"_e{j}"
                            glb[f"S{o.id}"] = self._fresh_args(o)
                            lines.append(f"    _e{j} = torch.empty_strided(S{o.id}[0], S{o.id}[1], "
                                         f"dtype=S{o.id}[2])")
                    glb.setdefault("torch", torch)
                    glb[target] = self._fast(node, op.out_kernel, op.out_names)
                    outkw = ", ".join(f"{n}={b}" for n, b in zip(op.out_names, bufnames))
                    lines.append(f"    {target}({args}{', ' if args else ''}{outkw})")
                    lines.append(f"    {', '.join(outs)} = {', '.join(bufnames)}")
                else:
                    glb[target] = self._fast(node, aten)
                    self._emit_result(lines, node, lhs, outs, bufnames, f"{target}({args})")
            for k, o in enumerate(node.outputs):
                # a kernel's own allocation, in the layout it chose: give it the traced
                # strides where a view reads it or the caller gets it
                if (bufnames[k] is not None or o.id not in layout_bound
                        or (aliased[k] and "inplace_input" not in node.attrs)
                        or k in node.meta.get("none_outputs", ())):
                    continue
                st = self._layout_of(o)
                if st is not None:
                    glb[f"T{o.id}"] = st
                    lines.append(f"    {outs[k]} = _conform({outs[k]}, T{o.id})")
            if self.check_aliasing:
                lines.append(f"    _chk.after({idx}, ({', '.join(outs)},))")
            if profile:
                lines.append(f"    _rec({idx})")
        glb["_own"] = _own
        rets = [names[v.id] for v in g.outputs]
        for i, shared in output_copies(g).items():
            if shared is None:
                lines.append(f"    _o{i} = _own({rets[i]})")
            rets[i] = f"_o{i if shared is None else shared}"
        # outputs whose exported strides differ from eager's (torch.export's
        # functionalization can re-derive a value as a permute of a contiguous clone)
        for i, st in g.meta.get("eager_output_strides", {}).items():
            glb[f"E{i}"] = tuple(st)
            lines.append(f"    _o{i}e = _conform({rets[i]}, E{i})")
            rets[i] = f"_o{i}e"
        ret = ", ".join(rets)
        head = ["def _run(inputs):"]
        if self.check_aliasing:
            head.append("    _chk.begin(inputs)")
        if g.inputs:
            head.append(f"    {', '.join(names[v.id] for v in g.inputs)}, = inputs")
        src = "\n".join(head + lines + [f"    return ({ret}{',' if len(g.outputs) == 1 else ''})"])
        self._src = src
        if profile:
            stamps: List[int] = []
            glb["_rec"] = lambda i: stamps.append((i, time.perf_counter_ns()))
            self._stamps = stamps
        self._code = compile(src, f"<opencann:{g.name}>", "exec")
        exec(self._code, glb)  # noqa: S102 - our codegen
        self._glb = glb
        return glb["_run"]

    def _fast(self, node, overload, out_names=()) -> Callable:
        """``overload`` or the public torch function proven to reach it (`fast_callable`),
        checked with the node's arguments on meta tensors."""
        metas = [torch.empty(v.desc.shape, dtype=v.desc.dtype.torch, device="meta")
                 for v in node.inputs]
        args, kwargs = call_args(node, metas)
        for name, o in zip(out_names, node.outputs):
            shape, strides, dtype = self._fresh_args(o)
            kwargs[name] = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        return fast_callable(overload, args, kwargs)

    @staticmethod
    def _layout_sensitive(g: Graph) -> set:
        """Ids of values whose strides must be the traced ones: graph outputs (the caller
        sees eager's strides) and inputs of ops whose output may alias them (a view's
        result, and whether it can be taken at all, depends on its input's strides). A
        kernel writing in place into an input (ConvAddAct) leaves that input in whatever
        layout it has; its own output is then conformed where needed."""
        need = {v.id for v in g.outputs}
        for n in g.nodes:
            if "inplace_input" in n.attrs:  # its output is conformed itself, if need be
                continue
            for idx in output_aliases(n):
                need.update(n.inputs[i].id for i in idx)
        return need

    @staticmethod
    def _layout_of(v: Value) -> Optional[tuple]:
        """The strides ``v`` must have: the traced ones when dense, contiguous when none
        were recorded (a node the passes inserted); None when the traced strides are not
        dense (an expanded or overlapping result: left as the kernel made it)."""
        st = _traced_strides(v)
        if st is not None:
            return st
        recorded = v.producer.meta.get("strides") if v.producer is not None else None
        if recorded and recorded[v.producer.outputs.index(v)] is not None:
            return None
        return _canonical(v.desc.shape, torch.empty(v.desc.shape, device="meta").stride())

    @staticmethod
    def _fresh_args(v) -> tuple:
        """(shape, strides, dtype) for a fresh output tensor of ``v``: the traced strides
        when the frontend recorded dense ones, else contiguous."""
        d = v.desc
        st = _traced_strides(v) or torch.empty(d.shape, device="meta").stride()
        return tuple(d.shape), tuple(st), d.dtype.torch

    def _emit_result(self, lines, node, lhs, outs, bufnames, call) -> None:
        if any(b is not None for b in bufnames):
            self.copy_out_nodes.append(node.name)
            lines.append(f"    _r = {call}")
            if len(outs) == 1:
                lines.append(f"    {bufnames[0]}.copy_(_r); {outs[0]} = {bufnames[0]}")
            else:
                for j, (o, b) in enumerate(zip(outs, bufnames)):
                    if b is None:
                        lines.append(f"    {o} = _r[{j}]")
                    else:
                        lines.append(f"    {b}.copy_(_r[{j}]); {o} = {b}")
        else:
            lines.append(f"    {lhs} = {call}")

    # -- running ------------------------------------------------------------------
    def run(self, inputs: Sequence[torch.Tensor]) -> tuple:
        """Run once; ``inputs`` flat, in graph-input order. Returns the flat outputs."""
        try:
            return self._fn(inputs)
        except AliasingError:
            raise
        except (RuntimeError, TypeError, ValueError, IndexError) as e:
            raise ExecutionError(self._locate(e)) from e

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

    def profile(self, inputs: Sequence[torch.Tensor], path: Optional[str] = None) -> List[Dict[str, Any]]:
        """Run once with per-op timing; returns Chrome trace events (µs) and writes them
        to ``path`` as Trace Event Format JSON when given."""
        prof = Executor.__new__(Executor)
        prof.__dict__.update(self.__dict__)
        prof.copy_out_nodes = []  # rebuilt below; keep this executor's list as it is
        prof._bound = []
        fn = prof._build(profile=True)
        prof._stamps.clear()
        t0 = time.perf_counter_ns()
        fn(inputs)
        events, prev = [], t0
        for i, t in prof._stamps:
            n = self.graph.nodes[i]
            events.append({"name": n.op, "cat": n.scope or "graph", "ph": "X",
                           "ts": (prev - t0) / 1e3, "dur": (t - prev) / 1e3, "pid": 0,
                           "tid": n.stream, "args": {"node": n.name, "source": n.source}})
            prev = t
        if path:
            with open(path, "w") as f:
                json.dump({"traceEvents": events, "displayTimeUnit": "ms"}, f)
        return events
