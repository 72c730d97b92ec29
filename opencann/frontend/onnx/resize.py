"""ONNX Resize (opsets 11-19+) in all its interpolation modes and coordinate transforms.

Two paths. Fast: the configurations ATen's upsampling kernels compute exactly as ONNX
Runtime (4-D; nearest + asymmetric + floor → ``aten.upsample_nearest2d``; linear +
half_pixel / pytorch_half_pixel, or align_corners with an integer scale →
``aten.upsample_bilinear2d``). General: Resize is separable, so each resized axis is one
weighted sum of ``taps`` gathered slices, ``y = Σ_k w_k[o] · x[idx_k[o]]`` (an
``index_select`` per tap, weights as constants), with indices and weights computed here
from the operator's formulas: every ``coordinate_transformation_mode`` (half_pixel,
half_pixel_symmetric, pytorch_half_pixel, align_corners, asymmetric,
tf_half_pixel_for_nn, tf_crop_and_resize with ``extrapolation_value``), nearest with every
``nearest_mode``, linear, and cubic with ``cubic_coeff_a`` and ``exclude_outside``;
``axes`` and ``keep_aspect_ratio_policy`` (opset 18). Sources: the ONNX operator
specification (onnx/docs/Operators.md, Resize) and ONNX Runtime's CPU kernel
(onnxruntime/core/providers/cpu/tensor/upsample*.{h,cc}), whose conventions are followed
where they are more specific: the align_corners ratio uses the integer output length
(onnx.reference uses ``in·scale``, off by ~1 for fractional scales), a linear source
coordinate is clamped into [0, in-1], taps outside the input read the edge.
``antialias`` is left to the host fallback (ONNX Runtime)."""
from __future__ import annotations

import math
from typing import List, Optional, Tuple

import torch

from ...ir import Value
from .converter import Converter, NotConverted, OnnxNode
from .registry import converts
from .tensor import norm_axis, shape

aten = torch.ops.aten


def _source(ctm: str, x: float, scale: float, d_in: int, d_out: int,
            roi: Tuple[float, float]) -> float:
    """The input coordinate of output coordinate ``x`` on one axis (the spec's formulas)."""
    if ctm == "half_pixel":
        return (x + 0.5) / scale - 0.5
    if ctm == "half_pixel_symmetric":
        adj = d_out / (scale * d_in)
        center = d_in / 2
        return center * (1 - adj) + (x + 0.5) / scale - 0.5
    if ctm == "pytorch_half_pixel":
        return (x + 0.5) / scale - 0.5 if d_out > 1 else 0.0
    if ctm == "align_corners":
        return 0.0 if d_out == 1 else x * (d_in - 1) / (d_out - 1)
    if ctm == "asymmetric":
        return x / scale
    if ctm == "tf_half_pixel_for_nn":
        return (x + 0.5) / scale
    if ctm == "tf_crop_and_resize":
        start, end = roi
        if d_out > 1:
            return start * (d_in - 1) + x * (end - start) * (d_in - 1) / (d_out - 1)
        return 0.5 * (start + end) * (d_in - 1)
    raise NotConverted(f"coordinate_transformation_mode {ctm}")


def _nearest(xo: float, mode: str) -> int:
    f = math.floor(xo)
    if mode == "round_prefer_floor":
        return f if xo - f <= 0.5 else f + 1
    if mode == "round_prefer_ceil":
        return f if xo - f < 0.5 else f + 1
    if mode == "floor":
        return f
    if mode == "ceil":
        return math.ceil(xo)
    raise NotConverted(f"nearest_mode {mode}")


def _cubic_weights(s: float, a: float) -> List[float]:
    """Keys' cubic convolution weights of taps x0-1 .. x0+2 at fraction ``s`` (coefficient ``a``)."""
    def w(t):
        t = abs(t)
        if t <= 1:
            return ((a + 2) * t - (a + 3)) * t * t + 1
        if t < 2:
            return ((t - 5) * t + 8) * t * a - 4 * a
        return 0.0
    return [w(s + 1), w(s), w(1 - s), w(2 - s)]


def axis_taps(mode: str, ctm: str, nearest_mode: str, a: float, exclude: bool, scale: float,
              d_in: int, d_out: int, roi: Tuple[float, float]):
    """(indices [taps][d_out], weights [taps][d_out], outside [d_out]) of one resized axis:
    output o = Σ_k weights[k][o] · x[indices[k][o]]; ``outside`` marks positions that take
    ``extrapolation_value`` (tf_crop_and_resize sampling outside the input)."""
    idx: List[List[int]] = []
    wts: List[List[float]] = []
    outside = []
    for o in range(d_out):
        xo = _source(ctm, o, scale, d_in, d_out, roi)
        outside.append(ctm == "tf_crop_and_resize" and (xo < 0 or xo > d_in - 1))
        if mode == "nearest":
            i = min(max(_nearest(xo, nearest_mode), 0), d_in - 1)
            cols, ws = [i], [1.0]
        elif mode == "linear":
            xc = min(max(xo, 0.0), d_in - 1.0)
            x0 = int(math.floor(xc))
            x1 = min(x0 + 1, d_in - 1)
            f = xc - x0
            cols, ws = [x0, x1], [1.0 - f, f]
        else:
            x0 = int(math.floor(xo))
            ws = _cubic_weights(xo - x0, a)
            raw = [x0 - 1, x0, x0 + 1, x0 + 2]
            if exclude:
                ws = [w if 0 <= c < d_in else 0.0 for c, w in zip(raw, ws)]
                tot = sum(ws)
                ws = [w / tot for w in ws] if tot else ws
            cols = [min(max(c, 0), d_in - 1) for c in raw]
        idx.append(cols)
        wts.append(ws)
    taps = len(idx[0]) if idx else 1
    return ([[r[k] for r in idx] for k in range(taps)], [[r[k] for r in wts] for k in range(taps)],
            outside)


def _broadcast(t: torch.Tensor, axis: int, rank: int) -> torch.Tensor:
    s = [1] * rank
    s[axis] = t.numel()
    return t.reshape(s)


def _resize_axis(cv: Converter, x: Value, axis: int, idx, wts) -> Value:
    rank = x.desc.rank
    dt = x.desc.dtype.torch
    d_in = shape(x)[axis]
    if len(idx) == 1 and idx[0] == list(range(d_in)):
        return x
    y: Optional[Value] = None
    for cols, ws in zip(idx, wts):
        g = cv.call(aten.index_select.default, x, axis, cv.const(torch.tensor(cols, dtype=torch.int64)))
        if len(idx) > 1:
            g = cv.call(aten.mul.Tensor, g, cv.const(_broadcast(torch.tensor(ws, dtype=dt), axis, rank)))
        y = g if y is None else cv.call(aten.add.Tensor, y, g)
    return y


def _geometry(cv: Converter, n: OnnxNode, s: List[int]):
    """(output sizes, per-axis scales, roi pairs) for every axis of the input."""
    r = len(s)
    axes = n.attr("axes")
    axes = list(range(r)) if axes is None else [norm_axis(int(v), r) for v in axes]
    roi = [(0.0, 1.0)] * r
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    if ctm == "tf_crop_and_resize" and n.has(1):
        c = n.c(1)
        if c is None:
            raise NotConverted("run-time roi")
        v = [float(t) for t in c.reshape(-1).tolist()]
        if len(v) == 2 * len(axes):
            for i, a in enumerate(axes):
                roi[a] = (v[i], v[len(axes) + i])
    scales_c = n.c(2) if n.has(2) else None
    if n.has(2) and scales_c is None:
        raise NotConverted("run-time scales")
    sizes = n.ints(3) if n.has(3) else None
    if scales_c is not None and scales_c.numel() and sizes is None:
        sc = [float(v) for v in scales_c.reshape(-1).tolist()]
        scales = [1.0] * r
        for a, v in zip(axes, sc):
            scales[a] = v
        out = [int(math.floor(d * f)) for d, f in zip(s, scales)]
        return out, scales, roi
    if sizes is None:
        raise NotConverted("neither scales nor sizes")
    out = list(s)
    for a, v in zip(axes, sizes):
        out[a] = int(v)
    policy = n.attr("keep_aspect_ratio_policy", "stretch")
    if policy != "stretch":
        ratios = [out[a] / s[a] for a in axes]
        k = min(ratios) if policy == "not_larger" else max(ratios)
        for a in axes:
            out[a] = int(math.floor(k * s[a] + 0.5))
        scales = [k if a in axes else 1.0 for a in range(r)]
        return out, scales, roi
    scales = [o / d if d else 1.0 for o, d in zip(out, s)]
    return out, scales, roi


def _aten_fast(cv: Converter, n: OnnxNode, s, out, scales, from_scales: bool) -> Optional[Value]:
    """The ATen upsampling kernel for the configurations it computes as ONNX Runtime, else None."""
    if len(s) != 4 or out[:2] != s[:2] or scales[:2] != [1.0, 1.0] or \
            n.attr("axes") is not None or n.attr("keep_aspect_ratio_policy", "stretch") != "stretch":
        return None
    x = n.x(0)
    if not x.desc.dtype.is_floating:
        return None
    mode = n.attr("mode", "nearest")
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    factors = scales[2:] if from_scales else None
    size = None if from_scales else out[2:]
    if mode == "nearest" and ctm == "asymmetric" and n.attr("nearest_mode", "round_prefer_floor") == "floor":
        return cv.call(aten.upsample_nearest2d.vec, x, size, factors)
    if mode == "linear":
        if ctm == "align_corners" and (not from_scales or all(d * f == o for d, f, o in
                                                             zip(s[2:], scales[2:], out[2:]))):
            return cv.call(aten.upsample_bilinear2d.vec, x, size, True, factors)
        if ctm in ("half_pixel", "pytorch_half_pixel") and all(o > 1 for o in out[2:]):
            return cv.call(aten.upsample_bilinear2d.vec, x, size, False, factors)
    return None


@converts("Resize")
def resize(cv: Converter, n: OnnxNode):
    """ONNX Resize of a tensor of any rank (constant ``roi``, ``scales`` or ``sizes``; see the
    module docstring for the modes) → an ATen upsampling kernel where it matches ONNX
    Runtime, else per resized axis an ``index_select`` per tap and a weighted sum, then
    ``extrapolation_value`` where tf_crop_and_resize samples outside. Raises NotConverted
    (host fallback on ONNX Runtime) for ``antialias``, run-time scales/sizes/roi, linear or
    cubic on integer tensors, and unknown modes. Returns the node's outputs."""
    x = n.x(0)
    s = shape(x)
    if n.attr("antialias", 0):
        raise NotConverted("antialias Resize")
    mode = n.attr("mode", "nearest")
    if mode not in ("nearest", "linear", "cubic"):
        raise NotConverted(f"{mode} Resize")
    if mode != "nearest" and not x.desc.dtype.is_floating:
        raise NotConverted(f"{mode} Resize of an integer tensor")
    out, scales, roi = _geometry(cv, n, s)
    from_scales = n.has(2) and n.c(2) is not None and n.c(2).numel() > 0 and not n.has(3)
    fast = _aten_fast(cv, n, s, out, scales, from_scales)
    if fast is not None:
        return [fast]
    ctm = n.attr("coordinate_transformation_mode", "half_pixel")
    nm = n.attr("nearest_mode", "round_prefer_floor")
    a = float(n.attr("cubic_coeff_a", -0.75))
    exclude = bool(n.attr("exclude_outside", 0))
    y = x
    masks = []
    for ax in range(len(s)):
        if out[ax] == s[ax] and scales[ax] == 1.0 and ctm != "tf_crop_and_resize":
            continue
        if out[ax] == 0 or s[ax] == 0:
            raise NotConverted("Resize to or from an empty axis")
        idx, wts, outside = axis_taps(mode, ctm, nm, a, exclude, scales[ax], s[ax], out[ax], roi[ax])
        y = _resize_axis(cv, y, ax, idx, wts)
        if any(outside):
            masks.append(_broadcast(torch.tensor(outside), ax, len(s)))
    if masks:
        m = masks[0]
        for k in masks[1:]:
            m = m | k
        ev = float(n.attr("extrapolation_value", 0.0))
        y = cv.call(aten.where.self, cv.const(m), cv.scalar(ev, x.desc.dtype.torch), y)
    if y is x:
        y = cv.call(aten.clone.default, x)
    return [y]
