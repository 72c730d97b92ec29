"""Capture entry points: `compile_module` (``opencann.compile`` of an ``nn.Module`` through
torch.export) and `compile_onnx` (an ONNX model), each ending in a `CompiledModel`."""
from __future__ import annotations

import threading
import time
from typing import Any, Dict, Optional, Sequence

import torch
import torch.utils._pytree as pytree

from ..frontend.torch import capture, from_exported_program
from ..ir import Graph
from ..report import CompileReport, PassRecord
from ..runtime import autocast_state
from ..runtime.call_binding import forward_arg_names
from .compiled_model import CompiledModel, OnnxCompiledModel, example_convention
from .options import check_options, option
from .pipeline import _bind_pipeline, _check_device, run_pipeline
from .shapes import StaticShapes

# opencann.compile runs one at a time: torch.export is not thread-safe (concurrent exports
# corrupt its mode stack and leave builtins patched), and compiling is CPU-bound anyway
_COMPILE_LOCK = threading.RLock()


def convert_exported(model: torch.nn.Module, ep, capture_seconds: Dict[str, float],
                     device: str, note: str) -> "tuple[Graph, CompileReport, list, list]":
    """The construct stage after capture: ``ep`` (``model``'s ExportedProgram) as an IR
    graph, a `CompileReport` for ``device`` that records the capture times and the
    ``convert_and_infer`` stage (with ``note``), ``model``'s (name, tensor) parameters and
    buffers (checked for in-place changes at call time), and the live tensors the compiled
    model must not share memory with (those, ``ep``'s state dict and lifted constants; see
    `snapshot_constants`). Raises what
    `from_exported_program` raises (an op it cannot convert, named with its source)."""
    t0 = time.perf_counter()
    graph = from_exported_program(ep, name=type(model).__name__)
    report = CompileReport(model=type(model).__name__, device=str(device),
                           capture_seconds=capture_seconds)
    report.passes.append(PassRecord("convert_and_infer", "construct", 0, len(graph.nodes),
                                    time.perf_counter() - t0, len(graph.nodes), note=note))
    # checked per call; kept in model files
    graph.signature = graph.signature.replace(autocast=autocast_state.current())
    if graph.signature.autocast is not None:
        report.notes.append(f"captured inside autocast(cpu, {graph.signature.autocast}): the graph "
                            "holds its casts, and calls must be made inside the same autocast")
    frozen = list(model.named_parameters()) + list(model.named_buffers())
    live = [t for _, t in frozen] + list(ep.state_dict.values()) + list(ep.constants.values())
    return graph, report, frozen, live


def compile_module(model: torch.nn.Module, example_inputs, device: str = "cpu",
                   options: Optional[Dict[str, Any]] = None, example_kwargs=None) -> CompiledModel:
    """Capture ``model`` with torch.export on ``example_inputs`` (a tensor or tuple) and
    compile it for ``device``. Raises CaptureError (capture), ValueError (bad options,
    device or dtype) with what to change. Thread-safe: concurrent calls run one at a
    time (torch.export is not thread-safe)."""
    with _COMPILE_LOCK:
        return _compile_module(model, example_inputs, device, options, example_kwargs)


def _refuse_growing_caches(args, kwargs) -> None:
    """Raises ValueError (one line) for a transformers cache among the inputs that grows
    by Python attribute writes (``is_compileable`` False: DynamicCache). Eager grows the
    caller's object in place; a compiled graph can only return a grown copy, so a caller
    reusing its object would get a stale cache's logits with no error."""
    seen = list(args) + list((kwargs or {}).values())
    for i, o in enumerate(seen):
        t = type(o)
        if (t.__module__.startswith("transformers.") and "Cache" in t.__name__
                and getattr(o, "is_compileable", True) is False):
            where = f"input {i}" if i < len(args) else f"input {list(kwargs)[i - len(args)]!r}"
            raise ValueError(f"{where} is a transformers {t.__name__}, which grows by Python "
                             f"attribute writes a compiled graph cannot make on your object "
                             f"(later calls would read a stale cache); use opencann.llm.compile "
                             f"(a preallocated KV cache written in place) or a static cache "
                             f"(transformers StaticCache, generate(..., "
                             f"cache_implementation='static'))")


def _compile_module(model, example_inputs, device, options, example_kwargs) -> CompiledModel:
    device = _check_device(device)
    options = check_options(options)
    if isinstance(example_inputs, list):
        raise ValueError("example_inputs must be a tensor or a tuple of the model's positional "
                         "inputs, got a list: pass tuple(example_inputs), or (my_list,) when "
                         "the model takes one list argument")
    args = example_inputs if isinstance(example_inputs, tuple) else (example_inputs,)
    _refuse_growing_caches(args, example_kwargs)
    ep, times = capture(model, args, example_kwargs)
    graph, report, frozen, live = convert_exported(model, ep, times, device,
                                           "FX → IR, shape/dtype inference checked against FX")
    ctx = run_pipeline(graph, device, options, report, _bind_pipeline(),
                       artifacts={"live_tensors": live})
    flat, in_spec = pytree.tree_flatten((args, example_kwargs or {}))
    arg_names = forward_arg_names(model)
    from torch.export.graph_signature import InputKind
    user = [s for s in ep.graph_signature.input_specs if s.kind == InputKind.USER_INPUT]
    positions = [i for i, s in enumerate(user) if isinstance(flat[i], torch.Tensor)]
    shapes = StaticShapes(graph, ctx.artifacts["memory_plan"], report,
                          option(options, "concurrent_calls"),
                          option(options, "check_aliasing"), executor=ctx.artifacts["executor"])
    return CompiledModel(graph, report, shapes, in_spec=in_spec, out_spec=ep.call_spec.out_spec,
                         input_positions=positions, frozen=frozen, module=model,
                         arg_names=arg_names, shared_weights=bool(option(options, "share_weights")),
                         **example_convention(flat))



def compile_onnx(model, device: str = "cpu", options: Optional[Dict[str, Any]] = None,
                 input_shapes: Optional[Dict[str, Sequence[int]]] = None) -> CompiledModel:
    """Compile an ONNX model (a ``.onnx`` path or ``onnx.ModelProto``, opset >= 13) for
    ``device``. ``input_shapes``: sizes for inputs with symbolic dims. Raises
    OnnxLoadError (bad file, old opset) or ConversionError (unsupported graph), both
    ValueError, with the fix."""
    from ..frontend.onnx import from_onnx, load_model
    device, options = _check_device(device), check_options(options)
    t0 = time.perf_counter()
    proto = load_model(model)
    graph = from_onnx(proto, input_shapes)
    report = CompileReport(model=graph.name, device=str(device))
    report.passes.append(PassRecord("convert_and_infer", "construct", 0, len(graph.nodes),
                                    time.perf_counter() - t0, len(graph.nodes),
                                    note="ONNX → IR, shapes checked against onnx.shape_inference"))
    ctx = run_pipeline(graph, device, options, report, _bind_pipeline())
    shapes = StaticShapes(graph, ctx.artifacts["memory_plan"], report,
                          check_aliasing=option(options, "check_aliasing"),
                          executor=ctx.artifacts["executor"])
    return OnnxCompiledModel(graph, report, shapes)
