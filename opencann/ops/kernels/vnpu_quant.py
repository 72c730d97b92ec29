"""vnpu kernels of CANN's quantization ops (bind-time factories, as ``ops/kernels/vnpu.py``):

- ``AscendQuant`` → int8 (the vnpu int8 path, ``passes/layout/vnpu_quantize_int8.py``):
  ``y = saturate_int8(round_half_even(x * scale) + offset)`` (x fp32, or fp16 widened
  exactly to fp32 first), NaN → -128, in the storage
  format the layout pass gave it (ND, NC1HWC0 or FRACTAL_NZ: fp32 C0 = 16 in, int8 C0 = 32
  out, the re-blocking CANN's AscendQuant does on its way to the Cube). The values are the
  CPU int8 path's (`quantize_u8` at offset + 128, minus 128: uint8 and int8 differ by that
  shift only), so the two devices quantize alike.
- ``AscendDequant`` with a ``deq_scale`` input (CANN's form): int32 Cube result →
  ``fp32 = x * deq_scale[c] (+ bias[c])`` per output channel ``c``, rounded once to the
  output dtype (fp32, or fp16 in an fp16 model) (``attrs["axis"]``: 1
  for a convolution's NCHW result, -1 for a matmul's [M, N]), in the storage format of x
  (int32 and fp32 share C0 = 16); pad positions stay zero.
- the CPU forms (uint8 AscendQuant, per-tensor AscendDequant: ONNX QDQ models) run their
  host kernels in ND.

Source: CANN operator list, AscendQuant ("y = round(x * scale + offset)", int8 out,
NC1HWC0 C0 = 32) and AscendDequant ("deq_scale": the product of the data and weight
scales, per channel); AMCT user guide (the quantization record's scale_d / offset_d /
scale_w).
"""
from __future__ import annotations

from typing import Callable, Sequence

import torch

from ...devices.vnpu import trans_data
from ...ir import DataType, Format, Node, TensorDesc, TensorRef
from .int8_cpu import make_ascend_dequant_kernel, make_ascend_quant_kernel, quantize_u8
from .vnpu import NPU_FORMATS, origin_format_for


def _plain(desc: TensorDesc):
    """(to plain, from plain) converters of a value stored as ``desc`` (identity in ND)."""
    return plain_converters(desc.format, desc.origin_shape)


def plain_converters(fmt: Format, origin_shape: Sequence[int]):
    """(to plain, from plain): functions taking a tensor stored in ``fmt`` (NC1HWC0,
    FRACTAL_NZ, ...) of logical shape ``origin_shape`` to its plain (NCHW / ND) layout and
    back (padding zero); identities for a plain ``fmt``."""
    if fmt not in NPU_FORMATS:
        return (lambda t: t), (lambda t: t)
    of, shape = origin_format_for(fmt).value, tuple(origin_shape)
    return (lambda t: trans_data(t, fmt.value, of, origin_shape=shape, origin_format=of),
            lambda t: trans_data(t, of, fmt.value, origin_shape=shape, origin_format=of).contiguous())


def quantize_int8(x: torch.Tensor, step: float, offset: int) -> torch.Tensor:
    """``x`` (float, any shape) to int8 ``saturate(round_half_even(x / step) + offset)`` in
    [-128, 127], NaN → -128, +inf → 127, -inf → -128; ``offset`` in [-128, 127]. The CPU
    path's `quantize_u8` shifted by 128 (same rounding)."""
    return (quantize_u8(x.contiguous(), step, offset + 128).to(torch.int16) - 128).to(torch.int8)


def dequantize(acc: torch.Tensor, deq_scale: torch.Tensor, bias, axis: int, dtype: torch.dtype) -> torch.Tensor:
    """AscendDequant's arithmetic on a plain int32 tensor ``acc`` (NCHW or [M, N]):
    ``acc · deq_scale[c] (+ bias[c])`` in fp32 along ``axis`` (``deq_scale``, ``bias``: [C],
    any float dtype; ``bias`` may be None), rounded once to ``dtype``. The one function the
    unfused AscendDequant kernel and the FixPipe epilogue of `opencann.ops.cube_epilogue`
    both call, so the two give the same bits."""
    view = [1] * acc.dim()
    view[axis % acc.dim()] = -1
    y = acc.to(torch.float32) * deq_scale.to(torch.float32).view(view)
    if bias is not None:
        y += bias.to(torch.float32).view(view)
    return y.to(dtype)


def make_vnpu_ascend_quant(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """AscendQuant on the vnpu: int8 output as the module docstring says (attrs ``scale``:
    1 / step, ``offset``: int8 zero point); a uint8 output runs the CPU kernel."""
    out = node.outputs[0].desc
    if out.dtype != DataType.INT8:
        return make_ascend_quant_kernel(node, in_descs, consts)
    step, offset = 1.0 / float(node.attrs["scale"]), int(node.attrs["offset"])
    to_plain, _ = _plain(in_descs[0])
    _, from_plain = _plain(out)
    return lambda x: from_plain(quantize_int8(to_plain(x).to(torch.float32), step, offset))


def make_vnpu_ascend_dequant(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """AscendDequant on the vnpu: with ``attrs["deq_scale"]`` (a TensorRef to fp32 [C]) the
    per-channel form of the module docstring (optional ``attrs["bias"]`` fp32 [C]);
    without it the per-tensor CPU kernel."""
    a = node.attrs
    if not isinstance(a.get("deq_scale"), TensorRef):
        return make_ascend_dequant_kernel(node, in_descs, consts)
    si = a["deq_scale"].index
    bi = a["bias"].index if isinstance(a.get("bias"), TensorRef) else None
    out = node.outputs[0].desc
    axis = int(a.get("axis", 1))
    to_plain, _ = _plain(in_descs[0])
    _, from_plain = _plain(out)
    dt = out.dtype.torch

    def run(*ins):
        return from_plain(dequantize(to_plain(ins[0]), ins[si], None if bi is None else ins[bi], axis, dt))
    return run


__all__ = ["dequantize", "make_vnpu_ascend_dequant", "make_vnpu_ascend_quant", "plain_converters", "quantize_int8"]
