"""ONNX converters for sampling and gathering ops common in exported vision and language
models: GridSample (opset 16 names bilinear/nearest/bicubic, opset 20 names
linear/nearest/cubic) → ``aten.grid_sampler_2d``/``grid_sampler_3d``; GatherND (with
``batch_dims``) → ``aten.index``; LRN → a channel-window average of squares
(``aten.avg_pool2d``). Semantics: the ONNX operator specification
(onnx/docs/Operators.md), checked against ONNX Runtime in
tests/conformance/onnx/test_fallback_kinds.py."""
from __future__ import annotations

import torch

from .converter import Converter, NotConverted, OnnxNode
from .registry import converts
from .tensor import reshape, shape

aten = torch.ops.aten

_GRID_MODES = {"bilinear": 0, "linear": 0, "nearest": 1, "bicubic": 2, "cubic": 2}
_GRID_PADDING = {"zeros": 0, "border": 1, "reflection": 2}


@converts("GridSample")
def grid_sample(cv: Converter, n: OnnxNode):
    """ONNX GridSample of X [N, C, H, W] at grid [N, Ho, Wo, 2] (or 5-D: [N, C, D, H, W] at
    [N, Do, Ho, Wo, 3]) with ``mode``, ``padding_mode`` and ``align_corners`` →
    ``aten.grid_sampler_2d`` / ``grid_sampler_3d`` (the same sampling rules: PyTorch's
    grid_sample is the operator's reference). Raises NotConverted for other ranks,
    cubic 3-D sampling, non-float inputs or unknown modes. Returns the node's outputs."""
    x, grid = n.x(0), n.x(1)
    mode = n.attr("mode", "linear" if cv.opset >= 20 else "bilinear")
    pad = n.attr("padding_mode", "zeros")
    if mode not in _GRID_MODES or pad not in _GRID_PADDING:
        raise NotConverted(f"GridSample mode {mode} / padding_mode {pad}")
    if not x.desc.dtype.is_floating or x.desc.dtype != grid.desc.dtype:
        raise NotConverted("GridSample of non-float or mixed-dtype inputs")
    ac = bool(n.attr("align_corners", 0))
    if x.desc.rank == 4:
        return [cv.call(aten.grid_sampler_2d.default, x, grid, _GRID_MODES[mode],
                        _GRID_PADDING[pad], ac)]
    if x.desc.rank == 5 and _GRID_MODES[mode] != 2:
        return [cv.call(aten.grid_sampler_3d.default, x, grid, _GRID_MODES[mode],
                        _GRID_PADDING[pad], ac)]
    raise NotConverted(f"{x.desc.rank}-D GridSample with mode {mode}")


@converts("GatherND")
def gather_nd(cv: Converter, n: OnnxNode):
    """ONNX GatherND: data [b..., d...] at int64 indices [b..., m..., k] (the first
    ``batch_dims`` dims shared) → output [b..., m..., d[k:]...] by ``aten.index`` with one
    index tensor per indexed dim (negative indices count from the end, as the
    specification says) and, for batch dims, a broadcast arange over the flattened batch.
    Returns the node's outputs."""
    data, idx = n.x(0), n.x(1)
    b = int(n.attr("batch_dims", 0))
    ds, ish = shape(data), shape(idx)
    k = ish[-1]
    if k > len(ds) - b:
        raise NotConverted("GatherND index depth beyond the data's rank")
    if idx.desc.dtype.torch != torch.int64:
        idx = cv.call(aten._to_copy.default, idx, dtype=torch.int64)
    nb = 1
    for s in ds[:b]:
        nb *= s
    mid = ish[b:-1]
    data2 = reshape(cv, data, [nb] + ds[b:])
    idx2 = reshape(cv, idx, [nb] + mid + [k])
    cols = [cv.call(aten.select.int, idx2, -1, j) for j in range(k)]
    lead = []
    if b:
        ar = torch.arange(nb, dtype=torch.int64).reshape([nb] + [1] * len(mid))
        lead = [cv.const(ar)]
    else:
        data2 = reshape(cv, data, ds)
        cols = [cv.call(aten.select.int, idx, -1, j) for j in range(k)]
    if k == 0 and not b:
        out = cv.call(aten.expand.default, reshape(cv, data, [1] * len(mid) + ds), mid + ds)
        return [cv.call(aten.clone.default, out)]
    y = cv.call(aten.index.Tensor, data2, lead + cols)
    return [reshape(cv, y, ish[:-1] + ds[b + k:])]


@converts("LRN")
def lrn(cv: Converter, n: OnnxNode):
    """ONNX LRN over channels of X [N, C, ...]: y = x / (bias + alpha/size · Σ x²)^beta, the
    sum over channels [c - ⌊(size-1)/2⌋, c + ⌈(size-1)/2⌉] (zero outside) → squares
    zero-padded along C and averaged by ``aten.avg_pool2d`` with a (size, 1) window on
    [N, 1, C, rest]. Raises NotConverted for non-float inputs. Returns the node's outputs."""
    x = n.x(0)
    if not x.desc.dtype.is_floating:
        raise NotConverted("LRN of a non-float input")
    size = int(n.attr("size"))
    alpha, beta, bias = float(n.attr("alpha", 1e-4)), float(n.attr("beta", 0.75)), \
        float(n.attr("bias", 1.0))
    s = shape(x)
    rest = 1
    for d in s[2:]:
        rest *= d
    sq = reshape(cv, cv.call(aten.mul.Tensor, x, x), [s[0], 1, s[1], rest])
    lo, hi = (size - 1) // 2, size - 1 - (size - 1) // 2
    sq = cv.call(aten.constant_pad_nd.default, sq, [0, 0, lo, hi], 0.0)
    mean = cv.call(aten.avg_pool2d.default, sq, [size, 1], [1, 1], [0, 0], False, True)
    den = cv.call(aten.add.Tensor, cv.call(aten.mul.Tensor, reshape(cv, mean, s), alpha),
                  bias)
    return [cv.call(aten.div.Tensor, x, cv.call(aten.pow.Tensor_Scalar, den, beta))]
