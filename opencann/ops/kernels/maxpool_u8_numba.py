"""Max pooling of a channels-last uint8 activation (QuantMaxPool's CPU kernel body) in one
numba pass: per output row, each window's elements maxed into the output pixel's C
contiguous channels (the inner loop runs along C, which LLVM vectorizes). Integer max
is exact, so the result equals ``quantized::max_pool2d``'s and eager's ``max_pool2d`` of
the same values in fp32. ResNet-50's stem pool (uint8 [1, 64, 112, 112] → [1, 64, 56,
56], 3×3 stride 2 pad 1) took 248 µs in ``quantized::max_pool2d`` (least of 200 calls, 2
threads, load 5), ATen's fp32 / bf16 ``max_pool2d`` 410 / 429 µs. numba because the
project's CPU codegen is numba (DESIGN.md); thread count and launch as the other numba
kernels (`numba_cache.launch`). Source of the output size (``ceil_mode`` included) and
the window rule: PyTorch ``aten/src/ATen/native/Pool.h`` (``pooling_output_shape``:
padding at most half the kernel, so every window holds an element of the input and 0,
uint8's minimum, is max's identity)."""
from __future__ import annotations

from typing import Optional, Sequence

import torch
from numba import prange

from .numba_cache import launch, njit


@njit(parallel=True, cache=True)
def _max_pool_nhwc(x, y, kh, kw, sh, sw, ph, pw, dh, dw):  # pragma: no cover - compiled by numba
    n_, h_, w_, c_ = x.shape
    oh_, ow_ = y.shape[1], y.shape[2]
    for r in prange(n_ * oh_):
        n = r // oh_
        oh = r - n * oh_
        for ow in range(ow_):
            out = y[n, oh, ow]
            out[:] = 0
            for i in range(kh):
                ih = oh * sh - ph + i * dh
                if ih < 0 or ih >= h_:
                    continue
                for j in range(kw):
                    iw = ow * sw - pw + j * dw
                    if iw < 0 or iw >= w_:
                        continue
                    src = x[n, ih, iw]
                    for c in range(c_):
                        out[c] = max(out[c], src[c])


def pooled_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """PyTorch's ``pooling_output_shape`` for one spatial dim (module docstring)."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)
    out = num // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def max_pool_u8(x: torch.Tensor, k: Sequence[int], stride: Sequence[int], pad: Sequence[int],
                dil: Sequence[int], ceil: bool) -> Optional[torch.Tensor]:
    """``max_pool2d`` of uint8 ``x`` [N, C, H, W] stored channels-last (kernel ``k``,
    ``stride``, ``pad``, ``dil`` as (h, w) pairs; ``ceil``: ceil_mode) as a fresh
    channels-last uint8 [N, C, OH, OW]; None when x is not a channels-last uint8 4-D
    tensor or ``pad`` exceeds half the kernel (the caller then uses torch's kernel)."""
    if x.dtype != torch.uint8 or x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) \
            or any(2 * p > kk for p, kk in zip(pad, k)):
        return None
    n, c, h, w = x.shape
    oh = pooled_size(h, k[0], stride[0], pad[0], dil[0], ceil)
    ow = pooled_size(w, k[1], stride[1], pad[1], dil[1], ceil)
    y = torch.empty((n, c, oh, ow), dtype=torch.uint8, memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    with launch(x.numel()):
        _max_pool_nhwc(x.permute(0, 2, 3, 1).numpy(), y.permute(0, 2, 3, 1).numpy(),
                       k[0], k[1], stride[0], stride[1], pad[0], pad[1], dil[0], dil[1])
    return y


__all__ = ["max_pool_u8", "pooled_size"]
