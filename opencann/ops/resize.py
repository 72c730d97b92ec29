"""Resize (``F.interpolate``) as whole ops: the ATen upsampling overloads, each one `OpDef`
whose cpu kernel is ATen's own (and its ``.out`` overload where one exists).

Why whole: torch.export's default decompositions spell bilinear/bicubic/linear resizes
out as index/mul/add arithmetic, where a zero-weight tap times a NaN neighbour gives NaN
(ATen's CPU kernel copies the input when the size is unchanged and otherwise combines
taps its own way), and bicubic becomes 16 ``index_put`` host fallbacks. Interpolation
is eager's kernel, not a re-derivation of it; `opencann.frontend.torch.capture.KEEP`
keeps these overloads out of the decomposition.

Names: CANN's operator where one exists — ``ResizeNearestNeighborV2`` (2-D nearest),
``ResizeBilinearV2`` (2-D bilinear), ``ResizeBicubic`` ("CANN Operator List", TBE ops) —
else the aclnn API's name (``aclnnUpsampleNearest1d``, ``UpsampleNearest3d``,
``UpsampleNearestExact1d/2d/3d``, ``UpsampleLinear1d``, ``UpsampleTrilinear3d``,
``UpsampleBilinear2dAA``, ``UpsampleBicubic2dAA``; source: CANN aclnn operator API
list). Each name is the ``.default`` overload (``output_size`` plus the optional per-dim
``scales_*`` that the coordinate mapping uses: what AOTAutograd/torch.compile records);
``<name>Vec`` is the ``.vec`` overload (``output_size`` or ``scale_factors``: what
torch.export and the ONNX Resize converter record). Both run the same ATen kernel.

Shapes: input [N, C, *spatial] (1, 2 or 3 spatial dims), output [N, C, *output spatial]
of the input's dtype (floating; nearest also uint8). Shape/dtype inference runs the
overload on meta tensors (`opencann.ops.opdef.infer`).

Cost: FLOPs per output element = 2·taps − 1 (a weighted sum of ``taps`` inputs: linear 2,
bilinear 4, bicubic 16, trilinear 8; nearest 0), antialiased taps grow with the
downscale factor (support 1 for bilinear, 2 for bicubic, times max(1, in/out) each side:
PyTorch's ``_upsample_*_aa`` CPU kernels, aten/src/ATen/native/cpu/UpSampleKernel.cpp);
bytes: the input read once and the output written once. vnpu: no NPU-format kernel —
the op runs ATen's kernel in ND format (`OpDef.kernel` falls back to the cpu kernel),
timed as one Vector kernel of 2·taps ops per output element (`fused_vector_cost`).

Gear padding (`OpDef.per_index`): a resize is independent along the batch and channel
dims (0, 1) and mixes the spatial ones.
"""
from __future__ import annotations

import math
from typing import Tuple

import torch

from ..devices.vnpu import KernelCost, NpuSpec, fused_vector_cost
from ..ir import Node, numel
from . import per_index as pi
from .opdef import Cost, OpDef, OpKind, _nbytes, register

aten = torch.ops.aten

# (name, ATen packet, taps per spatial dim, antialias support or 0)
_ROWS = [
    ("UpsampleNearest1d", aten.upsample_nearest1d, 1, 0),
    ("ResizeNearestNeighborV2", aten.upsample_nearest2d, 1, 0),   # CANN TBE op
    ("UpsampleNearest3d", aten.upsample_nearest3d, 1, 0),
    ("UpsampleNearestExact1d", aten._upsample_nearest_exact1d, 1, 0),
    ("UpsampleNearestExact2d", aten._upsample_nearest_exact2d, 1, 0),
    ("UpsampleNearestExact3d", aten._upsample_nearest_exact3d, 1, 0),
    ("UpsampleLinear1d", aten.upsample_linear1d, 2, 0),
    ("ResizeBilinearV2", aten.upsample_bilinear2d, 2, 0),          # CANN TBE op
    ("ResizeBicubic", aten.upsample_bicubic2d, 4, 0),              # CANN TBE op
    ("UpsampleTrilinear3d", aten.upsample_trilinear3d, 2, 0),
    ("UpsampleBilinear2dAA", aten._upsample_bilinear2d_aa, 2, 1),
    ("UpsampleBicubic2dAA", aten._upsample_bicubic2d_aa, 4, 2),
]

OVERLOADS = tuple(getattr(packet, o) for _, packet, _, _ in _ROWS for o in ("default", "vec"))
"""Every ATen overload F.interpolate reaches for a resize (``area`` is
``_adaptive_avg_pool*``, the library's pooling): kept whole through capture."""


def _taps(node: Node, per_dim: int, support: int) -> int:
    """Input elements combined per output element (product over the spatial dims)."""
    x, out = node.inputs[0].desc, node.outputs[0].desc
    n = 1
    for i, o in zip(x.shape[2:], out.shape[2:]):
        if support and isinstance(i, int) and isinstance(o, int) and o:
            n *= 2 * math.ceil(support * max(1.0, i / o))
        else:
            n *= per_dim
    return n


def _cost(per_dim: int, support: int):
    def cost(node: Node) -> Cost:
        out = node.outputs[0].desc
        if not out.is_static:
            return Cost(0, 0)
        taps = _taps(node, per_dim, support)
        flops = 0 if taps == 1 else (2 * taps - 1) * numel(out.shape)
        return Cost(flops, _nbytes(node.inputs[0].desc) + _nbytes(out))
    cost.__doc__ = f"(2·taps − 1) FLOPs per output element, {per_dim} taps per spatial dim"
    return cost


def _vnpu_cost(per_dim: int, support: int):
    def cost(node: Node, spec: NpuSpec) -> Tuple[KernelCost, str]:
        x, out = node.inputs[0].desc, node.outputs[0].desc
        n = max(1, numel(out.shape))
        taps = _taps(node, per_dim, support)
        return fused_vector_cost(n, max(1, 2 * taps - 1), _nbytes(x), n * out.dtype.itemsize,
                                 out.dtype.value, spec), "fused_vector_cost (resize)"
    return cost


def _register() -> None:
    for name, packet, per_dim, support in _ROWS:
        for overload, suffix in (("default", ""), ("vec", "Vec")):
            register(OpDef(name + suffix, OpKind.POOL, aten=getattr(packet, overload),
                           cost_fn=_cost(per_dim, support),
                           device_cost={"vnpu": _vnpu_cost(per_dim, support)},
                           per_index=pi.RESIZE,
                           doc=f"F.interpolate's {packet._qualified_op_name}.{overload}: ATen's kernel"))


_register()
