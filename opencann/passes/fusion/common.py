"""What the CPU fusions share: the activations oneDNN/BLAS kernels apply as post-ops,
the fusion base class that runs on cpu only, and the fused convolution's builder."""
from __future__ import annotations

from typing import Optional

import torch

from ...devices.cpu import mkldnn_available
from ...ir import DataType, Graph, Node, TensorRef
from ...ops import get_op
from ...ops.kernels.conv_choice import ONEDNN_CONV_DTYPES
from ..base import RewritePass



def _act(node: Optional[Node]) -> Optional[str]:
    """The activation ``node`` computes (its OpDef's ``activation`` column), or None."""
    return None if node is None else get_op(node.op).activation


# dtypes of oneDNN's fused convolution (bf16: native avx512_bf16 / AMX kernels); the
# conv_low_precision probe runs oneDNN's kernels for exactly these
CONV_DTYPES = ONEDNN_CONV_DTYPES


def _conv_check(conv: Node) -> Optional[str]:
    if not mkldnn_available():
        return "oneDNN (mkldnn) is not available in this torch build"
    if conv.attrs.get("transposed"):
        return "transposed convolution (no fused oneDNN kernel used here)"
    if conv.outputs[0].desc.dtype.torch not in CONV_DTYPES:
        return (f"dtype {conv.outputs[0].desc.dtype.value}: the fused oneDNN convolution runs "
                f"{' and '.join(DataType.from_torch(d).value for d in CONV_DTYPES)} only on this CPU")
    if conv.outputs[0].desc.rank != 4:
        return "not a 2-D convolution"
    if any(p != 0 for p in conv.attrs.get("output_padding", [0])):
        return "output padding"
    return None


def _make_conv(graph: Graph, conv: Node, act: str, before: Node, name: str) -> Node:
    ins = [conv.arg("input"), conv.arg("weight")]
    b = conv.arg("bias")
    attrs = {k: conv.attrs[k] for k in ("stride", "padding", "dilation", "groups")}
    attrs.update(input=TensorRef(0), weight=TensorRef(1), act=act)
    if b is not None:
        ins.append(b)
        attrs["bias"] = TensorRef(2)
    fused = graph.create_node("ConvBiasAct", ins, attrs, [before.outputs[0].desc], name=name,
                              source=conv.source, scope=conv.scope, before=before)
    return carry_keep_dtype(_stands_for(fused, before), conv)


def carry_keep_dtype(fused: Node, *replaced: Node) -> Node:
    """``fused`` is kept out of reduced precision when a node it replaces was named in
    the ``keep_dtype`` option (``meta["keep_dtype"]``, set by the ``precision`` pass before
    fusion renames nodes): int8 quantization reads the mark (`QuantizeInt8`). Returns
    ``fused``."""
    if any(r.meta.get("keep_dtype") for r in replaced):
        fused.meta["keep_dtype"] = True
    return fused


def _stands_for(fused: Node, replaced: Node) -> Node:
    """``fused`` replaces ``replaced``'s output: it keeps that output's traced strides
    (``meta["strides"]``), which views after it and the caller (eager's strides) rely on."""
    if replaced.meta.get("strides"):
        fused.meta["strides"] = replaced.meta["strides"][:1]
    return fused


class CpuFusion(RewritePass):
    """A fusion into CPU kernels (oneDNN post-ops, BLAS GEMMs): on other devices it does
    nothing and says so in the report."""

    devices = ("cpu",)
    off_device_note = "cpu-only fusion (oneDNN/BLAS kernels): skipped on {device}"
