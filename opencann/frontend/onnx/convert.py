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
shape inference on the node alone with its exact input shapes and constants.

Every output is checked against ``onnx.shape_inference`` (with data propagation) where
that gives a static shape; a disagreement is a ConversionError naming the node.
"""
from __future__ import annotations

import re
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

from .. import errors
from ...ir import DataType, Graph, Node, TensorDesc, TensorRef, Value
from ...ops import lookup_aten
from ...ops.onnx_fallback import encode_node, infer_outputs, make_onnx_kernel
from ..torch.convert import LOW_PRECISION, META_DIVERGES

# onnx TensorProto element type -> torch dtype (types the IR models)
ONNX_DTYPES = {1: torch.float32, 2: torch.uint8, 3: torch.int8, 5: torch.int16,
               6: torch.int32, 7: torch.int64, 9: torch.bool, 10: torch.float16,
               11: torch.float64, 14: torch.complex64, 16: torch.bfloat16}
# random ONNX ops draw from numpy's RNG in the reference evaluator: not compiled
RANDOM_OPS = {"RandomNormal", "RandomNormalLike", "RandomUniform", "RandomUniformLike",
              "Bernoulli", "Multinomial"}


class ConversionError(errors.ConversionError):
    """The ONNX graph could not be converted; the message names the node, ``kind`` the
    obstacle (`opencann.frontend.errors.KINDS`)."""


class NotConverted(Exception):
    """Raised by a converter for a configuration it does not map; the node then runs
    as an ``OnnxHostFallback`` and the reason is kept on it."""


def torch_dtype(elem: int, where: str) -> torch.dtype:
    """The torch dtype of an onnx element type; ConversionError when the IR lacks it."""
    if elem not in ONNX_DTYPES:
        import onnx
        name = onnx.TensorProto.DataType.Name(elem) if elem else "undefined"
        raise ConversionError(f"{where}: element type {name} is not supported (opencann models "
                              "float32/16, bfloat16, float64, int8/16/32/64, uint8, bool); "
                              "cast it in the model", kind="unsupported_dtype")
    return ONNX_DTYPES[elem]


class OnnxNode:
    """One ONNX node as converters see it: input Values, constants and attributes."""

    def __init__(self, cv: "Converter", proto):
        from onnx import helper
        self.cv, self.proto = cv, proto
        self.op_type, self.name = proto.op_type, proto.name or proto.output[0]
        self.inputs: List[str] = list(proto.input)
        self.outputs: List[str] = list(proto.output)
        self.attrs: Dict[str, Any] = {}
        for a in proto.attribute:
            v = helper.get_attribute_value(a)
            self.attrs[a.name] = v.decode() if isinstance(v, bytes) else v

    def attr(self, name: str, default: Any = None) -> Any:
        """The attribute ``name`` (int, float, str, lists, TensorProto; bytes decoded to str), or
        ``default`` when absent."""
        return self.attrs.get(name, default)

    def has(self, i: int) -> bool:
        """Whether input ``i`` is given (ONNX marks an omitted optional input with an empty name)."""
        return i < len(self.inputs) and self.inputs[i] != ""

    def x(self, i: int) -> Optional[Value]:
        """Input ``i`` as a Value (None when absent)."""
        return self.cv.env[self.inputs[i]] if self.has(i) else None

    def c(self, i: int) -> Optional[torch.Tensor]:
        """Input ``i``'s value when known at conversion time, else None."""
        v = self.x(i)
        return v.const if v is not None and v.is_const else None

    def ints(self, i: int, default=None) -> Optional[List[int]]:
        """Input ``i`` as a list of ints (axes, shapes, pads); NotConverted when it is
        computed at run time (a data-dependent shape)."""
        if not self.has(i):
            return default
        c = self.c(i)
        if c is None:
            raise NotConverted(f"input {self.inputs[i]} is computed at run time")
        return [int(a) for a in c.reshape(-1).tolist()]


def _lift_args(schema, args, kwargs) -> Tuple[List[Value], Dict[str, Any]]:
    """(inputs, attrs) of an ATen call: each Value argument becomes an input and a
    `TensorRef` to it in the attrs, keyed by the schema's argument names."""
    inputs: List[Value] = []
    attrs: Dict[str, Any] = {}

    def lift(a):
        if isinstance(a, Value):
            inputs.append(a)
            return TensorRef(len(inputs) - 1)
        if isinstance(a, (list, tuple)):
            return [lift(y) for y in a]
        return a

    for i, a in enumerate(schema.arguments):
        if i < len(args) and not a.kwarg_only:
            attrs[a.name] = lift(args[i])
        elif a.name in kwargs:
            attrs[a.name] = lift(kwargs[a.name])
    return inputs, attrs


def _sub(a, fn):
    """``a`` with every Value (also inside lists) replaced by ``fn(value)``."""
    if isinstance(a, Value):
        return fn(a)
    if isinstance(a, (list, tuple)):
        return [_sub(y, fn) for y in a]
    return a


def _meta_diverges(ir: Node) -> None:
    """Outputs where the meta kernel and the CPU kernel disagree (`META_DIVERGES`):
    inference BatchNorm's saved statistics are empty on CPU ([C] on meta); bf16/fp16
    inputs let the op allocate its own outputs (``no_out_kernel``)."""
    if ir.op not in META_DIVERGES:
        return
    for k in META_DIVERGES[ir.op]:
        if ir.op == "BatchNorm" and k < len(ir.outputs):
            ir.outputs[k].desc = TensorDesc((0,), ir.outputs[k].desc.dtype)
    if ir.inputs[0].desc.dtype in LOW_PRECISION:
        ir.meta["no_out_kernel"] = True


def _by_position(n: "OnnxNode", present: List[Value]) -> List[Optional[Value]]:
    """The values of a node's present outputs placed at their ONNX output positions (None
    where an optional output is omitted, e.g. LSTM's ``Y`` when only ``Y_h`` is used)."""
    it = iter(present)
    return [next(it) if y else None for y in n.outputs]


class Converter:
    """Builds the IR graph; `call` maps one ATen call to one IR node (or a constant)."""

    def __init__(self, graph: Graph, opsets: Dict[str, int]):
        self.graph = graph
        self.opsets = opsets
        self.opset = opsets.get("", 0)
        self.env: Dict[str, Value] = {}
        self.metas: Dict[int, torch.Tensor] = {}
        self.node: Optional[OnnxNode] = None

    # -- values -----------------------------------------------------------------------
    def meta(self, v: Value) -> torch.Tensor:
        """A meta tensor (shape, dtype and, for constants and ATen results, strides; no data)
        standing for ``v``, for shape inference through ATen's meta kernels; cached per value."""
        m = self.metas.get(v.id)
        if m is None:
            if v.is_const:
                m = torch.empty_strided(v.const.shape, v.const.stride(), dtype=v.const.dtype,
                                        device="meta")
            else:
                m = torch.empty(v.desc.shape, dtype=v.desc.dtype.torch, device="meta")
            self.metas[v.id] = m
        return m

    def const(self, t: torch.Tensor, name: Optional[str] = None) -> Value:
        """``t`` as a graph constant (contiguous), named ``name`` when given; returns its Value."""
        t = t.detach()
        if not t.is_contiguous():
            t = t.contiguous()
        return self.graph.add_const(t, name=name)

    def scalar(self, value, dtype: torch.dtype) -> Value:
        """A 0-d constant of ``value`` with ``dtype``."""
        return self.const(torch.tensor(value, dtype=dtype))

    # -- one ATen call ----------------------------------------------------------------
    def call(self, target: torch._ops.OpOverload, *args, **kwargs):
        """Append the IR node running ``target(*args, **kwargs)`` (Values for tensors);
        returns its output Value, or a list for multi-output ops. All-constant calls
        are evaluated now and return constants."""
        schema = target._schema
        inputs, attrs = _lift_args(schema, args, kwargs)
        multi = len(schema.returns) > 1 or isinstance(schema.returns[0].type, torch.ListType)
        if all(v.is_const for v in inputs):
            with torch.no_grad():
                res = target(*[_sub(a, lambda v: v.const) for a in args],
                             **{k: _sub(a, lambda v: v.const) for k, a in kwargs.items()})
            outs = [self.const(r) for r in (res if multi else [res])]
            return outs if multi else outs[0]
        margs = [_sub(a, self.meta) for a in args]
        mkw = {k: _sub(a, self.meta) for k, a in kwargs.items()}
        if "device" in mkw:
            mkw["device"] = "meta"
        try:
            res = target(*margs, **mkw)
        except Exception as e:  # noqa: BLE001 - re-raised with the node's name
            raise ConversionError(f"ONNX node {self.where()}: {target} rejects its arguments: "
                                  f"{str(e).splitlines()[0]}", kind="unsupported_op") from None
        mouts = list(res) if multi else [res]
        descs = [TensorDesc(tuple(int(s) for s in m.shape), DataType.from_torch(m.dtype))
                 for m in mouts]
        opdef = lookup_aten(target)
        ir = self.graph.create_node(opdef.name if opdef else "HostFallback", inputs, attrs, descs,
                                    name=self.node.name if self.node else None,
                                    source=self.source(), scope=self.scope())
        if opdef is None:
            ir.meta["aten"] = target
        _meta_diverges(ir)
        ir.meta["strides"] = [tuple(int(s) for s in m.stride()) if tuple(m.shape) == o.desc.shape
                              else None for m, o in zip(mouts, ir.outputs)]
        for o, m in zip(ir.outputs, mouts):
            self.metas[o.id] = m
        return list(ir.outputs) if multi else ir.outputs[0]

    # -- host fallback ----------------------------------------------------------------
    def fallback(self, n: OnnxNode, reason: str, descs: Sequence[Optional[TensorDesc]]) -> List[Value]:
        """The node as an OnnxHostFallback run by ONNX Runtime (or evaluated now when its
        inputs are all known). ``descs``: the whole model's shape inference of its outputs;
        the node's own inference on its exact input shapes and constants is preferred."""
        ins = [n.x(i) for i in range(len(n.inputs)) if n.has(i)]
        opsets = tuple(sorted(self.opsets.items()))
        raw = encode_node(n.proto.SerializeToString())
        n_out = len([y for y in n.outputs if y])
        own = infer_outputs(raw, opsets, [v.desc for v in ins],
                            [v.const if v.is_const else None for v in ins])
        descs = [TensorDesc(o[0], DataType.from_torch(o[1])) if o is not None else
                 (descs[k] if k < len(descs) else None) for k, o in enumerate(own[:n_out])]
        run, engine = self._host_kernel(n, reason, raw, opsets, [v.desc.dtype.torch for v in ins],
                                        n_out, descs, [tuple(v.desc.shape) for v in ins])
        if all(v.is_const for v in ins) and n.op_type not in RANDOM_OPS:
            return _by_position(n, [self.const(t) for t in run(*[v.const for v in ins])])
        if any(d is None for d in descs[:n_out]):
            raise ConversionError(
                f"ONNX node {self.where()} ({n.op_type}) has no converter ({reason}) and its "
                "output shape depends on the data (onnx shape inference gives no static shape); "
                "opencann compiles static graphs", kind="data_dependent")
        attrs = {"op_type": n.op_type, "domain": n.proto.domain, "onnx_node": raw,
                 "opsets": opsets, "engine": engine, "reason": reason}
        ir = self.graph.create_node("OnnxHostFallback", ins, attrs, list(descs[:n_out]),
                                    name=n.name, source=self.source(), scope=self.scope())
        return _by_position(n, list(ir.outputs))

    def _host_kernel(self, n: OnnxNode, reason: str, raw: str, opsets, dtypes, n_out: int, descs,
                     shapes=None):
        """(run, engine) of ``n``'s host kernel (built now, so an op neither ONNX Runtime nor
        onnx's reference evaluator can run is a ConversionError at compile time naming the
        op, its opset and the fix)."""
        try:
            return make_onnx_kernel(raw, opsets, dtypes, n_out, descs, in_shapes=shapes)
        except Exception as e:  # noqa: BLE001 - onnxruntime / onnx.reference errors
            msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            domain = n.proto.domain or "ai.onnx"
            version = self.opsets.get(n.proto.domain if n.proto.domain != "ai.onnx" else "", 0)
            found = re.search(r"found ([\d, ]+)", msg)
            have = sorted(int(v) for v in re.findall(r"\d+", found.group(1))) if found else []
            newer = [v for v in have if v > version]
            ours = ("has no opencann converter" if reason in ("", "no converter")
                    else f"is not converted by opencann ({reason})")
            if newer:
                tail = (f"onnx's reference evaluator runs it only at opsets "
                        f"{', '.join(map(str, have))}: convert the model first with "
                        f"onnx.version_converter.convert_version(model, {newer[0]})")
            else:
                tail = (f"neither ONNX Runtime nor onnx's reference evaluator can run it ({msg}): "
                        "it is not supported yet")
            raise ConversionError(f"ONNX node {self.where()}: {n.op_type} ({domain} opset {version}) "
                                  f"{ours}, and {tail}", kind="unsupported_op") from None

    # -- locations ----------------------------------------------------------------------
    def where(self) -> str:
        """The node being converted, for messages: ``'name (OpType)'`` ('?' outside a node)."""
        n = self.node
        return f"{n.name} ({n.op_type})" if n else "?"

    def source(self) -> str:
        """The source recorded on IR nodes: ``'onnx:<OpType>'`` of the node being converted (''
        outside a node)."""
        return f"onnx:{self.node.op_type}" if self.node else ""

    def scope(self) -> str:
        """The scope recorded on IR nodes: the ONNX node's name ('' outside a node)."""
        return self.node.name if self.node else ""


Convert = Callable[[Converter, OnnxNode], List[Value]]
CONVERTERS: Dict[str, Convert] = {}


def converts(*op_types: str):
    """Decorator registering a converter for ONNX ``op_types`` (default domain)."""
    def deco(fn: Convert) -> Convert:
        for t in op_types:
            CONVERTERS[t] = fn
        return fn
    return deco


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
                                  f"{example}}} (your sizes)", kind="dynamic_shape")
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
    cv = Converter(graph, opsets)
    for t in model.graph.initializer:
        arr = numpy_helper.to_array(t)
        dt = torch_dtype(t.data_type, f"initializer {t.name}")
        cv.env[t.name] = cv.const(torch.from_numpy(np.array(arr)).to(dt), name=t.name)
    for vi in model.graph.input:
        if vi.name in shapes:
            dt = torch_dtype(vi.type.tensor_type.elem_type, f"input {vi.name}")
            cv.env[vi.name] = graph.add_input(TensorDesc(shapes[vi.name], DataType.from_torch(dt)),
                                              name=vi.name)
    from . import control, nn, quant, resize, spatial, tensor  # noqa: F401  (register the converters)
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
    cv.graph.meta["output_storage"] = [frozenset((v.id,)) for v in outs]
    cv.graph.meta["output_names"] = [o.name for o in model.graph.output]
    cv.graph.meta["input_names"] = [v.name for v in cv.graph.inputs]
