"""One-pass bf16 → uint8 quantization (AscendQuant reading a bf16 activation inside a
bf16 graph): ``y = saturate(round_half_even(float(x) * inv_step) + offset)`` in [0, 255],
NaN → 0, over a dense tensor's storage in memory order (the result has x's strides).
(The range a dynamic quantization takes is ``torch.aminmax``'s, which reads bf16 directly.)

Without it an int8 Linear between bf16 ops pays a Cast of x to fp32 (a read of 2 bytes
and a write of 4 per element) before the fp32 kernel (`quant_numba.quantize_dense`) reads
it again: measured on MiniLM at seq 128 this Cast plus the quantization cost more than
the int8 GEMM saves over the bf16 one (docs/guide/precision.md).

bf16 is the upper half of an fp32 (same sign, exponent and top 7 mantissa bits), so its
value is exactly the fp32 whose bits are ``bits << 16``: `f32_of_bits` is that bit cast
(an LLVM ``bitcast``, which numba has no spelling for; it vectorizes), then the fp32
kernel's arithmetic follows, so a bf16 x gives the bits ``quantize_dense`` gives on
``x.float()``. numba because the project's CPU codegen is numba (DESIGN.md); thread count
and launch as the other kernels (`numba_cache.launch`).
Source of the rounding: IEEE 754 roundTiesToEven (``np.rint``), as ``torch.round``;
bf16's layout: the "bfloat16" format of Google's TPU documentation / Intel's BF16 whitepaper
(sign, 8 exponent bits, 7 mantissa bits: fp32's top 16 bits)."""
from __future__ import annotations

import numpy as np
import torch
from llvmlite import ir
from numba import prange, types
from numba.extending import intrinsic

from .numba_cache import launch, njit
from .quant_numba import BLOCK, SERIAL_MAX, dense_io, saturate_u8


@intrinsic
def f32_of_bits(typingctx, bits):
    """The float32 whose IEEE 754 bits are the low 32 bits of the integer ``bits`` (LLVM
    ``trunc`` + ``bitcast``; numba widens ``uint32 << uint32`` to 64 bits)."""
    if not isinstance(bits, types.Integer):
        return None

    def codegen(context, builder, signature, args):
        v = args[0]
        if bits.bitwidth > 32:
            v = builder.trunc(v, ir.IntType(32))
        return builder.bitcast(v, ir.FloatType())
    return types.float32(bits), codegen


@njit(cache=True)
def _quantize_bf16_run(xs, inv, offset, ys):  # pragma: no cover - compiled by numba
    for i in range(xs.size):
        ys[i] = saturate_u8(f32_of_bits(np.uint32(xs[i]) << np.uint32(16)), inv, offset)


@njit(parallel=True, cache=True)
def _quantize_bf16(xb, inv, offset, y):  # pragma: no cover - compiled by numba
    n = xb.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        m = min(BLOCK, n - s)
        _quantize_bf16_run(xb[s:s + m], inv, offset, y[s:s + m])


def quantize_bf16_dense(x: torch.Tensor, step: float, offset: int, out: torch.Tensor = None):
    """``x`` (bf16, dense: contiguous in some memory order) quantized to uint8 with its
    strides, ``saturate(round_half_even(x / step) + offset)`` computed in fp32 (the bits
    of quantizing ``x.float()``), NaN → 0, +inf → 255, -inf → 0, written into ``out`` when
    given and it fits (`quant_numba.dense_io`); None when x is not bf16 or not dense or
    ``out`` does not fit (the caller then uses eager's ops). ``step`` > 0, ``offset`` in
    [0, 255]."""
    io = dense_io(x, np.uint16, out) if x.dtype == torch.bfloat16 else None
    if io is None:
        return None
    xs, y, ys = io
    n = xs.size
    if n < SERIAL_MAX:      # as quant_numba: the parallel launch costs more than the pass
        _quantize_bf16_run(xs, np.float32(1.0 / step), np.float32(offset), ys)
        return y
    with launch(n):
        _quantize_bf16(xs, np.float32(1.0 / step), np.float32(offset), ys)
    return y


__all__ = ["f32_of_bits", "quantize_bf16_dense"]
