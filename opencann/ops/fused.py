"""opencann's fused ops and their CPU kernels.

- ``ConvBiasAct``: Conv2D (with BatchNorm folded into weight and bias) + activation,
  one oneDNN convolution with a fused post-op (``torch.ops.mkldnn._convolution_pointwise``)
  on a weight reordered once to oneDNN's blocked layout (``_reorder_convolution_weight``).
- ``ConvAddAct``: Conv2D + residual Add (+ ReLU) as oneDNN's ``sum`` post-op, written in
  place into the addend's buffer (``_convolution_pointwise_.binary``).
- ``LinearAct``: MatMulV2 (addmm) + activation: MKL's packed GEMM on a weight packed
  once per batch size (``torch.ops.mkl._mkl_linear``), activation applied in place.

Source: oneDNN "Primitive Attributes: Post-ops" (oneapi-src.github.io/oneDNN), the same
kernels PyTorch Inductor uses for CPU freezing (torch/_inductor/fx_passes/mkldnn_fusion.py).
Kernels are built per input shape by ``make_kernel(node, in_descs, consts)``.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional, Sequence

import torch

from ..ir import Node, TensorDesc
from .library import _conv_cost, _matmul_cost
from .opdef import Cost, OpDef, OpKind, register

ACTIVATIONS = ("none", "relu", "gelu", "tanh", "sigmoid", "silu")
_ACT_FN: Dict[str, Callable] = {
    "relu": torch.relu_, "gelu": torch.ops.aten.gelu_, "tanh": torch.tanh_,
    "sigmoid": torch.sigmoid_, "silu": torch.nn.functional.silu,
}
_ONEDNN_ACT = {"none": "none", "relu": "relu", "gelu": "gelu", "tanh": "tanh",
               "sigmoid": "sigmoid", "silu": "swish"}


def mkldnn_available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_convolution_pointwise")


def _conv_weight(node: Node, x: TensorDesc, w: torch.Tensor) -> torch.Tensor:
    """Reorder the conv weight once into oneDNN's blocked layout for this input size."""
    a = node.attrs
    try:
        return torch.ops.mkldnn._reorder_convolution_weight(
            w, a["padding"], a["stride"], a["dilation"], a["groups"], list(x.shape))
    except (RuntimeError, AttributeError):
        return w


def _make_conv_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    a = node.attrs
    w = consts[1]
    if w is None:  # weight is not a constant: no prepacking
        def run(x, w, b=None):
            return torch.ops.mkldnn._convolution_pointwise(
                x, w, b, a["padding"], a["stride"], a["dilation"], a["groups"],
                _ONEDNN_ACT[a["act"]], [], "tanh" if a["act"] == "gelu" and a.get("approximate") == "tanh" else "")
        return run
    wp = _conv_weight(node, in_descs[0], w)
    pad, stride, dil, groups = a["padding"], a["stride"], a["dilation"], a["groups"]
    act = _ONEDNN_ACT[a["act"]]
    conv = torch.ops.mkldnn._convolution_pointwise

    if node.op == "ConvAddAct":
        unary = None if a["act"] == "none" else act
        inplace = a.get("inplace", True)
        if inplace:
            f = torch.ops.mkldnn._convolution_pointwise_.binary

            def run(x, w, b, other):
                return f(other, x, wp, b, pad, stride, dil, groups, "add", None, unary, [], "")
        else:
            f = torch.ops.mkldnn._convolution_pointwise.binary

            def run(x, w, b, other):
                return f(x, other, wp, b, pad, stride, dil, groups, "add", None, unary, [], "")
        return run

    def run(x, w, b=None):
        return conv(x, wp, b, pad, stride, dil, groups, act, [], "")
    return run


def _make_linear_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """LinearAct(bias, x, w_t): packed MKL GEMM when the weight is constant."""
    act = node.attrs["act"]
    post = _ACT_FN.get(act)
    wt = consts[2]
    m = int(in_descs[1].shape[0])
    packed = None
    if wt is not None and hasattr(torch.ops, "mkl") and hasattr(torch.ops.mkl, "_mkl_linear") \
            and in_descs[1].dtype.torch == torch.float32:
        w = wt.t().contiguous()  # (out_features, in_features)
        try:
            packed = torch.ops.mkl._mkl_reorder_linear_weight(w, m)
        except RuntimeError:
            packed = None
    if packed is not None:
        lin = torch.ops.mkl._mkl_linear
        if post is None:
            return lambda b, x, _w: lin(x, packed, w, b, m)
        return lambda b, x, _w: post(lin(x, packed, w, b, m))
    addmm = torch.ops.aten.addmm.default
    if post is None:
        return lambda b, x, w_: addmm(b, x, w_)
    return lambda b, x, w_: post(addmm(b, x, w_))


def _linear_cost(node: Node) -> Cost:
    c = _matmul_cost(node)
    act = 0 if node.attrs.get("act", "none") == "none" else 8 * node.outputs[0].desc.numel
    return Cost(c.flops + act, c.bytes)


register(OpDef("ConvBiasAct", OpKind.FUSED, cost_fn=_conv_cost,
               doc="Conv2D(+folded BN)+activation in one oneDNN primitive"))
register(OpDef("ConvAddAct", OpKind.FUSED, cost_fn=_conv_cost,
               doc="Conv2D+Add(+ReLU) through oneDNN's sum post-op, in place into the addend"))
register(OpDef("LinearAct", OpKind.FUSED, cost_fn=_linear_cost,
               doc="addmm + activation on a packed weight"))

KERNEL_FACTORIES: Dict[str, Callable] = {
    "ConvBiasAct": _make_conv_kernel,
    "ConvAddAct": _make_conv_kernel,
    "LinearAct": _make_linear_kernel,
}
