"""Which values a cast to fp16 / bf16 would change in meaning, for the precision pass.

A cast to a low-precision type rounds; that is what mixed precision accepts. Two
changes are not rounding: a finite value beyond the type's range becomes ±inf
(``torch.finfo(torch.float32).min``, the fill transformers uses for attention masks,
is -inf in fp16 and bf16: a fully masked row then softmaxes to NaN or 0 instead of
eager's uniform average), and a nonzero constant whose every nonzero entry flushes to
zero (an epsilon of 1e-12 in fp16: a division by zero). `lost_in_cast` names such a
value among a node's float scalar arguments and constant tensor inputs; the pass then
keeps that node in fp32, where the value means what it meant in eager. Weights whose
few tiny entries flush to zero are ordinary rounding and do not count. The rule follows
onnxconverter-common's ``float16.convert_float_to_float16``, which keeps constants'
meaning by clamping them to fp16's range (``min_positive_val``, ``max_finite_val``)
instead of letting them become 0 or inf; here the op stays in fp32 instead of clamping,
since a clamped mask (-65504) added to scores in fp32 no longer absorbs them.

The same holds for an integer result cast to float before its dequantization scale
(`integer_accumulators`): ConvInteger's / MatMulInteger's int32 accumulator, an integer
sum or ``torch._int_mm``'s result routinely exceeds fp16's 65504 (inf, then NaN after the
scale) and the integers bf16 holds exactly; the ops reading it up to the scale's Mul / Div
stay in fp32, with the ops computing that scale, as CANN's AscendDequant applies the
scale in fp32 before any cast.
"""
from __future__ import annotations

from typing import Dict, Optional, Tuple

import torch

from ...ir import DataType, Graph, Node, Value
from ...ops import OpKind, get_op


def _scalar_lost(x: float, dt: torch.dtype) -> Optional[str]:
    """Why the float ``x`` loses its meaning as ``dt`` (None: it survives)."""
    why = _tensor_lost(torch.tensor([x], dtype=torch.float64), dt)
    return why.replace("constant holds ", "").replace("constant ", "") if why else None


def _tensor_lost(t: torch.Tensor, dt: torch.dtype) -> Optional[str]:
    """Why the constant ``t`` loses its meaning as ``dt``: a finite entry becomes ±inf,
    or every nonzero entry becomes 0 (None: it survives, rounding aside)."""
    if not t.is_floating_point() or t.numel() == 0:
        return None
    f = t.detach().double()
    low = f.to(dt)
    finite = torch.isfinite(f)
    over = finite & ~torch.isfinite(low)
    if bool(over.any()):
        x = f[over].flatten()[0].item()
        return f"constant holds {x:g}, which overflows {dt} to {'-' if x < 0 else ''}inf"
    nonzero = finite & (f != 0)
    if bool(nonzero.any()) and not bool((low[nonzero] != 0).any()):
        return f"constant {f[nonzero].flatten()[0].item():g} flushes to 0 in {dt}"
    return None


def lost_in_cast(node: Node, target: DataType) -> Optional[str]:
    """Why lowering ``node`` to ``target`` (fp16 / bf16) would change what one of its
    values means: a float scalar argument or a constant float input that overflows to
    ±inf or flushes to 0 (see the module docstring). None when every value survives."""
    dt = target.torch
    for name, v in node.attrs.items():
        if isinstance(v, float):
            why = _scalar_lost(v, dt)
            if why:
                return f"its argument {name}={why}"
    for v in node.inputs:
        if v.is_const and v.const is not None:
            why = _tensor_lost(v.const, dt)
            if why:
                return f"its {v.name or 'constant'}: {why}"
    return None


#: the largest integer up to which every integer is exact in each low type (2 ** (mantissa
#: bits + 1)): an integer result beyond it is lowered only after its scale is applied
_EXACT = {torch.float16: 2 ** 11, torch.bfloat16: 2 ** 8}
_SCALES = ("Mul", "Muls", "Div", "Divs")   # the ops that apply a dequantization scale
_SUMS = {"Add": 1, "Adds": 1, "Sub": -1, "Subs": -1}   # integer interval arithmetic


def integer_accumulators(graph: Graph, target: DataType) -> Dict[int, str]:
    """id(node) -> why the node must not compute in ``target`` (fp16 / bf16): it reads a
    float cast (to fp32 / fp64) of a non-constant integer value that may exceed the
    integers ``target`` holds exactly (`_int_range`: an int32 accumulator of ConvInteger,
    MatMulInteger, ``_int_mm``, an integer sum; not DequantizeLinear's int8 / uint8 minus
    its zero point), directly or through ops that are not a Mul / Div (the scale): those
    ops and the scale's Mul / Div stay in fp32, and so do the elementwise ops computing
    the scale operand (`_scale_nodes`: x's scale times the weight's). Empty for other
    targets."""
    limit = _EXACT.get(target.torch)
    if limit is None:
        return {}
    ranges: Dict[int, Tuple[int, int]] = {}
    raw: Dict[int, str] = {}   # float value id -> what it holds, for the reason
    keep: Dict[int, str] = {}
    for node in graph.nodes:
        _note_int_ranges(node, ranges)
        if node.op == "Cast":
            src, out = node.inputs[0], node.outputs[0]
            lo, hi = _int_range(src, ranges)
            if out.desc.dtype in (DataType.FLOAT, DataType.DOUBLE) and _is_int(src) \
                    and not src.is_const and max(-lo, hi) > limit:
                p = src.producer
                what = f"{p.name} ({p.op})" if p is not None else f"input {src.name or src.id}"
                raw[out.id] = (f"the {src.desc.dtype.value} result of {what}, cast to float (an "
                               f"integer up to {max(-lo, hi):.3g}, beyond those {target.value} "
                               "holds exactly: its scale is applied in fp32 first)")
            continue
        read = next((v for v in node.inputs if v.id in raw), None)
        if read is None:
            continue
        keep[id(node)] = f"it reads {raw[read.id]}"
        if node.op in _SCALES:
            for p in _scale_nodes(node, read):
                keep.setdefault(id(p), f"it computes the dequantization scale of {raw[read.id]}")
        else:
            raw.update({o.id: raw[read.id] for o in node.outputs if o.desc.dtype.is_floating})
    return keep


def _is_int(v: Value) -> bool:
    dt = v.desc.dtype.torch
    return not (dt.is_floating_point or dt.is_complex)


def _int_range(v: Value, ranges: Dict[int, Tuple[int, int]]) -> Tuple[int, int]:
    """(lowest, highest) integer ``v`` may hold: its recorded range (`_note_int_ranges`),
    a constant's own, else its dtype's (bool: 0, 1; a float: (0, 0), not asked)."""
    if v.id in ranges:
        return ranges[v.id]
    dt = v.desc.dtype.torch
    if dt == torch.bool or not _is_int(v):
        return (0, 1) if dt == torch.bool else (0, 0)
    if v.is_const and v.const is not None and v.const.numel():
        return int(v.const.min()), int(v.const.max())
    info = torch.iinfo(dt)
    return info.min, info.max


def _note_int_ranges(node: Node, ranges: Dict[int, Tuple[int, int]]) -> None:
    """Record the range of ``node``'s integer output where it is narrower than its dtype's:
    an integer Cast keeps its source's range (uint8 -> int32: 0..255), a view its input's,
    Add / Sub of two known ranges their interval sum (``alpha`` 1, within the dtype)."""
    if len(node.outputs) != 1 or not _is_int(node.outputs[0]) or not node.inputs:
        return
    out = node.outputs[0]
    full = _int_range_of_dtype(out)
    r = None
    if node.op == "Cast" or get_op(node.op).kind == OpKind.VIEW:
        src = node.inputs[0]
        r = _int_range(src, ranges) if _is_int(src) or src.desc.dtype.torch == torch.bool else None
    elif node.op in _SUMS and node.attrs.get("alpha", 1) == 1 and "self" in node.attrs \
            and "other" in node.attrs:
        a, b = node.arg("self"), node.arg("other")
        ra = _int_range(a, ranges) if isinstance(a, Value) and _is_int(a) else None
        rb = (_int_range(b, ranges) if isinstance(b, Value) and _is_int(b)
              else (b, b) if isinstance(b, int) and not isinstance(b, bool) else None)
        if ra is not None and rb is not None:
            r = ((ra[0] + rb[0], ra[1] + rb[1]) if _SUMS[node.op] > 0
                 else (ra[0] - rb[1], ra[1] - rb[0]))
    if r is not None and full[0] <= r[0] and r[1] <= full[1]:
        ranges[out.id] = r


def _int_range_of_dtype(v: Value) -> Tuple[int, int]:
    info = torch.iinfo(v.desc.dtype.torch) if v.desc.dtype.torch != torch.bool else None
    return (info.min, info.max) if info is not None else (0, 1)


def _scale_nodes(scale: Node, read: Value) -> list:
    """The elementwise / view nodes computing ``scale``'s (a Mul / Div) operands other than
    ``read`` (the integer result), walked back while their outputs are smaller than
    ``read`` (a broadcast scale: per tensor or per channel, not another activation)."""
    try:
        size = read.desc.numel
    except (TypeError, ValueError):   # a symbolic shape: no size to compare
        return []
    found: Dict[int, Node] = {}
    todo = [v for v in scale.inputs if v is not read]
    while todo:
        p = todo.pop().producer
        if p is None or p.op == "Cast" or id(p) in found \
                or get_op(p.op).kind not in (OpKind.ELEMENTWISE, OpKind.VIEW):
            continue
        try:
            small = all(o.desc.numel < size for o in p.outputs)
        except (TypeError, ValueError):
            small = False
        if small:
            found[id(p)] = p
            todo += [v for v in p.inputs if v.desc.dtype.is_floating and not v.is_const]
    return list(found.values())


def low_kernel_differs(node: Node, target: DataType) -> Optional[str]:
    """Why ``node`` run in ``target`` (fp16 / bf16) on the cpu device would put NaN or ±inf
    where eager's fp32 op does not, on this CPU (the precision pass asks it for the cpu
    only: the vnpu and CUDA run other kernels): a convolution (1-, 2- or 3-D, transposed or not) with
    an odd number of input channels per group, probed once per configuration
    (`parity.conv_low_precision_differs`: oneDNN's bf16 convolution pairs input channels,
    and the pad of an odd count reads a neighbouring position's NaN or inf); an
    activation (GELU erf / tanh, SiLU, tanh, sigmoid), probed once per (activation,
    dtype) (`parity.activation_low_precision_differs`: ATen's fp16 GELU returns +inf for
    +inf where its fp32 one, oneDNN's on AVX-512, returns NaN). None for every other node
    and where the probe finds eager's positions."""
    if target.torch not in (torch.bfloat16, torch.float16):
        return None
    act = _activation(node)
    if act is not None:
        from ...ops.parity import activation_low_precision_differs
        return activation_low_precision_differs(act, target.torch)
    if node.op != "Conv2D":
        return None
    a = node.attrs
    wref = a.get("weight")
    w = node.inputs[wref.index] if hasattr(wref, "index") else None
    if w is None or len(w.desc.shape) not in (3, 4, 5) \
            or not all(isinstance(d, int) for d in w.desc.shape):
        return None
    groups = int(a.get("groups", 1) or 1)
    transposed = bool(a.get("transposed"))
    d0, d1, *kernel = (int(d) for d in w.desc.shape)
    # weight [out, in / groups, *k]; transposed [in, out / groups, *k]
    cin, cout = (d0, d1 * groups) if transposed else (d1 * groups, d0)
    if (cin // groups) % 2 == 0:
        return None
    from ...ops.parity import conv_low_precision_differs
    rank = len(kernel)
    return conv_low_precision_differs(cin, cout, groups, tuple(kernel),
                                      _per_dim(a.get("stride", (1,)), rank),
                                      _per_dim(a.get("dilation", (1,)), rank), target.torch,
                                      transposed)


def _activation(node: Node) -> Optional[str]:
    """The `parity.activation_low` name of the activation ``node`` computes ("gelu",
    "gelu_tanh" for Gelu(approximate="tanh"), "silu", "tanh", "sigmoid"), else None."""
    from ...ops.parity.activation_low import LOW_ACTS
    act = get_op(node.op).activation
    if act == "gelu" and node.attrs.get("approximate", "none") == "tanh":
        act = "gelu_tanh"
    return act if act in LOW_ACTS else None


def _per_dim(v, rank: int) -> tuple:
    """A convolution's stride / dilation argument (one value or one per spatial dim) as
    ``rank`` ints."""
    v = tuple(int(x) for x in v)
    return v * rank if len(v) == 1 else v


__all__ = ["integer_accumulators", "lost_in_cast", "low_kernel_differs"]
