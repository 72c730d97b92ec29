"""``OnnxHostFallback``: an ONNX node with no opencann converter, run on the host by
ONNX Runtime (a one-node ``onnxruntime.InferenceSession`` built per node at compile time).

The torch frontend's ``HostFallback`` runs an ATen op eagerly; this is its ONNX twin,
reported the same way in the compile report's host fallbacks. ONNX Runtime is chosen
because it is what users compare an ONNX model against (the de-facto semantics of
exported models: ``onnx.reference`` differs from it, e.g. for Resize with
``align_corners`` and a fractional output length, and gives rank-0 results as shape
(1,)), and it is already a dependency of the ONNX path. Only an op ONNX Runtime's CPU
provider has no kernel for (a type combination it lacks, an op newer than it) runs on
``onnx.reference.ReferenceEvaluator``, the executable form of the specification; the
node's ``engine`` attribute says which one runs it.

Node layout (made by ``opencann.frontend.onnx``): inputs are the node's present ONNX
inputs in order; attrs ``op_type``, ``domain``, ``onnx_node`` (the serialized
``NodeProto``, base64 text so model files store it), ``opsets`` (tuple of (domain,
version)), ``engine`` ("onnxruntime" or "onnx.reference") and ``reason`` (why it was
not converted). Outputs keep their declared descriptions (onnx shape inference's):
every result is checked against them and a rank-0 output stays rank 0. onnx and
onnxruntime are imported when a kernel is built, so both stay optional.
"""
from __future__ import annotations

import base64
from typing import Callable, Optional, Sequence, Tuple

import numpy as np
import torch

from ..ir import Node, TensorDesc
from .opdef import OpDef, OpKind, register

# torch dtype -> onnx TensorProto element type (the numbers of onnx.proto's DataType)
_ONNX_ELEM = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5,
              torch.int32: 6, torch.int64: 7, torch.bool: 9, torch.float16: 10,
              torch.float64: 11, torch.complex64: 14, torch.bfloat16: 16}
ENGINES = ("onnxruntime", "onnx.reference")


def encode_node(raw: bytes) -> str:
    """A serialized ``NodeProto`` as the text stored in the ``onnx_node`` attribute (base64)."""
    return base64.b64encode(raw).decode("ascii")


def decode_node(text) -> bytes:
    """The serialized ``NodeProto`` of an ``onnx_node`` attribute (base64 text; raw bytes pass)."""
    return text if isinstance(text, (bytes, bytearray)) else base64.b64decode(text)


def _once(pairs):
    """(name, item) pairs with each ONNX input name once (its first slot): a node that
    reads one tensor in several slots (``Einsum(x, x)``) declares it as one graph input,
    since ONNX Runtime refuses a name defined twice."""
    seen: dict = {}
    for x, item in pairs:
        seen.setdefault(x, item)
    return list(seen.items())


def _one_node_model(node, opsets, in_dtypes, out_dtypes):
    import onnx
    from onnx import helper
    present = [x for x in node.input if x]
    if len(present) != len(in_dtypes):
        raise ValueError(f"ONNX node {node.name or node.op_type}: {len(present)} inputs, "
                         f"{len(in_dtypes)} tensors")
    for d in in_dtypes:
        if d == torch.bfloat16:
            raise ValueError("bfloat16 inputs have no numpy type for the host fallback; cast "
                             "them to float32 in the model")
    ins = [helper.make_tensor_value_info(x, _ONNX_ELEM[d], None)
           for x, d in _once(zip(present, in_dtypes))]
    names = [y for y in node.output if y]
    outs = [helper.make_tensor_value_info(y, _ONNX_ELEM[d], None) if d is not None
            else helper.make_value_info(y, onnx.TypeProto())
            for y, d in zip(names, list(out_dtypes) + [None] * (len(names) - len(out_dtypes)))]
    graph = helper.make_graph([node], "fallback", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = min(onnx.IR_VERSION, 10)
    return model, present, names


def _ort_session(model, node, opsets):
    """A one-node ONNX Runtime session; when the model's opset is newer than ONNX Runtime
    knows, the node is retried at its op's ``since_version`` (same semantics by definition)."""
    import onnx
    import onnxruntime as ort
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    so.inter_op_num_threads = 1
    so.log_severity_level = 4      # failures are raised (with their message), not logged
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    try:
        return ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    except Exception as first:  # noqa: BLE001 - onnxruntime raises its own Fail/NotImplemented
        domain = node.domain or ""
        version = dict(opsets).get(domain, dict(opsets).get("ai.onnx", 0))
        try:
            since = onnx.defs.get_schema(node.op_type, version, domain).since_version
        except Exception:  # noqa: BLE001 - unknown op: keep the first error
            raise first from None
        if since >= version:
            raise first from None
        m = onnx.ModelProto()
        m.CopyFrom(model)
        for o in m.opset_import:
            if (o.domain or "") == domain:
                o.version = since
        return ort.InferenceSession(m.SerializeToString(), so, providers=["CPUExecutionProvider"])


def _as_declared(r, d: Optional[TensorDesc], k: int, what: str) -> torch.Tensor:
    """Result ``r`` of output ``k`` as a fresh tensor with the declared shape of ``d`` (a
    rank-0 output stays rank 0); RuntimeError naming ``what`` when its element count or
    dtype differs from the declaration."""
    t = torch.from_numpy(np.array(r, copy=True, order="C"))
    if d is None:
        return t
    shape = tuple(int(s) for s in d.shape)
    if tuple(t.shape) != shape:
        if t.numel() != int(np.prod(shape)):
            raise RuntimeError(f"{what}: output {k} has shape {tuple(t.shape)}, declared {shape}; "
                               "the model's shapes are inconsistent")
        t = t.reshape(shape)
    if t.dtype != d.dtype.torch:
        raise RuntimeError(f"{what}: output {k} is {t.dtype}, declared {d.dtype.torch}")
    return t


def _with_backstop(evaluate, model, names):
    """``evaluate`` (ONNX Runtime), with ``onnx.reference`` taking over from the first call
    ONNX Runtime raises on (a kernel limit it checks only when running); when the reference
    fails too, ONNX Runtime's error is raised."""
    backstop = []

    def run(feeds):
        if backstop:
            return backstop[0](feeds)
        try:
            return evaluate(feeds)
        except Exception as e:  # noqa: BLE001 - onnxruntime's Fail / RuntimeException
            from onnx.reference import ReferenceEvaluator
            try:
                ref = ReferenceEvaluator(model)
                out = ref.run(names, feeds)
            except Exception:  # noqa: BLE001 - neither runs it: ONNX Runtime's error
                raise e from None
            backstop.append(lambda f: ref.run(names, f))
            return out
    return run


def make_onnx_kernel(onnx_node, opsets: Sequence[tuple], in_dtypes: Sequence[torch.dtype],
                     n_out: int, out_descs: Optional[Sequence[Optional[TensorDesc]]] = None,
                     engine: Optional[str] = None, in_shapes=None) -> Tuple[Callable, str]:
    """``(run, engine)``: ``run(*tensors) -> tuple of tensors`` evaluates the serialized ONNX
    node (bytes or base64 text) by ONNX Runtime's CPU provider (``engine`` "onnxruntime"),
    or, when ONNX Runtime cannot build it and ``engine`` is not forced, by
    ``onnx.reference.ReferenceEvaluator`` ("onnx.reference"). ``out_descs``: the declared
    output descriptions; each result must have that dtype and that many elements and is
    given that shape (so a rank-0 output stays rank 0); a mismatch raises RuntimeError
    naming the node. A call ONNX Runtime raises on (a kernel limit it checks only when
    running: Scan bodies of new function ops, some padded attention) is run by the
    reference evaluator instead, and so are the later calls; when that fails too, ONNX
    Runtime's error is raised. ``in_shapes`` is accepted for callers and unused. Raises
    ValueError for an input dtype with no numpy type (bfloat16), and the engine's own
    error when neither can run the node."""
    import onnx
    node = onnx.NodeProto()
    node.ParseFromString(decode_node(onnx_node))
    descs = list(out_descs or [])
    out_dtypes = [d.dtype.torch if d is not None else None for d in descs]
    model, present, names = _one_node_model(node, opsets, in_dtypes, out_dtypes)
    where = node.name or node.op_type

    evaluate = None
    if engine in (None, "onnxruntime"):
        try:
            sess = _ort_session(model, node, opsets)
            engine = "onnxruntime"

            def evaluate(feeds):
                return sess.run(names, feeds)
        except Exception:  # noqa: BLE001 - no ONNX Runtime kernel: try the reference
            if engine == "onnxruntime":
                raise
    if evaluate is None:
        from onnx.reference import ReferenceEvaluator
        ev = ReferenceEvaluator(model)
        engine = "onnx.reference"

        def evaluate(feeds):
            return ev.run(names, feeds)

    evaluate_or_reference = _with_backstop(evaluate, model, names) \
        if engine == "onnxruntime" else evaluate

    def run(*tensors):
        feeds = {x: t.detach().cpu().numpy() for x, t in zip(present, tensors)}
        res = evaluate_or_reference(feeds)
        what = f"ONNX host fallback {where} ({node.op_type}, {engine})"
        outs = [_as_declared(r, descs[k] if k < len(descs) else None, k, what)
                for k, r in enumerate(res[:n_out])]
        return tuple(outs)
    return run, engine


def _factory(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    run, _ = make_onnx_kernel(node.attrs["onnx_node"], node.attrs["opsets"],
                              [d.dtype.torch for d in in_descs], len(node.outputs),
                              [o.desc for o in node.outputs], node.attrs.get("engine"))
    if len(node.outputs) == 1:
        return lambda *xs: run(*xs)[0]
    return run


register(OpDef("OnnxHostFallback", OpKind.FALLBACK, kernel_factories={"cpu": _factory},
               doc="an ONNX node with no opencann converter, run on the host by ONNX Runtime "
                   "(onnx.reference where ONNX Runtime has no kernel)"))


def infer_outputs(onnx_node, opsets: Sequence[tuple], in_descs: Sequence[TensorDesc],
                  consts: Sequence[Optional[torch.Tensor]]) -> list:
    """The static output descriptions of one ONNX node (a list of ``(shape, torch dtype)`` or
    None per present output) by ``onnx.shape_inference`` on the node alone, its inputs given
    their exact shapes and its constant inputs as initializers (so shape-like operands
    propagate). Independent of the whole model's inference, which stale ``value_info`` or
    symbolic dims from an exporter can leave without static shapes."""
    import onnx
    from onnx import helper, numpy_helper
    node = onnx.NodeProto()
    node.ParseFromString(decode_node(onnx_node))
    present = [x for x in node.input if x]
    names = [y for y in node.output if y]
    from_elem = {v: k for k, v in _ONNX_ELEM.items()}
    try:
        ins = [helper.make_tensor_value_info(x, _ONNX_ELEM[d.dtype.torch], list(d.shape))
               for x, d in _once(zip(present, in_descs))]
        inits = [numpy_helper.from_array(c.detach().cpu().numpy(), x)
                 for x, c in _once(zip(present, consts)) if c is not None and c.dtype != torch.bfloat16]
        outs = [helper.make_value_info(y, onnx.TypeProto()) for y in names]
        graph = helper.make_graph([node], "infer", ins, outs, initializer=inits)
        model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
        model.ir_version = min(onnx.IR_VERSION, 10)
        inferred = onnx.shape_inference.infer_shapes(model, check_type=False, strict_mode=False,
                                                     data_prop=True)
    except Exception:  # noqa: BLE001 - no inference for this node: the caller decides
        return [None] * len(names)
    found = {}
    for vi in list(inferred.graph.value_info) + list(inferred.graph.output):
        t = vi.type.tensor_type
        if not vi.type.HasField("tensor_type") or t.elem_type not in from_elem or \
                not t.HasField("shape"):
            continue
        dims = [d.dim_value if d.HasField("dim_value") else None for d in t.shape.dim]
        if all(d is not None for d in dims):
            found[vi.name] = (tuple(dims), from_elem[t.elem_type])
    return [found.get(y) for y in names]


# onnxruntime's NodeArg type strings -> torch dtype
_ORT_TYPES = {"tensor(float)": torch.float32, "tensor(uint8)": torch.uint8, "tensor(int8)": torch.int8,
              "tensor(int16)": torch.int16, "tensor(int32)": torch.int32, "tensor(int64)": torch.int64,
              "tensor(bool)": torch.bool, "tensor(float16)": torch.float16, "tensor(double)": torch.float64,
              "tensor(complex64)": torch.complex64, "tensor(bfloat16)": torch.bfloat16}


def _probe_model(node, opsets, in_descs, consts):
    """(model, names): ``node`` alone with its inputs at their exact shapes (constants as
    initializers), each present output a graph output of unknown type, and a ``Shape`` of
    each (``<name>::rank``) telling its rank apart from an unknown shape."""
    import onnx
    from onnx import helper, numpy_helper
    present = [x for x in node.input if x]
    names = [y for y in node.output if y]
    pairs = _once(zip(present, zip(in_descs, consts)))
    ins = [helper.make_tensor_value_info(x, _ONNX_ELEM[d.dtype.torch], list(d.shape))
           for x, (d, c) in pairs if c is None or c.dtype == torch.bfloat16]
    inits = [numpy_helper.from_array(c.detach().cpu().numpy(), x)
             for x, (d, c) in pairs if c is not None and c.dtype != torch.bfloat16]
    probes = [helper.make_node("Shape", [y], [f"{y}::rank"]) for y in names]
    outs = [helper.make_value_info(y, onnx.TypeProto()) for y in names] + \
        [helper.make_value_info(p.output[0], onnx.TypeProto()) for p in probes]
    graph = helper.make_graph([node] + probes, "probe", ins, outs, initializer=inits)
    versions = dict(opsets)
    versions.setdefault("", 13)          # the probes' Shape
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in versions.items()])
    model.ir_version = min(onnx.IR_VERSION, 10)
    return model, names


def infer_outputs_ort(onnx_node, opsets: Sequence[tuple], in_descs: Sequence[TensorDesc],
                      consts: Sequence[Optional[torch.Tensor]]) -> list:
    """The output descriptions of one ONNX node by ONNX Runtime's own shape inference (its
    op schemas, com.microsoft's included, which ``onnx.shape_inference`` does not know):
    the output shapes its session resolves for the node alone, its inputs at their exact
    shapes and its constant inputs as initializers. One entry per present output:
    ``(dims, torch dtype or None)`` with ``dims`` a tuple of ints and None for a dim ONNX
    Runtime leaves unknown (a size that depends on the data, as NonZero's), or None when it
    gives no shape (its inference stops at the op, or it cannot build the node)."""
    import onnx
    node = onnx.NodeProto()
    node.ParseFromString(decode_node(onnx_node))
    try:
        model, names = _probe_model(node, opsets, in_descs, consts)
        sess = _ort_session(model, node, opsets)
    except Exception:  # noqa: BLE001 - no ONNX Runtime session: no shape from it
        return [None] * len([y for y in node.output if y])
    args = {a.name: a for a in sess.get_outputs()}
    found = []
    for y in names:
        a, rank = args.get(y), args.get(f"{y}::rank")
        shape = list(a.shape or []) if a is not None else []
        n = rank.shape[0] if rank is not None and rank.shape else None
        if not shape and n != 0:      # onnxruntime reads [] for an unknown shape as for rank 0
            found.append(None)
            continue
        found.append((tuple(d if isinstance(d, int) else None for d in shape), _ORT_TYPES.get(a.type)))
    return found
