"""Call-time guards: does this call still match what was compiled?

A compiled model is valid for the calls its compile assumed: the same non-tensor
arguments (baked into the graph), the same weights (a snapshot), the same module
attributes (baked in by torch.export), the same host autocast state, inputs of the
compiled shapes, dtypes and device, no aliasing between an input the model writes and
another, and the memory layout of the inputs whose layout the model reads. Each such
assumption is one `Guard` here: a class with a ``name`` and ``check(call)``, which
returns None when the call holds and raises ValueError with one line naming the
problem and the fix when it does not. `model_guards` composes, per model and at
construction, only the guards that model needs (no attribute guard for a module
without plain attributes, no overlap guard for a model that writes no input, no
baked-value guard without baked values, no layout guard when no input's layout is
read), in the order the checks always ran, so the first failing check of a call is
the one reported. ``torch.compile(backend="opencann")``'s freezing
(`opencann.dynamo.freezing`) uses `FrozenWeights` and `UnrecordedWrites` for its
weight checks.

The mechanisms stay where they are (`opencann.runtime.weight_watch` for writes torch
does not count, `opencann.runtime.autocast_state`, `opencann.runtime.input_overlap`,
`opencann.runtime.call_binding`, `opencann.frontend.torch.module_attrs`); a guard is
the one place that decides a call-time question from them. Each check has a fast path
(a few attribute reads and one comparison) and falls back to the full check, which
raises the error, only when the fast path does not hold. Per-guard cost per call:
``bench/guards.py``.
"""
from __future__ import annotations

import operator
import weakref
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..frontend.torch import AttributeChanged, AttributeGuard, check_layout
from ..ir.symbolic import fits
from ..runtime import autocast_state
from ..runtime.input_overlap import check_written_inputs
from ..runtime.weight_watch import WeightWatch

_VERSION = operator.attrgetter("_version")
_PTR = torch.Tensor.data_ptr
_STRIDED = torch.strided


class Call:
    """One call as the guards see it: ``flat`` (the call's arguments flattened in the
    compile-time order: tensors and baked non-tensor values) and ``tensors`` (the graph's
    input tensors, in graph-input order, as the caller passed them)."""

    __slots__ = ("flat", "tensors")

    def __init__(self, flat: Sequence[Any], tensors: Sequence[Any]):
        self.flat, self.tensors = flat, tensors


class Guard:
    """One call-time check. ``name``: the guard's name in reports and ``bench/guards.py``.
    ``check(call)`` returns None when the `Call` holds, else raises ValueError (one line:
    what differs from the compile and how to fix it)."""

    name = "guard"

    def check(self, call: Call) -> None:
        """None when ``call`` holds; else ValueError (one line, the problem and the fix)."""
        raise NotImplementedError(f"{type(self).__name__} defines no check")

    def __repr__(self) -> str:
        return f"<guard {self.name}>"


class BakedValues(Guard):
    """Non-tensor arguments (ints, floats, flags) equal the compile's: torch.export
    baked them into the graph. ``baked``: flat index -> value; ``label(i)`` names flat
    input ``i``. Equality is `same_value` (NaN equals NaN, 0.0 is not -0.0)."""

    name = "baked_values"

    def __init__(self, baked: Dict[int, Any], label: Callable[[int], str]):
        self.baked, self.label = dict(baked), label

    def check(self, call: Call) -> None:
        """ValueError naming the first non-tensor argument whose value differs."""
        flat = call.flat
        for i, want in self.baked.items():
            got = flat[i]
            if type(got) is not type(want) or not same_value(got, want):
                raise ValueError(
                    f"non-tensor input {self.label(i)} was {want!r} when the model was compiled "
                    f"and is {got if not isinstance(got, torch.Tensor) else 'a tensor'!r} now: "
                    "non-tensor arguments are baked into the compiled graph. Recompile with this "
                    "value, or make it a tensor input")


SNAPSHOT = "the compiled model holds a snapshot of the weights it was compiled with"
SHARED = ("the compiled model reads the module's weight memory (option share_weights) but its "
          "packed and folded copies of the weights (GEMM layouts, constants computed from "
          "weights) hold the values it was compiled with")


class WeightChanged(ValueError):
    """A frozen weight changed after compiling: ``name`` (the compiled module's parameter
    or buffer name), ``how`` (a phrase: "was modified in place", "was replaced ..."),
    ``detail`` (by what, when known, e.g. "by an optimizer step (AdamW)") and ``shared``
    (compiled with the option ``share_weights``). Its message is one line ending in the
    fix; an application that compiled a module of its own (opencann.llm's `DecoderLM`)
    catches it to name the user's parameter instead."""

    def __init__(self, name: str, how: str, shared: bool = False, detail: str = ""):
        self.name, self.how, self.shared, self.detail = name, how, shared, detail
        super().__init__(f"parameter or buffer {name!r} {how} after compiling"
                         f"{f' ({detail})' if detail else ''}: "
                         f"{SHARED if shared else SNAPSHOT}. Recompile after changing weights")


class FrozenWeights(Guard):
    """The module's parameters and buffers have the version counter and storage they
    had when they were frozen (a snapshot compiled into the graph): an in-place change
    torch records (``p.mul_(2)`` under no_grad, an optimizer step) or ``p.data = t``
    raises. Holds the tensors by weak reference (a freed tensor is not checked).
    ``named``: (name, tensor) pairs; ``shared``: compiled with ``share_weights`` (for the
    message, `WeightChanged`). `holds(tensors)` is the check on tensors passed in
    (the torch.compile freezing path, where dynamo passes the frozen tensors per call)."""

    name = "frozen_weights"

    def __init__(self, named: Sequence[Tuple[str, torch.Tensor]], shared: bool = False):
        self.shared = shared
        tensors = [t for _, t in named]
        self.names = [n for n, _ in named]
        self.ids = tuple(map(id, tensors))
        self.versions = tuple(map(_VERSION, tensors))
        self.ptrs = tuple(map(_PTR, tensors))
        self.freed = False

        def died(_ref, me=weakref.ref(self)):
            g = me()
            if g is not None:
                g.freed = True
        self.refs = [weakref.ref(t, died) for t in tensors]

    def holds(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Whether ``tensors`` are the frozen tensors (the same objects, none freed),
        with their versions and storages unchanged."""
        return (not self.freed and tuple(map(id, tensors)) == self.ids
                and tuple(map(_VERSION, tensors)) == self.versions
                and tuple(map(_PTR, tensors)) == self.ptrs)

    def check(self, call: Call) -> None:
        """`WeightChanged` naming the first weight modified in place or given new storage."""
        if not self.freed:
            ts = [r() for r in self.refs]
            try:
                if (tuple(map(_VERSION, ts)) == self.versions
                        and tuple(map(_PTR, ts)) == self.ptrs):
                    return
            except (AttributeError, TypeError):   # freed meanwhile (another thread)
                pass
        for name, ref, version, ptr in zip(self.names, self.refs, self.versions, self.ptrs):
            t = ref()
            if t is not None and (t._version != version or t.data_ptr() != ptr):
                how = ("was modified in place" if t._version != version
                       else "was given new storage (p.data = ...)")
                raise WeightChanged(name, how, self.shared)

    def changes(self, tensors: Sequence[torch.Tensor]) -> Dict[int, str]:
        """Index -> how the tensor passed there differs from the frozen one (replaced,
        modified in place with both versions, new storage); for messages."""
        out = {}
        for k, t in enumerate(tensors):
            old = self.refs[k]()
            if old is None or t is not old:
                out[k] = "was replaced by another tensor object"
            elif t._version != self.versions[k]:
                out[k] = f"was modified in place (version {self.versions[k]} -> {t._version})"
            elif t.data_ptr() != self.ptrs[k]:
                out[k] = "has new storage (p.data = ...)"
        return out


class AutocastState(Guard):
    """The host ``torch.autocast`` state is the capture's (``recorded``: its dtype name,
    None when captured outside autocast): the graph holds the capture's casts
    (`opencann.runtime.autocast_state`)."""

    name = "autocast_state"

    def __init__(self, recorded: Optional[str]):
        self.recorded = recorded

    def check(self, call: Call) -> None:
        """ValueError naming both autocast states when the host's differs."""
        if self.recorded is None and not torch.is_autocast_enabled(autocast_state.HOST):
            return
        autocast_state.check(self.recorded)


class UnrecordedWrites(Guard):
    """No frozen weight was written in a way torch does not count in ``_version``
    (fused optimizer steps, BatchNorm statistics of a train-mode forward, writes through
    ``.data``, a parameter, buffer or submodule replaced): `opencann.runtime.weight_watch`
    (an optimizer post-hook, registration hooks and per-call value probes). ``watch``
    is the `WeightWatch`; ``shared`` as `FrozenWeights`; `changed` is the bare per-call
    test."""

    name = "unrecorded_writes"

    def __init__(self, watch: WeightWatch, shared: bool = False):
        self.watch, self.shared = watch, shared

    def changed(self) -> bool:
        """Whether a watched tensor was written since the snapshot."""
        return self.watch.changed()

    def check(self, call: Call) -> None:
        """`WeightChanged` naming the weight written without a version bump, and how."""
        watch = self.watch
        if not watch.changed():
            return
        i, how = next(iter(watch.changes().items()), (None, None))
        if i is not None:
            if how.startswith("was replaced"):
                raise WeightChanged(watch.names[i], how, self.shared)
            raise WeightChanged(watch.names[i], "was modified in place", self.shared,
                                how.replace("was modified in place ", "", 1))


class ModuleAttributes(Guard):
    """The module's plain Python attributes (``self.scale``, a flag, ``training``) are
    the compile's: torch.export baked their values in (`AttributeGuard`)."""

    name = "module_attributes"

    def __init__(self, attributes: AttributeGuard):
        self.attributes = attributes

    def check(self, call: Call) -> None:
        """ValueError naming the attribute, both values and the fix (`AttributeGuard.check`)."""
        self.attributes.check()


class InputTensors(Guard):
    """The call's graph inputs are dense cpu tensors of the compiled shapes and dtypes,
    as many as the graph's inputs, none requiring grad while grad mode is on (the model
    is inference-only). ``inputs``: the graph's input Values; ``label(i)`` names tensor
    input ``i``; ``shown(desc)`` shows a compiled description in errors (dynamic dims by
    their names); ``shape_fix`` (tensor input index -> the fix to name when its shape
    differs) replaces "recompile" for the inputs it names (a growing KV cache)."""

    name = "input_tensors"

    def __init__(self, inputs: Sequence[Any], label: Callable[[int], str],
                 shown: Callable[[Any], str], shape_fix: Optional[Dict[int, str]] = None):
        self.inputs, self.label, self.shown = list(inputs), label, shown
        self.shape_fix = dict(shape_fix or {})
        self.n = len(self.inputs)
        # per input: (static shape, or None when a dim is symbolic; compiled shape; dtype)
        self.fast = [(tuple(v.desc.shape) if all(isinstance(d, int) for d in v.desc.shape)
                      else None, tuple(v.desc.shape), v.desc.dtype.torch) for v in self.inputs]

    def check(self, call: Call) -> None:
        """ValueError naming the input and what differs (count, type, layout, grad,
        shape or dtype, device); a fast path first, the full check only when it fails."""
        ts = call.tensors
        if len(ts) == self.n:
            grad = torch.is_grad_enabled()
            for t, (static, shape, dtype) in zip(ts, self.fast):
                if not (isinstance(t, torch.Tensor) and t.dtype is dtype and t.is_cpu
                        and t.layout is _STRIDED and not t.is_nested
                        and not (grad and t.requires_grad)
                        and (t.shape == static if static is not None else fits(t.shape, shape))):
                    break
            else:
                return
        self._full(ts)

    def _full(self, tensors: Sequence[Any]) -> None:
        """Every check of every input in order; raises the first failure."""
        if len(tensors) != self.n:
            raise ValueError(f"expected {self.n} tensor inputs, got {len(tensors)}")
        for i, (t, v) in enumerate(zip(tensors, self.inputs)):
            name = self.label(i)
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
                fix = self.shape_fix.get(i) if what == "shape" else None
                raise ValueError(
                    f"{name} is {str(t.dtype).replace('torch.', '')}{list(t.shape)} "
                    f"but the model was compiled for {self.shown(v.desc)}; the {what} differs: "
                    + (fix or f"recompile with example inputs of this {what}"
                       + (" or cast the input" if what == "dtype" else "")))
            if t.device.type != "cpu":
                raise ValueError(f"{name} is on {t.device}; the compiled model "
                                 "runs on the host (cpu): move the input with .cpu()")


class InputOverlap(Guard):
    """No input the model writes into (``written``: tensor input indices) shares memory
    with another input of the call: the graph reads its inputs as separate tensors
    (`opencann.runtime.input_overlap`)."""

    name = "input_overlap"

    def __init__(self, written: Sequence[int], label: Callable[[int], str]):
        self.written, self.label = list(written), label

    def check(self, call: Call) -> None:
        """ValueError naming the written input and the input sharing its memory."""
        check_written_inputs(call.tensors, self.written, self.label)


class InputLayout(Guard):
    """The inputs whose memory layout the model reads (an ``as_strided``, or
    ``x.stride()``/``x.is_contiguous()``/``x.storage_offset()`` in its code: ``read``
    and ``offset_read``, tensor input indices) have the example's layout: strides
    (contiguous where the example was) and, for ``offset_read``, storage offset.
    ``contiguous``, ``strides``, ``offsets``: the examples' (per tensor input)."""

    name = "input_layout"

    def __init__(self, read: Sequence[int], offset_read: Sequence[int],
                 contiguous: Sequence[bool], strides: Sequence[Sequence[int]],
                 offsets: Sequence[int], label: Callable[[int], str]):
        self.read, self.offset_read = sorted(read), frozenset(offset_read)
        self.contig, self.label = list(contiguous), label
        self.strides = [tuple(st) for st in strides]
        self.offsets = list(offsets)

    def check(self, call: Call) -> None:
        """ValueError naming the input, its strides or offset, and the example's."""
        tensors = call.tensors
        for i in self.read:
            t = tensors[i]
            contig = self.contig[i] if i < len(self.contig) else False
            if contig and not t.is_contiguous():
                raise ValueError(
                    f"{self.label(i)} has strides {tuple(t.stride())} and the model "
                    "reads its memory layout (as_strided, or x.stride()/x.is_contiguous() in its "
                    "code): the graph, compiled on a contiguous "
                    "example, would read other elements than eager does. Compile with an example "
                    "of this layout, or pass .contiguous() if that layout's result is meant")
            st = self.strides[i] if i < len(self.strides) else None
            if st is not None and not contig and tuple(t.stride()) != st:
                raise ValueError(
                    f"{self.label(i)} has strides {tuple(t.stride())} (the "
                    f"example's: {st}) and the model reads its memory layout (as_strided, or "
                    "x.stride()/x.is_contiguous() in its code): "
                    "the graph would read other elements than eager does. Pass a tensor of the "
                    "example's layout, or compile with an example of this one")
            want = self.offsets[i] if i < len(self.offsets) else 0
            if i in self.offset_read and t.storage_offset() != want:
                raise ValueError(
                    f"{self.label(i)} starts at storage offset {t.storage_offset()} "
                    f"(the example's: {want}) and the model reads its memory layout (as_strided "
                    "with an absolute offset, or x.storage_offset() in its code: traced from the "
                    "example's): the graph "
                    "would read other elements than eager does. Pass x.clone(), or compile with "
                    "an example at this offset")


def model_guards(*, inputs: Sequence[Any], label: Callable[[int], str],
                 flat_label: Callable[[int], str], shown: Callable[[Any], str],
                 baked: Dict[int, Any], frozen: Sequence[Tuple[str, torch.Tensor]] = (),
                 module: Optional[torch.nn.Module] = None, autocast: Any = False,
                 written: Sequence[int] = (), layout_read: Sequence[int] = (),
                 offset_read: Sequence[int] = (), contiguous: Sequence[bool] = (),
                 strides: Sequence[Sequence[int]] = (), offsets: Sequence[int] = (),
                 shape_fix: Optional[Dict[int, str]] = None,
                 shared_weights: bool = False) -> List[Guard]:
    """The guards a compiled model needs, in the order they run per call:
    `BakedValues` (if any value is baked), `FrozenWeights` and `UnrecordedWrites` (if
    weights were frozen from a live module: ``frozen`` (name, tensor) pairs, ``module``
    their owner), `AutocastState` (unless ``autocast`` is False: an ONNX graph or a
    loaded one without a recorded state has none to check; None means captured outside
    autocast), `ModuleAttributes` (if ``module`` has plain public attributes),
    `InputTensors` (always), `InputOverlap` (if the model writes inputs ``written``),
    `InputLayout` (if an input's layout is read: ``layout_read``; ``offset_read`` among
    them have their storage offset checked too). ``inputs``: the graph's input Values;
    ``label(i)``/``flat_label(i)`` name tensor input / flat argument ``i``; ``shape_fix``
    as `InputTensors` takes it; ``shared_weights``: compiled with the option
    ``share_weights`` (the weight guards' messages say so)."""
    guards: List[Guard] = []
    if baked:
        guards.append(BakedValues(baked, flat_label))
    if frozen:
        guards.append(FrozenWeights(frozen, shared_weights))
    if autocast is not False:
        guards.append(AutocastState(autocast))
    if frozen:
        guards.append(UnrecordedWrites(WeightWatch([t for _, t in frozen],
                                                   [n for n, _ in frozen], module),
                                        shared_weights))
    if module is not None:
        attributes = AttributeGuard(module)
        if len(attributes):
            guards.append(ModuleAttributes(attributes))
    guards.append(InputTensors(inputs, label, shown, shape_fix))
    if written:
        guards.append(InputOverlap(written, label))
    if layout_read:
        guards.append(InputLayout(layout_read, offset_read, contiguous, strides, offsets, label))
    return guards


def same_value(a: Any, b: Any) -> bool:
    """Equality for baked non-tensor arguments (NaN equals NaN, 0.0 is not -0.0: the
    sign of a zero changes results such as ``1 / s``; never raises)."""
    import math
    if isinstance(a, float) and isinstance(b, float):
        return (a == b and math.copysign(1.0, a) == math.copysign(1.0, b)) or (a != a and b != b)
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - exotic objects: identity only
        return a is b


__all__ = ["AttributeChanged", "AutocastState", "BakedValues", "Call", "FrozenWeights", "Guard",
           "InputLayout", "InputOverlap", "InputTensors", "ModuleAttributes", "UnrecordedWrites",
           "model_guards", "same_value"]
