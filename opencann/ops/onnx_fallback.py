"""``OnnxHostFallback``: an ONNX node with no opencann converter, run on the host by
the ONNX package's reference implementation (``onnx.reference.ReferenceEvaluator``).

The torch frontend's ``HostFallback`` runs an ATen op eagerly; this is its ONNX twin,
reported the same way in the compile report's host fallbacks. onnx's evaluator is
chosen because it is the executable form of the operator specification, kept by the
ONNX project itself (source: onnx/reference, "ONNX reference implementation"), so any
standard op the frontend cannot map yet still runs, exactly as specified.

Node layout (made by ``opencann.frontend.onnx``): inputs are the node's present ONNX
inputs in order; attrs ``op_type``, ``domain``, ``onnx_node`` (the serialized
``NodeProto``), ``opsets`` (tuple of (domain, version)) and ``reason`` (why it was not
converted). Outputs keep the descriptions onnx shape inference gave them. onnx is
imported when a kernel is built, so the package stays optional.
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np
import torch

from ..ir import Node, TensorDesc
from .opdef import OpDef, OpKind, register

# torch dtype -> onnx TensorProto element type (the numbers of onnx.proto's DataType)
_ONNX_ELEM = {torch.float32: 1, torch.uint8: 2, torch.int8: 3, torch.int16: 5,
              torch.int32: 6, torch.int64: 7, torch.bool: 9, torch.float16: 10,
              torch.float64: 11, torch.complex64: 14, torch.bfloat16: 16}


def make_onnx_kernel(onnx_node: bytes, opsets: Sequence[tuple], in_dtypes: Sequence[torch.dtype],
                     n_out: int) -> Callable:
    """``run(*tensors) -> tuple of tensors``: the serialized ONNX node evaluated by
    ``onnx.reference.ReferenceEvaluator`` on numpy copies of the inputs. Raises
    ValueError for an input dtype onnx cannot take (bfloat16 has no numpy type)."""
    import onnx
    from onnx import helper
    from onnx.reference import ReferenceEvaluator

    node = onnx.NodeProto()
    node.ParseFromString(onnx_node)
    present = [x for x in node.input if x]
    if len(present) != len(in_dtypes):
        raise ValueError(f"ONNX node {node.name or node.op_type}: {len(present)} inputs, "
                         f"{len(in_dtypes)} tensors")
    ins = [helper.make_tensor_value_info(x, _ONNX_ELEM[d], None) for x, d in zip(present, in_dtypes)]
    outs = [helper.make_value_info(y, onnx.TypeProto()) for y in node.output if y]
    graph = helper.make_graph([node], "fallback", ins, outs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid(d, v) for d, v in opsets])
    model.ir_version = onnx.IR_VERSION
    ev = ReferenceEvaluator(model)
    names = [y for y in node.output if y]

    def run(*tensors):
        feeds = {x: t.detach().numpy() for x, t in zip(present, tensors)}
        res = ev.run(names, feeds)
        outs = []
        for r in res[:n_out]:
            a = np.ascontiguousarray(np.asarray(r))
            outs.append(torch.from_numpy(a.copy() if not a.flags.writeable else a))
        return tuple(outs)
    return run


def _factory(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    run = make_onnx_kernel(node.attrs["onnx_node"], node.attrs["opsets"],
                           [d.dtype.torch for d in in_descs], len(node.outputs))
    if len(node.outputs) == 1:
        return lambda *xs: run(*xs)[0]
    return run


register(OpDef("OnnxHostFallback", OpKind.FALLBACK, kernel_factories={"cpu": _factory},
               doc="an ONNX node with no opencann converter, run on the host by "
                   "onnx.reference.ReferenceEvaluator"))
