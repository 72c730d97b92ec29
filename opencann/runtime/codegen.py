"""Code generation for the executor: one straight-line Python function per graph.

As torch.fx's codegen does, the graph becomes the source of one function ``_run(inputs)``
with one Python call per op. Kernels, constants and non-literal arguments are bound once
as globals of that function (``K<i>`` is node i's kernel, ``c<i>`` constant i, ``B<id>``
the arena view of value ``id``, ``L<i>`` a bound literal); intermediates are views into
the executor's arena. Ops with an ATen ``.out`` overload write straight into their planned
buffer; ops without one return a fresh tensor that is copied into its buffer ("copy-out").
The strides helpers here keep every value that a view reads or the caller gets in the
layout eager PyTorch gave it (``node.meta["strides"]``, recorded at conversion).

Static views are hoisted out of ``_run``: a view op (Reshape, Transpose, StridedSlice...)
of a tensor that is the same object on every call (a constant, a planned arena buffer,
or another hoisted view) gives the same view every call, so it is made once when the
code is bound (``H<id>``, remade by `Executor.clone` for a new arena) and costs nothing
per call. Not hoisted: views of graph inputs, graph outputs (the caller gets a new view
object each call), a reshape that copies, and debugging variants (alias checks,
observers, several streams).

Views of a kernel's fresh result are folded onto it: that result is conformed to its
traced strides, so a view (or a chain of views) of it is the same ``(size, stride,
offset)`` window on every call. The window is found once at binding, by running the
chain on a meta tensor of the result's layout, and each view a kernel or the caller
reads is made per call by one ``as_strided`` of the result (``_as``); views read only
by other folded views are not made at all. A transformer's Q/K/V (StridedSlice,
Reshape, Transpose of the QKV GEMM's result) are three ``as_strided`` calls instead of
nine view calls (~1 µs against ~4 µs each, docs/performance.md). Same debugging
exceptions as hoisting; a reshape that would copy, a dtype view and symbolic shapes are
left to run as they are.

A kernel whose operands are all static (constants, arena buffers, hoisted views) and whose
outputs all have planned buffers is bound to them once too, ``P<i> = _pre(K<i>, ...)``
(remade per clone like the hoisted views), and called as ``P<i>()``: the kernels that
offer ``prebind`` (the decode GEMV, GatedMLP, AddRmsNorm) then skip their per-call checks
and conversions, which cost most right after a decode GEMV has streamed its weight
through the caches (`CodeGen._prebound`, docs/performance.md).
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Dict, List, Optional

import torch

from ..ir import Graph, MemoryPlan, Node, TensorListRef, TensorRef, Value, is_dense
from ..ops import (OpKind, call_args, get_op, graph_happens_before, inplace_inputs,
                   out_buffers_fit, out_contiguous_inputs, output_aliases, storage_roots)
from ..ops.parity import layout_dependent
from .alias_check import AliasChecker
from .fast_call import fast_callable_keyed, value_free


# -- strides ------------------------------------------------------------------------

def _traced_strides(v: Value) -> Optional[tuple]:
    """The strides ATen gave ``v`` when the graph was traced (``node.meta["strides"]``),
    canonicalized; None when unrecorded or not dense (then ``v`` is laid out
    contiguously)."""
    st = v.traced_strides
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


def _pre(kernel: Callable, args: tuple, out) -> Callable:
    """``kernel`` bound to the static operands ``args`` and planned buffers ``out``
    (`CodeGen._prebound`): ``kernel.prebind(*args, out=out)`` where the kernel offers it
    and it applies, else ``functools.partial(kernel, *args, out=out)``."""
    pre = getattr(kernel, "prebind", None)
    bound = pre(*args, out=out) if pre is not None else None
    return bound if bound is not None else functools.partial(kernel, *args, out=out)


def _as_window(t: torch.Tensor, window: tuple) -> torch.Tensor:
    """The view ``(size, stride, offset)`` = ``window`` of ``t``'s storage, the offset
    counted from ``t``'s own (`CodeGen._folded`)."""
    size, stride, offset = window
    return t.as_strided(size, stride, t.storage_offset() + offset)


def _own(t: torch.Tensor) -> torch.Tensor:
    """A copy of ``t`` in memory of its own, with ``t``'s exact strides (also expanded or
    overlapping ones): the span of storage ``t`` covers is copied and viewed the same way."""
    if t.numel() == 0:
        return t.clone()
    span = 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))
    flat = t.as_strided((span,), (1,), t.storage_offset()).clone()
    return flat.as_strided(t.shape, t.stride())


def arena_view(arena: torch.Tensor, plan: MemoryPlan, v: Value,
               typed: Optional[Dict[torch.dtype, torch.Tensor]] = None) -> torch.Tensor:
    """The view of planned value ``v`` in ``arena`` (uint8, ``plan.arena_bytes``): its
    buffer's bytes at ``plan.buffers[...].offset``, viewed as ``v``'s dtype and shape with
    its traced strides when dense, else contiguous. ``typed`` (a dict kept with this
    arena) memoises the whole arena viewed per dtype, so each view is one ``as_strided``
    (same storage, offset, sizes and strides). Raises KeyError when ``v`` is not planned."""
    b = plan.buffers[plan.value_buffer[v.id]]
    d = v.desc
    dt = d.dtype.torch
    st = _traced_strides(v)
    size = d.dtype.itemsize
    if typed is not None and b.offset % size == 0 and arena.numel() % size == 0:
        base = typed.get(dt)
        if base is None:
            base = typed[dt] = arena.view(dt)
        return base.as_strided(d.shape, st or _contiguous(d.shape), b.offset // size)
    t = arena[b.offset:b.offset + d.nbytes].view(dt)
    return t.view(d.shape) if st is None else t.as_strided(d.shape, st)


def _layout_sensitive(g: Graph) -> set:
    """Ids of values whose strides must be the traced ones: graph outputs (the caller
    sees eager's strides), inputs of ops whose output may alias them (a view's
    result, and whether it can be taken at all, depends on its input's strides) and
    inputs of cpu elementwise ops whose kernel gives other values at another layout
    (`layout_dependent`: AVX-512's exact GELU on oneDNN's channels-last convolution
    output). A kernel writing in place into an input (ConvAddAct, KvCacheUpdate:
    `inplace_inputs`) leaves that input in whatever layout it has; its own output is then
    conformed where needed."""
    need = {v.id for v in g.outputs}
    for n in g.nodes:
        if inplace_inputs(n):  # its output is conformed itself, if need be
            continue
        for idx in output_aliases(n):
            need.update(n.inputs[i].id for i in idx)
        if n.device.kind == "cpu" and layout_dependent(n):
            need.update(v.id for v in n.inputs)
    return need


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


def _fresh_args(v: Value) -> tuple:
    """(shape, strides, dtype) for a fresh output tensor of ``v``: the traced strides
    when the frontend recorded dense ones, else contiguous."""
    d = v.desc
    st = _traced_strides(v) or torch.empty(d.shape, device="meta").stride()
    return tuple(d.shape), tuple(st), d.dtype.torch


# -- outputs ------------------------------------------------------------------------

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
    Eager's aliasing comes from ``graph.signature.output_storage``, recorded at conversion;
    without it, outputs are assumed distinct unless they are the same value."""
    roots = storage_roots(graph)
    eager = graph.signature.output_storage
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


# -- kernels ------------------------------------------------------------------------

def _kernel_factory(node: Node) -> Optional[Callable]:
    """The bind-time kernel factory of ``node`` on its device (``factory(node, in_descs,
    consts) -> kernel``), or None: the node runs its ATen op."""
    return get_op(node.op).kernel_factory(node.device)


def _out_capable(node: Node) -> bool:
    """Whether ``node``'s factory-made kernel takes ``out=`` (writes into a given buffer)."""
    return get_op(node.op).writes_out(node)


def _fast(node: Node, overload, out_names=()) -> Callable:
    """``overload`` or the public torch function proven to reach it (`fast_callable`),
    checked with the node's arguments on meta tensors, once per `_proof_key` (so a
    graph specialised to another shape reuses the proof)."""
    def make_args():
        metas = [torch.empty(v.desc.shape, dtype=v.desc.dtype.torch, device="meta")
                 for v in node.inputs]
        args, kwargs = call_args(node, metas)
        for name, o in zip(out_names, node.outputs):
            shape, strides, dtype = _fresh_args(o)
            kwargs[name] = torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        return args, kwargs
    return fast_callable_keyed(overload, _proof_key(node, overload, out_names), make_args)


def _proof_key(node: Node, overload, out_names) -> tuple:
    """What `fast_callable`'s proof for ``node`` depends on: the overload, the inputs'
    dtypes and ranks (their metas are contiguous), each out tensor's dtype, rank and
    contiguity, and the attributes, with ints by type alone when the overload is
    `value_free` (a size bound at another shape gives the same key)."""
    free = value_free(overload)

    def lit(a):
        if isinstance(a, TensorRef):
            return ("T", a.index)
        if isinstance(a, TensorListRef):
            return ("TL", a.start, a.length)
        if isinstance(a, (list, tuple)):
            return (type(a).__name__,) + tuple(lit(y) for y in a)
        if free and isinstance(a, int) and not isinstance(a, bool):
            return int
        return (type(a).__name__, repr(a))
    outs = []
    for name, o in zip(out_names, node.outputs):
        st = _traced_strides(o)
        outs.append((name, o.desc.dtype, len(o.desc.shape),
                     st is None or st == _contiguous(o.desc.shape)))
    return (overload, tuple((v.desc.dtype, len(v.desc.shape)) for v in node.inputs),
            tuple(outs), tuple((k, lit(v)) for k, v in sorted(node.attrs.items())))


_SCHEMA_ARGS: Dict[Any, tuple] = {}


def _schema_args(overload) -> tuple:
    """(name, kwarg_only) of each argument of ``overload``'s schema, memoised (read once
    per node at every binding)."""
    args = _SCHEMA_ARGS.get(overload)
    if args is None:
        args = _SCHEMA_ARGS[overload] = tuple((a.name, a.kwarg_only)
                                              for a in overload._schema.arguments)
    return args


def _contiguous(shape) -> tuple:
    """Row-major strides of ``shape`` (elements), as ``torch.empty(shape).stride()``."""
    out, acc = [], 1
    for d in reversed(shape):
        out.append(acc)
        acc *= max(int(d), 1)
    return tuple(reversed(out))


def _slots(g: Graph, made_on: Dict[int, int]) -> Dict[int, int]:
    """Value id -> slot index for the values handed between streams: read on another
    stream than the one making them, or graph outputs (returned by ``_run``)."""
    slot: Dict[int, int] = {}
    for n in g.nodes:
        for x in n.inputs:
            if made_on.get(x.id, n.stream) != n.stream:
                slot.setdefault(x.id, len(slot))
    for v in g.outputs:
        if v.id in made_on:
            slot.setdefault(v.id, len(slot))
    return slot


# -- the generator ------------------------------------------------------------------

class CodeGen:
    """Builds the source of ``_run(inputs)`` for ``graph`` and the globals it needs.

    A graph on several streams (``node.stream``) gets one function per stream
    (`_generate_streams`), except with ``check_aliasing`` or ``observe`` (debugging:
    the checker's liveness and the observer's node order are those of one stream) or
    ``serial`` (timing each node alone: `Executor.node_seconds`), which
    run the nodes in their order on one thread; the memory plan is valid for that too
    (it keeps apart all values that may be live at once on any interleaving).
    ``view(v)`` gives the arena view of a planned value (bound as ``B<id>``);
    ``check_aliasing`` adds `AliasChecker` calls after every kernel; ``profile`` adds a
    ``_rec(i)`` call after node i (the caller binds ``_rec``); ``observe`` an ``_obs(i,
    outputs)`` call (the caller binds ``_obs``). After `generate`,
    ``bound`` lists (global name, value) of each arena view, ``hoisted`` (global name,
    call text, {local name: global name}) each static view in binding order, and
    ``copy_out_nodes`` the nodes whose result is copied into its buffer."""

    def __init__(self, graph: Graph, plan: MemoryPlan, view: Callable[[Value], torch.Tensor],
                 check_aliasing: bool = False, profile: bool = False, observe: bool = False,
                 serial: bool = False):
        self.graph, self.plan, self.view = graph, plan, view
        self.check_aliasing, self.profile, self.observe = check_aliasing, profile, observe
        self.serial = serial
        self.glb: Dict[str, Any] = {}
        self.names: Dict[int, str] = {}
        self.lines: List[str] = []
        self.bound: List[tuple] = []
        self.copy_out_nodes: List[str] = []
        self.hoisted: List[tuple] = []   # (global name, call text, {local name: global name})
        self.static: Dict[int, str] = {}  # value id -> global holding it on every call
        # value id -> (local name of the fresh result it is a view of, probe tensor of its
        # window): `_folded`; ``pending``: folded views not made yet (their `_as` line)
        self.rooted: Dict[int, tuple] = {}
        self.pending: Dict[int, str] = {}
        self.fresh: set = set()   # values a kernel's own allocation holds (`_unplanned_if_fresh`)
        self.hoist = not (check_aliasing or observe)
        self._lit = 0
        self.nstreams, self.nevents, self.nslots = 1, 0, 0

    def generate(self) -> tuple:
        """(source, globals) of ``_run``; the source defines it, the globals bind it."""
        g, glb = self.graph, self.glb
        for i, v in enumerate(g.inputs):
            self.names[v.id] = f"x{i}"
        for i, c in enumerate(g.constants):
            self.names[c.id] = self.static[c.id] = f"c{i}"
            glb[f"c{i}"] = c.const
        layout_bound = _layout_sensitive(g)
        glb["_conform"], glb["_pre"] = _conform, _pre
        if self.check_aliasing:
            glb["_chk"] = AliasChecker(g, self.plan)
        if any(n.stream for n in g.nodes) and not (self.check_aliasing or self.observe
                                                   or self.serial):
            return self._generate_streams(layout_bound)
        for idx, node in enumerate(g.nodes):
            self._emit_node(idx, node, layout_bound)
        glb["_own"] = _own
        ret = self._emit_returns()
        head = ["def _run(inputs):"]
        if self.check_aliasing:
            head.append("    _chk.begin(inputs)")
        if g.inputs:
            head.append(f"    {', '.join(self.names[v.id] for v in g.inputs)}, = inputs")
        tail = [f"    return ({ret}{',' if len(g.outputs) == 1 else ''})"]
        return "\n".join(head + self.lines + tail), glb

    def _generate_streams(self, layout_bound: set) -> tuple:
        """(source, globals) on several streams: one ``_s<k>(inputs, _V)`` per stream
        (`opencann.runtime.streams`) with a wait ``_W(e)`` before and a record
        ``_E[e].set()`` after each event of `graph_happens_before`, values crossing
        streams (and graph outputs) handed over in the slots ``_V``; ``_run`` calls
        ``_go(inputs)`` (the runner, bound by the executor) and returns from the slots.
        Sets ``nstreams``, ``nevents`` and ``nslots``."""
        g = self.graph
        hb = graph_happens_before(g)
        self.nstreams, self.nevents = hb.nstreams, len(hb.events)
        self.hoist = False   # values handed between streams are loaded into locals
        waits: Dict[int, List[int]] = {}
        records: Dict[int, List[int]] = {}
        for k, (p, c) in enumerate(hb.events):
            waits.setdefault(c, []).append(k)
            records.setdefault(p, []).append(k)
        made_on = {o.id: n.stream for n in g.nodes for o in n.outputs}
        slot = _slots(g, made_on)
        self.nslots = len(slot)
        unpack = (f"    {', '.join(self.names[v.id] for v in g.inputs)}, = inputs"
                  if g.inputs else None)
        body: List[List[str]] = [[f"def _s{k}(inputs, _V):"] + ([unpack] if unpack else [])
                                 for k in range(self.nstreams)]
        if self.profile:
            for k in range(self.nstreams):
                body[k].append(f"    _rec({~k})")
        loaded = [set() for _ in range(self.nstreams)]
        for idx, node in enumerate(g.nodes):
            self.lines = body[node.stream]
            for k in waits.get(idx, ()):
                self.lines.append(f"    _W({k})")
            if self.profile and idx in waits:
                self.lines.append(f"    _rec({~node.stream})")
            for x in node.inputs:
                if x.id in slot and made_on[x.id] != node.stream and x.id not in loaded[node.stream]:
                    loaded[node.stream].add(x.id)
                    self.lines.append(f"    {self.names[x.id]} = _V[{slot[x.id]}]")
            self._emit_node(idx, node, layout_bound)
            for o in node.outputs:
                if o.id in slot:
                    self.lines.append(f"    _V[{slot[o.id]}] = {self.names[o.id]}")
            for k in records.get(idx, ()):
                self.lines.append(f"    _E[{k}].set()")
        self.lines = []
        head = ["def _run(inputs):"]
        if self.check_aliasing:
            head.append("    _chk.begin(inputs)")
        if unpack:
            head.append(unpack)
        head.append("    _V = _go(inputs)")
        for v in g.outputs:
            if v.id in slot:
                head.append(f"    {self.names[v.id]} = _V[{slot[v.id]}]")
        self.glb["_own"] = _own
        ret = self._emit_returns()
        tail = [f"    return ({ret}{',' if len(g.outputs) == 1 else ''})"]
        src = "\n\n".join("\n".join(b + (["    pass"] if len(b) == 1 else [])) for b in body)
        return src + "\n\n" + "\n".join(head + self.lines + tail), self.glb

    # -- arguments ------------------------------------------------------------------
    def literal(self, x) -> str:
        """Inline plain literals; bind everything else (lists, dtypes, inf/nan) as a global.
        In a graph specialised from symbolic dims (``meta["specialised"]``) ints are bound
        too: they may be sizes, so every shape then generates the same source text (and
        `Executor` compiles it once)."""
        if isinstance(x, int) and not isinstance(x, bool) and self.graph.meta.get("specialised"):
            pass
        elif (x is None or isinstance(x, (bool, int, str))
                or (isinstance(x, float) and math.isfinite(x))):
            return repr(x)
        k = f"L{self._lit}"
        self._lit += 1
        self.glb[k] = x
        return k

    def render(self, a, node: Node) -> str:
        """Source text of ATen argument ``a`` of ``node`` (tensor refs by name)."""
        names = self.names
        if isinstance(a, TensorRef):
            return names[node.inputs[a.index].id]
        if isinstance(a, TensorListRef):
            return "[" + ", ".join(names[v.id] for v in node.inputs[a.start:a.start + a.length]) + "]"
        if isinstance(a, (list, tuple)) and any(isinstance(y, (TensorRef, list, tuple)) for y in a):
            inner = ", ".join(self.render(y, node) for y in a)
            return f"[{inner}]"
        return self.literal(a)

    def aten_args(self, node: Node, aten, contiguous=()) -> str:
        """Source text of the arguments of ATen overload ``aten`` for ``node`` (its
        attributes in schema order, keyword-only ones as keywords); the tensors named in
        ``contiguous`` made contiguous at the call (`OpDef.out_contiguous`)."""
        pos, kw = [], []
        for name, kwarg_only in _schema_args(aten):
            if name in node.attrs:
                a = self.render(node.attrs[name], node)
                if name in contiguous and isinstance(node.attrs[name], TensorRef):
                    a += ".contiguous()"
                (kw.append(f"{name}={a}") if kwarg_only else pos.append(a))
        return ", ".join(pos + kw)

    # -- one node -------------------------------------------------------------------
    def _emit_node(self, idx: int, node: Node, layout_bound: set) -> None:
        if self.hoist and (self._hoisted(node) or self._folded(node)):
            if self.profile:
                self.lines.append(f"    _rec({idx})")
            return
        for x in node.inputs:
            self._materialize(x)
        op = get_op(node.op)
        aliased = output_aliases(node)
        outs = []
        for o in node.outputs:
            self.names[o.id] = f"v{o.id}"
            outs.append(self.names[o.id])
        bufnames = self._bind_buffers(node, aliased)
        lhs = ", ".join(outs) + ("," if len(outs) == 1 and len(node.outputs) > 1 else "")
        factory = _kernel_factory(node)
        if factory is not None:
            self._emit_factory_call(idx, node, factory, lhs, outs, bufnames)
        else:
            self._emit_aten_call(idx, node, op, aliased, lhs, outs, bufnames)
        self._emit_conform(node, aliased, outs, bufnames, layout_bound)
        if self.check_aliasing:
            self.lines.append(f"    _chk.after({idx}, ({', '.join(outs)},))")
        if self.observe:
            self.lines.append(f"    _obs({idx}, ({', '.join(outs)},))")
        if self.profile:
            self.lines.append(f"    _rec({idx})")

    def _hoisted(self, node: Node) -> bool:
        """Make ``node`` once, at binding, when it is a static view (module docstring):
        binds ``H<id>`` and records it in ``hoisted``; False (nothing done) otherwise."""
        op = get_op(node.op)
        aten = op.aten or node.meta.get("aten")
        if (op.kind is not OpKind.VIEW or len(node.outputs) != 1 or _kernel_factory(node)
                or aten is None or op.kernel(node.device) not in (None, aten) or inplace_inputs(node)
                or not output_aliases(node)[0] or node.outputs[0] in self.graph.outputs
                or not node.inputs or any(x.id not in self.static for x in node.inputs)):
            return False
        target = f"K{node.outputs[0].id}h"
        call = f"{target}({self.aten_args(node, aten)})"
        local = {self.names[x.id]: self.static[x.id] for x in node.inputs
                 if self.names[x.id] != self.static[x.id]}
        self.glb[target] = _fast(node, aten)
        with torch.no_grad():
            r = eval(call, self.glb, {k: self.glb[g] for k, g in local.items()})  # noqa: S307
        base = self.glb[self.static[node.inputs[0].id]]
        if not isinstance(r, torch.Tensor) \
                or r.untyped_storage().data_ptr() != base.untyped_storage().data_ptr():
            return False   # a reshape that copied: it must run every call
        name = f"H{node.outputs[0].id}"
        self.glb[name] = r
        self.names[node.outputs[0].id] = self.static[node.outputs[0].id] = name
        self.hoisted.append((name, call, local))
        return True

    def _view_op(self, node: Node):
        """The ATen overload of ``node`` when it is a plain view op (one input, one output
        aliasing it, no kernel of its own, not in place, not a graph output), else None."""
        op = get_op(node.op)
        aten = op.aten or node.meta.get("aten")
        if (op.kind is not OpKind.VIEW or len(node.outputs) != 1 or len(node.inputs) != 1
                or _kernel_factory(node) or aten is None or op.kernel(node.device) not in (None, aten)
                or inplace_inputs(node) or not output_aliases(node)[0]
                or node.outputs[0] in self.graph.outputs):
            return None
        return aten

    def _folded(self, node: Node) -> bool:
        """Fold ``node``, a view of a fresh kernel result or of a folded view (module
        docstring), into a window of that result: its line (``_as``) is emitted when a
        reader needs it (`_materialize`). False (nothing done) when it does not apply."""
        aten = self._view_op(node)
        x = node.inputs[0] if node.inputs else None
        if aten is None or x.id not in self.rooted:
            return False
        root, probe = self.rooted[x.id]
        name = self.names[x.id]
        target = f"K{node.outputs[0].id}h"
        self.glb.setdefault(target, _fast(node, aten))
        with torch.no_grad():
            r = eval(f"{target}({self.aten_args(node, aten)})", self.glb, {name: probe})  # noqa: S307
        base = probe._base if probe._base is not None else probe
        if not isinstance(r, torch.Tensor) or r.dtype != probe.dtype or r._base is not base:
            return False   # a reshape that copies, or a dtype view: it runs as it is
        o = node.outputs[0]
        self.names[o.id] = f"v{o.id}"
        self.rooted[o.id] = (root, r)
        self.glb[f"W{o.id}"] = (tuple(r.shape), tuple(r.stride()), r.storage_offset())
        self.glb.setdefault("_as", _as_window)
        self.pending[o.id] = f"    v{o.id} = _as({root}, W{o.id})"
        return True

    def _materialize(self, v: Value) -> None:
        """Emit the `_as` line of ``v`` if it is a folded view not made yet."""
        line = self.pending.pop(v.id, None)
        if line is not None:
            self.lines.append(line)

    def _root(self, node: Node, k: int, local: str, strides: tuple) -> None:
        """Record output ``k`` of ``node`` (local ``local``, conformed to ``strides``) as a
        root whose views `_folded` may fold: a meta probe tensor of its layout, offset 0
        (no memory: the views' sizes, strides and offsets only)."""
        o = node.outputs[k]
        shape = o.desc.shape
        if not self.hoist or not all(isinstance(d, int) for d in shape) \
                or not any(self._view_op(u) is not None for u in o.users):
            return
        probe = torch.empty_strided(tuple(shape), strides, dtype=o.desc.dtype.torch, device="meta")
        self.rooted[o.id] = (local, probe)

    def _bind_buffers(self, node: Node, aliased) -> List[Optional[str]]:
        """``B<id>`` (bound to its arena view) for each planned, non-aliasing output; None
        for the others."""
        bufnames: List[Optional[str]] = []
        for k, o in enumerate(node.outputs):
            if o.id in self.plan.value_buffer and not aliased[k]:
                bn = f"B{o.id}"
                self.glb[bn] = self.view(o)
                self.bound.append((bn, o))
                bufnames.append(bn)
            else:
                bufnames.append(None)
        return bufnames

    def _emit_factory_call(self, idx, node, factory, lhs, outs, bufnames) -> None:
        target = f"K{idx}"
        written = inplace_inputs(node)
        consts = [v.const for v in node.inputs]
        self.glb[target] = factory(node, [v.desc for v in node.inputs], consts)
        self._unplanned_if_fresh(node, self.glb[target], bufnames)
        if self._prebound(idx, node, outs, bufnames):
            return
        call = f"{target}({', '.join(self.names[v.id] for v in node.inputs)}"
        if _out_capable(node) and len(bufnames) == 1 and bufnames[0] is not None:
            self.lines.append(f"    {outs[0]} = {call}, out={bufnames[0]})")
            self.static[node.outputs[0].id] = bufnames[0]   # out= kernels return ``out``
        elif _out_capable(node) and len(bufnames) > 1 and any(b is not None for b in bufnames) \
                and all(b is not None or k in written for k, b in enumerate(bufnames)):
            # several outputs: ``out`` is the tuple of their buffers (None for an output
            # written into an input in place), returned as that tuple with the inputs
            self.lines.append(f"    {', '.join(outs)} = {call}, out=({', '.join(map(str, bufnames))},))")
            for o, b in zip(node.outputs, bufnames):
                if b is not None:
                    self.static[o.id] = b
        else:
            self._emit_result(node, lhs, outs, bufnames, call + ")")

    def _unplanned_if_fresh(self, node: Node, kernel: Callable, bufnames: List) -> None:
        """Leave ``node``'s planned buffer unused (``bufnames[0] = None``) when its bound
        kernel computes into an allocation of its own (``kernel.fresh_result``:
        oneDNN's inner product, `cpu.fresh_result`), which ``out=`` would only copy into
        the buffer: its consumers read the kernel's result, whose views fold onto it as
        any fresh result's (`_emit_conform` roots it). Only where views are hoisted (not
        under the alias checker or observers, which expect the planned buffers)."""
        if (self.hoist and len(bufnames) == 1 and bufnames[0] is not None
                and getattr(kernel, "fresh_result", False) and not inplace_inputs(node)):
            bufnames[0] = None
            self.fresh.add(node.outputs[0].id)

    def _prebound(self, idx: int, node: Node, outs, bufnames) -> bool:
        """Bind kernel ``K<idx>`` once to its operands when every one is the same tensor
        at every call (a constant, an arena buffer or a hoisted view: `static`) and every
        output has its planned buffer: ``P<idx> = _pre(K<idx>, operands, buffers)``,
        remade for a clone's arena as the hoisted views are, and the call is ``P<idx>()``.
        Where the kernel offers ``prebind`` (the decode GEMV, GatedMLP's one-GEMM form,
        AddRmsNorm) that call runs it with no per-call conversion or check of its tensors
        (`numba_cache.prebound`: what a decode step's small kernels cost right after a GEMV
        has streamed its weight); else it is the plain call on those operands, so a
        dynamic graph's source is the same at every shape whatever kernel each shape
        chose. False (nothing emitted) for any other node."""
        if not (self.hoist and _out_capable(node) and bufnames
                and all(b is not None for b in bufnames)
                and all(x.id in self.static for x in node.inputs)):
            return False
        out = bufnames[0] if len(bufnames) == 1 else f"({', '.join(bufnames)},)"
        call = f"_pre(K{idx}, ({''.join(self.static[x.id] + ', ' for x in node.inputs)}), {out})"
        with torch.no_grad():
            self.glb[f"P{idx}"] = eval(call, self.glb)  # noqa: S307 - our codegen
        self.hoisted.append((f"P{idx}", call, {}))
        self.lines.append(f"    {', '.join(outs)} = P{idx}()")
        for o, b in zip(node.outputs, bufnames):
            self.static[o.id] = b
        return True

    def _emit_aten_call(self, idx, node, op, aliased, lhs, outs, bufnames) -> None:
        target = f"K{idx}"
        aten = op.aten or node.meta["aten"]
        kernel = op.kernel(node.device) or aten   # a user's OpDef.kernels entry, or ATen
        use_out = (kernel is aten and op.out_kernel is not None and not any(aliased)
                   and len(bufnames) == len(op.out_names)
                   and not node.meta.get("none_outputs")
                   and not node.meta.get("no_out_kernel")
                   and out_buffers_fit(op, self._out_buffers(node, bufnames)))
        if not use_out:
            self.glb[target] = _fast(node, aten) if kernel is aten else kernel
            self._emit_result(node, lhs, outs, bufnames, f"{target}({self.aten_args(node, aten)})")
            return
        # an .out overload that mishandles some strided operand gets it contiguous
        args = self.aten_args(node, aten, out_contiguous_inputs(op))
        # outputs outside the arena (graph outputs) get a fresh tensor each run in the
        # traced layout (eager's strides), so a multi-output kernel still writes its
        # planned outputs in place
        for j, o in enumerate(node.outputs):
            if bufnames[j] is None:
                bufnames[j] = f"_e{j}"
                self.glb[f"S{o.id}"] = _fresh_args(o)
                self.lines.append(f"    _e{j} = torch.empty_strided(S{o.id}[0], S{o.id}[1], "
                                  f"dtype=S{o.id}[2])")
        self.glb.setdefault("torch", torch)
        self.glb[target] = _fast(node, op.out_kernel, op.out_names)
        outkw = ", ".join(f"{n}={b}" for n, b in zip(op.out_names, bufnames))
        self.lines.append(f"    {target}({args}{', ' if args else ''}{outkw})")
        self.lines.append(f"    {', '.join(outs)} = {', '.join(bufnames)}")
        for o, b in zip(node.outputs, bufnames):
            if b.startswith("B"):
                self.static[o.id] = b

    def _out_buffers(self, node: Node, bufnames) -> List[torch.Tensor]:
        """The tensor each output of ``node`` is written into by an ``.out`` call: its
        planned buffer, else a meta stand-in of the fresh tensor made per call."""
        def fresh(o):
            shape, strides, dtype = _fresh_args(o)
            return torch.empty_strided(shape, strides, dtype=dtype, device="meta")
        return [self.glb[b] if b is not None else fresh(o) for b, o in zip(bufnames, node.outputs)]

    def _emit_result(self, node, lhs, outs, bufnames, call) -> None:
        """Assign a kernel's returned result(s); copy each planned one into its buffer."""
        lines = self.lines
        if not any(b is not None for b in bufnames):
            lines.append(f"    {lhs} = {call}")
            return
        self.copy_out_nodes.append(node.name)
        lines.append(f"    _r = {call}")
        if len(outs) == 1:
            lines.append(f"    {bufnames[0]}.copy_(_r); {outs[0]} = {bufnames[0]}")
            self.static[node.outputs[0].id] = bufnames[0]
            return
        for j, (o, b) in enumerate(zip(outs, bufnames)):
            if b is None:
                lines.append(f"    {o} = _r[{j}]")
            else:
                lines.append(f"    {b}.copy_(_r[{j}]); {o} = {b}")
                self.static[node.outputs[j].id] = b

    def _emit_conform(self, node, aliased, outs, bufnames, layout_bound) -> None:
        """A kernel's own allocation, in the layout it chose: give it the traced strides
        where a view reads it or the caller gets it."""
        written = inplace_inputs(node)
        for k, o in enumerate(node.outputs):
            if (bufnames[k] is not None or (o.id not in layout_bound and o.id not in self.fresh)
                    or (aliased[k] and k not in written)
                    or k in node.meta.get("none_outputs", ())):
                continue
            st = _layout_of(o)
            if st is not None:
                self.glb[f"T{o.id}"] = st
                self.lines.append(f"    {outs[k]} = _conform({outs[k]}, T{o.id})")
                self._root(node, k, outs[k], st)

    # -- outputs --------------------------------------------------------------------
    def _emit_returns(self) -> str:
        """Copies and conforms of the graph outputs; returns the return tuple's text."""
        g = self.graph
        for v in g.outputs:
            self._materialize(v)
        rets = [self.names[v.id] for v in g.outputs]
        for i, shared in output_copies(g).items():
            if shared is None:
                self.lines.append(f"    _o{i} = _own({rets[i]})")
            rets[i] = f"_o{i if shared is None else shared}"
        # outputs whose exported strides differ from eager's (torch.export's
        # functionalization can re-derive a value as a permute of a contiguous clone)
        for i, st in g.signature.eager_output_strides.items():
            self.glb[f"E{i}"] = tuple(st)
            self.lines.append(f"    _o{i}e = _conform({rets[i]}, E{i})")
            rets[i] = f"_o{i}e"
        return ", ".join(rets)
