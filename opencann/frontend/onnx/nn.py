"""ONNX converters, arithmetic and neural-network ops: elementwise math, activations,
reductions, MatMul/Gemm, Conv/ConvTranspose, Batch/Layer/Group/InstanceNormalization,
Softmax, pooling (Resize: ``resize.py``). Each maps to the ATen overloads the torch frontend produces
(Gemm → ``aten.addmm``, Conv → ``aten.convolution``, inference BatchNormalization →
``aten._native_batch_norm_legit_no_training``...) so the fusion passes apply as they
do to captured PyTorch models. Semantics: the ONNX operator specification
(onnx/docs/Operators.md); configurations not mapped raise NotConverted (host fallback).

NaN, ±inf and ±0 (compared with ONNX Runtime 1.x CPU and numpy on NaN, ±inf, ±0 and
halves; tests/integration/test_onnx_frontend.py): where ATen differs from the specification the
converter corrects it: ``Sign(NaN)`` is NaN (``aten.sign`` gives 0); ``Clip``'s absent
bounds are the type's lowest / largest value, so ``±inf`` clips to ``±FLT_MAX``.
``Round`` is half to even, ``Mod`` follows the divisor's sign (``fmod=1``: the
dividend's; float ``Mod`` runs in float64, as ATen's vectorized float32 kernels give NaN
where the quotient overflows), float→int ``Cast`` of NaN/±inf is undefined in the specification (ours
matches ONNX Runtime on x86). Where ONNX Runtime itself deviates from the specification
and numpy, we follow the specification / numpy: ``ReduceMax``/``ReduceMin`` with a NaN
give NaN and ``ArgMax``/``ArgMin`` the index of the first NaN (ONNX Runtime skips NaN);
``ReduceLogSumExp`` over a NaN and +inf is NaN (ONNX Runtime gives inf when the +inf comes
first; found by
``opencann fuzz --backend onnx``, seed 20028);
``MaxPool`` keeps NaN (ONNX Runtime drops some, by position); a NaN ``Clip`` bound
makes the result NaN (numpy, ATen; ONNX Runtime ignores the bound, the specification
does not say). ``Selu``/``Celu`` of ``-0.0`` give ``-0.0`` (ONNX Runtime ``+0.0``)."""
from __future__ import annotations

import math
from typing import List, Optional

import torch

from ...ir import Value
from .converter import Converter, NotConverted, OnnxNode
from .registry import converts
from .tensor import norm_axis, reshape, shape

aten = torch.ops.aten

_UNARY = {
    "Abs": aten.abs.default, "Neg": aten.neg.default, "Exp": aten.exp.default,
    "Log": aten.log.default, "Sqrt": aten.sqrt.default, "Reciprocal": aten.reciprocal.default,
    "Sin": aten.sin.default, "Cos": aten.cos.default, "Tan": aten.tan.default,
    "Asin": aten.asin.default, "Acos": aten.acos.default, "Atan": aten.atan.default,
    "Sinh": aten.sinh.default, "Cosh": aten.cosh.default, "Asinh": aten.asinh.default,
    "Acosh": aten.acosh.default, "Atanh": aten.atanh.default,
    "Floor": aten.floor.default, "Ceil": aten.ceil.default, "Round": aten.round.default,
    "Sign": aten.sign.default, "Erf": aten.erf.default, "Relu": aten.relu.default,
    "Sigmoid": aten.sigmoid.default, "Tanh": aten.tanh.default, "Not": aten.logical_not.default,
    "IsNaN": aten.isnan.default, "BitwiseNot": aten.bitwise_not.default,
    "Mish": aten.mish.default, "Softplus": aten.softplus.default,
}
_BINARY = {
    "Add": aten.add.Tensor, "Sub": aten.sub.Tensor, "Mul": aten.mul.Tensor,
    "Equal": aten.eq.Tensor, "Less": aten.lt.Tensor, "LessOrEqual": aten.le.Tensor,
    "Greater": aten.gt.Tensor, "GreaterOrEqual": aten.ge.Tensor,
    "And": aten.logical_and.default, "Or": aten.logical_or.default,
    "Xor": aten.logical_xor.default, "BitwiseAnd": aten.bitwise_and.Tensor,
    "BitwiseOr": aten.bitwise_or.Tensor, "BitwiseXor": aten.bitwise_xor.Tensor,
}


@converts(*_UNARY)
def unary(cv: Converter, n: OnnxNode):
    """ONNX elementwise unary ops (Abs, Exp, Relu, Sigmoid, Not, IsNaN, ...) → the ATen op of the
    same name (`_UNARY`); Sign of NaN stays NaN (aten.sign gives 0). Returns the node's outputs
    (a list of Values)."""
    x = n.x(0)
    y = cv.call(_UNARY[n.op_type], x)
    if n.op_type == "Sign" and x.desc.dtype.is_floating:
        # ONNX (and numpy) Sign(NaN) is NaN; aten.sign gives 0
        y = cv.call(aten.where.self, cv.call(aten.isnan.default, x), x, y)
    return [y]


@converts(*_BINARY)
def binary(cv: Converter, n: OnnxNode):
    """ONNX elementwise binary ops (Add, Sub, Mul, comparisons, logical and bitwise ops; numpy
    broadcasting) → the ATen op (`_BINARY`); MatMul + Add(constant bias) becomes ``addmm`` as
    for a torch Linear. Returns the node's outputs (a list of Values)."""
    if n.op_type == "Add":
        for prod, bias in ((n.x(0), n.x(1)), (n.x(1), n.x(0))):
            y = _linear_bias(cv, prod, bias)
            if y is not None:
                return [y]
    return [cv.call(_BINARY[n.op_type], n.x(0), n.x(1))]


def _linear_bias(cv: Converter, prod: Value, bias: Value) -> Optional[Value]:
    """MatMul + Add(bias) as exported for a Linear layer ⇒ ``addmm(bias, x, w)`` [+ view],
    the graph the torch frontend gets, so Linear+activation fusion applies. ``prod``
    must be an ``mm`` (or a view of one) and ``bias`` a constant of shape [N] (or
    [1, ..., N]). The mm stays for other users (dead-code elimination drops it if none)."""
    p = prod.producer
    view = None
    if p is not None and p.op == "Reshape" and p.inputs[0].producer is not None:
        view, p = p, p.inputs[0].producer
    if p is None or p.op != "MatMul" or not bias.is_const:
        return None
    nn_ = shape(p.outputs[0])[-1]
    b = bias.const
    if shape(prod)[-1] != nn_ or b.dtype != prod.desc.dtype.torch or b.numel() != nn_ or b.shape[-1:] != (nn_,) \
            or b.dim() > prod.desc.rank:
        return None
    y = cv.call(aten.addmm.default, cv.const(b.reshape(nn_)), p.inputs[0], p.inputs[1])
    return reshape(cv, y, shape(prod)) if view is not None else y


@converts("Div")
def div(cv: Converter, n: OnnxNode):
    """ONNX Div: true division for floats, truncation toward zero for integers
    (``div(rounding_mode='trunc')``). Returns the node's outputs (a list of Values)."""
    a, b = n.x(0), n.x(1)
    if a.desc.dtype.is_floating:
        return [cv.call(aten.div.Tensor, a, b)]
    return [cv.call(aten.div.Tensor_mode, a, b, rounding_mode="trunc")]


@converts("Mod")
def mod(cv: Converter, n: OnnxNode):
    """ONNX Mod: ``remainder`` (the divisor's sign) or, with ``fmod=1``, ``fmod`` (the dividend's);
    float16/bfloat16/float32 computed in float64 and rounded once (ATen's vectorized float32
    kernels give NaN where the quotient overflows). Returns the node's outputs (a list of
    Values)."""
    fn = aten.fmod.Tensor if n.attr("fmod", 0) else aten.remainder.Tensor
    a, b = n.x(0), n.x(1)
    dt = a.desc.dtype.torch
    if dt in (torch.float32, torch.float16, torch.bfloat16):
        # ATen's vectorized float32 fmod/remainder give NaN where |a / b| overflows
        # (fmod(3.4e38, -0.7)); in float64 the result is exact (C fmod), then rounded once
        f64 = torch.float64
        y = cv.call(fn, cv.call(aten._to_copy.default, a, dtype=f64),
                    cv.call(aten._to_copy.default, b, dtype=f64))
        return [cv.call(aten._to_copy.default, y, dtype=dt)]
    return [cv.call(fn, a, b)]


@converts("Pow")
def pow_op(cv: Converter, n: OnnxNode):
    """ONNX Pow: ``pow.Tensor_Scalar`` for a one-element constant float exponent, else
    ``pow.Tensor_Tensor``; the result has the base's dtype, as ONNX specifies. Returns the
    node's outputs (a list of Values)."""
    a, b = n.x(0), n.x(1)
    c = n.c(1)
    if c is not None and c.numel() == 1 and a.desc.dtype.is_floating and c.dim() <= a.desc.rank:
        e = c.reshape(-1)[0].item()
        y = cv.call(aten.pow.Tensor_Scalar, a, float(e))
    else:
        y = cv.call(aten.pow.Tensor_Tensor, a, b)
    if y.desc.dtype != a.desc.dtype:
        y = cv.call(aten._to_copy.default, y, dtype=a.desc.dtype.torch)
    return [y]


@converts("Max", "Min", "Sum", "Mean")
def variadic(cv: Converter, n: OnnxNode):
    """ONNX Max, Min, Sum, Mean over any number of broadcast inputs: a chain of
    ``maximum``/``minimum``/``add`` (Mean then divides by the count); one input is copied.
    Returns the node's outputs (a list of Values)."""
    xs = [n.x(i) for i in range(len(n.inputs)) if n.has(i)]
    fn = {"Max": aten.maximum.default, "Min": aten.minimum.default,
          "Sum": aten.add.Tensor, "Mean": aten.add.Tensor}[n.op_type]
    y = xs[0]
    for x in xs[1:]:
        y = cv.call(fn, y, x)
    if n.op_type == "Mean":
        y = cv.call(aten.div.Tensor, y, cv.scalar(len(xs), y.desc.dtype.torch))
    elif len(xs) == 1:
        y = cv.call(aten.clone.default, y)
    return [y]


@converts("IsInf")
def isinf(cv: Converter, n: OnnxNode):
    """ONNX IsInf: ``isinf``, or an equality with +inf or -inf when ``detect_negative`` or
    ``detect_positive`` is 0. Output bool, the input's shape. Returns the node's outputs (a list
    of Values)."""
    x = n.x(0)
    pos, neg = n.attr("detect_positive", 1), n.attr("detect_negative", 1)
    if pos and neg:
        return [cv.call(aten.isinf.default, x)]
    inf = cv.scalar(math.inf if pos else -math.inf, x.desc.dtype.torch)
    return [cv.call(aten.eq.Tensor, x, inf)]


@converts("LeakyRelu")
def leaky_relu(cv: Converter, n: OnnxNode):
    """ONNX LeakyRelu (``alpha``, default 0.01) → ``aten.leaky_relu``. Returns the node's outputs
    (a list of Values)."""
    return [cv.call(aten.leaky_relu.default, n.x(0), n.attr("alpha", 0.01))]


@converts("Elu", "Selu", "Celu")
def elu(cv: Converter, n: OnnxNode):
    """ONNX Elu and Celu (``alpha``, default 1.0) → ``aten.elu``/``aten.celu``; Selu → ``aten.elu``
    with the specification's default ``alpha`` and ``gamma`` (Klambauer et al. 2017). Returns
    the node's outputs (a list of Values)."""
    x = n.x(0)
    if n.op_type == "Elu":
        return [cv.call(aten.elu.default, x, n.attr("alpha", 1.0))]
    if n.op_type == "Celu":
        return [cv.call(aten.celu.default, x, n.attr("alpha", 1.0))]
    return [cv.call(aten.elu.default, x, n.attr("alpha", 1.67326319217681884765625),
                    n.attr("gamma", 1.05070102214813232421875))]


@converts("HardSigmoid")
def hard_sigmoid(cv: Converter, n: OnnxNode):
    """ONNX HardSigmoid: ``clamp(alpha * x + beta, 0, 1)`` (defaults alpha 0.2, beta 0.5). Returns
    the node's outputs (a list of Values)."""
    x = n.x(0)
    y = cv.call(aten.add.Scalar, cv.call(aten.mul.Scalar, x, n.attr("alpha", 0.2)),
                n.attr("beta", 0.5))
    return [cv.call(aten.clamp.default, y, 0.0, 1.0)]


@converts("HardSwish")
def hard_swish(cv: Converter, n: OnnxNode):
    """ONNX HardSwish → ``aten.hardswish`` (``x * relu6(x + 3) / 6``). Returns the node's outputs
    (a list of Values)."""
    return [cv.call(aten.hardswish.default, n.x(0))]


@converts("Softsign")
def softsign(cv: Converter, n: OnnxNode):
    """ONNX Softsign: ``x / (1 + |x|)``. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    return [cv.call(aten.div.Tensor, x, cv.call(aten.add.Scalar, cv.call(aten.abs.default, x), 1))]


@converts("ThresholdedRelu")
def thresholded_relu(cv: Converter, n: OnnxNode):
    """ONNX ThresholdedRelu: ``x`` where ``x > alpha`` (default 1.0), else 0. Returns the node's
    outputs (a list of Values)."""
    x = n.x(0)
    keep = cv.call(aten.gt.Scalar, x, n.attr("alpha", 1.0))
    return [cv.call(aten.where.self, keep, x, cv.scalar(0, x.desc.dtype.torch))]


@converts("PRelu")
def prelu(cv: Converter, n: OnnxNode):
    """ONNX PRelu: ``slope * x`` where ``x < 0``, else ``x`` (``slope`` broadcast to ``x``).
    Returns the node's outputs (a list of Values)."""
    x, slope = n.x(0), n.x(1)
    neg = cv.call(aten.lt.Scalar, x, 0)
    return [cv.call(aten.where.self, neg, cv.call(aten.mul.Tensor, x, slope), x)]


@converts("Gelu")
def gelu(cv: Converter, n: OnnxNode):
    """ONNX Gelu (opset 20; ``approximate`` 'none' or 'tanh') → ``aten.gelu``. Returns the node's
    outputs (a list of Values)."""
    return [cv.call(aten.gelu.default, n.x(0), approximate=n.attr("approximate", "none"))]


@converts("Clip")
def clip(cv: Converter, n: OnnxNode):
    """``min`` / ``max`` default to the type's lowest / largest value (the specification's
    ``numeric_limits``), so for floats ``±inf`` becomes ``±FLT_MAX`` even without bounds,
    as in ONNX Runtime. A NaN bound makes every element NaN (as numpy and ATen; ONNX
    Runtime ignores it)."""
    x = n.x(0)
    dt = x.desc.dtype.torch
    fin = torch.finfo(dt) if dt.is_floating_point else None
    if (n.has(1) and n.c(1) is None) or (n.has(2) and n.c(2) is None):
        lo_v = n.x(1) if n.has(1) else (cv.scalar(fin.min, dt) if fin else None)
        hi_v = n.x(2) if n.has(2) else (cv.scalar(fin.max, dt) if fin else None)
        return [cv.call(aten.clamp.Tensor, x, lo_v, hi_v)]
    lo = n.c(1).item() if n.has(1) else None
    hi = n.c(2).item() if n.has(2) else None
    if fin is not None:
        lo = fin.min if lo is None else lo
        hi = fin.max if hi is None else hi
    if lo is None and hi is None:
        return [x]
    if lo is not None and hi is not None and lo > hi:
        raise NotConverted("min > max")
    if lo == 0 and hi is None:
        return [cv.call(aten.relu.default, x)]
    return [cv.call(aten.clamp.default, x, lo, hi)]


# -- reductions -------------------------------------------------------------------------

def _axes(cv: Converter, n: OnnxNode, rank: int) -> Optional[List[int]]:
    """The reduced axes (None = all, [] = none): input 1 from opset 18 (13 for
    ReduceSum), else the ``axes`` attribute."""
    axes = n.ints(1) if n.has(1) else n.attr("axes")
    if not axes:
        return [] if n.attr("noop_with_empty_axes", 0) else None
    return sorted(norm_axis(a, rank) for a in axes)


def _reduce(cv: Converter, x: Value, axes, keep: bool, how: str) -> Value:
    """``x`` reduced over ``axes`` (None: all) by ``how``. Integer Sum/Prod stay in the
    input's dtype (wrapping, as ONNX Runtime; ATen would widen to int64) and integer Mean
    is the integer sum divided with truncation toward zero (ONNX Runtime's)."""
    rank = x.desc.rank
    dims = list(range(rank)) if axes is None else axes
    dt = x.desc.dtype.torch
    integer = not (dt.is_floating_point or dt.is_complex) and dt != torch.bool
    if how == "sum":
        return cv.call(aten.sum.dim_IntList, x, dims, keep, dtype=dt if integer else None)
    if how == "mean":
        if integer:
            count = 1
            for d in dims:
                count *= shape(x)[d]
            total = cv.call(aten.sum.dim_IntList, x, dims, keep, dtype=dt)
            return cv.call(aten.div.Tensor_mode, total, cv.scalar(max(count, 1), dt),
                           rounding_mode="trunc")
        return cv.call(aten.mean.dim, x, dims, keep)
    if how in ("max", "min"):
        if any(shape(x)[d] == 0 for d in dims):
            raise NotConverted("reduction over an empty dimension")
        return cv.call(aten.amax.default if how == "max" else aten.amin.default, x, dims, keep)
    if how == "prod":
        for d in sorted(dims, reverse=True):
            x = cv.call(aten.prod.dim_int, x, d, keep, dtype=dt if integer else None)
        return x
    if how == "logsumexp":
        return cv.call(aten.logsumexp.default, x, dims, keep)
    raise AssertionError(how)


@converts("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1",
          "ReduceL2", "ReduceSumSquare", "ReduceLogSum", "ReduceLogSumExp")
def reduce(cv: Converter, n: OnnxNode):
    """ONNX Reduce* ops (Sum, Mean, Max, Min, Prod, L1, L2, SumSquare, LogSum, LogSumExp) over
    ``axes`` (attribute or input; ``keepdims`` default 1) → ATen reductions; no axes reduce all
    dims, or copy the input with ``noop_with_empty_axes``; boolean Max/Min are any/all. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    axes = _axes(cv, n, x.desc.rank)
    keep = bool(n.attr("keepdims", 1))
    if axes == []:
        return [cv.call(aten.clone.default, x)]
    op = n.op_type
    if op in ("ReduceMax", "ReduceMin") and x.desc.dtype.torch == torch.bool:
        # max of booleans is any (False over an empty set), min is all (True)
        fn = aten.any.dims if op == "ReduceMax" else aten.all.dims
        return [cv.call(fn, x, list(range(x.desc.rank)) if axes is None else axes, keep)]
    how = {"ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "max", "ReduceMin": "min",
           "ReduceProd": "prod", "ReduceLogSumExp": "logsumexp"}.get(op)
    if how is not None:
        return [_reduce(cv, x, axes, keep, how)]
    if op == "ReduceL1":
        return [_reduce(cv, cv.call(aten.abs.default, x), axes, keep, "sum")]
    if op == "ReduceSumSquare":
        return [_reduce(cv, cv.call(aten.mul.Tensor, x, x), axes, keep, "sum")]
    if op == "ReduceL2":
        y = cv.call(aten.sqrt.default, _reduce(cv, cv.call(aten.mul.Tensor, x, x), axes, keep, "sum"))
    else:  # ReduceLogSum
        y = cv.call(aten.log.default, _reduce(cv, x, axes, keep, "sum"))
    if y.desc.dtype != x.desc.dtype:
        y = cv.call(aten._to_copy.default, y, dtype=x.desc.dtype.torch)
    return [y]


@converts("ArgMax", "ArgMin")
def argmax(cv: Converter, n: OnnxNode):
    """ONNX ArgMax/ArgMin along ``axis`` (``keepdims`` default 1) → ``aten.argmax``/``argmin``
    (int64; the first NaN wins, as numpy); ``select_last_index`` searches the flipped axis.
    Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    axis = norm_axis(n.attr("axis", 0), x.desc.rank)
    keep = bool(n.attr("keepdims", 1))
    fn = aten.argmax.default if n.op_type == "ArgMax" else aten.argmin.default
    if n.attr("select_last_index", 0):
        d = shape(x)[axis]
        flipped = cv.call(aten.index_select.default, x, axis,
                          cv.const(torch.arange(d - 1, -1, -1)))
        i = cv.call(fn, flipped, axis, keep)
        return [cv.call(aten.rsub.Scalar, i, d - 1)]
    return [cv.call(fn, x, axis, keep)]


@converts("CumSum")
def cumsum(cv: Converter, n: OnnxNode):
    """ONNX CumSum along a constant axis → ``aten.cumsum`` in the input's dtype: an
    integer input's dtype is pinned (ATen would widen int32 to int64), a float one's is
    not (it follows the input, so precision modes can lower it). Raises NotConverted for
    ``exclusive`` or ``reverse``. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    axis = norm_axis(n.ints(1)[0], x.desc.rank)
    if n.attr("exclusive", 0) or n.attr("reverse", 0):
        raise NotConverted("exclusive or reverse CumSum")
    dt = x.desc.dtype
    return [cv.call(aten.cumsum.default, x, axis, dtype=None if dt.is_floating else dt.torch)]


# -- matrix products --------------------------------------------------------------------

def matmul(cv: Converter, a: Value, b: Value) -> Value:
    """numpy ``matmul`` semantics by mm / bmm with views and expands, as ATen's own
    ``matmul`` decomposition does (so a Linear on 3-D input is view → mm → view)."""
    sa, sb = shape(a), shape(b)
    if len(sa) == 1:
        return reshape(cv, matmul(cv, reshape(cv, a, [1] + sa), b), sb[:-2] + sb[-1:] if len(sb) > 1 else [])
    if len(sb) == 1:
        y = matmul(cv, a, reshape(cv, b, sb + [1]))
        return reshape(cv, y, shape(y)[:-1])
    if len(sa) == 2 and len(sb) == 2:
        return cv.call(aten.mm.default, a, b)
    m, k, nn = sa[-2], sa[-1], sb[-1]
    if len(sb) == 2:   # (..., m, k) @ (k, n): fold the batch into the rows
        y = cv.call(aten.mm.default, reshape(cv, a, [math.prod(sa[:-1]), k]), b)
        return reshape(cv, y, sa[:-1] + [nn])
    batch = list(torch.broadcast_shapes(tuple(sa[:-2]), tuple(sb[:-2])))
    bt = math.prod(batch)
    if sa[:-2] != batch:
        a = cv.call(aten.expand.default, a, batch + [m, k])
    if sb[:-2] != batch:
        b = cv.call(aten.expand.default, b, batch + [k, nn])
    y = cv.call(aten.bmm.default, reshape(cv, a, [bt, m, k]), reshape(cv, b, [bt, k, nn]))
    return reshape(cv, y, batch + [m, nn])


@converts("MatMul")
def matmul_op(cv: Converter, n: OnnxNode):
    """ONNX MatMul (numpy ``matmul`` semantics, float dtypes) → mm/bmm with views (`matmul`).
    Raises NotConverted for integer inputs. Returns the node's outputs (a list of Values)."""
    a, b = n.x(0), n.x(1)
    if a.desc.dtype.torch not in (torch.float32, torch.float64, torch.float16, torch.bfloat16):
        raise NotConverted(f"integer MatMul ({a.desc.dtype})")
    return [matmul(cv, a, b)]


@converts("Gemm")
def gemm(cv: Converter, n: OnnxNode):
    """ONNX Gemm: ``alpha * A' @ B' + beta * C`` (A', B' transposed by ``transA``/``transB``) →
    ``aten.addmm`` (``aten.mm`` without C or with beta 0), as the torch frontend produces for
    Linear. Returns the node's outputs (a list of Values)."""
    a, b, c = n.x(0), n.x(1), n.x(2)
    alpha, beta = n.attr("alpha", 1.0), n.attr("beta", 1.0)
    if n.attr("transA", 0):
        a = cv.call(aten.permute.default, a, [1, 0])
    if n.attr("transB", 0):
        b = cv.call(aten.permute.default, b, [1, 0])
    if c is None or beta == 0:
        y = cv.call(aten.mm.default, a, b)
        return [y if alpha == 1 else cv.call(aten.mul.Scalar, y, alpha)]
    kw = {}
    if beta != 1:
        kw["beta"] = beta
    if alpha != 1:
        kw["alpha"] = alpha
    return [cv.call(aten.addmm.default, c, a, b, **kw)]


# -- convolution ------------------------------------------------------------------------

def _auto_pads(n: OnnxNode, in_sp, k, strides, dil) -> List[int]:
    """ONNX pads [b1..bn, e1..en] from ``auto_pad`` (SAME_UPPER puts the odd one at
    the end) or the ``pads`` attribute."""
    auto = n.attr("auto_pad", "NOTSET")
    r = len(in_sp)
    if auto in ("NOTSET", ""):
        return list(n.attr("pads", [0] * 2 * r))
    if auto == "VALID":
        return [0] * 2 * r
    begin, end = [], []
    for i in range(r):
        out = -(-in_sp[i] // strides[i])
        total = max(0, (out - 1) * strides[i] + (k[i] - 1) * dil[i] + 1 - in_sp[i])
        small, big = total // 2, total - total // 2
        begin.append(small if auto == "SAME_UPPER" else big)
        end.append(big if auto == "SAME_UPPER" else small)
    return begin + end


def _pad_input(cv: Converter, x: Value, pads: List[int], value: float = 0.0):
    """Pads symmetric → (x, per-dim padding); asymmetric ones are applied to ``x``."""
    r = len(pads) // 2
    begin, end = pads[:r], pads[r:]
    if begin == end:
        return x, begin
    tpad: List[int] = []
    for i in range(r - 1, -1, -1):
        tpad += [begin[i], end[i]]
    return cv.call(aten.constant_pad_nd.default, x, tpad, value), [0] * r


@converts("Conv")
def conv(cv: Converter, n: OnnxNode):
    """ONNX Conv (1-/2-/3-D, groups, dilations, ``auto_pad``) → ``aten.convolution``; asymmetric
    pads are applied to the input first (``constant_pad_nd``). Returns the node's outputs (a
    list of Values)."""
    x, w, b = n.x(0), n.x(1), n.x(2)
    sp = shape(x)[2:]
    r = len(sp)
    k = n.attr("kernel_shape") or shape(w)[2:]
    strides = list(n.attr("strides", [1] * r))
    dil = list(n.attr("dilations", [1] * r))
    x, padding = _pad_input(cv, x, _auto_pads(n, sp, k, strides, dil))
    return [cv.call(aten.convolution.default, x, w, b, strides, padding, dil, False,
                    [0] * r, n.attr("group", 1))]


@converts("ConvTranspose")
def conv_transpose(cv: Converter, n: OnnxNode):
    """ONNX ConvTranspose → ``aten.convolution(transposed=True)`` with ``output_padding``. Raises
    NotConverted for ``output_shape``, SAME ``auto_pad`` or asymmetric pads. Returns the node's
    outputs (a list of Values)."""
    x, w, b = n.x(0), n.x(1), n.x(2)
    sp = shape(x)[2:]
    r = len(sp)
    k = list(n.attr("kernel_shape") or shape(w)[2:])
    strides = list(n.attr("strides", [1] * r))
    dil = list(n.attr("dilations", [1] * r))
    out_pad = list(n.attr("output_padding", [0] * r))
    auto = n.attr("auto_pad", "NOTSET")
    if n.attr("output_shape") is not None or auto not in ("NOTSET", "", "VALID"):
        raise NotConverted("ConvTranspose with output_shape or SAME auto_pad")
    pads = [0] * 2 * r if auto == "VALID" else list(n.attr("pads", [0] * 2 * r))
    if pads[:r] != pads[r:]:
        raise NotConverted("asymmetric ConvTranspose pads")
    return [cv.call(aten.convolution.default, x, w, b, strides, pads[:r], dil, True,
                    out_pad, n.attr("group", 1))]


# -- normalization ----------------------------------------------------------------------

@converts("BatchNormalization")
def batch_norm(cv: Converter, n: OnnxNode):
    """ONNX BatchNormalization in inference mode (scale, bias, running mean and variance;
    ``epsilon`` default 1e-5) → ``aten._native_batch_norm_legit_no_training``, so Conv+BN
    folding applies. Raises NotConverted in training mode. Returns the node's outputs (a list of
    Values)."""
    if n.attr("training_mode", 0) or len([y for y in n.outputs if y]) > 1:
        raise NotConverted("training-mode BatchNormalization")
    x = n.x(0)
    return [cv.call(aten._native_batch_norm_legit_no_training.default, x, n.x(1), n.x(2), n.x(3),
                    n.x(4), n.attr("momentum", 0.9), n.attr("epsilon", 1e-5))[0]]


@converts("LayerNormalization")
def layer_norm(cv: Converter, n: OnnxNode):
    """ONNX LayerNormalization over the dims from ``axis`` (default -1) →
    ``aten.native_layer_norm`` (scale and bias expanded to the normalized shape); the optional
    mean and inverse-std outputs too. Raises NotConverted for ``stash_type`` other than 1
    (float32). Returns the node's outputs (a list of Values)."""
    x, scale, bias = n.x(0), n.x(1), n.x(2)
    s = shape(x)
    axis = norm_axis(n.attr("axis", -1), len(s))
    if n.attr("stash_type", 1) != 1 or not x.desc.dtype.is_floating:
        raise NotConverted("stash_type other than float32")
    normalized = s[axis:]
    if shape(scale) != normalized:
        scale = cv.call(aten.expand.default, scale, normalized)
    if bias is not None and shape(bias) != normalized:
        bias = cv.call(aten.expand.default, bias, normalized)
    outs = cv.call(aten.native_layer_norm.default, x, normalized, scale, bias,
                   n.attr("epsilon", 1e-5))
    return outs[:len(n.outputs)]


@converts("InstanceNormalization", "GroupNormalization")
def group_norm(cv: Converter, n: OnnxNode):
    """ONNX InstanceNormalization (one group per channel) and GroupNormalization-21 (per-channel
    scale) → ``aten.native_group_norm``. Raises NotConverted for GroupNormalization-18
    (per-group scale). Returns the node's outputs (a list of Values)."""
    x, scale, bias = n.x(0), n.x(1), n.x(2)
    s = shape(x)
    c = s[1]
    groups = c if n.op_type == "InstanceNormalization" else n.attr("num_groups")
    if n.op_type == "GroupNormalization" and (cv.opset < 21 or shape(scale) != [c]):
        raise NotConverted("GroupNormalization-18 (per-group scale)")
    hw = math.prod(s[2:])
    y = cv.call(aten.native_group_norm.default, x, scale, bias, s[0], c, hw, groups,
                n.attr("epsilon", 1e-5))[0]
    return [y]


@converts("Softmax", "LogSoftmax")
def softmax(cv: Converter, n: OnnxNode):
    """ONNX Softmax/LogSoftmax along ``axis`` (default -1, opset 13) →
    ``aten._softmax``/``_log_softmax``. Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    axis = norm_axis(n.attr("axis", -1), x.desc.rank)
    fn = aten._softmax.default if n.op_type == "Softmax" else aten._log_softmax.default
    return [cv.call(fn, x, axis, False)]


# -- pooling ----------------------------------------------------------------------------

def _to_2d(cv: Converter, x: Value):
    """1-D pooling runs as 2-D on (N, C, 1, L); returns (x, undo)."""
    s = shape(x)
    if len(s) == 3:
        return reshape(cv, x, s[:2] + [1, s[2]]), lambda y: reshape(cv, y, shape(y)[:2] + [shape(y)[3]])
    return x, lambda y: y


@converts("MaxPool", "AveragePool")
def pool(cv: Converter, n: OnnxNode):
    """ONNX MaxPool and AveragePool, 1-D (run as 2-D), 2-D or 3-D, with strides, dilations, pads or
    ``auto_pad``, ``ceil_mode`` and ``count_include_pad`` →
    ``aten.max_pool{2,3}d_with_indices``/``avg_pool{2,3}d``; MaxPool keeps NaN. Raises NotConverted for
    other ranks, the Indices output, integer MaxPool, and pads ATen cannot express. Returns the
    node's outputs (a list of Values)."""
    x = n.x(0)
    sp = shape(x)[2:]
    r = len(sp)
    if r not in (1, 2, 3):
        raise NotConverted(f"{r}-D pooling")
    if n.op_type == "MaxPool" and (len(n.outputs) > 1 and n.outputs[1]):
        raise NotConverted("MaxPool Indices output")
    k = list(n.attr("kernel_shape"))
    strides = list(n.attr("strides", [1] * r))
    dil = list(n.attr("dilations", [1] * r))
    ceil = bool(n.attr("ceil_mode", 0))
    pads = _auto_pads(n, sp, k, strides, dil)
    if n.op_type == "AveragePool" and (dil != [1] * r or (ceil and any(pads))):
        raise NotConverted("dilated or padded ceil-mode AveragePool")
    if any(p * 2 > kk for p, kk in zip(pads, k + k)) or (ceil and pads[:r] != pads[r:]):
        raise NotConverted("padding larger than half the kernel")
    if n.op_type == "MaxPool":
        fill = -math.inf if x.desc.dtype.is_floating else torch.iinfo(x.desc.dtype.torch).min
        if not x.desc.dtype.is_floating:
            raise NotConverted("integer MaxPool")
        x, padding = _pad_input(cv, x, pads, fill)
    else:
        include = bool(n.attr("count_include_pad", 0))
        if pads[:r] != pads[r:]:
            if not include:
                raise NotConverted("asymmetric AveragePool pads without count_include_pad")
            x, padding = _pad_input(cv, x, pads)
        else:
            padding = pads[:r]
    if r == 3:
        if n.op_type == "MaxPool":
            return [cv.call(aten.max_pool3d_with_indices.default, x, k, strides, padding, dil,
                            ceil)[0]]
        return [cv.call(aten.avg_pool3d.default, x, k, strides, padding, ceil,
                        bool(n.attr("count_include_pad", 0)))]
    x, undo = _to_2d(cv, x)
    if r == 1:
        k, strides, dil, padding = [1] + k, [1] + strides, [1] + dil, [0] + list(padding)
    if n.op_type == "MaxPool":
        y = cv.call(aten.max_pool2d_with_indices.default, x, k, strides, padding, dil, ceil)[0]
    else:
        y = cv.call(aten.avg_pool2d.default, x, k, strides, padding, ceil,
                    bool(n.attr("count_include_pad", 0)))
    return [undo(y)]


@converts("GlobalAveragePool", "GlobalMaxPool")
def global_pool(cv: Converter, n: OnnxNode):
    """ONNX GlobalAveragePool/GlobalMaxPool: ``mean``/``amax`` over every spatial dim, kept as size
    1 ([N, C, 1, ...]). Returns the node's outputs (a list of Values)."""
    x = n.x(0)
    dims = list(range(2, x.desc.rank))
    if n.op_type == "GlobalAveragePool":
        return [cv.call(aten.mean.dim, x, dims, True)]
    return [cv.call(aten.amax.default, x, dims, True)]
