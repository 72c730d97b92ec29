"""ONNX ``If`` with a condition known at conversion time: the taken branch's nodes are
converted in place (they read outer-scope values through the converter's environment, as
ONNX subgraphs do), so exporters' shape-dependent branches compile. An If on a run-time
condition is refused earlier (`convert.convert_node`: control flow)."""
from __future__ import annotations

import numpy as np
import torch

from .converter import Converter, OnnxNode, torch_dtype
from .registry import converts


@converts("If")
def if_op(cv: Converter, n: OnnxNode):
    """ONNX If whose ``cond`` is a constant: the nodes of ``then_branch`` (cond true) or
    ``else_branch`` converted into the graph, its initializers as constants; returns the
    branch's outputs (a list of Values)."""
    from onnx import numpy_helper
    cond = n.c(0)
    branch = n.attr("then_branch" if bool(cond.reshape(-1)[0].item()) else "else_branch")
    outer = cv.node
    for t in branch.initializer:
        arr = np.array(numpy_helper.to_array(t))
        cv.env[t.name] = cv.const(torch.from_numpy(arr).to(torch_dtype(t.data_type, t.name)),
                                  name=t.name)
    for proto in branch.node:
        cv.convert_inline(proto)
    cv.node = outer
    return [cv.env[o.name] for o in branch.output]
