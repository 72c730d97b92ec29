"""The state of one ONNX → IR conversion, as converters see it: `Converter` (the graph being
built, the ONNX-name → Value environment, `Converter.call` mapping one ATen call to one IR
node with its output descriptions from ATen's meta kernels), `OnnxNode` (one ONNX node's
inputs, constants and attributes), the element-type table and the errors.

The converter functions (``nn.py``, ``tensor.py``, ``quant.py``) take these and register
into `registry.CONVERTERS`; ``convert.py`` drives the conversion. Imports run one way:
converter modules → ``converter``/``registry``, ``convert`` → all of them.
"""
from __future__ import annotations

import re
from typing import Any, Dict, List, Optional, Sequence, Tuple

import torch

from .. import errors
from ...ir import DataType, Graph, Node, TensorDesc, TensorRef, Value
from ...ops import lookup_aten
from ...ops.onnx_fallback import encode_node, infer_outputs, infer_outputs_ort, make_onnx_kernel
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

    def __init__(self, graph: Graph, opsets: Dict[str, int], convert_node=None):
        self.graph = graph
        self.opsets = opsets
        self.opset = opsets.get("", 0)
        self.env: Dict[str, Value] = {}
        self.metas: Dict[int, torch.Tensor] = {}
        self.node: Optional[OnnxNode] = None
        # the driver's per-node conversion (convert.convert_node), for converters that
        # convert a subgraph's nodes inline (If with a constant condition); passed in so
        # that converter modules never import the driver
        self._convert_node = convert_node

    def convert_inline(self, proto) -> None:
        """Convert ONNX node ``proto`` (of a subgraph being inlined) into the graph, as
        the driver converts a top-level node (no shape-inference check)."""
        self._convert_node(self, proto, {}, False)

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
        inputs are all known). ``descs``: the whole model's shape inference of its outputs
        (declared ``value_info`` included); the node's own inference on its exact input
        shapes and constants is preferred, and ONNX Runtime's (`_runtime_descs`) fills what
        neither gives (com.microsoft ops)."""
        ins = [n.x(i) for i in range(len(n.inputs)) if n.has(i)]
        opsets = tuple(sorted(self.opsets.items()))
        raw = encode_node(n.proto.SerializeToString())
        n_out = len([y for y in n.outputs if y])
        consts = [v.const if v.is_const else None for v in ins]
        own = infer_outputs(raw, opsets, [v.desc for v in ins], consts)
        descs = [TensorDesc(o[0], DataType.from_torch(o[1])) if o is not None else
                 (descs[k] if k < len(descs) else None) for k, o in enumerate(own[:n_out])]
        run, engine = self._host_kernel(n, reason, raw, opsets, [v.desc.dtype.torch for v in ins],
                                        n_out, descs, [tuple(v.desc.shape) for v in ins])
        if all(v.is_const for v in ins) and n.op_type not in RANDOM_OPS:
            return _by_position(n, [self.const(t) for t in run(*[v.const for v in ins])])
        if any(d is None for d in descs[:n_out]):
            descs = self._runtime_descs(n, reason, raw, opsets, ins, consts, descs[:n_out])
        attrs = {"op_type": n.op_type, "domain": n.proto.domain, "onnx_node": raw,
                 "opsets": opsets, "engine": engine, "reason": reason}
        ir = self.graph.create_node("OnnxHostFallback", ins, attrs, list(descs[:n_out]),
                                    name=n.name, source=self.source(), scope=self.scope())
        return _by_position(n, list(ir.outputs))

    def _runtime_descs(self, n: OnnxNode, reason: str, raw: str, opsets, ins, consts, descs) -> list:
        """``descs`` with each unknown entry from ONNX Runtime's shape inference of the node
        (`infer_outputs_ort`). ConversionError naming the node and output: ``data_dependent``
        where ONNX Runtime leaves a dim unknown (the size depends on the data), else
        `_no_shape_error` where no inference gives a shape."""
        ort_found = infer_outputs_ort(raw, opsets, [v.desc for v in ins], consts)
        names = [y for y in n.outputs if y]
        why = "no opencann converter" if reason in ("", "no converter") else f"not converted: {reason}"
        out = list(descs)
        for k, d in enumerate(descs):
            if d is not None:
                continue
            got = ort_found[k] if k < len(ort_found) else None
            dims = None if got is None else got[0]
            if got is not None and got[1] is not None and all(s is not None for s in dims):
                out[k] = TensorDesc(dims, DataType.from_torch(got[1]))
            elif dims is not None and any(s is None for s in dims):
                shown = "(" + ", ".join("?" if s is None else str(s) for s in dims) + ")"
                raise ConversionError(
                    f"ONNX node {self.where()} ({why}) runs on ONNX Runtime, whose shape inference "
                    f"gives its output {names[k]!r} the shape {shown}: its size depends on the data; "
                    "opencann compiles static graphs", kind="data_dependent")
            else:
                raise self._no_shape_error(n, why, names[k], ins)
        return out

    def _no_shape_error(self, n: OnnxNode, why: str, name: str, ins) -> ConversionError:
        """The error for output ``name`` of ``n`` when neither onnx's nor ONNX Runtime's shape
        inference gives it a shape: ``data_dependent`` when the node reads run-time integer
        inputs (axes, shapes, sizes taken from the data), else ``unsupported_op``; both
        name the fix."""
        ints = [x for x, v in zip([x for x in n.inputs if x], ins) if not v.is_const
                and v.desc.dtype.torch in (torch.int32, torch.int64)]
        head = (f"ONNX node {self.where()} ({n.proto.domain or 'ai.onnx'}, {why}) runs on ONNX Runtime, "
                f"but neither onnx's nor ONNX Runtime's shape inference gives its output {name!r} a "
                "static shape")
        if ints:
            return ConversionError(
                f"{head}: it can depend on the values of its run-time integer input(s) "
                f"{', '.join(map(repr, ints))} (axes, shapes or sizes computed from the data); opencann "
                "compiles static graphs. Fix: make them constants (initializers) in the model",
                kind="data_dependent")
        return ConversionError(
            f"{head} (their inference stops at this op on these inputs). Fix: declare its static shape "
            "in the model (graph.value_info, e.g. by onnxruntime.tools.symbolic_shape_infer), or "
            "replace the op", kind="unsupported_op")

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


