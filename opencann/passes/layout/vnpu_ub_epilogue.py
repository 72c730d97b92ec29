"""Stage 3 (after `NpuLayoutSelection`), vnpu only: GE's UB fusion as a graph rewrite.

`VnpuUbEpilogue`:
    Conv2D/MatMul(x, w) → [bias Add] → [Relu/GELU/SiLU/Tanh/Sigmoid] → [residual Add]
                                                                  (each link one consumer)
    ⇒ CubeEpilogue(x, w, bias?, residual?; cube=Conv2D/..., epilogue=(roles...))
The chain is what `opencann.ops.kernels.vnpu_cost.ub_epilogues` finds (at most three
links, each the only consumer of the one before, shape and dtype kept; a reshape of a
Linear's ND result between them is taken along, free in ND); the fused node is
executed as one kernel (`opencann.ops.cube_epilogue`) and costed as one Cube kernel with a
Vector epilogue, so the estimate reads the graph as it runs. A Cube node whose chain stops
for a reason (two consumers, a graph output) is reported with that reason, and the reason
is kept in ``node.meta["epilogue_not_fused"]`` for the estimate's row.

Where the preset has ``fixpipe_quant`` (Atlas A2) an int8 Cube op's chain starts with its
AscendDequant (int32 L0C → fp16/fp32 per-channel deq_scale in the FixPipe, no Vector pass)
and may end with the next int8 layer's AscendQuant (requantization: the Cube op writes
int8):
    Conv2D(int8 → int32) → AscendDequant → [Relu] → [residual Add] → [Relu] → [AscendQuant]
    ⇒ CubeEpilogue(x_i8, w_i8, corr, deq_scale, bias?, residual?; epilogue=(dequant, ...))
bit-equal to the unfused chain (the same `dequantize` / `quantize_int8` functions).
Source: CANN Graph Engine, UB fusion ("UBFusion" section of the fusion switch file):
Cube result → fixpipe → Unified Buffer → Vector ops → one write to GM; Ascend C
``Fixpipe`` (quantPre DEQF16 / VDEQF16 / REQ8 / VREQ8) on Atlas A2.
"""
from __future__ import annotations

from typing import List, Tuple

from ...ir import Format, Graph, Node
from ...ops.kernels.vnpu_cost import FIXPIPE_ROLES, UB_EPILOGUE, ub_epilogues
from ..base import Pass, PassContext


def fuse_chain(graph: Graph, cube: Node, links: List[Node], roles: Tuple[str, ...]) -> Node:
    """Replace ``cube`` and its epilogue ``links`` (in order, with ``roles``) by one
    CubeEpilogue node placed where the last link was; returns it."""
    ins, steps, prev, shapes = list(cube.inputs), [], cube.outputs[0], []
    extra = {}
    for node, role in zip(links, roles):
        shape = tuple(int(d) for d in node.outputs[0].desc.shape)
        if role == "dequant":                        # deq_scale (+ bias) operands, FixPipe attrs
            a = node.attrs
            ins.append(node.inputs[a["deq_scale"].index])
            steps.append(("dequant", len(ins) - 1))
            shapes.append(shape)
            if "bias" in a:
                ins.append(node.inputs[a["bias"].index])
                steps.append(("deq_bias", len(ins) - 1))
                shapes.append(shape)
            extra.update(acc_format=cube.outputs[0].desc.format.value, dequant_axis=int(a.get("axis", 1)),
                         dequant_dtype=node.outputs[0].desc.dtype.value)
        elif role == "quant":                        # requantization: AscendQuant's scale / offset
            steps.append(("quant", -1))
            shapes.append(shape)
            extra.update(quant_scale=float(node.attrs["scale"]), quant_offset=int(node.attrs["offset"]))
        elif role not in ("bias", "add"):              # an activation or a reshape: no operand
            steps.append((role, -1))
            shapes.append(shape)
        else:
            other = node.inputs[1] if node.inputs[0] is prev else node.inputs[0]
            ins.append(other)
            steps.append((role, len(ins) - 1))
            shapes.append(shape)
        prev = node.outputs[0]
    last = links[-1]
    attrs = dict(cube.attrs, cube=cube.op, cube_inputs=len(cube.inputs), epilogue=tuple(steps), shapes=tuple(shapes),
                 **extra)
    with graph.rewriting():   # the fused node records the nodes it replaces
        fused = graph.create_node("CubeEpilogue", ins, attrs, [last.outputs[0].desc],
                                  name=f"{cube.name}_{'_'.join(roles)}", source=cube.source, scope=cube.scope,
                                  before=last)
        fused.device = cube.device
        if last.meta.get("strides"):
            fused.meta["strides"] = last.meta["strides"][:1]
        graph.replace_all_uses_with(last.outputs[0], fused.outputs[0])
        for n in reversed([cube, *links]):
            graph.erase_node(n)
    return fused


def _unsupported(cube: Node, roles: Tuple[str, ...]) -> str:
    """Why the CubeEpilogue kernel cannot take this chain ("" when it can): an integer
    Cube output without its FixPipe dequantization, a bias Add after one, or a bias
    broadcast over NC1HWC0 storage (only FRACTAL_NZ and ND lay a bias out for the Vector
    unit)."""
    out = cube.outputs[0].desc
    if roles and roles[0] == "dequant":
        if "bias" in roles:
            return "a bias Add after the FixPipe dequantization: fold it into AscendDequant's bias"
        return ""
    if not out.dtype.torch.is_floating_point:
        return "integer Cube output: the epilogue here is for floating point"
    if "bias" in roles and out.format == Format.NC1HWC0:
        return "a bias Add on NC1HWC0 storage: the epilogue lays a bias out over FRACTAL_NZ or ND only"
    return ""


class VnpuUbEpilogue(Pass):
    """Conv/MatMul + bias Add / activation / residual Add ⇒ one CubeEpilogue node (vnpu)."""

    name, stage = UB_EPILOGUE, "layout"
    ops = ("Conv2D", "MatMul", "MatMulV2", "BatchMatMul")
    devices = ("vnpu",)
    off_device_note = "vnpu-only fusion (Cube epilogue in the Unified Buffer): skipped on {device}"
    switch_section = "UBFusion"
    site_switchable = True

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Fuse every chain `ub_epilogues` finds (float outputs only); record the Cube
        nodes left alone with their reason. Returns the number of CubeEpilogue nodes made."""
        epi, absorbed, why_not = ub_epilogues(graph, fixpipe=bool(getattr(ctx.device.spec, "fixpipe_quant", False)))
        for cube, why in why_not.items():
            cube.meta["epilogue_not_fused"] = why
            ctx.skipped(cube, why)
        links = {}
        for node, cube in absorbed.items():
            links.setdefault(cube, []).append(node)
        made = 0
        for cube, chain in links.items():
            ctx.root = cube
            why = _unsupported(cube, epi[cube])
            if why:
                ctx.skipped(cube, why)
                cube.meta["epilogue_not_fused"] = why
                continue
            if ctx.site_off(cube):
                continue
            fused = fuse_chain(graph, cube, chain, epi[cube])
            fix = [r for r in epi[cube] if r in FIXPIPE_ROLES]
            vec = [r for r in epi[cube] if r != "reshape" and r not in FIXPIPE_ROLES]
            parts = ([f"fixpipe({', '.join(fix)})"] if fix else []) + ([f"epilogue({', '.join(vec)})"] if vec or not fix
                                                                     else [])
            ctx.applied([fused], " + ".join([cube.op, *parts]))
            made += 1
        ctx.root = None
        ctx.note(f"{made} Cube kernels took an epilogue ({sum(len(c) for c in links.values())} ops fused), "
                 f"{len(why_not)} left alone")
        return made


__all__ = ["VnpuUbEpilogue", "fuse_chain"]
