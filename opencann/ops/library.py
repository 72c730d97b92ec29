"""The operator table: CANN-style op names for the core-ATen overloads opencann
implements. Names follow the CANN operator list where one exists (Add/Adds, Mul/Muls,
ReduceSum, Conv2D, BatchMatMul, LayerNorm, TransData...); source: "CANN Operator List"
(Ascend documentation, built-in operator specifications).

Each row: (name, aten overload, kind, flops per element, inplace-able); the dicts after
the table fill the other `OpDef` columns of some rows (activation, keep-fp32, vnpu cost,
NPU format family). Adding an op is one row here (plus its entries in those dicts).
"""
from __future__ import annotations

import torch

from ..devices.vnpu import trans_data_cost
from ..ir import Node, numel
from .kernels import vnpu as vnpu_kernels
from .kernels import vnpu_nd
from .kernels import attention_cpu
from .kernels import cpu as cpu_kernels
from .kernels import embedding_cpu, pool_cpu
from .kernels import vnpu_cost
from . import per_index as pi
from .opdef import Cost, OpDef, OpKind, _nbytes, register

aten = torch.ops.aten
E, R, V, D, C, N, P = (OpKind.ELEMENTWISE, OpKind.REDUCTION, OpKind.VIEW, OpKind.DATA,
                       OpKind.CREATION, OpKind.NORM, OpKind.POOL)

_TABLE = [
    # elementwise arithmetic
    ("Add", aten.add.Tensor, E, 1, True), ("Adds", aten.add.Scalar, E, 1, True),
    ("Sub", aten.sub.Tensor, E, 1, True), ("Subs", aten.sub.Scalar, E, 1, True),
    ("RSub", aten.rsub.Scalar, E, 1, True),
    ("Mul", aten.mul.Tensor, E, 1, True), ("Muls", aten.mul.Scalar, E, 1, True),
    ("Div", aten.div.Tensor, E, 1, True), ("Divs", aten.div.Scalar, E, 1, True),
    ("DivMode", aten.div.Tensor_mode, E, 2, True),
    ("Pow", aten.pow.Tensor_Scalar, E, 2, True), ("PowTensor", aten.pow.Tensor_Tensor, E, 4, True),
    ("Neg", aten.neg.default, E, 1, True), ("Abs", aten.abs.default, E, 1, True),
    ("Exp", aten.exp.default, E, 4, True), ("Log", aten.log.default, E, 4, True),
    ("Sqrt", aten.sqrt.default, E, 2, True), ("Rsqrt", aten.rsqrt.default, E, 2, True),
    ("Reciprocal", aten.reciprocal.default, E, 1, True),
    ("Sin", aten.sin.default, E, 4, True), ("Cos", aten.cos.default, E, 4, True),
    ("Floor", aten.floor.default, E, 1, True), ("Sign", aten.sign.default, E, 1, True),
    ("Round", aten.round.default, E, 1, True),
    ("Maximum", aten.maximum.default, E, 1, True), ("Minimum", aten.minimum.default, E, 1, True),
    ("ClipByValue", aten.clamp.default, E, 2, True),
    ("ClampTensor", aten.clamp.Tensor, E, 2, True),
    ("Select", aten.where.self, E, 1, False),
    ("Addcmul", aten.addcmul.default, E, 2, True),
    # activations
    ("Relu", aten.relu.default, E, 1, True), ("Gelu", aten.gelu.default, E, 8, True),
    ("Sigmoid", aten.sigmoid.default, E, 4, True), ("Tanh", aten.tanh.default, E, 4, True),
    ("Erf", aten.erf.default, E, 4, True), ("Swish", aten.silu.default, E, 5, True),
    ("HardTanh", aten.hardtanh.default, E, 2, True), ("LeakyRelu", aten.leaky_relu.default, E, 2, True),
    ("HardSigmoid", aten.hardsigmoid.default, E, 3, True),
    ("HardSwish", aten.hardswish.default, E, 4, True),
    # comparisons and logic
    ("Equal", aten.eq.Tensor, E, 1, False), ("Equals", aten.eq.Scalar, E, 1, False),
    ("NotEqual", aten.ne.Tensor, E, 1, False), ("NotEquals", aten.ne.Scalar, E, 1, False),
    ("Less", aten.lt.Tensor, E, 1, False), ("Lesss", aten.lt.Scalar, E, 1, False),
    ("LessEqual", aten.le.Tensor, E, 1, False), ("LessEquals", aten.le.Scalar, E, 1, False),
    ("Greater", aten.gt.Tensor, E, 1, False), ("Greaters", aten.gt.Scalar, E, 1, False),
    ("GreaterEqual", aten.ge.Tensor, E, 1, False), ("GreaterEquals", aten.ge.Scalar, E, 1, False),
    ("LogicalNot", aten.logical_not.default, E, 1, False),
    ("LogicalAnd", aten.logical_and.default, E, 1, False),
    ("LogicalOr", aten.logical_or.default, E, 1, False),
    ("BitwiseAnd", aten.bitwise_and.Tensor, E, 1, False),
    ("BitwiseOr", aten.bitwise_or.Tensor, E, 1, False),
    ("BitwiseNot", aten.bitwise_not.default, E, 1, False),
    ("IsNan", aten.isnan.default, E, 1, False),
    # casts and copies
    ("Cast", aten._to_copy.default, E, 0, False), ("Identity", aten.clone.default, D, 0, False),
    ("Fill", aten.fill.Scalar, E, 0, False),
    # reductions
    ("ReduceSum", aten.sum.dim_IntList, R, 1, False), ("ReduceSumAll", aten.sum.default, R, 1, False),
    ("ReduceMean", aten.mean.dim, R, 1, False), ("ReduceMeanAll", aten.mean.default, R, 1, False),
    ("ReduceMax", aten.amax.default, R, 1, False),
    ("ReduceMin", aten.amin.default, R, 1, False), ("ReduceAny", aten.any.dim, R, 1, False),
    ("ReduceAll", aten.all.dim, R, 1, False),
    ("ArgMaxD", aten.argmax.default, R, 1, False), ("ArgMinD", aten.argmin.default, R, 1, False),
    ("ReduceMaxD", aten.max.dim, R, 1, False),
    ("ReduceVar", aten.var.correction, R, 3, False),
    ("Cumsum", aten.cumsum.default, R, 1, False),
    # normalisation and softmax
    ("SoftmaxV2", aten._softmax.default, N, 5, False),
    ("LogSoftmaxV2", aten._log_softmax.default, N, 5, False),
    ("LayerNorm", aten.native_layer_norm.default, N, 8, False),
    ("BatchNorm", aten._native_batch_norm_legit_no_training.default, N, 4, False),
    # training BatchNorm: batch statistics, normalised output, updated running statistics
    # (CANN splits it into BNTrainingReduce + BNTrainingUpdate)
    ("BNTrainingUpdate", aten._native_batch_norm_legit_functional.default, N, 8, False),
    ("BNTrainingUpdateNoStats", aten._native_batch_norm_legit.no_stats, N, 8, False),
    ("GroupNorm", aten.native_group_norm.default, N, 8, False),
    # pooling
    ("MaxPoolWithArgmax", aten.max_pool2d_with_indices.default, P, 1, False),
    # the values alone (inference); ATen's CPU kernel still computes indices internally,
    # but into memory of its own, in its input's layout: no strided copy of values and
    # int64 indices into planned NCHW buffers (ResNet-50's pool: 1.0 -> 0.2 ms)
    ("MaxPool", aten.max_pool2d.default, P, 1, False),
    ("AvgPool", aten.avg_pool2d.default, P, 1, False),
    ("AdaptiveAvgPool2d", aten._adaptive_avg_pool2d.default, P, 1, False),
    # gathers, concatenation, padding, creation
    ("Embedding", aten.embedding.default, D, 0, False),
    ("GatherElements", aten.gather.default, D, 0, False),
    ("Index", aten.index.Tensor, D, 0, False),
    ("IndexSelect", aten.index_select.default, D, 0, False),
    ("ConcatD", aten.cat.default, D, 0, False), ("Pack", aten.stack.default, D, 0, False),
    ("PadV3", aten.constant_pad_nd.default, D, 0, False),
    ("Tile", aten.repeat.default, D, 0, False),
    ("Triu", aten.triu.default, D, 0, False), ("Tril", aten.tril.default, D, 0, False),
    ("Range", aten.arange.start_step, C, 0, False), ("RangeEnd", aten.arange.default, C, 0, False),
    ("Fill2", aten.full.default, C, 0, False), ("FillLike", aten.full_like.default, C, 0, False),
    ("ScalarTensor", aten.scalar_tensor.default, C, 0, False),
    ("ZerosLike", aten.zeros_like.default, C, 0, False),
    ("OnesLike", aten.ones_like.default, C, 0, False),
    # views and shape ops (alias their input; no copy, no kernel work)
    ("Reshape", aten.view.default, V, 0, False), ("UnsafeReshape", aten._unsafe_view.default, V, 0, False),
    ("ReshapeCopy", aten.reshape.default, V, 0, False),
    ("Transpose", aten.permute.default, V, 0, False), ("TransposeD", aten.t.default, V, 0, False),
    ("Swapaxes", aten.transpose.int, V, 0, False),
    ("Unsqueeze", aten.unsqueeze.default, V, 0, False), ("Squeeze", aten.squeeze.dims, V, 0, False),
    ("SqueezeDim", aten.squeeze.dim, V, 0, False),
    ("BroadcastTo", aten.expand.default, V, 0, False),
    ("StridedSlice", aten.slice.Tensor, V, 0, False), ("SelectInt", aten.select.int, V, 0, False),
    ("SplitWithSize", aten.split_with_sizes.default, V, 0, False),
    ("SplitV", aten.split.Tensor, V, 0, False),
    ("Alias", aten.alias.default, V, 0, False),
    ("AsStrided", aten.as_strided.default, V, 0, False),
    # gradients (training backward graphs): one native kernel each instead of the
    # decomposition's chain of elementwise passes; names after CANN's *Grad operators
    ("ReluGrad", aten.threshold_backward.default, E, 1, True),
    ("GeluGrad", aten.gelu_backward.default, E, 10, True),
    ("TanhGrad", aten.tanh_backward.default, E, 3, True),
    ("SigmoidGrad", aten.sigmoid_backward.default, E, 3, True),
    ("SwishGrad", aten.silu_backward.default, E, 6, True),
    ("DropOutDoMaskGrad", aten.native_dropout_backward.default, E, 2, True),
    ("SoftmaxGrad", aten._softmax_backward_data.default, N, 4, False),
    ("LogSoftmaxGrad", aten._log_softmax_backward_data.default, N, 4, False),
    ("LayerNormGrad", aten.native_layer_norm_backward.default, N, 10, False),
    ("BatchNormGrad", aten.native_batch_norm_backward.default, N, 10, False),
    ("MaxPoolGradWithArgmax", aten.max_pool2d_with_indices_backward.default, P, 1, False),
    ("AvgPoolGrad", aten.avg_pool2d_backward.default, P, 1, False),
    ("AdaptiveAvgPool2dGrad", aten._adaptive_avg_pool2d_backward.default, P, 1, False),
    ("EmbeddingDenseGrad", aten.embedding_dense_backward.default, D, 1, False),
]


# aliasing the ATen schema does not state: ``_unsafe_view(Tensor self, ...) -> Tensor``
# carries no annotation, but its kernel returns a view of ``self``
_DECLARED_ALIASES = {"UnsafeReshape": (("self",),)}
# the op computing output 0 alone (OpDef.primary_only), run when the others are unread
_PRIMARY_ONLY = {"MaxPoolWithArgmax": "MaxPool", "ReduceMaxD": "ReduceMax"}


# OpDef.out_contiguous: operands (schema argument names) that an ATen ``.out`` overload
# handles only when contiguous, where the functional overload takes any strides: it
# walks them as if row-major and gives wrong values, no error. The runtime makes such an
# input contiguous first, and runs the functional overload when such an output's buffer
# is not contiguous. Evidence (torch 2.13, CPU, fp32 and bf16; the audit of every op's
# ``.out`` overload against its functional one at transposed, strided, offset, expanded
# and channels-last operands: tests/unit/test_out_overload_layouts.py, also a script):
# - _native_batch_norm_legit.no_stats_out (BatchNorm with batch statistics and no
#   running ones) on a transposed, strided or expanded input, or into a non-contiguous
#   buffer (a contiguous input into a channels-last one): off by up to ~9;
# - _softmax.out, _log_softmax.out, _softmax_backward_data.out,
#   _log_softmax_backward_data.out into a non-contiguous buffer: the values land as if
#   the buffer were contiguous (the traced layout of _log_softmax_backward_data's result
#   follows a transposed gradient: a compiled backward was off by ~45);
# - gelu.out from a contiguous input into a non-contiguous buffer (oneDNN's kernel
#   writes it as if contiguous: garbage, NaN lost).
_OUT_CONTIGUOUS = {
    "BNTrainingUpdateNoStats": ("input", "out"),
    "SoftmaxV2": ("out",), "LogSoftmaxV2": ("out",),
    "SoftmaxGrad": ("grad_input",), "LogSoftmaxGrad": ("out",),
    "Gelu": ("out",),
}

# OpDef.activation: the activations opencann's fused CPU kernels take (ConvBiasAct, LinearAct)
_ACTIVATION = {"Relu": "relu", "Gelu": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Swish": "silu"}

# OpDef.keep_fp32: CANN's "black list" analogue, ops whose accuracy needs fp32
# (MixedPrecision's default keep-list)
_KEEP_FP32 = {"SoftmaxV2", "LogSoftmaxV2", "LayerNorm", "BatchNorm", "GroupNorm",
              "ReduceSum", "ReduceSumAll", "ReduceMean", "ReduceMeanAll", "ReduceVar", "Cumsum",
              "ReduceMax", "ReduceMin", "Exp", "Log", "Pow", "PowTensor", "Sqrt", "Rsqrt",
              "Reciprocal", "Div", "Divs", "FlashAttentionScore"}

# OpDef.device_cost["vnpu"] of elementwise ops: the key of the vnpu cost model's
# VECTOR_OP_COST table (comparisons and logic: one subtract-and-select per element)
_VNPU_VECTOR = {
    "Add": "add", "Adds": "add", "Sub": "sub", "Subs": "sub", "RSub": "sub", "Mul": "mul", "Muls": "mul",
    "Div": "div", "Divs": "div", "DivMode": "div", "Pow": "pow", "PowTensor": "pow", "Neg": "neg",
    "Abs": "abs", "Exp": "exp", "Log": "log", "Sqrt": "sqrt", "Rsqrt": "rsqrt", "Reciprocal": "reciprocal",
    "Sin": "sin", "Cos": "cos", "Floor": "copy", "Sign": "copy", "Maximum": "max", "Minimum": "min",
    "ClipByValue": "clamp", "ClampTensor": "clamp", "HardTanh": "clamp", "Select": "where", "Relu": "relu",
    "Gelu": "gelu", "Sigmoid": "sigmoid", "Tanh": "tanh", "Erf": "erf", "Swish": "silu",
    "LeakyRelu": "leaky_relu", "HardSigmoid": "clamp", "HardSwish": "silu", "Cast": "cast", "Fill": "copy",
    **{n: "sub" for n in ("Equal", "Equals", "NotEqual", "NotEquals", "Less", "Lesss", "LessEqual",
                          "LessEquals", "Greater", "Greaters", "GreaterEqual", "GreaterEquals",
                          "LogicalNot", "LogicalAnd", "LogicalOr", "BitwiseAnd", "BitwiseOr",
                          "BitwiseNot", "IsNan")},
}
# ... of reductions and pooling: how elements combine
_VNPU_REDUCE = {
    "ReduceSum": "add", "ReduceSumAll": "add", "ReduceMean": "add", "ReduceMeanAll": "add", "ReduceMax": "max",
    "ReduceMin": "min", "ReduceAny": "max", "ReduceAll": "min", "ArgMaxD": "max", "ArgMinD": "min",
    "ReduceMaxD": "max", "ReduceVar": "add", "Cumsum": "add", "MaxPoolWithArgmax": "max", "AvgPool": "add",
    "AdaptiveAvgPool2d": "add",
}
_VNPU_COST = {"SoftmaxV2": vnpu_cost.softmax, "LogSoftmaxV2": vnpu_cost.softmax,
              "LayerNorm": vnpu_cost.layernorm, "BatchNorm": vnpu_cost.batchnorm,
              **{n: vnpu_cost.vector(k) for n, k in _VNPU_VECTOR.items()},
              **{n: vnpu_cost.reduction(k) for n, k in _VNPU_REDUCE.items()}}

# OpDef.fuse_expr: the op per element in FusedElementwise's neutral syntax
# (ops/kernels/ew_program.py), only where the compiled code rounds as ATen does: IEEE
# +, -, *, /, sqrt are exact in every order-preserving code; exp, log, tanh, erf, sin,
# cos are libm calls (≤ 1 ulp from ATen's SLEEF, see docs/guide/precision.md); NaN-propagating
# maximum/minimum as torch's. Reductions name their combine (trailing dim only).
def _alpha1(expr: str):
    return lambda a: expr if a.get("alpha", 1) == 1 else None


def _bound(e: str, a: dict, b: str, cmp: str, nan_form: str) -> str:
    v = a[b]
    if isinstance(v, float) and v != v:
        return f"{nan_form}({e}, {{{b}}})"
    return f"where({e} {cmp} {{{b}}}, {{{b}}}, {e})"


def _clamp(lo: str, hi: str):
    """clamp as ATen's kernel: a value equal to a bound is kept (clamp(-0.0, min=0.0)
    is -0.0, where ``maximum`` may give either zero), NaN stays NaN, a NaN bound gives
    NaN (``maximum``/``minimum`` propagate it)."""
    def expr(a):
        e = "{self}"
        if a.get(lo) is not None:
            e = _bound(e, a, lo, "<", "maximum")
        if a.get(hi) is not None:
            e = _bound(e, a, hi, ">", "minimum")
        return e if e != "{self}" else None
    return expr


_FUSE_EXPR = {
    "Add": _alpha1("{self} + {other}"), "Adds": _alpha1("{self} + {other}"),
    "Sub": _alpha1("{self} - {other}"), "Subs": _alpha1("{self} - {other}"),
    "RSub": _alpha1("{other} - {self}"),
    "Mul": "{self} * {other}", "Muls": "{self} * {other}",
    "Div": "{self} / {other}", "Divs": "{self} / {other}",
    "Pow": lambda a: {2: "{self} * {self}", 3: "{self} * {self} * {self}"}.get(a.get("exponent")),
    "Neg": "-({self})", "Abs": "abs({self})",
    "Exp": "exp({self})", "Log": "log({self})", "Sqrt": "sqrt({self})",
    "Rsqrt": "#1 / sqrt({self})", "Reciprocal": "#1 / {self}",
    "Sin": "sin({self})", "Cos": "cos({self})", "Tanh": "tanh({self})", "Erf": "erf({self})",
    "Maximum": "maximum({self}, {other})", "Minimum": "minimum({self}, {other})",
    "ClipByValue": _clamp("min", "max"), "HardTanh": _clamp("min_val", "max_val"),
    "Select": "where({condition}, {self}, {other})",
    "Relu": "where({self} < #0, #0, {self})", "Sigmoid": "#1 / (#1 + exp(-({self})))",
    "Swish": "{self} / (#1 + exp(-({self})))",
    "LeakyRelu": "where({self} > #0, {self}, {self} * {negative_slope})",
    "Equal": "{self} == {other}", "Equals": "{self} == {other}",
    "NotEqual": "{self} != {other}", "NotEquals": "{self} != {other}",
    "Less": "{self} < {other}", "Lesss": "{self} < {other}",
    "LessEqual": "{self} <= {other}", "LessEquals": "{self} <= {other}",
    "Greater": "{self} > {other}", "Greaters": "{self} > {other}",
    "GreaterEqual": "{self} >= {other}", "GreaterEquals": "{self} >= {other}",
    "IsNan": "{self} != {self}", "LogicalNot": "lnot(truth({self}))",
    "LogicalAnd": "truth({self}) & truth({other})", "LogicalOr": "truth({self}) | truth({other})",
    "Cast": lambda a: "{self}" if a.get("memory_format") in (None, torch.preserve_format,
                                                          torch.contiguous_format) else None,
    "ReduceSum": "sum", "ReduceMean": "mean", "ReduceMax": "amax", "ReduceMin": "amin",
}

# OpDef.npu_format "channelwise": run on NC1HWC0 storage per channel (pooling, H/W
# reductions, inference BatchNorm); every non-random elementwise op is "elementwise"
_CHANNELWISE = ("MaxPoolWithArgmax", "AvgPool", "AdaptiveAvgPool2d", "ReduceMean", "ReduceSum",
                "ReduceMax", "ReduceMin", "BatchNorm")
# OpDef.channels_last: ATen's CPU kernel follows an NHWC input (the CPU layout stage); cat
# writes into its planned buffer's strides (an .out kernel keeps a preexisting layout)
_CHANNELS_LAST = _CHANNELWISE + ("MaxPool", "ConcatD")


# OpDef.per_index: along which dims each op is independent per index (gear padding).
# Elementwise rows (kind ELEMENTWISE) are independent along every dim; gradients have none
_PER_INDEX = {
    "Add": pi.offset, "Adds": pi.offset, "Sub": pi.offset, "Subs": pi.offset,
    "Identity": pi.ALL, "Triu": pi.ALL, "Tril": pi.ALL, "FillLike": pi.ALL,
    "ZerosLike": pi.ALL, "OnesLike": pi.ALL,
    **{n: pi.REDUCE for n in ("ReduceSum", "ReduceSumAll", "ReduceMean", "ReduceMeanAll",
                              "ReduceMax", "ReduceMin", "ReduceAny", "ReduceAll", "ArgMaxD",
                              "ArgMinD", "ReduceMaxD", "ReduceVar")},
    "Cumsum": pi.CUMULATIVE, "SoftmaxV2": pi.SOFTMAX, "LogSoftmaxV2": pi.SOFTMAX,
    "LayerNorm": pi.LAYER_NORM, "BatchNorm": pi.BATCH_NORM_INFERENCE,
    "BNTrainingUpdate": pi.BATCH_NORM_TRAINING, "BNTrainingUpdateNoStats": pi.BATCH_NORM_TRAINING,
    "GroupNorm": pi.GROUP_NORM,
    **{n: pi.POOL for n in ("MaxPoolWithArgmax", "MaxPool", "AvgPool", "AdaptiveAvgPool2d")},
    "Embedding": pi.embedding, "GatherElements": pi.gather, "Index": pi.index, "IndexSelect": pi.index_select,
    "ConcatD": pi.cat, "Pack": pi.stack, "PadV3": pi.constant_pad, "Tile": pi.repeat,
    "Range": pi.source, "RangeEnd": pi.source, "Fill2": pi.source, "ScalarTensor": pi.source,
    **{n: pi.reshape for n in ("Reshape", "UnsafeReshape", "ReshapeCopy")},
    "Transpose": pi.permute, "TransposeD": pi.transpose, "Swapaxes": pi.transpose,
    "Unsqueeze": pi.unsqueeze, "Squeeze": pi.squeeze, "SqueezeDim": pi.squeeze,
    "BroadcastTo": pi.expand, "StridedSlice": pi.slice_, "SelectInt": pi.select,
    "SplitWithSize": pi.split, "SplitV": pi.split, "Alias": pi.same,
}


def _npu(family: str) -> dict:
    """The OpDef columns of an op that runs in NPU formats as ``family``."""
    return {"npu_format": family, "kernel_factories": {"vnpu": vnpu_kernels.FACTORIES[family]}}


# table ops with a CPU kernel of their own instead of the ATen op (the ATen op stays
# their reference and fallback): MaxPool's numba pass on channels-last fp32 / bf16, a
# decode step's Embedding rows (numba, into the planned buffer: `_CPU_OUT`)
_CPU_KERNELS = {"MaxPool": pool_cpu.make_max_pool_kernel, "Embedding": embedding_cpu.bind_embedding}
_CPU_OUT = {"Embedding": embedding_cpu.embedding_writes_out}


def _columns(name: str, kind: OpKind) -> dict:
    """Activation, keep-fp32, vnpu cost and NPU-format columns of table row ``name``."""
    cols = {"activation": _ACTIVATION.get(name), "keep_fp32": name in _KEEP_FP32,
            "fuse_expr": _FUSE_EXPR.get(name), "reads_layout": name == "AsStrided",
            "out_contiguous": _OUT_CONTIGUOUS.get(name, ()),
            "per_index": _PER_INDEX.get(name, pi.ALL if kind == OpKind.ELEMENTWISE and
                                        not name.endswith("Grad") else None)}
    if name in _VNPU_COST:
        cols["device_cost"] = {"vnpu": _VNPU_COST[name]}
    cols["channels_last"] = kind == OpKind.ELEMENTWISE or name in _CHANNELS_LAST
    if kind == OpKind.ELEMENTWISE:
        cols.update(_npu("elementwise"))
    elif name in _CHANNELWISE:
        cols.update(_npu("channelwise"))
    elif name in vnpu_nd.FACTORIES:
        cols["kernel_factories"] = {"vnpu": vnpu_nd.FACTORIES[name]}
        if name in vnpu_nd.LAST_AXIS_NZ:      # also on FRACTAL_NZ, over the last axis
            cols["npu_format"] = "lastaxis"
    elif kind in (OpKind.DATA, OpKind.CREATION):     # MTE data movement in ND: exact
        cols["kernel_factories"] = {"vnpu": vnpu_nd.make_data_movement}
    if name in _CPU_KERNELS:
        cols["kernel_factories"] = {**cols.get("kernel_factories", {}), "cpu": _CPU_KERNELS[name]}
    if name in _CPU_OUT:
        cols["out_capable"] = _CPU_OUT[name]
    return cols


def _trans_data_cost(node: Node) -> Cost:
    """Bytes read + written by one TransData, from the vnpu cost model (`trans_data_cost`,
    ascend910b numbers); no FLOPs; nothing for an empty tensor (batch 0)."""
    s, d = node.inputs[0].desc, node.outputs[0].desc
    if not numel(s.shape) or not numel(d.shape):
        return Cost(0, 0)
    e = s.dtype.itemsize
    c0 = max(1, 32 // e)
    kc = trans_data_cost(numel(s.shape), numel(d.shape), s.dtype.value, burst_bytes=c0 * e)
    return Cost(0, int(kc.hbm_bytes))


def _matmul_cost(node: Node) -> Cost:
    """2·M·N·K per (batch) product; addmm (and a LinearAct with a bias) adds M·N for the
    bias."""
    ins = [v.desc for v in node.inputs]
    out = node.outputs[0].desc
    a = ins[-2]  # mm(a, b), bmm(a, b), addmm(bias, a, b); origin shapes: formats pad storage
    k = int(a.origin_shape[-1])
    flops = 2 * k * numel(out.origin_shape)
    if node.op == "MatMulV2" or (node.op == "LinearAct" and node.attrs.get("self") is not None):
        flops += numel(out.origin_shape)
    return Cost(flops, sum(_nbytes(d) for d in ins) + _nbytes(out))


def _conv_cost(node: Node) -> Cost:
    """2·N·C_out·H_out·W_out·(C_in/groups)·K_h·K_w (plus bias)."""
    w = node.inputs[1].desc
    out = node.outputs[0].desc
    macs = numel(out.origin_shape) * numel(w.origin_shape[1:])
    moved = sum(_nbytes(v.desc) for v in node.inputs) + _nbytes(out)
    return Cost(2 * macs, moved)


def _conv_grad_cost(node: Node) -> Cost:
    """convolution_backward(grad_out, input, weight, ...): the input and the weight
    gradient are one convolution's MACs each, 2 FLOPs per MAC."""
    g, w = node.inputs[0].desc, node.inputs[2].desc
    macs = numel(g.origin_shape) * numel(w.origin_shape[1:])
    moved = sum(_nbytes(v.desc) for v in node.inputs) + sum(_nbytes(o.desc) for o in node.outputs)
    return Cost(4 * macs, moved)


def _attention_grad_cost(node: Node) -> Cost:
    """Attention backward (grad_out, q, k, v, ...): five S_q×S_k×D matmuls (QKᵀ again,
    dV, dP, dQ, dK) = 2.5× the forward's two; source: Dao et al. 2022, FlashAttention
    (arXiv:2205.14135) Algorithm 4."""
    q, k = node.inputs[1].desc, node.inputs[2].desc
    bh = numel(q.shape[:-2])
    sq, d, sk = int(q.shape[-2]), int(q.shape[-1]), int(k.shape[-2])
    moved = sum(_nbytes(v.desc) for v in node.inputs) + sum(_nbytes(o.desc) for o in node.outputs)
    return Cost(10 * bh * sq * sk * d + 8 * bh * sq * sk, moved)


def _attention_cost(node: Node) -> Cost:
    """4·B·H·S_q·S_k·D (two matmuls) + 5·B·H·S_q·S_k (softmax)."""
    q, k = node.inputs[0].desc, node.inputs[1].desc
    bh = numel(q.shape[:-2])
    sq, d = int(q.shape[-2]), int(q.shape[-1])
    sk = int(k.shape[-2])
    flops = 4 * bh * sq * sk * d + 5 * bh * sq * sk
    moved = sum(_nbytes(v.desc) for v in node.inputs) + _nbytes(node.outputs[0].desc)
    return Cost(flops, moved)


def _register_all() -> None:
    for name, target, kind, fpe, inplace in _TABLE:
        register(OpDef(name, kind, aten=target, flops_per_elem=fpe, inplace_ok=inplace,
                       aliases=_DECLARED_ALIASES.get(name), primary_only=_PRIMARY_ONLY.get(name),
                       **_columns(name, kind)))
    mm = {"cost_fn": _matmul_cost, "device_cost": {"vnpu": vnpu_cost.matmul}, **_npu("matmul")}
    register(OpDef("MatMul", OpKind.MATMUL, aten=aten.mm.default, per_index=pi.mm, **mm))
    register(OpDef("BatchMatMul", OpKind.MATMUL, aten=aten.bmm.default, per_index=pi.bmm, **mm))
    register(OpDef("MatMulV2", OpKind.MATMUL, aten=aten.addmm.default, per_index=pi.addmm, **mm,
                   doc="addmm(bias, x, w): a Linear layer after decomposition"))
    register(OpDef("Conv2D", OpKind.CONV, aten=aten.convolution.default, cost_fn=_conv_cost,
                   device_cost={"vnpu": vnpu_cost.conv}, per_index=pi.CONV, channels_last=True,
                   **_npu("conv")))
    register(OpDef("ScaledDotProductAttention", OpKind.ATTENTION,
                   aten=aten.scaled_dot_product_attention.default, cost_fn=_attention_cost,
                   kernel_factories={"cpu": attention_cpu.make_attention_kernel, "vnpu": vnpu_nd.make_sdpa},
                   out_capable=attention_cpu.attention_writes_out, kernel_per_shape=True,
                   device_cost={"vnpu": vnpu_cost.attention}, per_index=pi.attention,
                   precision_keeps=("attn_mask",)))
    register(OpDef("Conv2DBackprop", OpKind.CONV, aten=aten.convolution_backward.default,
                   cost_fn=_conv_grad_cost,
                   doc="input, weight and bias gradients: CANN's Conv2DBackpropInput + Filter"))
    register(OpDef("FlashAttentionScore", OpKind.ATTENTION,
                   aten=aten._scaled_dot_product_flash_attention_for_cpu.default,
                   cost_fn=_attention_cost, keep_fp32=True, per_index=pi.attention,
                   doc="fused attention forward kept for training "
                   "(returns the output and the logsumexp its backward reads)"))
    register(OpDef("FlashAttentionScoreGrad", OpKind.ATTENTION,
                   aten=aten._scaled_dot_product_flash_attention_for_cpu_backward.default,
                   cost_fn=_attention_grad_cost))
    register(OpDef("Dropout", OpKind.ELEMENTWISE, aten=aten.native_dropout.default,
                   flops_per_elem=2, random=True, device_cost={"vnpu": vnpu_cost.vector("mul")}))
    register(OpDef("HostFallback", OpKind.FALLBACK,
                   doc="an ATen op with no opencann converter, run on the host as is"))
    register(OpDef("TransData", OpKind.DATA, aliases=((),), cost_fn=_trans_data_cost,
                   kernel_factories={"vnpu": vnpu_kernels.make_trans_data,
                                     "cpu": cpu_kernels.make_trans_data},
                   out_capable=lambda node: node.device.kind == "cpu",
                   device_cost={"vnpu": vnpu_cost.trans_data},
                   doc="format conversion (CANN TransData); attrs src_format, dst_format (format names, "
                       "e.g. 'ND', 'NC1HWC0'), origin_shape, origin_format: the logical shape and its plain "
                       "format"))


_register_all()
