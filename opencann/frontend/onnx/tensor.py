"""ONNX converters, shape and data movement: Shape/Size/Constant/ConstantOfShape/Range
(folded to constants), Reshape/Flatten/Squeeze/Unsqueeze (views), Transpose, Concat,
Split, Slice, Gather(Elements), Expand, Tile, Pad, Identity/Dropout, Cast, Where, Trilu.
Semantics follow the ONNX operator specification (onnx/docs/Operators.md)."""
from __future__ import annotations

from typing import List, Sequence

import numpy as np
import torch

from ...ir import Value
from .converter import Converter, NotConverted, OnnxNode, torch_dtype
from .registry import converts

aten = torch.ops.aten


def shape(v: Value) -> List[int]:
    """``v``'s shape as a list of ints (static shapes only)."""
    return [int(s) for s in v.desc.shape]


def norm_axis(axis: int, rank: int) -> int:
    """``axis`` in ``[0, rank)``: a negative ONNX axis counts from the end."""
    return axis + rank if axis < 0 else axis


def reshape(cv: Converter, x: Value, new_shape: Sequence[int]) -> Value:
    """A view of ``x`` with ``new_shape`` (a contiguous copy first when ``x``'s layout
    does not allow the view, as ``torch.reshape`` does)."""
    new_shape = [int(s) for s in new_shape]
    if list(new_shape) == shape(x):
        return x
    try:
        cv.meta(x).view(new_shape)
    except RuntimeError:
        x = cv.call(aten.clone.default, x, memory_format=torch.contiguous_format)
    return cv.call(aten.view.default, x, new_shape)


@converts("Constant")
def constant(cv: Converter, n: OnnxNode):
    """ONNX Constant (``value`` tensor, or ``value_float(s)`` float32 / ``value_int(s)`` int64) → a
    graph constant. Raises NotConverted for sparse or string constants. Returns the node's
    outputs (a list of Values)."""
    from onnx import numpy_helper
    a = n.attrs
    if "value" in a:
        arr = numpy_helper.to_array(a["value"])
        t = torch.from_numpy(np.array(arr)).to(torch_dtype(a["value"].data_type, cv.where()))
    elif "value_float" in a:
        t = torch.tensor(a["value_float"], dtype=torch.float32)
    elif "value_floats" in a:
        t = torch.tensor(list(a["value_floats"]), dtype=torch.float32)
    elif "value_int" in a:
        t = torch.tensor(a["value_int"], dtype=torch.int64)
    elif "value_ints" in a:
        t = torch.tensor(list(a["value_ints"]), dtype=torch.int64)
    else:
        raise NotConverted("sparse or string constant")
    return [cv.const(t)]


@converts("Shape")
def shape_op(cv: Converter, n: OnnxNode):
    """ONNX Shape (``start``/``end`` clamped to the rank) → an int64 constant of the static shape.
    Returns the node's outputs (a list of Values)."""
    s = shape(n.x(0))
    r = len(s)
    start = n.attr("start", 0)
    end = n.attr("end", r)
    start = min(max(norm_axis(start, r), 0), r)
    end = min(max(norm_axis(end, r), 0), r)
    return [cv.const(torch.tensor(s[start:end], dtype=torch.int64))]


@converts("Size")
def size_op(cv: Converter, n: OnnxNode):
    """ONNX Size → an int64 scalar constant: the number of elements. Returns the node's outputs (a
    list of Values)."""
    return [cv.const(torch.tensor(int(np.prod(shape(n.x(0)))), dtype=torch.int64))]


@converts("ConstantOfShape")
def constant_of_shape(cv: Converter, n: OnnxNode):
    """ONNX ConstantOfShape → a constant of the given shape filled with ``value`` (a one-element
    tensor; default float32 zero). Returns the node's outputs (a list of Values)."""
    from onnx import numpy_helper
    dims = n.ints(0)
    val = n.attr("value")
    if val is None:
        fill = torch.zeros((), dtype=torch.float32)
    else:
        fill = torch.from_numpy(np.array(numpy_helper.to_array(val))).reshape(())
        fill = fill.to(torch_dtype(val.data_type, cv.where()))
    return [cv.const(torch.full(dims, fill.item(), dtype=fill.dtype))]


@converts("Range")
def range_op(cv: Converter, n: OnnxNode):
    """ONNX Range with constant start, limit and delta → an ``arange`` constant in the start's
    dtype. Raises NotConverted for run-time values (the length would be data-dependent). Returns
    the node's outputs (a list of Values)."""
    s, l, d = n.c(0), n.c(1), n.c(2)
    if s is None or l is None or d is None:
        raise NotConverted("Range over run-time values has a data-dependent shape")
    return [cv.const(torch.arange(s.item(), l.item(), d.item(), dtype=s.dtype))]


@converts("Identity")
def identity(cv: Converter, n: OnnxNode):
    """ONNX Identity: the input Value itself. Returns the node's outputs (a list of Values)."""
    return [n.x(0)]


@converts("Dropout")
def dropout(cv: Converter, n: OnnxNode):
    """ONNX Dropout in inference: the input itself, and an all-true bool mask when the mask output
    is used. Raises NotConverted when ``training_mode`` is true or not constant. Returns the
    node's outputs (a list of Values)."""
    training = n.c(2)
    if n.has(2) and (training is None or bool(training.item())):
        raise NotConverted("training-mode Dropout")
    x = n.x(0)
    outs = [x]
    if len(n.outputs) > 1 and n.outputs[1]:
        outs.append(cv.const(torch.ones(shape(x), dtype=torch.bool)))
    return outs


@converts("Cast")
def cast(cv: Converter, n: OnnxNode):
    """ONNX Cast to ``to`` → ``aten._to_copy`` (float→int truncates toward zero; NaN/inf are
    undefined in the specification); the input itself when the dtype already matches. Raises
    NotConverted for float8 ``saturate``/``round_mode``. Returns the node's outputs (a list of
    Values)."""
    to = torch_dtype(n.attr("to"), cv.where())
    if n.attr("saturate", 1) != 1 or n.attr("round_mode", "up") != "up":
        raise NotConverted("float8 saturation / rounding mode")
    x = n.x(0)
    if x.desc.dtype.torch == to:
        return [x]
    if x.desc.dtype.torch.is_floating_point and not to.is_floating_point and to != torch.bool:
        # ONNX float->int casts truncate like C; so does torch. NaN/out-of-range are UB in both
        pass
    return [cv.call(aten._to_copy.default, x, dtype=to)]


@converts("CastLike")
def cast_like(cv: Converter, n: OnnxNode):
    """ONNX CastLike: a cast to the second input's dtype (`cast`'s rules). Returns the node's
    outputs (a list of Values)."""
    x, like = n.x(0), n.x(1)
    if x.desc.dtype == like.desc.dtype:
        return [x]
    return [cv.call(aten._to_copy.default, x, dtype=like.desc.dtype.torch)]


@converts("Reshape")
def reshape_op(cv: Converter, n: OnnxNode):
    """ONNX Reshape to a constant shape (0 copies the input's dim unless ``allowzero``; one -1 is
    inferred) → a view (a contiguous copy first when the layout needs it). Returns the node's
    outputs (a list of Values)."""
    x = n.x(0)
    want = n.ints(1)
    allowzero = n.attr("allowzero", 0)
    src = shape(x)
    out = [src[i] if (d == 0 and not allowzero) else d for i, d in enumerate(want)]
    if -1 in out:
        known = int(np.prod([d for d in out if d != -1]))
        out[out.index(-1)] = int(np.prod(src)) // known if known else 0
    return [reshape(cv, x, out)]


@converts("Flatten")
def flatten(cv: Converter, n: OnnxNode):
    """ONNX Flatten at ``axis`` (default 1): a 2-D view [prod(dims before), prod(dims from axis)].
    Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    s = shape(x)
    axis = norm_axis(n.attr("axis", 1), len(s))
    return [reshape(cv, x, [int(np.prod(s[:axis])), int(np.prod(s[axis:]))])]


@converts("Squeeze")
def squeeze(cv: Converter, n: OnnxNode):
    """ONNX Squeeze of the given ``axes`` (input or attribute; all size-1 dims when absent): a
    view. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    s = shape(x)
    axes = n.ints(1) if n.has(1) else n.attr("axes")
    axes = [i for i, d in enumerate(s) if d == 1] if axes is None else \
        [norm_axis(a, len(s)) for a in axes]
    return [reshape(cv, x, [d for i, d in enumerate(s) if i not in axes])]


@converts("Unsqueeze")
def unsqueeze(cv: Converter, n: OnnxNode):
    """ONNX Unsqueeze: size-1 dims inserted at ``axes`` (input or attribute, counted in the
    output's rank): a view. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    s = shape(x)
    axes = n.ints(1) if n.has(1) else n.attr("axes")
    r = len(s) + len(axes)
    axes = sorted(norm_axis(a, r) for a in axes)
    out = list(s)
    for a in axes:
        out.insert(a, 1)
    return [reshape(cv, x, out)]


@converts("Transpose")
def transpose(cv: Converter, n: OnnxNode):
    """ONNX Transpose by ``perm`` (default: reversed dims) → ``aten.permute``; the input itself for
    the identity permutation. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    perm = n.attr("perm") or list(range(x.desc.rank))[::-1]
    perm = list(perm)
    if perm == list(range(x.desc.rank)):
        return [x]
    return [cv.call(aten.permute.default, x, perm)]


@converts("Concat")
def concat(cv: Converter, n: OnnxNode):
    """ONNX Concat along ``axis`` → ``aten.cat`` (one input: itself). Returns the node's outputs (a
    list of Values)."""
    xs = [n.x(i) for i in range(len(n.inputs)) if n.has(i)]
    axis = norm_axis(n.attr("axis"), xs[0].desc.rank)
    if len(xs) == 1:
        return [xs[0]]
    return [cv.call(aten.cat.default, xs, axis)]


@converts("Split")
def split(cv: Converter, n: OnnxNode):
    """ONNX Split along ``axis`` into the given sizes (input or attribute) or ``num_outputs``
    near-equal parts (the last smaller) → ``aten.split_with_sizes``. Returns the node's outputs
    (a list of Values)."""
    x = n.x(0)
    axis = norm_axis(n.attr("axis", 0), x.desc.rank)
    dim = shape(x)[axis]
    k = len(n.outputs)
    sizes = n.ints(1) if n.has(1) else n.attr("split")
    if sizes is None:
        parts = n.attr("num_outputs", k)
        step = -(-dim // parts)
        sizes = [min(step, dim - i * step) for i in range(parts)]
    sizes = list(sizes)
    return list(cv.call(aten.split_with_sizes.default, x, sizes, axis))


@converts("Slice")
def slice_op(cv: Converter, n: OnnxNode):
    """ONNX Slice with constant starts, ends, axes and steps (clamped as the specification says) →
    ``aten.slice`` for positive steps, ``index_select`` for negative ones. Raises NotConverted
    for a zero step. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    s = shape(x)
    starts, ends = n.ints(1), n.ints(2)
    axes = n.ints(3, list(range(len(starts))))
    steps = n.ints(4, [1] * len(starts))
    for st, en, ax, sp in zip(starts, ends, axes, steps):
        ax = norm_axis(ax, len(s))
        d = s[ax]
        if sp == 0:
            raise NotConverted("zero step")
        # clamp as the ONNX spec: [0, d] for positive steps
        st = st + d if st < 0 else st
        en = en + d if en < 0 else en
        if sp > 0:
            st, en = min(max(st, 0), d), min(max(en, 0), d)
            if st == 0 and en == d and sp == 1:
                continue
            x = cv.call(aten.slice.Tensor, x, ax, st, max(en, st), sp)
        else:   # the spec: starts into [0, d-1], ends into [-1, d-1] for negative steps
            st, en = min(max(st, 0), d - 1), min(max(en, -1), d - 1)
            idx = list(range(st, en, sp))
            x = cv.call(aten.index_select.default, x, ax, cv.const(torch.tensor(idx, dtype=torch.int64)))
        s = shape(x)
    if x is n.x(0):
        return [x]
    return [x]


@converts("Gather")
def gather(cv: Converter, n: OnnxNode):
    """ONNX Gather along ``axis``: ``select`` for a constant scalar index, ``index_select`` + view
    for constant indices (negative ones wrapped), ``aten.index`` for run-time indices. Returns
    the node's outputs (a list of Values)."""
    x, idx = n.x(0), n.x(1)
    axis = norm_axis(n.attr("axis", 0), x.desc.rank)
    c = n.c(1)
    if c is not None and c.dim() == 0:
        return [cv.call(aten.select.int, x, axis, int(c.item()))]
    if c is not None:
        d = shape(x)[axis]
        c = torch.where(c < 0, c + d, c).to(torch.int64)
        flat = cv.call(aten.index_select.default, x, axis, cv.const(c.reshape(-1)))
        s = shape(x)
        return [reshape(cv, flat, s[:axis] + list(c.shape) + s[axis + 1:])]
    return [cv.call(aten.index.Tensor, x, [None] * axis + [idx])]


@converts("GatherElements")
def gather_elements(cv: Converter, n: OnnxNode):
    """ONNX GatherElements along ``axis`` → ``aten.gather`` with negative indices wrapped and cast
    to int64. Returns the node's outputs (a list of Values)."""
    x, idx = n.x(0), n.x(1)
    axis = norm_axis(n.attr("axis", 0), x.desc.rank)
    d = cv.scalar(shape(x)[axis], idx.desc.dtype.torch)
    neg = cv.call(aten.lt.Scalar, idx, 0)
    idx = cv.call(aten.where.self, neg, cv.call(aten.add.Tensor, idx, d), idx)
    if idx.desc.dtype.torch != torch.int64:
        idx = cv.call(aten._to_copy.default, idx, dtype=torch.int64)
    return [cv.call(aten.gather.default, x, axis, idx)]


@converts("Expand")
def expand(cv: Converter, n: OnnxNode):
    """ONNX Expand to the broadcast of the input's shape and a constant shape → ``aten.expand`` (a
    view). Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    want = n.ints(1)
    out = list(np.broadcast_shapes(tuple(shape(x)), tuple(want)))
    if out == shape(x):
        return [x]
    return [cv.call(aten.expand.default, x, out)]


@converts("Tile")
def tile(cv: Converter, n: OnnxNode):
    """ONNX Tile by constant repeats → ``aten.repeat``. Returns the node's outputs (a list of
    Values)."""
    return [cv.call(aten.repeat.default, n.x(0), n.ints(1))]


def _pad_by_index(cv: Converter, x: Value, axis: int, before: int, after: int, mode: str) -> Value:
    """``x`` padded (negative: cropped) along ``axis`` in ``mode`` reflect (mirror without
    the edge), edge (repeat the edge) or wrap (periodic), as one ``index_select`` of a
    constant index list (ONNX Pad, onnx/docs/Operators.md; the same indices as numpy.pad's
    reflect / edge / wrap modes). Raises NotConverted for an empty axis and a reflect pad
    longer than the axis minus one (ONNX Runtime refuses it)."""
    if before < 0 or after < 0:      # crop first; the padding then refers to what is left
        d = shape(x)[axis]
        x = cv.call(aten.slice.Tensor, x, axis, max(-before, 0), max(d - max(-after, 0),
                                                                     max(-before, 0)), 1)
        before, after = max(before, 0), max(after, 0)
    d = shape(x)[axis]
    if before == 0 and after == 0:
        return x
    if d == 0:
        raise NotConverted(f"{mode} Pad of an empty axis")
    if mode == "reflect" and max(before, after) > d - 1:
        raise NotConverted("reflect Pad longer than the axis minus one")
    idx = []
    for i in range(-before, d + after):
        if mode == "edge":
            j = min(max(i, 0), d - 1)
        elif mode == "wrap":
            j = i % d
        else:
            j = -i if i < 0 else (2 * (d - 1) - i if i >= d else i)
        idx.append(j)
    return cv.call(aten.index_select.default, x, axis, cv.const(torch.tensor(idx, dtype=torch.int64)))


@converts("Pad")
def pad(cv: Converter, n: OnnxNode):
    """ONNX Pad with constant pads (and ``axes``): constant mode (constant pad value) →
    ``aten.constant_pad_nd``; reflect, edge and wrap → one ``index_select`` per padded axis
    (`_pad_by_index`); the input itself when all pads are 0. Raises NotConverted for a
    run-time pad value. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    r = x.desc.rank
    mode = n.attr("mode", "constant")
    if mode not in ("constant", "reflect", "edge", "wrap"):
        raise NotConverted(f"Pad mode {mode}")
    pads = n.ints(1)
    if mode != "constant":
        axes = [norm_axis(a, r) for a in n.ints(3, list(range(r)))]
        k = len(axes)
        for i, a in enumerate(axes):
            x = _pad_by_index(cv, x, a, pads[i], pads[k + i], mode)
        return [x]
    value = 0.0
    if n.has(2):
        c = n.c(2)
        if c is None:
            raise NotConverted("run-time pad value")
        value = c.reshape(-1)[0].item() if c.numel() else 0.0
    axes = [norm_axis(a, r) for a in n.ints(3, list(range(r)))]
    k = len(axes)
    begin = {a: pads[i] for i, a in enumerate(axes)}
    end = {a: pads[k + i] for i, a in enumerate(axes)}
    first = min(axes) if axes else r
    tpad: List[int] = []
    for a in range(r - 1, first - 1, -1):
        tpad += [begin.get(a, 0), end.get(a, 0)]
    if not any(tpad):
        return [x]
    return [cv.call(aten.constant_pad_nd.default, x, tpad, value)]


@converts("Where")
def where(cv: Converter, n: OnnxNode):
    """ONNX Where(condition, X, Y) with broadcasting → ``aten.where.self``. Returns the node's
    outputs (a list of Values)."""
    return [cv.call(aten.where.self, n.x(0), n.x(1), n.x(2))]


@converts("Trilu")
def trilu(cv: Converter, n: OnnxNode):
    """ONNX Trilu: ``triu`` (``upper`` default 1) or ``tril`` with diagonal offset ``k`` (optional
    constant input, default 0). Returns the node's outputs (a list of Values)."""
    k = n.ints(1, [0])[0]
    fn = aten.triu.default if n.attr("upper", 1) else aten.tril.default
    return [cv.call(fn, n.x(0), k)]
