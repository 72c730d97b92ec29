"""`CompiledModel`: a compiled graph called like the original module: its calling
convention, the call-time guards it needs (`opencann.engine.guards`) and a shape policy
(`opencann.engine.shapes`: static, dynamic dims, gears) that runs the graph;
`OnnxCompiledModel` builds one for an ONNX graph."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..ir import Graph, MemoryPlan
from ..ops import layout_read_inputs
from ..report import CompileReport
from ..runtime import Executor
from ..runtime.call_binding import bind_call, input_labels, leaf_paths
from .guards import Call, Guard, model_guards
from .shapes import ShapePolicy


class CompiledModel:
    """A compiled model: call it like the original module.

    Inputs must have the shapes and dtypes of the example inputs (the graph is static);
    a mismatch raises ValueError naming the input and the expected description, as do
    another number or nesting of inputs, a non-tensor argument with another value than
    at compile time (it is baked into the graph), an input not on the cpu, a sparse
    input, an input that requires grad while grad mode is on (the compiled model is
    inference-only: outputs never carry a gradient), and a
    parameter or buffer modified in place since compiling (weights are frozen), and a
    plain Python attribute of the module (``self.scale``, a flag, ``training``) changed
    since compiling (export baked its value in: `AttributeGuard`).
    Non-contiguous inputs are made contiguous. Outputs have eager's strides and share
    memory only where eager's do (views of an input); constant outputs are fresh per call.
    ``check_aliasing`` (the compile option; None: the ``OPENCANN_CHECK_ALIASING``
    environment variable) checks every kernel's output aliasing at run time (debug).
    It may be called from several threads at once: each call borrows an executor (its
    own arena) from a pool of at most ``concurrent_calls`` (compile option, default
    `DEFAULT_CONCURRENT_CALLS`); further calls wait for one to be free.
    A model that writes into its inputs (``x.add_(1)``) does so here too: after the run
    the new values are copied into the caller's tensors, except where an op wrote the
    caller's tensor itself in place (``OpDef.inplace_of``: KvCacheUpdate writing a KV
    cache passed as an input, when it is contiguous as the example was), and an output that is the
    mutated input (``return x.add_(1)``) is the caller's tensor object.
    Weights are a snapshot taken at compile time (the model holds its own copies):
    changing the module afterwards never changes results; a change raises ValueError on
    the next call naming the tensor and saying to recompile: one torch records (``p.mul_(2)``
    under no_grad, an optimizer step), ``p.data = t``, and those it does not
    (`opencann.runtime.weight_watch`: fused optimizer steps, BatchNorm statistics from a
    train-mode forward, writes through ``.data``; a parameter, buffer or submodule of
    ``module`` replaced). A call under another host
    ``torch.autocast`` state than the compile's raises ValueError naming both
    (`opencann.runtime.autocast_state`).
    Attributes: ``graph``, ``plan`` (MemoryPlan), ``report`` (CompileReport),
    ``executor`` (the first executor), ``pool`` (ExecutorPool), ``shapes`` (the shape
    policy: `StaticShapes`, `DynamicShapes` or `Gears`; ``plans``, ``binder``,
    ``padder``, ``gear_spec`` and ``device`` are the dynamic policies'), ``guards`` (the
    `Guard` s checked per call, only those this model needs: `model_guards`).

    Built by one constructor for every kind: ``graph``, ``report``, the shape policy
    ``shapes`` and the calling convention (``in_spec``/``out_spec``: pytree TreeSpecs of
    the example call and its result, None for an ONNX graph; ``input_positions``: flat
    indices of the tensor inputs; ``baked``: flat index -> non-tensor value fixed at
    compile time; ``contiguous``, ``storage_offsets``, ``strides``: per tensor input, the
    example's, see `example_convention`; ``arg_names``: ``forward``'s positional
    parameter names; ``onnx_inputs``: an ONNX graph's input names, which it is called
    by, returning a tuple); ``frozen`` ((name, tensor) weights frozen from ``module``,
    the live module) for the weight and attribute guards; ``shared_weights``: compiled
    with the option ``share_weights`` (the weight guards' messages say so).
    """


    def __init__(self, graph: Graph, report: CompileReport, shapes: ShapePolicy, *,
                 in_spec=None, out_spec=None, input_positions: Optional[Sequence[int]] = None,
                 baked: Optional[Dict[int, Any]] = None,
                 contiguous: Sequence[bool] = (), storage_offsets: Sequence[int] = (),
                 strides: Sequence[Sequence[int]] = (),
                 arg_names: Optional[Sequence[Optional[str]]] = None,
                 frozen: Optional[Sequence[Tuple[str, torch.Tensor]]] = None,
                 module: Optional[torch.nn.Module] = None,
                 onnx_inputs: Optional[Sequence[str]] = None, shared_weights: bool = False):
        self.graph, self.report, self.shapes = graph, report, shapes
        self._in_spec, self._out_spec = in_spec, out_spec
        # forward's positional parameter names: calls are bound by name (call_binding)
        self._arg_names = list(arg_names) if arg_names is not None else None
        self._labels = input_labels(in_spec, self._arg_names) if in_spec is not None else None
        self._positions = list(input_positions) if input_positions is not None else None
        self._baked = dict(baked or {})
        self._contig = list(contiguous)
        # as_strided offsets are absolute: the examples' storage offsets were traced in
        self._offsets = list(storage_offsets)
        self._strides = [tuple(st) for st in strides]
        self._onnx = list(onnx_inputs) if onnx_inputs is not None else None
        sig = _signature(graph)
        self._mutations = sig["input_mutations"]
        self._out = sig
        self.guards: List[Guard] = model_guards(
            inputs=graph.inputs, label=self._input_label, flat_label=self._flat_label,
            shown=shapes.shown, baked=self._baked, frozen=frozen or (), module=module,
            autocast=False if self._onnx is not None else sig["autocast"],
            written=self._mutations, layout_read=sig["layout_read"],
            offset_read=sig["offset_read"], contiguous=self._contig,
            strides=self._strides, offsets=self._offsets,
            shape_fix=_growing_cache_fix(in_spec, self._positions), shared_weights=shared_weights)
        self._checks = [g.check for g in self.guards]
        # a call of n plain tensors, bound and flattened as they come (no pytree walk)
        n = len(graph.inputs)
        plain = pytree.tree_structure(((0,) * n, {}))
        self._plain_n = (n if not self._baked and (in_spec is None or in_spec == plain)
                         and self._positions in (None, list(range(n))) else -1)
        # outputs returned as they come: no literal, no mutated or viewed input
        self._plain_out = not (self._mutations or sig["output_literals"] or sig["returns_input"]
                               or sig["input_views"]) and sig["n_outputs"] in (None, len(
                                   graph.outputs))
        self._leaf_out = out_spec is not None and out_spec.is_leaf()

    @property
    def plan(self) -> MemoryPlan:
        """The memory plan (a dynamic model: the example shape's)."""
        return self.shapes.plan

    @property
    def executor(self) -> Executor:
        """The first executor (a dynamic model: the example shape's)."""
        return self.shapes.executor

    @property
    def pool(self):
        """What calls borrow executors from: an `ExecutorPool` (a dynamic model: its
        `ShapePlanCache`); ``size`` bounds concurrent calls."""
        return self.shapes.pool

    def __getattr__(self, name: str):
        if name in _POLICY_ATTRS:   # the dynamic policies' (plans, binder, ...)
            return getattr(self.__dict__["shapes"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def calling_convention(self) -> Dict[str, Any]:
        """How calls map onto the graph, for `opencann.save`: ``in_spec``/``out_spec``
        (pytree TreeSpecs or None), ``input_positions`` (flat indices of the tensor
        inputs), ``baked`` (flat index -> non-tensor value fixed at compile time),
        ``contiguous`` (per tensor input: was the example contiguous),
        ``storage_offsets`` and ``strides`` (per tensor input: the example's),
        ``concurrent_calls`` (the executor pool's size), ``arg_names`` (names of
        ``forward``'s positional parameters, None per positional-only one; None if
        unknown), by which calls are bound, and ``onnx_inputs`` (an ONNX graph's input
        names, by which its calls are bound and checked; None for a torch model); plus
        the shape policy's fields (a dynamic model: ``dynamic`` and ``gears``,
        `DynamicShapes.saved`)."""
        return {"in_spec": self._in_spec, "out_spec": self._out_spec,
                "input_positions": self._positions, "baked": dict(self._baked),
                "contiguous": list(self._contig), "storage_offsets": list(self._offsets),
                "strides": [list(st) for st in self._strides],
                "concurrent_calls": self.pool.size,
                "arg_names": self._arg_names,
                "onnx_inputs": list(self._onnx) if self._onnx is not None else None,
                **self.shapes.saved()}

    def _flat_inputs(self, args, kwargs) -> list:
        """The graph's input tensors for a call (checked; contiguous where the examples were)."""
        return self._contiguous(self._user_tensors(args, kwargs))

    def _contiguous(self, tensors) -> list:
        # the graph was traced on contiguous examples: its views assume those strides
        contig = self._contig
        return [t.contiguous() if i < len(contig) and contig[i] else t
                for i, t in enumerate(tensors)]

    def _bind(self, args, kwargs) -> Tuple[Sequence[Any], Sequence[Any]]:
        """(the call's flat arguments in the compile-time order, its tensor inputs);
        raises ValueError for a call bound or nested otherwise than the example."""
        if not kwargs and len(args) == self._plain_n:
            for a in args:
                if type(a) is not torch.Tensor:
                    break
            else:
                return args, args
        if self._in_spec is not None:
            args, kwargs = bind_call(args, kwargs, self._in_spec, self._arg_names)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise ValueError(_nesting_error(args, kwargs, self._in_spec, self._arg_names))
        tensors = [flat[i] for i in self._positions] if self._positions is not None else flat
        return flat, tensors

    def _user_tensors(self, args, kwargs) -> list:
        """The caller's tensors, in graph-input order, after every guard checked them."""
        flat, tensors = self._bind(args, kwargs)
        call = Call(flat, tensors)
        for check in self._checks:
            check(call)
        return list(tensors)

    def _flat_label(self, i: int) -> str:
        """Flat argument ``i`` as errors name it."""
        return self._labels[i] if self._labels else f"#{i}"

    def _input_label(self, i: int) -> str:
        """Tensor input ``i`` as errors name it (``input 'x' (argument #0)``)."""
        if self._labels and self._positions is not None:
            return f"input {self._labels[self._positions[i]]}"
        return f"input {i} ({self.graph.inputs[i].name})"

    def __call__(self, *args, **kwargs):
        if self._onnx is not None:
            args = self._onnx_order(args, kwargs)
            kwargs = {}
        return self._returned(self._user_tensors(args, kwargs))

    def call_unguarded(self, *args):
        """``self(*args)`` without evaluating the guards (torch.compile's
        ``skip_guard_eval_unsafe`` stance), for a caller that just made a guarded call
        with tensors of the same kinds (dtypes, shapes, strides, aliasing) and vouches
        that nothing the guards watch (weights, module attributes, autocast) changed
        since: `opencann.llm`'s decode loop checks them at the first step of each
        ``generate`` call, then saves ~0.1 ms a token (a 12-layer Llama, 2 cores). ``args``:
        the graph's input tensors, positional; a call not of that plain form (keyword
        or non-tensor arguments, an ONNX graph) runs guarded. A call the guards would
        have refused gives wrong results here, not an error."""
        if self._onnx is not None or len(args) != self._plain_n \
                or any(type(a) is not torch.Tensor for a in args):
            return self(*args)
        return self._returned(list(args))

    def _returned(self, user: list):
        """Run on the checked tensor inputs ``user``; the call's result as the caller's
        model returns it."""
        if torch.is_grad_enabled():
            with torch.no_grad():
                outs = self._run(user)
        else:
            outs = self._run(user)
        if self._plain_out:
            if self._leaf_out:
                return outs[0]
            if self._out_spec is None:
                return outs[0] if len(outs) == 1 else tuple(outs)
            return pytree.tree_unflatten(list(outs), self._out_spec)
        return self._structure(outs[len(self._mutations):], user)

    def run_observed(self, observe, *args, **kwargs) -> tuple:
        """Run one call (no grad) on the plan that serves these inputs' shapes (a dynamic
        model: that shape's, built on first use; gears: the serving gear's, padded as a
        call is), calling ``observe(node, outputs)`` right after each node's kernel
        (``outputs``: that node's output tensors, valid only during the call); returns
        the graph's flat outputs. For tools that look inside a call (calibration, layer
        comparison). Raises what a call raises for inputs the guards refuse."""
        user = self._contiguous(self._user_tensors(args, kwargs))
        with torch.no_grad():
            return self.shapes.run_observed(user, observe)

    def _run(self, user: list) -> tuple:
        outs = self.shapes.run(self._contiguous(user))
        # a model that writes into its inputs: the caller's tensors get eager's values;
        # one written in place (KvCacheUpdate on the caller's KV cache, OpDef.inplace_of)
        # already holds them: no copy-back
        for i, new in zip(self._mutations, outs):
            if new is not user[i]:
                user[i].copy_(new)
        return outs

    def _onnx_order(self, args, kwargs) -> tuple:
        """An ONNX model's call (positional, or by input name) in graph-input order; a
        keyword binds the input of that name whatever the keywords' order. ValueError
        (one line) for an unknown name, an input given twice or missing, or too many."""
        names = self._onnx
        unknown = sorted(set(kwargs) - set(names))
        twice = sorted(set(names[:len(args)]) & set(kwargs))
        missing = [k for k in names[len(args):] if k not in kwargs]
        problem = (f"unknown input name(s) {unknown}" if unknown else
                   f"input(s) {twice} given both positionally and by name" if twice else
                   f"{len(args)} positional inputs for {len(names)}" if len(args) > len(names) else
                   f"input(s) {missing} missing" if missing else "")
        if problem:
            raise ValueError(f"the ONNX model takes inputs {names} (positionally in that order, "
                             f"or by name): {problem}; got {len(args)} positional and "
                             f"keywords {sorted(kwargs)}")
        return tuple(args) + tuple(kwargs[k] for k in names[len(args):])

    def _structure(self, outs, user=None):
        sig = self._out
        lits = sig["output_literals"]
        k = len(self._mutations)
        n = (sig["n_outputs"] if sig["n_outputs"] is not None else len(outs) + k) - k
        mine = sig["returns_input"] if user is not None else {}
        views = self.shapes.views(sig["input_views"], user) if user is not None else {}
        it = iter(outs)
        flat = []
        for i in range(n):
            if i + k in lits:
                flat.append(self.shapes.literal(lits[i + k], user))
                continue
            o = next(it)
            # an output that is a mutated input is the caller's tensor itself, as in eager
            v = _view_of(user, views.get(i))
            flat.append(user[mine[i]] if i in mine else o if v is None else v)
        if self._out_spec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return pytree.tree_unflatten(flat, self._out_spec)

    def profile(self, *args, path: Optional[str] = None, **kwargs):
        """Run once recording per-op times; returns Chrome trace events, writes JSON to
        ``path`` if given (open in chrome://tracing or ui.perfetto.dev)."""
        return self.shapes.profile(self._flat_inputs(args, kwargs), path)


_POLICY_ATTRS = frozenset({"plans", "binder", "padder", "gear_spec", "device"})


def _signature(graph: Graph) -> Dict[str, Any]:
    """The calling convention the frontend wrote (``graph.signature``, the one place it is
    read here): ``input_mutations`` (tensor inputs written, in output order),
    ``output_literals``, ``n_outputs``, ``returns_input``, ``input_views``, ``autocast``
    (the capture's host autocast state), and the tensor inputs whose memory layout the
    graph reads (``layout_read``) or whose absolute storage offset it reads
    (``offset_read``): an as_strided, or a layout query in the model's code."""
    sig = graph.signature
    queried = sig.layout_queries or {}
    return {"input_mutations": list(sig.input_mutations),
            "output_literals": sig.output_literals,
            "n_outputs": sig.n_outputs,
            "returns_input": sig.returns_input,
            "input_views": sig.input_views,
            "autocast": sig.autocast,   # None: compiled outside autocast
            "layout_read": sorted(layout_read_inputs(graph) | frozenset(queried.get("layout", ()))
                                  | frozenset(queried.get("offset", ()))),
            "offset_read": sorted(layout_read_inputs(graph, absolute_offset=True)
                                  | frozenset(queried.get("offset", ())))}


def example_convention(flat: Sequence[Any]) -> Dict[str, Any]:
    """The calling-convention fields the example call fixes (``flat``: its flattened
    arguments): ``baked`` (flat index -> non-tensor value: baked into the graph, calls
    must repeat it) and, per tensor input, ``contiguous``, ``storage_offsets`` and
    ``strides`` (the graph was traced on these layouts)."""
    tensors = [t for t in flat if isinstance(t, torch.Tensor)]
    return {"baked": {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)},
            "contiguous": [t.is_contiguous() for t in tensors],
            "storage_offsets": [t.storage_offset() for t in tensors],
            "strides": [tuple(t.stride()) for t in tensors]}


def OnnxCompiledModel(graph: Graph, report: CompileReport, shapes: ShapePolicy) -> CompiledModel:
    """A compiled ONNX model: a `CompiledModel` called with tensors in graph-input order
    (or by input name as keywords), returning a tuple of the graph's outputs."""
    n = len(graph.outputs)
    return CompiledModel(graph, report, shapes, out_spec=pytree.tree_flatten(tuple(range(n)))[1],
                         onnx_inputs=list(graph.signature.input_names),
                         **example_convention([torch.empty(0) for _ in graph.inputs]))


def _nesting_error(args, kwargs, in_spec, arg_names) -> str:
    """One line naming the first argument whose nesting of lists, tuples and dicts
    differs from the example's."""
    want_args, want_kw = pytree.tree_unflatten([None] * in_spec.num_leaves, in_spec)
    names = list(arg_names or [])
    pairs = [(a, w, f"'{names[j]}' (argument #{j})" if j < len(names) and names[j]
              else f"argument #{j}") for j, (a, w) in enumerate(zip(args, want_args))]
    pairs += [(kwargs[k], want_kw[k], f"'{k}' (keyword)") for k in want_kw]
    for got, want, what in pairs:
        if pytree.tree_structure(got) != pytree.tree_structure(want):
            g, w = _nest(got), _nest(want)
            return (f"input {what} is {g if g != w else 'nested differently'} but the model "
                    f"was compiled for {w} (the "
                    "example's lists, tuples and dicts): call it like the example inputs, or "
                    "recompile")
    return "the call's nesting of inputs differs from the example's: call it like the example"


def _view_of(user, view) -> Optional[torch.Tensor]:
    """The view of the caller's mutated input that an output is in eager
    (``graph.signature.input_views``), or None when the caller's tensor is laid out
    otherwise than the traced one (then the output is a copy)."""
    if view is None:
        return None
    i, shape, stride, offset, base_stride = view
    t = user[i]
    if tuple(t.stride()) != tuple(base_stride):
        return None
    return t.as_strided(shape, stride, t.storage_offset() + offset)


def _growing_cache_fix(in_spec, positions: Optional[Sequence[int]]) -> Dict[int, str]:
    """Tensor input index -> the fix for a shape change, for the tensors of a transformers
    cache object in the call (``DynamicCache``: its keys and values grow by the new tokens
    every step, so the next call's shapes never match a compiled graph's)."""
    if in_spec is None:
        return {}
    caches = {}
    for flat, (_, types) in enumerate(leaf_paths(in_spec)):
        cls = next((t for t in reversed(types) if isinstance(t, type)
                    and t.__module__.startswith("transformers.") and "Cache" in t.__name__), None)
        if cls is not None:
            caches[flat] = cls.__name__
    tensor_at = positions if positions is not None else range(in_spec.num_leaves)
    return {i: (f"it is a tensor of the transformers {caches[f]} passed in, which grows with "
                "every decoded token, and a compiled graph has fixed shapes. Use opencann.llm "
                "(one decode graph for every position, its KV cache preallocated and written "
                "in place) or a static cache (transformers StaticCache, generate(..., "
                "cache_implementation='static'), or torch.compile(model.forward, "
                "backend='opencann'))")
            for i, f in enumerate(tensor_at) if f in caches}


def _nest(o: Any) -> str:
    return (f"a {type(o).__name__} of {len(o)}" if isinstance(o, (list, tuple, dict))
            else "a single value")

