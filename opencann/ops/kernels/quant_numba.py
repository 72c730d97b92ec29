"""One-pass fp32 ↔ uint8 conversions: `quantize_dense` (AscendQuant's CPU kernel body:
fp32 → uint8) and `dequantize_dense` (AscendDequant's: uint8 / int8 → fp32, ``(x -
offset) * step`` in fp32, the difference exact and the product rounded once, as the
eager spelling ``copy_``, ``sub_``, ``mul_`` rounds it in three passes).

Quantization: ``y = saturate(
round_half_even(x * inv_step) + offset)`` in [0, 255], NaN → 0, over a dense tensor's
storage in memory order (any dense layout: NCHW or channels-last alike; the result has
x's strides). Eager's spelling (mul, round, add, clamp, nan_to_num, cast) reads and
writes the tensor five times; measured on ResNet-50 int8 at batch 1 (2-core Xeon,
loaded), those passes were 7 of 17 ms. The loop runs over blocks of `BLOCK` elements with
the NaN and saturation tests as selects, which LLVM vectorizes (a per-element branch did
not: 3-4x slower); below `SERIAL_MAX` elements (a transformer's [128, 768] activation) one
serial call without the parallel launch, whose fixed cost was most of the pass there.
numba because the project's CPU codegen is numba (DESIGN.md); thread count and launch as
the GEMV's (`numba_cache.launch`).
Source of the rounding: IEEE 754 roundTiesToEven (``np.rint``), as ``torch.round``."""
from __future__ import annotations

import numpy as np
import torch
from numba import prange

from .numba_cache import launch, njit


BLOCK = 4096        # elements per parallel work item
SERIAL_MAX = 1 << 17   # below this many elements one serial call: a parallel launch's fixed
                       # cost (~15 us of thread-count and dispatch work) exceeds the pass itself


@njit(cache=True, inline="always")
def saturate_u8(v, inv, offset):  # pragma: no cover - compiled by numba
    """uint8 ``saturate(round_half_even(v * inv) + offset)``, NaN → 0 (fp32 v, inv, offset);
    selects, not branches, so the loops calling it vectorize."""
    r = np.rint(v * inv) + offset
    r = r if r > np.float32(0.0) else np.float32(0.0)   # NaN compares false: 0, the minimum
    r = r if r < np.float32(255.0) else np.float32(255.0)
    return np.uint8(np.int32(r))


@njit(cache=True, inline="always")
def saturate_u8_div(v, step, offset):  # pragma: no cover - compiled by numba
    """`saturate_u8` of ``v / step`` (a correctly rounded fp32 division: ONNX
    QuantizeLinear's ``x / y_scale``, which ``v * (1 / step)`` misses by one step at a
    rounding boundary)."""
    r = np.rint(v / step) + offset
    r = r if r > np.float32(0.0) else np.float32(0.0)
    r = r if r < np.float32(255.0) else np.float32(255.0)
    return np.uint8(np.int32(r))


@njit(cache=True)
def _quantize_run(xs, a, offset, ys, divide):  # pragma: no cover - compiled by numba
    """ys = `saturate_u8_div` (xs, step ``a``) when ``divide``, else `saturate_u8` (xs,
    1/step ``a``): the flag is tested once, outside the loops, which stay branch-free."""
    if divide:
        for i in range(xs.size):
            ys[i] = saturate_u8_div(xs[i], a, offset)
    else:
        for i in range(xs.size):
            ys[i] = saturate_u8(xs[i], a, offset)


@njit(parallel=True, cache=True)
def _quantize(x, a, offset, y, divide):  # pragma: no cover - compiled by numba
    n = x.size
    for b in prange((n + BLOCK - 1) // BLOCK):
        s = b * BLOCK
        m = min(BLOCK, n - s)
        _quantize_run(x[s:s + m], a, offset, y[s:s + m], divide)


def dense_flat(x: torch.Tensor):
    """x's storage as a 1-D tensor in memory order, or None when x is not dense
    (contiguous, or channels-last 4-D)."""
    if not (x.is_contiguous() or (x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last))):
        return None
    return x.as_strided((x.numel(),), (1,))


def dense_io(x: torch.Tensor, np_dtype, out: torch.Tensor = None):
    """(x's storage as a flat numpy array of ``np_dtype`` (x's element size: its bits
    reinterpreted), y: a uint8 tensor with x's strides, y's storage as a flat numpy
    array), or None when x is not dense. y is ``out`` when given (a uint8 tensor of x's
    shape and strides: the planned arena buffer, reused memory where a fresh allocation
    page-faults in the call), else fresh; None too when ``out`` does not fit (the caller
    then writes a fresh y into it). A contiguous x takes numpy's views and allocation:
    torch's ``as_strided`` / ``empty_like`` / dtype ``view`` cost ~2 µs each, and the pass
    over a [128, 768] activation is ~17 µs (measured: the call 34 → 22 µs)."""
    if x.requires_grad:
        x = x.detach()
    if out is not None and not (out.dtype == torch.uint8 and out.shape == x.shape
                                and out.stride() == x.stride()):
        return None
    if x.is_contiguous():
        xs = x.numpy() if x.dtype != torch.bfloat16 else x.view(torch.int16).numpy()
        if out is not None:
            return xs.reshape(-1).view(np_dtype), out, out.numpy().reshape(-1)
        y = np.empty(tuple(x.shape), np.uint8)
        return xs.reshape(-1).view(np_dtype), torch.from_numpy(y), y.reshape(-1)
    xd = dense_flat(x)
    if xd is None:
        return None
    y = torch.empty_like(x, dtype=torch.uint8) if out is None else out
    if y.stride() != x.stride():
        return None
    xs = xd.numpy() if x.dtype != torch.bfloat16 else xd.view(torch.int16).numpy()
    return xs.view(np_dtype), y, y.as_strided((x.numel(),), (1,)).numpy()


def quantize_dense(x: torch.Tensor, step: float, offset: int, out: torch.Tensor = None,
                   divide: bool = False):
    """``x`` (fp32, dense: contiguous in some memory order) quantized to uint8 with its
    strides (written into ``out`` when given and it fits: `dense_io`), or None when x is
    not fp32 or not dense or ``out`` does not fit (the caller then uses eager's ops).
    ``divide``: x / step (ONNX QuantizeLinear), else x · (1 / step) (AscendQuant)."""
    io = dense_io(x, np.float32, out) if x.dtype == torch.float32 else None
    if io is None:
        return None
    xf, y, yf = io
    n = xf.size
    a = np.float32(step) if divide else np.float32(1.0 / step)
    if n < SERIAL_MAX:
        _quantize_run(xf, a, np.float32(offset), yf, bool(divide))
        return y
    with launch(n):
        _quantize(xf, a, np.float32(offset), yf, bool(divide))
    return y


@njit(parallel=True, cache=True)
def _dequantize(x, offset, step, y):  # pragma: no cover - compiled by numba
    for i in prange(x.size):
        y[i] = (np.float32(x[i]) - offset) * step


def dequantize_dense(x: torch.Tensor, step: float, offset: float):
    """``x`` (uint8 or int8, dense: contiguous in some memory order) dequantized to a fresh
    fp32 tensor with its strides, ``(x - offset) * step`` in fp32 (module docstring), or
    None when x is not such a tensor (the caller then uses eager's ops)."""
    xd = dense_flat(x) if x.dtype in (torch.uint8, torch.int8) else None
    if xd is None:
        return None
    y = torch.empty_like(x, dtype=torch.float32)
    if y.stride() != x.stride():
        return None
    n = x.numel()
    if n == 0:
        return y
    with launch(n):
        _dequantize(xd.numpy(), np.float32(offset), np.float32(step), y.as_strided((n,), (1,)).numpy())
    return y


__all__ = ["dense_flat", "dense_io", "dequantize_dense", "quantize_dense", "saturate_u8",
           "saturate_u8_div"]
