"""The ``CubeEpilogue`` graph op: a Cube op (Conv2D, MatMul, MatMulV2, BatchMatMul) with
the bias Add / activation / residual Add after it run in its epilogue, as ONE vnpu kernel (GE's
UB fusion: the Cube result leaves L0C through the fixpipe into the Unified Buffer, the
Vector unit applies the epilogue, one write to HBM). Made by the pass
``vnpu_ub_epilogue`` (``passes/layout/vnpu_ub_epilogue.py``) after format selection.

Node layout: the Cube op's inputs and attributes as they were (``input``/``weight``/...
or ``self``/``mat1``/``mat2`` TensorRefs into the same positions), then one input per
epilogue link that has an operand; attrs ``cube`` (the Cube op's name), ``cube_inputs``
(how many inputs are the Cube op's) and ``epilogue``
(a tuple of (role, input index): role "bias" (a smaller operand broadcast), "add" (a
residual of the output's shape and format) or an activation, index -1: "relu", "gelu",
"gelu_tanh", "tanh", "sigmoid", "silu", or "reshape" of a 2-D MatMul's ND result; the
FixPipe roles of an int8 Cube op: "dequant" (deq_scale input), "deq_bias" (its bias input),
"quant" (requantization to int8, attrs ``quant_scale`` / ``quant_offset`` as AscendQuant's
``scale`` / ``offset``), with attrs ``acc_format`` (the int32 result's storage format),
``dequant_axis`` and ``dequant_dtype``) and
``shapes`` (the value's shape after each link). Output: the last link's
value (the Cube output's shape, dtype and storage format; int8 at C0 = 32 after "quant").

Kernel (vnpu): with FixPipe roles, `_fixpipe_kernel` (bit-equal to the unfused
AscendDequant → ... → AscendQuant chain); otherwise the Cube op's own vnpu kernel, then the epilogue on its storage tensor in
float32, rounded once to the output dtype (unfused, each op rounds: the fused result
differs by at most one rounding per link, within fp16 tolerance; equal in fp32), the
storage padding re-zeroed (`opencann.devices.vnpu.elementwise`). Cost (vnpu): the Cube
op's cost model with the ``epilogue`` roles (`vnpu_cost.cube_with_epilogue`).
"""
from __future__ import annotations

from typing import Callable, Sequence, Tuple

import torch
import torch.nn.functional as F

from ..devices.vnpu import elementwise
from ..ir import DataType, Format, Node, TensorDesc
from .kernels import vnpu_cost
from .kernels.vnpu_quant import dequantize, plain_converters, quantize_int8
from .kernels.vnpu import NPU_FORMATS, nz_row
from .opdef import Cost, OpDef, OpKind, get_op, register

# epilogue role -> its activation on the fp32 accumulator ("bias" and "add" read an operand)
ACTIVATIONS = {"relu": torch.relu, "gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
               "tanh": torch.tanh, "sigmoid": torch.sigmoid, "silu": F.silu}
FIXPIPE = ("dequant", "deq_bias", "quant")
ROLES = ("bias", "add", "reshape", *ACTIVATIONS, *FIXPIPE)


class CubeView:
    """``node`` (a CubeEpilogue) seen as its Cube op: ``op`` is the attr ``cube``, every
    other attribute is the node's and ``inputs`` are the Cube op's (the first
    ``cube_inputs``, in their places), so the Cube op's kernel factory and cost function
    read it unchanged."""

    def __init__(self, node: Node):
        self._node = node
        self.op = node.attrs["cube"]
        self.inputs = node.inputs[:int(node.attrs["cube_inputs"])]

    def __getattr__(self, name):
        return getattr(self._node, name)


def _roles(node: Node) -> Tuple[str, ...]:
    return tuple(r for r, _ in node.attrs["epilogue"] if r != "reshape")


def _vector_roles(node: Node) -> Tuple[str, ...]:
    return tuple(r for r in _roles(node) if r not in FIXPIPE)


def cube_epilogue_cost(node: Node) -> Cost:
    """The Cube op's FLOPs and bytes (its ``cost``) + one FLOP per output element and link;
    the epilogue's own reads (bias, residual) are added, its intermediate writes are not."""
    c = get_op(node.attrs["cube"]).cost(CubeView(node))
    out = node.outputs[0].desc
    extra = sum(node.inputs[i].desc.numel * node.inputs[i].desc.dtype.itemsize
                for _, i in node.attrs["epilogue"] if i >= 0 and node.inputs[i].desc.is_static)
    return Cost(c.flops + len(_roles(node)) * out.numel, c.bytes + extra)


def vnpu_cube_epilogue_cost(node: Node, spec):
    """The vnpu time model: the Cube op's with its epilogue (`vnpu_cost.cube_with_epilogue`;
    FixPipe roles cost no Vector work, the kernel writes the output's dtype)."""
    return vnpu_cost.cube_with_epilogue(CubeView(node), spec, _roles(node))


def vnpu_unfused_cost(node: Node, spec):
    """The vnpu time model of the same work without UB fusion: the Cube op alone, then one
    Vector kernel per link (`elementwise_cost` of the link's op key on the output: bias /
    residual Add 'add' reading 1 / 2 full-size tensors, an activation its own key; a
    reshape is free), run one after another (`vnpu_cost.combine`)."""
    from ..devices.vnpu import elementwise_cost
    view = CubeView(node)
    cube, model = vnpu_cost.cube_with_epilogue(view, spec, ())
    out = node.outputs[0].desc
    parts = [cube]
    if any(r in FIXPIPE for r in _roles(node)):       # the separate AscendDequant / AscendQuant kernels
        acc = max(1, out.numel)
        parts.append(elementwise_cost("mul", acc, "int32", 1, spec))
        if "quant" in _roles(node):
            parts.append(elementwise_cost("mul", acc, node.attrs["dequant_dtype"], 1, spec))
    for role in _vector_roles(node):
        key = "gelu" if role == "gelu_tanh" else ("add" if role == "bias" else role)
        parts.append(elementwise_cost(key, max(1, out.numel), out.dtype.value, 2 if role == "add" else 1, spec))
    return vnpu_cost.combine("CubeEpilogue", parts), f"{model.split(' + ')[0]} + {len(parts) - 1} Vector kernels (unfused)"


def _fixpipe_kernel(node: Node, cube: Callable, in_descs: Sequence[TensorDesc]) -> Callable:
    """The int8 Cube op with its FixPipe chain (epilogue starting with 'dequant'): the int32
    result and the residuals read in their plain layout, then exactly the unfused ops in
    order: AscendDequant (`dequantize`, to ``attrs["dequant_dtype"]``), each activation /
    residual Add in that dtype (the unfused Vector kernels' torch ops), AscendQuant
    (`quantize_int8`, int8) when the chain requantizes; the result stored in the output's
    format. Bit-equal to the unfused chain."""
    a, out = node.attrs, node.outputs[0].desc
    steps = tuple(a["epilogue"])
    acc_plain, _ = plain_converters(Format(a["acc_format"]), out.origin_shape)
    _, store = plain_converters(out.format, out.origin_shape)
    plain = {i: plain_converters(in_descs[i].format, in_descs[i].origin_shape)[0] for r, i in steps if r == "add"}
    dt, axis = DataType(a["dequant_dtype"]).torch, int(a["dequant_axis"])
    si = next(i for r, i in steps if r == "dequant")
    bi = next((i for r, i in steps if r == "deq_bias"), None)
    step, offset = (1.0 / float(a["quant_scale"]), int(a["quant_offset"])) if "quant_scale" in a else (None, None)

    def run(*ins):
        y = dequantize(acc_plain(cube(*ins)), ins[si], None if bi is None else ins[bi], axis, dt)
        for role, i in steps:
            if role in ACTIVATIONS:
                y = ACTIVATIONS[role](y)
            elif role == "add":
                y = y + plain[i](ins[i])
            elif role == "quant":
                y = quantize_int8(y.to(torch.float32), step, offset)
        return store(y.contiguous())
    return run


def make_cube_epilogue_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory (vnpu): ``run(*inputs)`` = the Cube op's vnpu kernel on the leading
    inputs, then the epilogue in float32 on the storage tensor, one rounding (module
    docstring). Raises ValueError for an unknown role."""
    view = CubeView(node)
    cube = get_op(view.op).kernel_factories["vnpu"](view, in_descs, consts)
    steps = tuple(node.attrs["epilogue"])
    if steps and steps[0][0] == "dequant":
        return _fixpipe_kernel(node, cube, in_descs)
    shapes = tuple(node.attrs.get("shapes") or ((),) * len(steps))
    bad = [r for r, _ in steps if r not in ROLES]
    if bad:
        raise ValueError(f"{node.name}: unknown epilogue role {bad[0]!r}; roles are {ROLES}")
    out = node.outputs[0].desc
    fmt = out.format
    c0 = int(out.shape[-1]) if fmt in NPU_FORMATS else 0

    def operand(t: torch.Tensor, role: str) -> torch.Tensor:
        if role == "bias" and fmt == Format.FRACTAL_NZ:
            return nz_row(t, c0)        # [N] laid out over the NZ fractals (the UB broadcast)
        return t

    def epilogue(y: torch.Tensor, *others: torch.Tensor) -> torch.Tensor:
        acc = y.to(torch.float64 if y.dtype == torch.float64 else torch.float32)
        k = 0
        for (role, i), shape in zip(steps, shapes):
            if role in ACTIVATIONS:
                acc = ACTIVATIONS[role](acc)
            elif role == "reshape":                # ND only (the pass follows reshapes in ND)
                acc = acc.reshape(shape)
            else:
                acc = acc + others[k].to(acc.dtype)
                k += 1
        return acc.to(y.dtype)

    def run(*ins):
        y = cube(*ins)
        others = [operand(ins[i], r) for r, i in steps if i >= 0]
        if fmt not in NPU_FORMATS:
            return epilogue(y, *others)
        return elementwise(epilogue, y, *others, fmt=fmt.value, origin_shape=tuple(out.origin_shape),
                           origin_format=out.origin_format.value)
    return run


register(OpDef("CubeEpilogue", OpKind.FUSED, aliases=((),), cost_fn=cube_epilogue_cost,
               kernel_factories={"vnpu": make_cube_epilogue_kernel},
               device_cost={"vnpu": vnpu_cube_epilogue_cost},
               doc="Conv2D/MatMul + bias Add / Relu / residual Add as one vnpu kernel "
                   "(GE's UB fusion: fixpipe to UB, Vector epilogue, one HBM write)"))

__all__ = ["ACTIVATIONS", "CubeView", "ROLES", "cube_epilogue_cost", "make_cube_epilogue_kernel", "vnpu_cube_epilogue_cost",
           "vnpu_unfused_cost"]
