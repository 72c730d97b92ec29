"""Whether a graph node's ATen kernel gives another result at another memory layout on
this CPU (`layout_dependent`), and the layout eager ran a value at (`eager_layout`).

Eager's result is eager's kernel at eager's layout (the traced strides). A rewrite that
moves an elementwise op to another layout (the CPU layout stage's NHWC regions, an
elementwise op reading a oneDNN convolution's channels-last output as is) keeps eager's
result only when the op's kernel is layout-independent; `layout_dependent` asks
`layout_probe.layout_differs` with the node's operand dtypes and broadcast shapes and
its literal arguments (cached there per signature, in memory and on disk). On AVX-512,
ATen's exact GELU is layout-dependent (oneDNN's kernel for contiguous tensors gives
gelu(+inf) = NaN, the channels-last/strided loop +inf: pytorch/pytorch#185770).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ...ir import Node, TensorListRef, TensorRef, Value
from ..opdef import OpKind, get_op
from .conv_probes import conv_post_op_differs, conv_sum_differs
from .layout_probe import PROBE_SHAPE, Operand, layout_differs


def _hashable(a: Any) -> Any:
    if isinstance(a, (list, tuple)):
        return tuple(_hashable(x) for x in a)
    return a


def _operand(node: Node, v: Value) -> Operand:
    """``v`` as a probe `Operand`: `PROBE_SHAPE`'s size on each dim where ``v`` spans the
    node's (4-D) output, 1 where it broadcasts (right-aligned, as ATen broadcasts)."""
    out = [int(s) for s in node.outputs[0].desc.shape]
    shape = [int(s) for s in v.desc.shape]
    probe = [p if o != 1 else 1 for p, o in zip(PROBE_SHAPE, out)]
    lead = len(out) - len(shape)
    dims = tuple(probe[lead + j] if s == out[lead + j] and s != 1 else 1 for j, s in enumerate(shape))
    return Operand(v.desc.dtype.torch, (1,) * lead + dims)   # 4-D: laid out as the others


# the layouts a rewrite may run an op at instead of eager's contiguous or channels-last
# one (the layout stage's NHWC, oneDNN's channels-last output; mixed operands included):
# none makes an eager value strided, that is a view, which keeps eager's layout
_MOVED_TO = ("contiguous", "channels_last")
_MAX_C = 40   # probe channels of a window op: 2.5 AVX-512 fp32 vectors (a body and a tail)


def _window_operand(v: Value, c: int) -> Operand:
    """``v`` as a probe `Operand` of a pooling, reduction or BatchNorm node whose data
    has ``c`` channels: its own shape with batch 1 and at most `_MAX_C` channels (4-D),
    a per-channel [c] operand cut likewise, other shapes as is; the sparse pattern."""
    shape = tuple(int(s) for s in v.desc.shape)
    if len(shape) == 4:
        shape = (1, min(shape[1], _MAX_C)) + shape[2:]
    elif shape == (c,):
        shape = (min(c, _MAX_C),)
    return Operand(v.desc.dtype.torch, shape, True)


def _probe_signature(node: Node) -> Optional[tuple]:
    """(overload, args, kwargs) of ``node``'s call with `Operand` placeholders, or None
    when the node is not probed (not an ATen op the CPU layout stage may move, with
    static shapes and a 4-D input or output)."""
    op = get_op(node.op)
    if not op.channels_last or op.aten is None or op.random or not node.outputs \
            or op.kind not in (OpKind.ELEMENTWISE, OpKind.POOL, OpKind.REDUCTION, OpKind.NORM):
        return None
    out = node.outputs[0].desc
    if any(not v.desc.is_static for v in node.inputs) or not out.is_static:
        return None
    window = op.kind != OpKind.ELEMENTWISE
    data = [v for v in node.inputs if v.desc.rank == 4]
    if (out.rank != 4 and not window) or (window and not data):
        return None
    c = int(data[0].desc.shape[1]) if data else 0
    args, kwargs = [], []
    for a in op.aten._schema.arguments:
        if a.name not in node.attrs:
            continue
        val = node.attrs[a.name]
        if isinstance(val, TensorListRef):
            return None
        if isinstance(val, TensorRef):
            v = node.inputs[val.index]
            if v.desc.rank > 4:
                return None
            val = _window_operand(v, c) if window else _operand(node, v)
        else:
            val = _hashable(val)
        if a.kwarg_only:
            kwargs.append((a.name, val))
        else:
            args.append(val)
    return op.aten, tuple(args), tuple(kwargs)


def layout_dependent(node: Node) -> str:
    """Why ``node``'s ATen kernel must run at eager's layout: its probe
    (`layout_probe.layout_differs`, run on this CPU once per signature: op,
    operand dtypes and broadcast shapes, literals) gives other values (NaN, ±inf, ±0.0,
    overflow) with channels-last or mixed operands than with contiguous ones (the
    layouts a rewrite moves an op between: `_MOVED_TO`);
    "" when it gives the same, or when the node is not an ATen op the layout stage may
    move (``OpDef.channels_last``: elementwise with a static 4-D output; pooling, H/W
    reductions, BatchNorm on a static 4-D input, probed at the node's H, W with batch 1
    and at most 40 channels: a sum over H·W may overflow in one order and not in
    another)."""
    sig = _probe_signature(node)
    if sig is None:
        return ""
    return layout_differs(*sig, _MOVED_TO) or ""


def eager_layout(v: Value) -> str:
    """The layout eager gave ``v`` (4-D): "channels_last" when its traced strides
    (``meta["eager_strides"]`` if a pass changed them, else ``meta["strides"]``) are
    channels-last and not also contiguous, "strided" when they are neither, else
    "contiguous" (also when none were recorded: graph inputs, constants, pass-made nodes)."""
    p = v.producer
    if p is None:
        return "contiguous"
    k = p.outputs.index(v)
    st = (p.meta.get("eager_strides") or p.meta.get("strides") or [None] * len(p.outputs))
    st = st[k] if k < len(st) else None
    if st is None or v.desc.rank != 4 or not v.desc.is_static:
        return "contiguous"
    return strides_layout([int(s) for s in v.desc.shape], st)


def strides_layout(shape: Sequence[int], strides: Sequence[int]) -> str:
    """"contiguous", "channels_last" or "strided": the layout of 4-D ``strides``
    (elements) for ``shape``, ignoring the strides of size-1 dims."""
    n, c, h, w = shape
    cont = (c * h * w, h * w, w, 1)
    cl = (h * w * c, 1, w * c, c)

    def same(ref):
        return all(int(a) == b for a, b, s in zip(strides, ref, shape) if s != 1)
    if same(cont):
        return "contiguous"
    return "channels_last" if same(cl) else "strided"


def _layout_of_strides(node: Node, key: str) -> Optional[str]:
    st = (node.meta.get(key) or [None])[0]
    out = node.outputs[0].desc
    if st is None or out.rank != 4 or not out.is_static:
        return None
    return strides_layout([int(s) for s in out.shape], st)


def kernel_layout_differs(node: Node) -> str:
    """Why a compiled ``node`` would not give eager's values on this CPU ("" when it
    would): an elementwise op the CPU layout stage moved off eager's layout (its
    ``meta["strides"]`` vs ``meta["eager_strides"]``) whose kernel is `layout_dependent`
    here, a ``ConvBiasAct`` whose post-op differs from eager's activation at eager's
    layout (`conv_post_op_differs`), a ``ConvAddAct`` whose sum [+ ReLU] differs
    (`conv_sum_differs`). A model file compiled on one CPU is checked with it on the
    CPU that loads it (AVX2's GELU is layout-independent, AVX-512's is not)."""
    if node.op == "ConvBiasAct" and node.attrs.get("act", "none") != "none":
        out = node.outputs[0]
        return conv_post_op_differs(node.attrs["act"], out.desc.dtype.torch, eager_layout(out)) or ""
    if node.op == "ConvAddAct":
        out, other = node.outputs[0], node.inputs[node.attrs["other"].index]
        return conv_sum_differs(node.attrs.get("act") == "relu", out.desc.dtype.torch,
                                eager_layout(out), eager_layout(other)) or ""
    moved = _layout_of_strides(node, "strides")
    if moved is not None and "eager_strides" in node.meta and moved != _layout_of_strides(node, "eager_strides"):
        return layout_dependent(node)
    return ""


__all__ = ["eager_layout", "kernel_layout_differs", "layout_dependent", "strides_layout"]
