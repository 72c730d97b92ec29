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
"""
from __future__ import annotations

from typing import Optional

import torch

from ...ir import DataType, Node
from ...ops import get_op


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


__all__ = ["lost_in_cast", "low_kernel_differs"]
