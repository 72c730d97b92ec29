"""Capture once, compile whole per concrete shape: `SymbolicCapture`.

A family of static graphs that differ only in one size (opencann.llm's prefill graph per
prompt bucket) is exported ONCE with torch.export's dynamic dims and converted to an IR
whose shapes carry symbols; each concrete shape is then `specialise`d from that IR and
compiled whole - every pass at its concrete sizes, layout, memory plan and kernel
binding, as ATC compiles each gear of ``--dynamic_dims`` - into a static `CompiledModel`,
the graph `compile_module` would build from a capture at that shape, without running
torch.export and its decomposition again. Measured on the 2-core EPYC host for
SmolLM2-135M's 30-layer prefill graph, one process: the dynamic capture 30-34 s (export
9-10 s, decomposition 20-25 s: symbolic shapes cost), a static capture at one length
14-17 s, then 0.6-1 s per shape (`compile_shape`) where each static graph pays its
capture: worth it from the second shape on. Unlike `compile_dynamic` (one symbolic
graph, passes run once with guards, plans per shape) nothing here is decided on
symbols: a pass that needs a concrete size gets it.
"""
from __future__ import annotations

import copy
from typing import Any, Dict, Mapping, Optional, Tuple

import torch
import torch.utils._pytree as pytree

from ..devices import parse_device
from ..frontend.torch.dynamic import dynamic_dims
from ..ir.symbolic import fits
from ..runtime.call_binding import forward_arg_names
from .compiled_model import CompiledModel, example_convention
from .dynamic import ShapeBinder, _capture, compile_shape
from .entry import _COMPILE_LOCK, convert_exported
from .options import check_options, option
from .shapes import StaticShapes


class SymbolicCapture:
    """``model`` captured once on ``example_inputs`` (a tuple of its positional inputs)
    with the dynamic dims ``dynamic_shapes`` (opencann's spec: ``{"input_ids": {1:
    "tokens"}}``, see `opencann.frontend.torch.dynamic`) in ``dim_ranges`` (name ->
    (min, max)), for ``device``. `compile` turns it into a static `CompiledModel` per
    concrete shape. ``capture_seconds``: the export and decomposition times, paid once.

    Raises CaptureError when torch.export cannot trace the model with these dims (the
    caller may capture each shape statically instead), ValueError for a bad spec."""

    def __init__(self, model: torch.nn.Module, example_inputs: Tuple[Any, ...],
                 dynamic_shapes: Any, dim_ranges: Optional[Mapping[str, Tuple[int, int]]] = None,
                 device: str = "cpu"):
        self.model, self.device = model, parse_device(device)
        with _COMPILE_LOCK:
            ep, times, labels, _ = _capture(model, example_inputs, None, dynamic_shapes, dim_ranges)
            self.graph, self.report, self.frozen, self.live = convert_exported(
                model, ep, times, self.device, "FX → IR with symbolic dims, specialised per shape")
        self.capture_seconds = dict(times)
        self.binder = ShapeBinder(self.graph, dynamic_dims(ep, labels),
                                  self.graph.signature.shape_guards,
                                  [v.name for v in self.graph.inputs])
        self.out_spec = ep.call_spec.out_spec
        from torch.export.graph_signature import InputKind
        self.n_user = sum(s.kind == InputKind.USER_INPUT for s in ep.graph_signature.input_specs)

    def values(self, inputs: Tuple[Any, ...]) -> Dict[str, int]:
        """Symbol -> size for ``inputs``; ValueError (one line) for inputs that are not
        the capture's (another count, a static dim or dtype other than captured: the
        specialised graph would be compiled for the captured sizes, not these), a size
        outside its range or against the model's shape conditions (`ShapeBinder.bind`)."""
        flat = pytree.tree_flatten((inputs, {}))[0]
        tensors = [t for t in flat if isinstance(t, torch.Tensor)]
        if len(tensors) != len(self.graph.inputs):
            raise ValueError(f"the capture takes {len(self.graph.inputs)} tensor inputs "
                             f"(as captured), got {len(tensors)}")
        for t, v in zip(tensors, self.graph.inputs):
            if not fits(t.shape, v.desc.shape) or t.dtype != v.desc.dtype.torch:
                raise ValueError(
                    f"input {v.name!r} is {str(t.dtype).replace('torch.', '')}{list(t.shape)} "
                    f"but was captured as {str(v.desc.dtype.torch).replace('torch.', '')}"
                    f"{[self.binder.readable(d) if isinstance(d, str) else d for d in v.desc.shape]}"
                    f": only the dynamic dims "
                    f"({', '.join(map(self.binder.readable, self.binder.order))}) may differ; "
                    f"capture again for other static sizes or dtypes")
        return dict(zip(self.binder.order, self.binder.bind(tensors)))

    def compile(self, inputs: Tuple[Any, ...], options: Optional[Dict[str, Any]] = None
                ) -> CompiledModel:
        """The static `CompiledModel` for the shapes of ``inputs`` (the model's positional
        inputs, as `compile_module` takes them): the captured IR specialised to their
        sizes and compiled whole with ``options`` (`compile_shape`). Its report holds the
        capture times once measured and notes that the capture was shared. Raises
        ValueError for sizes outside the declared ranges or bad options."""
        options = check_options(options)
        values = self.values(inputs)
        flat, in_spec = pytree.tree_flatten((inputs, {}))
        report = copy.deepcopy(self.report)
        report.notes.append("captured once with dynamic dims and specialised to " + ", ".join(
            f"{self.binder.readable(s)}={v}" for s, v in values.items()))
        with _COMPILE_LOCK:
            g, plan, executor = compile_shape(self.graph, values, str(self.device), options,
                                              report, self.live)
        # the concrete graph carries no condition on symbols it no longer has
        g.signature = g.signature.replace(shape_guards=())
        shapes = StaticShapes(g, plan, report, option(options, "concurrent_calls"),
                              option(options, "check_aliasing"), executor=executor)
        positions = [i for i in range(self.n_user) if isinstance(flat[i], torch.Tensor)]
        return CompiledModel(g, report, shapes, in_spec=in_spec, out_spec=self.out_spec,
                             input_positions=positions, frozen=self.frozen, module=self.model,
                             arg_names=forward_arg_names(self.model),
                             shared_weights=bool(option(options, "share_weights")),
                             **example_convention(flat))


__all__ = ["SymbolicCapture"]
