"""ONNX (opset 13+) → opencann IR.

Each ONNX node is mapped by one converter function of `CONVERTERS` (``nn.py``,
``tensor.py``) to IR nodes of the same ATen-backed ops the torch frontend produces
(Conv → Conv2D = ``aten.convolution``, Gemm → MatMulV2 = ``aten.addmm``, ...), so the
passes (Conv+BN folding, Conv+ReLU, Linear+activation) apply unchanged. Shapes are
static: output descriptions come from running the ATen op on meta tensors (with their
strides, as FX fake tensors would), and any node whose inputs are all known at
conversion (initializers, Shape/Constant/Range subgraphs) is evaluated right away into
a constant. A node with no converter (or a configuration its converter does not take)
becomes an ``OnnxHostFallback`` run by ONNX Runtime (``opencann.ops.onnx_fallback``),
reported like the torch frontend's ATen host fallbacks; its output shapes come from onnx
shape inference on the node alone with its exact input shapes and constants, the model's
declared ones, or else ONNX Runtime's shape inference of the node (com.microsoft ops).

Every output is checked against ``onnx.shape_inference`` (with data propagation) where
that gives a static shape; a disagreement is a ConversionError naming the node.
"""
from __future__ import annotations

from typing import Dict, List, Optional, Sequence

import numpy as np
import torch

from ...ir import DataType, Graph, TensorDesc, Value
from . import control, nn, qlinear, quant, resize, spatial, tensor  # noqa: F401  (register the converters)
from .converter import (ONNX_DTYPES, RANDOM_OPS, ConversionError, Converter, NotConverted, OnnxNode,
                        torch_dtype)
from .registry import CONVERTERS

__all__ = ["CONVERTERS", "ConversionError", "Converter", "NotConverted", "OnnxNode", "from_onnx",
           "convert_node", "torch_dtype"]



def _value_infos(model, onnx_mod) -> Dict[str, TensorDesc]:
    """Static output descriptions from onnx shape inference (data propagation on)."""
    try:
        inferred = onnx_mod.shape_inference.infer_shapes(model, check_type=False,
                                                         strict_mode=False, data_prop=True)
    except Exception:  # noqa: BLE001 - inference is a cross-check, not a requirement
        return {}
    out: Dict[str, TensorDesc] = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or t.elem_type not in ONNX_DTYPES \
                or not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if all(d is not None for d in dims):
            out[vi.name] = TensorDesc(tuple(dims), DataType.from_torch(ONNX_DTYPES[t.elem_type]))
    return out


def _input_shapes(model, input_shapes: Optional[Dict[str, Sequence[int]]]) -> Dict[str, tuple]:
    inits = {t.name for t in model.graph.initializer}
    shapes: Dict[str, tuple] = {}
    given = dict(input_shapes or {})
    names = [i.name for i in model.graph.input if i.name not in inits]
    unknown = set(given) - set(names)
    if unknown:
        raise ConversionError(f"input_shapes names {sorted(unknown)}, which are not inputs of the "
                              f"model; its inputs are {names}", kind="bad_argument")
    for vi in model.graph.input:
        if vi.name in inits:
            continue
        if not vi.type.HasField("tensor_type"):
            raise ConversionError(f"input {vi.name} is not a tensor (sequence, map or optional "
                                  "inputs are not supported)", kind="object_input")
        dims = [d.dim_value if d.HasField("dim_value") else (d.dim_param or "?")
                for d in vi.type.tensor_type.shape.dim]
        if vi.name in given:
            shp = tuple(int(s) for s in given[vi.name])
            if len(shp) != len(dims) or any(isinstance(d, int) and d != s for d, s in zip(dims, shp)):
                raise ConversionError(f"input_shapes[{vi.name!r}] = {shp} does not match the "
                                      f"model's declared shape {tuple(dims)}", kind="bad_argument")
            shapes[vi.name] = shp
        elif all(isinstance(d, int) for d in dims):
            shapes[vi.name] = tuple(dims)
        else:
            example = tuple(d if isinstance(d, int) else 1 for d in dims)
            raise ConversionError(f"input {vi.name} has symbolic dims {tuple(dims)}; opencann "
                                  f"compiles static shapes: pass input_shapes={{{vi.name!r}: "
                                  f"{example}}} (your sizes; opencann atc: --input_shape "
                                  f"\"{vi.name}:{','.join(map(str, example))}\")",
                                  kind="dynamic_shape")
    return shapes


def from_onnx(model, input_shapes: Optional[Dict[str, Sequence[int]]] = None,
              check: bool = True) -> Graph:
    """Convert a loaded, checked ``onnx.ModelProto`` (see ``load_model``) into an IR Graph.

    Graph inputs are the model's inputs that are not initializers, in order, with the
    declared static shapes or ``input_shapes`` (name -> sizes) for symbolic dims;
    initializers become constants. Raises ConversionError naming the node for: a
    symbolic input without ``input_shapes``, an unsupported element type, control flow
    (If/Loop/Scan on run-time values), random ops, a data-dependent output shape, and
    (``check``) a disagreement with ``onnx.shape_inference``."""
    import onnx
    from onnx import numpy_helper

    from .dynamic_quant import fold_dynamic_matmuls
    model, dynamic_int8 = fold_dynamic_matmuls(model)
    shapes = _input_shapes(model, input_shapes)
    fixed = onnx.ModelProto()
    fixed.CopyFrom(model)
    for vi in fixed.graph.input:
        if vi.name in shapes:
            dims = vi.type.tensor_type.shape.dim
            for d, s in zip(dims, shapes[vi.name]):
                d.Clear()
                d.dim_value = s
    # an exporter's value_info / output shapes hold its symbolic dims ("batch"), which would
    # keep inference from giving the now-static shapes: those dims are inferred afresh
    for vi in list(fixed.graph.value_info) + list(fixed.graph.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.HasField("shape"):
            for d in vi.type.tensor_type.shape.dim:
                if not d.HasField("dim_value"):
                    d.Clear()
    infos = _value_infos(fixed, onnx)
    opsets = {o.domain if o.domain != "ai.onnx" else "": o.version for o in model.opset_import}
    graph = Graph(model.graph.name or "onnx_model")
    graph.meta["frontend"] = "onnx"
    if dynamic_int8:   # quantize_dynamic's MatMuls (dynamic_quant.py): quantize_int8 runs them int8
        graph.meta["int8_dynamic_weights"] = dynamic_int8
    cv = Converter(graph, opsets, convert_node)
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t)
        dt = torch_dtype(t.data_type, f"initializer {t.name}")
        cv.env[t.name] = cv.const(torch.from_numpy(np.array(arr)).to(dt), name=t.name)
    for vi in model.graph.input:
        if vi.name in shapes:
            dt = torch_dtype(vi.type.tensor_type.elem_type, f"input {vi.name}")
            cv.env[vi.name] = graph.add_input(TensorDesc(shapes[vi.name], DataType.from_torch(dt)),
                                              name=vi.name)
    for proto in model.graph.node:
        convert_node(cv, proto, infos, check)
    _set_outputs(cv, model)
    return graph


def convert_node(cv: Converter, proto, infos: Dict[str, TensorDesc], check: bool) -> None:
    """Convert one ONNX node into ``cv.graph``; binds its outputs in ``cv.env``."""
    n = OnnxNode(cv, proto)
    cv.node = n
    for x in n.inputs:
        if x and x not in cv.env:
            raise ConversionError(f"ONNX node {cv.where()}: input {x!r} is produced by no earlier "
                                  "node (the graph is not topologically sorted or is truncated)",
                                  kind="malformed_model")
    if n.op_type in ("If", "Loop", "Scan", "SequenceMap") and not all(
            n.x(i) is None or n.x(i).is_const for i in range(len(n.inputs))):
        raise ConversionError(f"ONNX node {cv.where()}: control flow ({n.op_type}) on run-time "
                              "values is not supported; opencann compiles static graphs",
                              kind="control_flow")
    if n.op_type in RANDOM_OPS:
        raise ConversionError(f"ONNX node {cv.where()}: random op {n.op_type} is not supported "
                              "(it would draw from numpy's RNG on the host)", kind="random_op")
    fn = CONVERTERS.get(n.op_type) if proto.domain in ("", "ai.onnx") else None
    outs: Optional[List[Value]] = None
    reason = "no converter" if fn is None else ""
    if fn is not None:
        try:
            outs = fn(cv, n)
        except NotConverted as e:
            reason = str(e)
    if outs is None:
        outs = cv.fallback(n, reason, [infos.get(y) for y in n.outputs if y])
    present = [y for y in n.outputs if y]
    for k, y in enumerate(n.outputs):
        if not y:
            continue
        if k >= len(outs) or outs[k] is None:
            raise ConversionError(f"ONNX node {cv.where()}: output {k} ({y}) is not produced by "
                                  "its converter", kind="internal")
        cv.env[y] = outs[k]
        want = infos.get(y)
        got = outs[k].desc
        if check and want is not None and (tuple(want.shape) != tuple(got.shape)
                                           or want.dtype != got.dtype):
            raise ConversionError(f"shape inference disagrees for ONNX node {cv.where()} output "
                                  f"{y}: opencann {got}, onnx.shape_inference {want}",
                                  kind="internal")
    del present
    cv.node = None


def _set_outputs(cv: Converter, model) -> None:
    """Graph outputs in the model's order. An output that is a graph input, or that
    appears twice, is copied so every result is its own tensor. Every ONNX graph output
    is a distinct tensor (ONNX Runtime returns fresh arrays, initializers and inputs
    included): ``output_storage`` records each as its own storage, so the runtime copies
    outputs that passes later merge (CSE of ``Relu(x), Relu(x)``) or that view an input
    or a constant (`output_copies`)."""
    import torch as _t
    outs: List[Value] = []
    graph_inputs = {id(v) for v in cv.graph.inputs}
    for o in model.graph.output:
        v = cv.env[o.name]
        if id(v) in graph_inputs or any(v is u for u in outs):
            cv.node = None
            v = cv.call(_t.ops.aten.clone.default, v)
            if v.is_const:
                v = cv.const(v.const.clone())
        outs.append(v)
    cv.graph.outputs = outs
    cv.graph.signature = cv.graph.signature.replace(
        output_storage=tuple(frozenset((v.id,)) for v in outs),
        output_names=tuple(o.name for o in model.graph.output),
        input_names=tuple(v.name for v in cv.graph.inputs))
