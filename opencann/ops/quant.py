"""opencann's int8 ops (the `quantize_int8` pass makes them; kernels in
``ops/kernels/int8_cpu.py``), named after CANN's graph ops where they exist:

- ``AscendQuant``: fp32 (or bf16, read directly) → uint8 per tensor, CANN's AscendQuant (attrs ``scale``: the
  reciprocal of the step, as CANN's ``y = round(x * scale + offset)``; ``offset``: the
  zero point).
- ``AscendDequant``: uint8 → fp32 per tensor, ``(x - offset) * scale`` (CANN's
  AscendDequant as a graph op; ONNX DequantizeLinear of a QDQ model converts to it); on
  the vnpu also CANN's own form: int32 (an int8 Conv2D / MatMulV2's result) →
  fp32 ``x * deq_scale[c] + bias[c]`` per output channel (inputs ``deq_scale``, ``bias``).
  On the vnpu both run in the storage format of their Cube neighbour (``npu_format``
  "quant", kernels ``ops/kernels/vnpu_quant.py``); AscendQuant then writes int8 with an
  offset in [-128, 127] (NC1HWC0 / FRACTAL_NZ with C0 = 32).
- ``QuantConvBiasAct``: int8 Conv2D (uint8 x, int8 per-channel weight) + bias +
  activation with CANN's AscendDequant fused into its fp32 output.
- ``QuantConvAddAct``: the same with the residual Add (+ ReLU): oneDNN's ``sum`` post-op
  into the fp32 addend, in place as ``ConvAddAct``.
- ``QuantAdd``: the sum of two uint8 tensors requantized to uint8 (ONNX QDQ's residual
  Add, ``qdq_eltwise_int8``; ONNX Runtime's QLinearAdd).
- ``QuantMaxPool``: MaxPool on a uint8 activation (the ``fuse_requant`` pass moves a
  MaxPool between two int8 layers to uint8: max commutes with quantization).
- ``QuantLinearAct``: int8 MatMul / Linear (+ activation), dequantized to fp32 (bf16
  inside a bf16 graph); with ``attrs["dynamic"]`` x comes in fp32 (or bf16) and is
  quantized per call.
- ``DynamicQuantDequant``: float → float, x on the uint8 grid of ONNX DynamicQuantizeLinear
  (its range taken per call) and dequantized: the float emulation of a dynamic int8
  linear's input on the vnpu (`vnpu_quantize_int8`: an ONNX ``quantize_dynamic`` file),
  with the levels the dynamic ``QuantLinearAct`` quantizes x to. Host kernel (ND).
- ``AddLayerNormQuant``: CANN's AddLayerNormQuant: Add + LayerNorm (float32, the
  residual stream) and the norm's uint8 quantization for the int8 Linear reading it
  (``fuse_add_layer_norm_quant``; kernel ``ops/kernels/add_layer_norm_quant_cpu.py``: one
  pass over the rows writing both outputs into the planned buffers).

Costs: the fp32 ops' FLOPs (the work is the same; the report shows it); bytes at the
int8 operands' sizes. On the vnpu the Cube cost runs at the operands' dtype (int8: twice
the fp16 rate, `NpuSpec.peak_cube_tflops(1)`)."""
from __future__ import annotations

from ..ir import Node, numel
from .kernels import vnpu_cost
from .kernels.vnpu_quant import make_vnpu_ascend_dequant, make_vnpu_ascend_quant
from .kernels.int8_cpu import (make_ascend_dequant_kernel, make_ascend_quant_kernel, make_dynamic_quant_dequant_kernel,
                               make_quant_conv_kernel,
                               make_quant_add_kernel, make_quant_linear_kernel, make_quant_max_pool_kernel)
from .kernels.add_layer_norm_quant_cpu import make_add_layer_norm_quant_kernel
from .library import _conv_cost
from . import per_index as pi
from .opdef import Cost, OpDef, OpKind, _nbytes, register


def _quant_linear_cost(node: Node) -> Cost:
    """2·M·N·K (+ M·N for a bias) on the origin shapes; bytes of every operand."""
    x = node.arg("mat1").desc
    out = node.outputs[0].desc
    flops = 2 * int(x.origin_shape[-1]) * numel(out.origin_shape)
    if node.attrs.get("self") is not None:
        flops += numel(out.origin_shape)
    return Cost(flops, sum(_nbytes(v.desc) for v in node.inputs) + _nbytes(out))


register(OpDef("AscendQuant", OpKind.ELEMENTWISE, flops_per_elem=4, aliases=((),), channels_last=True,
               kernel_factories={"cpu": make_ascend_quant_kernel, "vnpu": make_vnpu_ascend_quant}, npu_format="quant",
               out_capable=lambda n: n.device.kind == "cpu",   # the vnpu kernel returns its own
               device_cost={"vnpu": vnpu_cost.quant}, per_index=pi.ALL,
               doc="fp32/bf16 → uint8 (int8 on the vnpu): saturate(round(x * scale) + offset), NaN → the minimum"))
register(OpDef("AscendDequant", OpKind.ELEMENTWISE, flops_per_elem=2, aliases=((),), channels_last=True,
               kernel_factories={"cpu": make_ascend_dequant_kernel, "vnpu": make_vnpu_ascend_dequant},
               npu_format="quant",
               device_cost={"vnpu": vnpu_cost.quant}, per_index=pi.ALL,
               doc="uint8 → fp32: (x - offset) * scale; int32 → fp32: x * deq_scale[c] + bias[c] (vnpu)"))
register(OpDef("QuantConvBiasAct", OpKind.FUSED, aliases=((),), cost_fn=_conv_cost,
               fused_from=("Conv2D",), kernel_factories={"cpu": make_quant_conv_kernel},
               device_cost={"vnpu": vnpu_cost.conv}, per_index=pi.CONV,
               doc="int8 Conv2D + bias + activation, dequantized to fp32 (oneDNN qconv)"))
register(OpDef("QuantConvAddAct", OpKind.FUSED, aliases=((),), cost_fn=_conv_cost,
               fused_from=("Conv2D",), kernel_factories={"cpu": make_quant_conv_kernel},
               device_cost={"vnpu": vnpu_cost.conv}, per_index=pi.CONV_ADD,
               doc="int8 Conv2D + residual Add (+ReLU) into the fp32 addend, in place"))
register(OpDef("QuantAdd", OpKind.ELEMENTWISE, flops_per_elem=6, aliases=((),), per_index=pi.ALL,
               kernel_factories={"cpu": make_quant_add_kernel}, device_cost={"vnpu": vnpu_cost.vector("add")},
               doc="uint8 + uint8 → uint8 at three quantizations (quantized::add)"))
register(OpDef("QuantMaxPool", OpKind.POOL, aliases=((),), per_index=pi.POOL,
               kernel_factories={"cpu": make_quant_max_pool_kernel},
               doc="MaxPool on uint8 (quantized::max_pool2d's NHWC kernel)"))
register(OpDef("QuantLinearAct", OpKind.FUSED, aliases=((),), cost_fn=_quant_linear_cost,
               fused_from=("MatMulV2", "MatMul"), kernel_factories={"cpu": make_quant_linear_kernel},
               device_cost={"vnpu": vnpu_cost.matmul}, per_index=pi.addmm,
               doc="int8 Linear (+ activation), dequantized to fp32 (oneDNN qlinear)"))
register(OpDef("DynamicQuantDequant", OpKind.FUSED, flops_per_elem=6, aliases=((),),
               kernel_factories={"cpu": make_dynamic_quant_dequant_kernel}, device_cost={"vnpu": vnpu_cost.quant},
               doc="x quantized to uint8 by DynamicQuantizeLinear's per-call range, then dequantized (x's dtype)"))
register(OpDef("AddLayerNormQuant", OpKind.FUSED, flops_per_elem=12, aliases=((), ()),
               fused_from=("LayerNorm",), kernel_factories={"cpu": make_add_layer_norm_quant_kernel},
               out_capable=lambda node: True,   # writes (y, y_q) into the planned buffers
               keep_fp32=True, per_index=pi.add_layer_norm_cast,
               doc="(LayerNorm(float(x1) + float(x2)), its uint8 quantization): AddLayerNormCast "
                   "and the AscendQuant of its low output as one node"))
