"""MaxPool's CPU kernel (a bind-time factory, the OpDef's ``kernel_factories["cpu"]``):
`maxpool_numba.max_pool_float` on a channels-last fp32 / bf16 activation (ResNet-50's
stem pool 1.4-4x faster than ATen's ``max_pool2d``, eager's values and NaN positions;
figures in that module), ATen's ``max_pool2d`` on anything else. numba loads on the
first call, not at import."""
from __future__ import annotations

from typing import Callable, List, Sequence

import torch

from ...ir import Node, TensorDesc


def _pair(v, default) -> List[int]:
    """An int or a 1- / 2-sequence as [h, w]; ``default`` when None or empty."""
    v = default if v is None or (isinstance(v, (list, tuple)) and not v) else v
    if isinstance(v, int):
        return [v, v]
    v = [int(e) for e in v]
    return v * 2 if len(v) == 1 else v


def make_max_pool_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """MaxPool (``node.attrs`` as ATen's ``max_pool2d``: ``kernel_size``, ``stride``
    (default: the kernel), ``padding`` (default 0), ``dilation`` (default 1),
    ``ceil_mode``): ``run(x)`` gives `maxpool_numba.max_pool_float` for a channels-last
    4-D fp32 / bf16 x with padding at most half the kernel, else ATen's ``max_pool2d``
    (any other dtype, layout or rank); a fresh tensor either way, eager's values and NaN
    positions. Raises KeyError when ``kernel_size`` is missing (the converter always
    sets it)."""
    a = node.attrs
    k = _pair(a["kernel_size"], None)
    stride = _pair(a.get("stride"), k)
    pad = _pair(a.get("padding"), 0)
    dil = _pair(a.get("dilation"), 1)
    ceil = bool(a.get("ceil_mode", False))
    aten = torch.ops.aten.max_pool2d.default

    def run(x):
        if x.dtype in (torch.float32, torch.bfloat16) and x.dim() == 4:
            from .maxpool_numba import max_pool_float
            y = max_pool_float(x, k, stride, pad, dil, ceil)
            if y is not None:
                return y
        return aten(x, k, stride, pad, dil, ceil)
    return run


__all__ = ["make_max_pool_kernel"]
