"""opencann's fused ops: their `OpDef` rows (columns filled: CPU kernel factory,
out-capable, cost); the kernels themselves are in ``ops/kernels/cpu.py``.

- ``ConvBiasAct``: Conv2D (with BatchNorm folded into weight and bias) + activation,
  one oneDNN convolution with a fused post-op.
- ``ConvAddAct``: Conv2D + residual Add (+ ReLU) as oneDNN's ``sum`` post-op, written in
  place into the addend's buffer.
- ``LinearAct``: MatMulV2 (addmm), or MatMul (mm, a bias-free Linear: no ``self``
  input), [+ activation] into the planned buffer, by the GEMM kernel chosen per shape
  (addmm / mm, oneDNN's or MKL's prepacked GEMM, the decode GEMV; oneDNN's bf16 one
  returns its own allocation: `linear_writes_out`); the activation runs in place on the
  result.
- ``AddLayerNorm``: LayerNorm(a + b) over the last axis (ONNX Runtime's
  SkipLayerNormalization), one pass per row (``ops/kernels/add_layer_norm.py``).
- ``AddLayerNormCast``: mixed precision's Cast(low → fp32) + Add + LayerNorm + Cast(fp32 →
  low) as one node with two outputs, (y float32, y in bf16/fp16): the LayerNorm
  counterpart of CANN's AddRmsNormCast; the chain's bits
  (``ops/kernels/add_layer_norm_cast_cpu.py``).

Costs: the unfused ops' FLOPs (convolution / GEMM + the activation's per-element FLOPs)
so fusing does not change the work the report shows.
"""
from __future__ import annotations

from typing import Optional

from ..ir import Node
from .kernels import vnpu_cost
from .kernels.add_layer_norm import make_add_layer_norm_kernel
from .kernels.add_layer_norm_cast_cpu import make_add_layer_norm_cast_kernel
from .kernels.cpu import linear_writes_out, make_conv_kernel, make_linear_kernel
from .library import _conv_cost, _matmul_cost
from . import per_index as pi
from .opdef import Cost, OpDef, OpKind, all_ops, register

def _act_op(act: str) -> Optional[OpDef]:
    """The library op whose ``activation`` column is ``act`` (its FLOPs per element are
    what the fused activation costs)."""
    return next((op for op in all_ops() if op.activation == act), None)


def _act_flops(node: Node) -> int:
    op = _act_op(node.attrs.get("act", "none"))
    return 0 if op is None else int(op.flops_per_elem * node.outputs[0].desc.numel)


def _linear_cost(node: Node) -> Cost:
    c = _matmul_cost(node)
    return Cost(c.flops + _act_flops(node), c.bytes)


def _conv_act_cost(node: Node) -> Cost:
    c = _conv_cost(node)
    return Cost(c.flops + _act_flops(node), c.bytes)


register(OpDef("ConvBiasAct", OpKind.FUSED, aliases=((),), cost_fn=_conv_act_cost,
               fused_from=("Conv2D",),
               kernel_factories={"cpu": make_conv_kernel}, device_cost={"vnpu": vnpu_cost.conv},
               kernel_per_shape=True,   # eager's or oneDNN's kernel by size: ops/kernels/conv_choice
               per_index=pi.CONV, doc="Conv2D(+folded BN)+activation in one oneDNN primitive"))
register(OpDef("ConvAddAct", OpKind.FUSED, aliases=((),),  # in place: the node's inplace_input
               fused_from=("Conv2D",),
               cost_fn=_conv_act_cost, kernel_factories={"cpu": make_conv_kernel},
               device_cost={"vnpu": vnpu_cost.conv}, per_index=pi.CONV_ADD, kernel_per_shape=True,
               doc="Conv2D+Add(+ReLU) through oneDNN's sum post-op, in place into the addend"))
register(OpDef("LinearAct", OpKind.FUSED, aliases=((),), cost_fn=_linear_cost,
               fused_from=("MatMulV2", "MatMul"),
               kernel_factories={"cpu": make_linear_kernel}, out_capable=linear_writes_out,
               device_cost={"vnpu": vnpu_cost.matmul}, per_index=pi.addmm,
               doc="addmm (or bias-free mm) + activation on a packed weight"))
register(OpDef("AddLayerNorm", OpKind.FUSED, flops_per_elem=9, aliases=((),),
               fused_from=("LayerNorm",),
               kernel_factories={"cpu": make_add_layer_norm_kernel}, out_capable=lambda node: True,
               keep_fp32=True, per_index=pi.add_layer_norm,
               doc="LayerNorm(a + b) over the last axis with γ, β in one pass"))
register(OpDef("AddLayerNormCast", OpKind.FUSED, flops_per_elem=10, aliases=((), ()),
               fused_from=("LayerNorm",),
               kernel_factories={"cpu": make_add_layer_norm_cast_kernel},
               keep_fp32=True, per_index=pi.add_layer_norm_cast,
               doc="(LayerNorm(float(x1) + float(x2)), its bf16/fp16 cast): mixed precision's "
                   "Cast + Add + LayerNorm + Cast as one node"))
