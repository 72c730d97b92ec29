"""`CompiledModel`: a compiled graph called like the original module (calling convention,
call-time checks, executor pool); `OnnxCompiledModel` for ONNX graphs."""
from __future__ import annotations

import math
import weakref
from typing import Any, Dict, Optional, Sequence, Tuple

import torch
import torch.utils._pytree as pytree

from ..frontend.torch import AttributeGuard, check_layout
from ..ir import Graph, MemoryPlan
from ..ir.symbolic import fits
from ..ops import layout_read_inputs
from ..passes import PassContext, PassManager
from ..report import CompileReport
from ..runtime import DEFAULT_CONCURRENT_CALLS, Executor, ExecutorPool, autocast_state
from ..runtime.call_binding import bind_call, input_labels
from ..runtime.input_overlap import check_written_inputs
from ..runtime.weight_watch import WeightWatch
from .binding import BindKernels


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
    the new values are copied into the caller's tensors, and an output that is the
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
    ``executor`` (the first executor), ``pool`` (ExecutorPool).
    """

    def __init__(self, graph: Graph, plan: MemoryPlan, report: CompileReport,
                 in_spec=None, out_spec=None, input_positions: Optional[Sequence[int]] = None,
                 example_flat: Optional[Sequence[Any]] = None,
                 frozen: Optional[Sequence[Tuple[str, torch.Tensor]]] = None,
                 concurrent_calls: int = DEFAULT_CONCURRENT_CALLS,
                 check_aliasing: Optional[bool] = None,
                 arg_names: Optional[Sequence[Optional[str]]] = None,
                 executor: Optional[Executor] = None,
                 module: Optional[torch.nn.Module] = None):
        self.graph, self.plan, self.report = graph, plan, report
        self._in_spec, self._out_spec = in_spec, out_spec
        # forward's positional parameter names: calls are bound by name (call_binding)
        self._arg_names = list(arg_names) if arg_names is not None else None
        self._labels = input_labels(in_spec, self._arg_names) if in_spec is not None else None
        self._positions = list(input_positions) if input_positions is not None else None
        flat = list(example_flat or [])
        # non-tensor arguments are baked into the graph: calls must repeat them
        self._baked = {i: v for i, v in enumerate(flat) if not isinstance(v, torch.Tensor)}
        self._mutations = list(graph.signature.input_mutations)
        self._contig = [t.is_contiguous() for t in flat if isinstance(t, torch.Tensor)]
        # as_strided offsets are absolute: the examples' storage offsets were traced in
        self._offsets = [t.storage_offset() for t in flat if isinstance(t, torch.Tensor)]
        self._strides = [tuple(t.stride()) for t in flat if isinstance(t, torch.Tensor)]
        # inputs an as_strided reads: a contiguous copy would be read at other places
        # ... and inputs whose layout the model's own code queried while it was captured
        queried = graph.signature.layout_queries
        self._layout_read = (layout_read_inputs(graph) | frozenset(queried.get("layout", ()))
                             | frozenset(queried.get("offset", ())))
        self._offset_read = (layout_read_inputs(graph, absolute_offset=True)
                             | frozenset(queried.get("offset", ())))
        # weights are a snapshot (folded, prepacked, copied): detect in-place changes of
        # the module's tensors (weak references: the compiled model never keeps them alive)
        self._frozen = [(n, weakref.ref(t), t._version, t.data_ptr()) for n, t in (frozen or [])]
        # ... and the writes torch does not count in ``_version`` (fused optimizer steps,
        # BatchNorm statistics in a train-mode forward, ``.data``): runtime.weight_watch
        # the host autocast state of the capture (torch.export) must be the call's; ONNX
        # graphs and torch.compile's have no such state
        self._checks_autocast = not graph.signature.input_names
        self._watch = (WeightWatch([t for _, t in frozen], [n for n, _ in frozen], module)
                       if frozen else None)
        # the module's plain Python attributes export baked in (a loaded model: none)
        self._attributes = AttributeGuard(module) if module is not None else None
        if executor is None:   # a loaded model: run the binding stage alone
            ctx = PassContext(options={"check_aliasing": check_aliasing}, report=report,
                              artifacts={"memory_plan": plan})
            PassManager([BindKernels()]).run(graph, ctx)
            executor = ctx.artifacts["executor"]
        self.executor = executor
        self.pool = ExecutorPool(lambda: Executor(graph, plan, check_aliasing=check_aliasing),
                                 concurrent_calls, first=self.executor)

    def calling_convention(self) -> Dict[str, Any]:
        """How calls map onto the graph, for `opencann.save`: ``in_spec``/``out_spec``
        (pytree TreeSpecs or None), ``input_positions`` (flat indices of the tensor
        inputs), ``baked`` (flat index -> non-tensor value fixed at compile time),
        ``contiguous`` (per tensor input: was the example contiguous),
        ``storage_offsets`` and ``strides`` (per tensor input: the example's),
        ``concurrent_calls`` (the executor pool's size) and ``arg_names`` (names of
        ``forward``'s positional parameters, None per positional-only one; None if
        unknown), by which calls are bound."""
        return {"in_spec": self._in_spec, "out_spec": self._out_spec,
                "input_positions": self._positions, "baked": dict(self._baked),
                "contiguous": list(self._contig), "storage_offsets": list(self._offsets),
                "strides": [list(st) for st in self._strides],
                "concurrent_calls": self.pool.size,
                "arg_names": self._arg_names}

    @classmethod
    def from_parts(cls, graph: Graph, plan: MemoryPlan, report: CompileReport, in_spec, out_spec,
                   input_positions: Optional[Sequence[int]], baked: Dict[int, Any],
                   contiguous: Sequence[bool],
                   concurrent_calls: int = DEFAULT_CONCURRENT_CALLS,
                   arg_names: Optional[Sequence[Optional[str]]] = None) -> "CompiledModel":
        """A compiled model from saved parts (`opencann.load`): the arguments of
        `calling_convention` plus graph, plan and report. Binds kernels; no capture.
        Weights are not watched for in-place changes (the file holds its own copy)."""
        cm = cls(graph, plan, report, in_spec=in_spec, out_spec=out_spec,
                 input_positions=input_positions, concurrent_calls=concurrent_calls,
                 arg_names=arg_names)
        cm._baked, cm._contig = dict(baked), list(contiguous)
        return cm

    def _flat_inputs(self, args, kwargs) -> list:
        """The graph's input tensors for a call (contiguous where the examples were)."""
        return self._contiguous(self._user_tensors(args, kwargs))

    def _contiguous(self, tensors: list) -> list:
        # the graph was traced on contiguous examples: its views assume those strides
        made = [t.contiguous() if i < len(self._contig) and self._contig[i] else t
                for i, t in enumerate(tensors)]
        for i in self._layout_read:
            if made[i] is not tensors[i]:
                raise ValueError(
                    f"{self._input_label(i)} has strides {tuple(tensors[i].stride())} and the model "
                    "reads its memory layout (as_strided, or x.stride()/x.is_contiguous() in its code): "
                    "the graph, compiled on a contiguous "
                    "example, would read other elements than eager does. Compile with an example "
                    "of this layout, or pass .contiguous() if that layout's result is meant")
            st = self._strides[i] if i < len(self._strides) else None
            if st is not None and not self._contig[i] and tuple(tensors[i].stride()) != tuple(st):
                raise ValueError(
                    f"{self._input_label(i)} has strides {tuple(tensors[i].stride())} (the "
                    f"example's: {tuple(st)}) and the model reads its memory layout (as_strided, or "
                    "x.stride()/x.is_contiguous() in its code): "
                    "the graph would read other elements than eager does. Pass a tensor of the "
                    "example's layout, or compile with an example of this one")
            want = self._offsets[i] if i < len(self._offsets) else 0
            if i in self._offset_read and tensors[i].storage_offset() != want:
                raise ValueError(
                    f"{self._input_label(i)} starts at storage offset {tensors[i].storage_offset()} "
                    f"(the example's: {want}) and the model reads its memory layout (as_strided "
                    "with an absolute offset, or x.storage_offset() in its code: traced from the "
                    "example's): the graph "
                    "would read other elements than eager does. Pass x.clone(), or compile with "
                    "an example at this offset")
        return made

    def _user_tensors(self, args, kwargs) -> list:
        """The caller's tensors, in graph-input order, after checking them."""
        if self._in_spec is not None:
            args, kwargs = bind_call(args, kwargs, self._in_spec, self._arg_names)
        flat, spec = pytree.tree_flatten((args, kwargs))
        if self._in_spec is not None and spec != self._in_spec:
            raise ValueError(_nesting_error(args, kwargs, self._in_spec, self._arg_names))
        label = (lambda i: self._labels[i]) if self._labels else (lambda i: f"#{i}")
        for i, want in self._baked.items():
            got = flat[i]
            if type(got) is not type(want) or not _same_value(got, want):
                raise ValueError(
                    f"non-tensor input {label(i)} was {want!r} when the model was compiled and is "
                    f"{got if not isinstance(got, torch.Tensor) else 'a tensor'!r} now: non-tensor "
                    "arguments are baked into the compiled graph. Recompile with this value, or "
                    "make it a tensor input")
        self._check_weights()
        if self._attributes is not None:
            self._attributes.check()
        tensors = [flat[i] for i in self._positions] if self._positions is not None else flat
        if len(tensors) != len(self.graph.inputs):
            raise ValueError(f"expected {len(self.graph.inputs)} tensor inputs, got {len(tensors)}")
        for i, (t, v) in enumerate(zip(tensors, self.graph.inputs)):
            name = self._input_label(i)
            if not isinstance(t, torch.Tensor):
                raise ValueError(f"{name} must be a tensor, got {type(t).__name__}")
            check_layout(t, f"{name}")
            if t.requires_grad and torch.is_grad_enabled():
                raise ValueError(
                    f"{name} requires grad, but opencann.compile makes an "
                    "inference model: its outputs carry no gradient. Pass x.detach() or call "
                    "it under torch.no_grad(); to train, use torch.compile(model, "
                    "backend='opencann')")
            if not fits(t.shape, v.desc.shape) or t.dtype != v.desc.dtype.torch:
                what = "shape" if not fits(t.shape, v.desc.shape) else "dtype"
                raise ValueError(
                    f"{name} is {str(t.dtype).replace('torch.', '')}{list(t.shape)} "
                    f"but the model was compiled for {self._shown(v.desc)}; the {what} differs: recompile with "
                    f"example inputs of this {what}" + (" or cast the input" if what == "dtype" else ""))
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}; the compiled model "
                                 "runs on the host (cpu): move the input with .cpu()")
        check_written_inputs(tensors, self._mutations, self._input_label)
        return tensors

    def _check_weights(self) -> None:
        """Raise ValueError (one line naming the tensor) if the module's weights changed
        since compiling, or if the host autocast state differs from the capture's."""
        for name, ref, version, ptr in self._frozen:
            t = ref()
            if t is not None and (t._version != version or t.data_ptr() != ptr):
                how = ("modified in place" if t._version != version
                       else "given new storage (p.data = ...)")
                raise ValueError(
                    f"parameter or buffer {name!r} was {how} after compiling: the "
                    "compiled model holds a snapshot of the weights it was compiled with. "
                    "Recompile after changing weights")
        if self._checks_autocast:
            autocast_state.check(self.graph.signature.autocast)   # None: compiled outside
        if self._watch is not None and self._watch.changed():
            i, how = next(iter(self._watch.changes().items()), (None, None))
            if i is not None:
                what = (f"{how} after compiling" if how.startswith("was replaced") else
                        f"was modified in place after compiling ("
                        f"{how.replace('was modified in place ', '', 1)})")
                raise ValueError(
                    f"parameter or buffer {self._watch.names[i]!r} {what}: the "
                    "compiled model holds a snapshot of the weights it was compiled with. "
                    "Recompile after changing weights")

    def _input_label(self, i: int) -> str:
        """Tensor input ``i`` as errors name it (``input 'x' (argument #0)``)."""
        if self._labels and self._positions is not None:
            return f"input {self._labels[self._positions[i]]}"
        return f"input {i} ({self.graph.inputs[i].name})"

    def _shown(self, desc) -> str:
        """``desc`` as input errors show it (`DynamicCompiledModel` names its dims)."""
        return str(desc)

    def __call__(self, *args, **kwargs):
        user = self._user_tensors(args, kwargs)
        with torch.no_grad():
            outs = self.pool.run(self._contiguous(user))
            # a model that writes into its inputs: the caller's tensors get eager's values
            for i, new in zip(self._mutations, outs):
                user[i].copy_(new)
        return self._structure(outs[len(self._mutations):], user)

    def _structure(self, outs, user=None):
        sig = self.graph.signature
        lits = sig.output_literals
        k = len(self._mutations)
        n = sig.n_flat(len(outs) + k) - k
        mine = sig.returns_input if user is not None else {}
        views = self._input_views(user) if user is not None else {}
        it = iter(outs)
        flat = []
        for i in range(n):
            if i + k in lits:
                flat.append(self._literal(lits[i + k], user))
                continue
            o = next(it)
            # an output that is a mutated input is the caller's tensor itself, as in eager
            v = _view_of(user, views.get(i))
            flat.append(user[mine[i]] if i in mine else o if v is None else v)
        if self._out_spec is None:
            return flat[0] if len(flat) == 1 else tuple(flat)
        return pytree.tree_unflatten(flat, self._out_spec)

    def _literal(self, value, user):
        """A non-tensor output (an int, ``x.shape[0]``) for this call (``value`` itself
        here; `opencann.dynamic` binds symbolic sizes to the call's)."""
        return value

    def _input_views(self, user) -> Dict[int, list]:
        """``graph.signature.input_views`` for this call's inputs ``user`` (concrete here;
        `opencann.dynamic` binds symbolic ones)."""
        return self.graph.signature.input_views

    def profile(self, *args, path: Optional[str] = None, **kwargs):
        """Run once recording per-op times; returns Chrome trace events, writes JSON to
        ``path`` if given (open in chrome://tracing or ui.perfetto.dev)."""
        return self.pool.profile(self._flat_inputs(args, kwargs), path)



class OnnxCompiledModel(CompiledModel):
    """A compiled ONNX model: call it with tensors in graph-input order (or by input
    name as keywords); returns a tuple of the graph's outputs."""

    def __call__(self, *args, **kwargs):
        names = list(self.graph.signature.input_names)
        unknown = set(kwargs) - set(names)
        if unknown or len(args) + len(kwargs) != len(names) or set(names[:len(args)]) & set(kwargs):
            raise ValueError(f"the ONNX model takes inputs {names} (positionally or by name); "
                             f"got {len(args)} positional and {sorted(kwargs)}")
        ordered = list(args) + [kwargs[k] for k in names[len(args):]]
        return tuple(super().__call__(*ordered))



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


def _nest(o: Any) -> str:
    return (f"a {type(o).__name__} of {len(o)}" if isinstance(o, (list, tuple, dict))
            else "a single value")


def _same_value(a: Any, b: Any) -> bool:
    """Equality for baked non-tensor arguments (NaN equals NaN, 0.0 is not -0.0: the
    sign of a zero changes results such as ``1 / s``; never raises)."""
    if isinstance(a, float) and isinstance(b, float):
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - exotic objects: identity only
        return a is b
