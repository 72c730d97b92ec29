"""Whether a graph node's ATen kernel gives another result at another memory layout on
this CPU (`layout_dependent`), and the layout eager ran a value at (`eager_layout`).

Eager's result is eager's kernel at eager's layout (the traced strides). A rewrite that
moves an elementwise op to another layout (the CPU layout stage's NHWC regions, an
elementwise op reading a oneDNN convolution's channels-last output as is) keeps eager's
result only when the op's kernel is layout-independent; `layout_dependent` asks
`opencann.devices.cpu_layout_values.layout_differs` with the node's operand dtypes and
broadcast shapes and its literal arguments (cached there per signature). On AVX-512,
ATen's exact GELU is layout-dependent (oneDNN's kernel for contiguous tensors gives
gelu(+inf) = NaN, the channels-last/strided loop +inf: pytorch/pytorch#185770).
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

from ..devices.cpu_layout_values import PROBE_SHAPE, Operand, layout_differs
from ..ir import Node, TensorListRef, TensorRef, Value
from .opdef import OpKind, get_op


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


def _probe_signature(node: Node) -> Optional[tuple]:
    """(overload, args, kwargs) of ``node``'s call with `Operand` placeholders, or None
    when the node is not probed (not an ATen elementwise op with a static 4-D output)."""
    op = get_op(node.op)
    if op.kind != OpKind.ELEMENTWISE or op.aten is None or op.random or not node.outputs:
        return None
    out = node.outputs[0].desc
    if out.rank != 4 or not out.is_static or any(not v.desc.is_static for v in node.inputs):
        return None
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
            val = _operand(node, v)
        else:
            val = _hashable(val)
        if a.kwarg_only:
            kwargs.append((a.name, val))
        else:
            args.append(val)
    return op.aten, tuple(args), tuple(kwargs)


def layout_dependent(node: Node) -> str:
    """Why ``node``'s ATen kernel must run at eager's layout: its probe
    (`devices.cpu_layout_values.layout_differs`, run on this CPU once per signature: op,
    operand dtypes and broadcast shapes, literals) gives other values (NaN, ±inf, ±0.0,
    overflow) with channels-last, strided or mixed operands than with contiguous ones;
    "" when it gives the same, or when the node is not an ATen elementwise op with a
    static 4-D output (nothing else is moved between layouts)."""
    sig = _probe_signature(node)
    if sig is None:
        return ""
    try:
        why = layout_differs(*sig)
    except TypeError:        # an unhashable literal: probe uncached
        why = layout_differs.__wrapped__(*sig)
    return why or ""


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


__all__ = ["eager_layout", "layout_dependent", "strides_layout"]
