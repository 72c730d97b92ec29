"""2-D max pooling of a channels-last fp32 / bf16 activation in one numba pass (MaxPool's
CPU kernel through `pool_cpu.make_max_pool_kernel`): per output row, each window's
elements maxed into the output pixel's C contiguous channels (the inner loops run along
C, which LLVM vectorizes), with eager's rule of ATen's CPU kernel
(``aten/src/ATen/native/cpu/MaxPoolKernel.cpp``): start at -inf and take ``val`` when
``val > max || isnan(val)``, so a NaN in the window gives NaN (the window's last), -0.0
and +0.0 tie (the first kept), and fp32 results are eager's bits. bf16 is compared as the
fp32 value its bits extend to (bf16 is fp32's top 16 bits) and the chosen element's bits
are written back: the same values as eager's (it computes in fp32 and rounds the chosen
element, which is exact), NaN where eager's is NaN (its payload may differ: eager's
rounding canonicalizes it).

Measured against ATen's ``max_pool2d`` (``bench/maxpool.py``: ResNet-50's stem pool, 3×3
stride 2 pad 1 over channels-last [N, 64, 112, 112], least of interleaved calls, 2
threads, shared 2-core Xeon with AMX): fp32 472 → 262 µs at N = 1 and 8.8 → 2.3 ms at
N = 8 (load 5), 455 → 236 µs and 2.1-3.9 → 1.8 ms (load 1.3-2.3); bf16 464 → 326 µs and
9.7 → 2.6 ms (load 5), 451 → 292 µs and 2.0-4.4 → 2.3-2.4 ms (load 1.3-2.3). (uint8 was
tried for QuantMaxPool and not kept: faster than ``quantized::max_pool2d`` at load 5,
slower at load 1.3.) numba because the project's CPU codegen is numba (DESIGN.md); thread
count and launch as the other numba kernels (`numba_cache.launch`). Source of the output
size (``ceil_mode`` included) and the window rule: PyTorch ``aten/src/ATen/native/Pool.h``
(``pooling_output_shape``; padding at most half the kernel, so every window holds an
element of the input)."""
from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch
from numba import prange

from .numba_cache import launch, njit


@njit(parallel=True, cache=True)
def _max_pool_nhwc_f32(x, y, kh, kw, sh, sw, ph, pw, dh, dw):  # pragma: no cover - compiled by numba
    n_, h_, w_, c_ = x.shape
    oh_, ow_ = y.shape[1], y.shape[2]
    for r in prange(n_ * oh_):
        n = r // oh_
        oh = r - n * oh_
        for ow in range(ow_):
            out = y[n, oh, ow]
            out[:] = -np.inf
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
                        v = src[c]
                        if v > out[c] or v != v:
                            out[c] = v


@njit(parallel=True, cache=True)
def _max_pool_nhwc_bf16(x, y, kh, kw, sh, sw, ph, pw, dh, dw):  # pragma: no cover - compiled by numba
    # x, y: the bf16 tensors' uint16 bits; each element compared as the fp32 its bits extend to
    n_, h_, w_, c_ = x.shape
    oh_, ow_ = y.shape[1], y.shape[2]
    for r in prange(n_ * oh_):
        n = r // oh_
        oh = r - n * oh_
        vi = np.empty(c_, np.uint32)
        vf = vi.view(np.float32)
        mi = np.empty(c_, np.uint32)
        mf = mi.view(np.float32)
        for ow in range(ow_):
            mf[:] = -np.inf
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
                        vi[c] = np.uint32(src[c]) << 16
                    for c in range(c_):
                        v = vf[c]
                        if v > mf[c] or v != v:
                            mf[c] = v
            out = y[n, oh, ow]
            for c in range(c_):
                out[c] = np.uint16(mi[c] >> 16)


def pooled_size(size: int, k: int, s: int, p: int, d: int, ceil: bool) -> int:
    """PyTorch's ``pooling_output_shape`` for one spatial dim (module docstring)."""
    num = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil else 0)
    out = num // s + 1
    if ceil and (out - 1) * s >= size + p:
        out -= 1
    return out


def _pool(x: torch.Tensor, dtypes, k, stride, pad, dil, ceil) -> Optional[torch.Tensor]:
    """The pooled channels-last tensor, or None when x is not a channels-last 4-D tensor
    of one of ``dtypes`` or ``pad`` exceeds half the kernel."""
    if x.dtype not in dtypes or x.dim() != 4 or not x.is_contiguous(memory_format=torch.channels_last) \
            or any(2 * p > kk for p, kk in zip(pad, k)):
        return None
    n, c, h, w = x.shape
    oh = pooled_size(h, k[0], stride[0], pad[0], dil[0], ceil)
    ow = pooled_size(w, k[1], stride[1], pad[1], dil[1], ceil)
    y = torch.empty((n, c, oh, ow), dtype=x.dtype, memory_format=torch.channels_last)
    if y.numel() == 0:
        return y
    xv, yv = x.permute(0, 2, 3, 1), y.permute(0, 2, 3, 1)
    if x.dtype == torch.bfloat16:
        xa, ya, f = xv.view(torch.int16).numpy().view(np.uint16), yv.view(torch.int16).numpy().view(np.uint16), \
            _max_pool_nhwc_bf16
    else:
        xa, ya, f = xv.numpy(), yv.numpy(), _max_pool_nhwc_f32
    with launch(x.numel()):
        f(xa, ya, k[0], k[1], stride[0], stride[1], pad[0], pad[1], dil[0], dil[1])
    return y


def max_pool_float(x: torch.Tensor, k: Sequence[int], stride: Sequence[int], pad: Sequence[int],
                   dil: Sequence[int], ceil: bool) -> Optional[torch.Tensor]:
    """``max_pool2d`` of fp32 or bf16 ``x`` [N, C, H, W] stored channels-last with eager's
    NaN rule (module docstring), as a fresh channels-last tensor of x's dtype; None when x
    is not such a tensor or ``pad`` exceeds half the kernel (the caller then uses ATen's
    kernel). ``k``, ``stride``, ``pad``, ``dil``: (h, w) pairs; ``ceil``: ceil_mode."""
    return _pool(x, (torch.float32, torch.bfloat16), k, stride, pad, dil, ceil)


__all__ = ["max_pool_float", "pooled_size"]
