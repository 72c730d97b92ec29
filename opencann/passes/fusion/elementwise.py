"""Stage 2, fusion: `FuseElementwise` (``fuse_elementwise``), maximal groups of elementwise
ops (broadcasting inputs, casts, at most one trailing max/min, or integer sum, over the
last dim) ⇒ one
`FusedElementwise` node whose kernel is generated from the group (numba on the CPU, Triton
on CUDA; ``ops/fused_elementwise.py``). Runs after the pattern fusions, so patterns win.

A group takes the ops whose `OpDef.fuse_expr` gives a per-element form that rounds as
ATen does, all of one domain (the broadcast output shape), in float32, float64, int32,
int64 or bool. It ends at: views (reshape, expand, transpose: strides not followed), random
ops, ops without a fused form (Gelu, Pow with other exponents...), float16/bfloat16 (eager
rounds each op's float32 result to 16 bits; not reproduced), a broadcast of an intermediate
(a group keeps one domain), a reduction (the group's last op), a float sum or mean (eager
rounds every partial sum to the dtype in ATen's cascade order, which depends on the CPU's
vector width; a float64 or differently ordered sum rounds and overflows elsewhere: [3e38,
3e38, -3e38, -3e38] is inf or NaN in eager, 0 in float64), and a merge that would make the
graph cyclic. Every fused op's result is rounded to its dtype, as eager's kernel rounds it. Values read outside the group stay its outputs. Groups of one op are not
fused (ATen's kernel writes the planned buffer itself). Every cut and every group not formed
is reported with its reason.

On cpu the pass runs only when asked (``options={"enable": ["fuse_elementwise"]}``): it
was not faster than ATen here (docs/design/passes.md, bench/elementwise_fusion.py). On vnpu it
runs by default: the estimate costs each group as one Vector kernel that reads its inputs
and writes its outputs to HBM once. ``options["fuse_elementwise_fastmath"]``: compile with
fast-math (changes rounding).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Set, Union

import torch

from ...ir import Graph, Node, TensorRef, Value
from ...ops import OpKind, get_op, is_random
from ...ops.kernels.ew_program import COMPUTE_DTYPES, lit
from ...ops.kernels.vnpu_cost import UB_EPILOGUE, ub_epilogues
from ..base import Pass, PassContext
from .match import contiguous_strides

#: fewest ops a group needs: one op gains nothing over ATen's own kernel
MIN_OPS = 2
_SINGLE = ("single fusable op: ATen's kernel writes the planned buffer itself; a generated "
           f"kernel pays off from {MIN_OPS} ops")


class _Group:
    def __init__(self, node: Node, shape):
        self.nodes: List[Node] = [node]
        self.shape = shape
        self.closed = False          # ends in a reduction


def _dtype(v: Value) -> str:
    return v.desc.dtype.value


def _template(node: Node) -> Union[str, None]:
    fe = get_op(node.op).fuse_expr
    return fe(node.attrs) if callable(fe) else fe


def why_not(node: Node) -> Optional[str]:
    """Why ``node`` cannot join a group (None: it can). Only ops of elementwise,
    reduction or view kind, or random ones, get a reason; others return "" (not fusable,
    nothing to report)."""
    op = get_op(node.op)
    if is_random(node):
        return f"{node.op} is random: random ops never fuse (each call draws new numbers)"
    if op.kind == OpKind.VIEW:
        return (f"{node.op} is a view (aliases its input): a group ends at views, the "
                "generated code does not follow their strides")
    if op.kind not in (OpKind.ELEMENTWISE, OpKind.REDUCTION):
        return ""
    t = _template(node)
    if t is None:
        return (f"{node.op} has no fused form that rounds as ATen does"
                if op.fuse_expr is None else f"{node.op} with these arguments has no fused form")
    if len(node.outputs) != 1:
        return f"{node.op} has {len(node.outputs)} outputs"
    for v in (*node.inputs, node.outputs[0]):
        if _dtype(v) not in COMPUTE_DTYPES and v.desc.dtype.is_floating:
            return (f"dtype {_dtype(v)}: eager rounds each op's result to {_dtype(v)} (some "
                    "compute in float32 inside); the generated code does not reproduce that "
                    "per-op rounding, so it is not fused")
        if _dtype(v) not in COMPUTE_DTYPES:
            return (f"dtype {_dtype(v)}: the generated code handles {', '.join(COMPUTE_DTYPES)} "
                    "(small-int promotion and wraparound not reproduced), so it is not fused")
    out = node.outputs[0].desc
    if node.op == "Cast" and node.inputs[0].desc.dtype.is_floating and not out.dtype.is_floating \
            and out.dtype.value != "bool":
        return "float → integer cast: NaN/inf/out-of-range values are undefined in compiled code"
    if op.kind == OpKind.REDUCTION:
        return _reduction_why(node, t)
    if out.rank == 0:
        return "0-d result: nothing to gain"
    strides = node.meta.get("strides")
    if strides and strides[0] is not None and list(strides[0]) != contiguous_strides(out.shape):
        return f"eager lays the result out with strides {list(strides[0])}; the generated code writes contiguous"
    return None


def _reduction_why(node: Node, kind: str) -> Optional[str]:
    x = node.inputs[0].desc
    dims = node.attrs.get("dim")
    dims = [dims] if isinstance(dims, int) else list(dims or [])
    if x.rank < 1 or len(dims) != 1 or dims[0] not in (-1, x.rank - 1):
        return f"{node.op} over dims {dims}: only a reduction over the last dim fuses"
    if node.attrs.get("dtype") is not None:
        return f"{node.op} with dtype=: not fused"
    if kind == "mean" and not x.dtype.is_floating:
        return "mean of an integer tensor"
    if kind in ("sum", "mean") and x.dtype.is_floating:
        return (f"{node.op} of {x.dtype.value}: eager adds in {x.dtype.value} in ATen's cascade "
                "order (set by the CPU's vector width), rounding every partial sum; a fused sum "
                "would round and overflow elsewhere, so it runs in ATen on the group's output")
    if x.rank == 1 and not node.attrs.get("keepdim"):
        return "reduction to a 0-d tensor: not fused"
    return None


class FuseElementwise(Pass):
    """Maximal elementwise groups (+ a trailing last-dim reduction) ⇒ FusedElementwise."""

    name, stage = "fuse_elementwise", "fusion"
    #: CANN UB fusion reference: "TbeEltwiseFusionPass" (up to six consecutive
    #: ElemWise/Broadcast nodes) and "AutomaticUbFusion" (connected Elemwise ops)
    switch_section, cann_names = "UBFusion", ("TbeEltwiseFusionPass", "AutomaticUbFusion")
    site_switchable = True
    #: runs on cpu by default (it did not beat ATen there: docs/design/passes.md)
    cpu_default = False

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Form the groups in graph order, report each cut, fuse each group of ≥ MIN_OPS
        ops; returns the number of groups fused."""
        if ctx.device_kind == "cpu" and not self.cpu_default and \
                self.name not in ctx.options["enable"]:
            ctx.note("off on cpu by default (not faster than ATen here, docs/design/passes.md); "
                     "options={'enable': ['fuse_elementwise']} runs it")
            return 0
        epilogue = ub_epilogues(graph)[1] if ctx.device_kind == "vnpu" else {}
        groups = self._form(graph, ctx, epilogue)
        fused = 0
        for g in groups:
            if len(g.nodes) < MIN_OPS:
                ctx.skipped(g.nodes[0], _SINGLE)
                continue
            ctx.root = g.nodes[-1]
            if ctx.site_off(g.nodes[-1]):
                continue
            if _cyclic(graph, set(g.nodes)):
                ctx.skipped(g.nodes[-1], "fusing would make the graph cyclic with an earlier fused group")
                continue
            self._rewrite(graph, g, ctx)
            fused += 1
        ctx.root = None
        if fused:
            graph.topo_sort()
        ctx.note(f"{fused} group(s) fused")
        return fused

    # -- grouping --------------------------------------------------------------------
    def _form(self, graph: Graph, ctx: PassContext, epilogue: dict) -> List[_Group]:
        pos = {n: i for i, n in enumerate(graph.nodes)}
        of: Dict[Node, _Group] = {}
        groups: List[_Group] = []
        reported: Set[Node] = set()
        for node in graph.nodes:
            why = why_not(node)
            if why is None and node in epilogue:
                why = f"left to {epilogue[node].name}'s Cube epilogue ({UB_EPILOGUE})"
            if why is not None:
                self._report_edges(node, why, ctx, reported)
                continue
            red = get_op(node.op).kind == OpKind.REDUCTION
            shape = tuple(node.inputs[0].desc.shape) if red else tuple(node.outputs[0].desc.shape)
            g = _Group(node, shape)
            for v in dict.fromkeys(node.inputs):
                pg = of.get(v.producer) if v.producer is not None else None
                if pg is None or pg is g:
                    continue
                if pg.closed:
                    ctx.skipped(node, f"reads {v}, the result of a reduction: a reduction ends its group")
                elif pg.shape != shape:
                    ctx.skipped(node, f"broadcasts {v} {list(pg.shape)} to {list(shape)}: a group "
                                "keeps one domain, so the groups stay apart")
                elif _cyclic(graph, set(pg.nodes) | set(g.nodes), pos):
                    ctx.skipped(node, f"joining the group of {v} would make the graph cyclic "
                                "(a path leaves the group and comes back)")
                else:
                    g.nodes = sorted(pg.nodes + g.nodes, key=pos.get)
                    for n in pg.nodes:
                        of[n] = g
                    groups.remove(pg)
            g.closed = red
            of[node] = g
            groups.append(g)
        return groups

    @staticmethod
    def _report_edges(node: Node, why: str, ctx: PassContext, reported: Set[Node]) -> None:
        """Report ``why`` at ``node`` when it is an elementwise op or touches one (a cut of
        a group, or a group not formed)."""
        if not why or node in reported:
            return
        near = [v.producer for v in node.inputs if v.producer is not None] + \
            [u for o in node.outputs for u in o.users]
        ew = (OpKind.ELEMENTWISE, OpKind.REDUCTION)
        if get_op(node.op).kind == OpKind.ELEMENTWISE or any(get_op(n.op).kind in ew for n in near):
            reported.add(node)
            ctx.skipped(node, why)

    # -- rewriting -------------------------------------------------------------------
    def _rewrite(self, graph: Graph, g: _Group, ctx: PassContext) -> None:
        inside = set(g.nodes)
        names: Dict[int, str] = {}
        inputs: List[Value] = []
        lines, outputs, out_vals, reduce = [], [], [], None

        def ref(v: Value) -> str:
            if v.id not in names:
                names[v.id] = f"a{len(inputs)}"
                inputs.append(v)
            return names[v.id]

        for i, n in enumerate(g.nodes):
            o = n.outputs[0]
            if get_op(n.op).kind == OpKind.REDUCTION:
                reduce = [_template(n), ref(n.inputs[0]), _dtype(o), bool(n.attrs.get("keepdim"))]
                outputs.append("r")
                out_vals.append(o)
                continue
            names[o.id] = f"t{i}"
            lines.append([f"t{i}", _dtype(o), _render(n, ref)])
            if any(o is x for x in graph.outputs) or any(u not in inside for u in o.users):
                outputs.append(f"t{i}")
                out_vals.append(o)
        last = g.nodes[-1]
        attrs = {"program": lines, "outputs": outputs, "reduce": reduce,
                 "fastmath": bool(ctx.options["fuse_elementwise_fastmath"]),
                 "shape": list(g.shape), "ops": [n.op for n in g.nodes]}
        with graph.rewriting():   # the fused node records the nodes it replaces
            new = graph.create_node("FusedElementwise", inputs, attrs, [v.desc for v in out_vals],
                                    name=f"{last.name}_fused", source=last.source, scope=last.scope,
                                    before=last)
            for old, nv in zip(out_vals, new.outputs):
                graph.replace_all_uses_with(old, nv)
            for n in reversed(g.nodes):
                graph.erase_node(n)
        ctx.applied(list(g.nodes), "+".join(n.op for n in g.nodes))


def _compute_dtype(node: Node) -> str:
    """The dtype the op computes in: its result's; for a bool result (comparisons,
    logic, casts to bool), torch's promotion of its operands (scalars as wrapped numbers)."""
    out = _dtype(node.outputs[0])
    if out != "bool":
        return out
    ops = []
    for k, val in node.attrs.items():
        if isinstance(val, TensorRef) and k != "condition":
            d = node.inputs[val.index].desc
            # rank is what promotion looks at (0-d tensors rank below dimensioned ones);
            # sizes may be symbolic
            ops.append(torch.empty([1] * d.rank, dtype=d.dtype.torch, device="meta"))
        elif k in ("other",) and isinstance(val, (int, float, bool)):
            ops.append(val)
    if not ops:
        return out
    return str(torch.result_type(*ops) if len(ops) > 1 else ops[0].dtype).replace("torch.", "")


def _render(node: Node, ref) -> str:
    """The node's expression in the neutral syntax: operands by program name (cast to the
    compute dtype), literals typed in it."""
    cd = _compute_dtype(node)
    op = get_op(node.op)
    schema = {a.name: a for a in op.aten._schema.arguments}
    text = _template(node).replace("#1", lit(cd, 1)).replace("#0", lit(cd, 0))
    out = []
    for part in _split(text):
        if not part.startswith("{"):
            out.append(part)
            continue
        name = part[1:-1]
        val = node.attrs[name] if name in node.attrs else schema[name].default_value
        if isinstance(val, TensorRef):
            v = node.inputs[val.index]
            s = ref(v)
            if _dtype(v) != cd and name != "condition":
                s = f"cast_{cd}({s})"
            out.append(s)
        else:
            out.append(lit(cd, val))
    return "".join(out)


def _split(text: str) -> List[str]:
    parts, i = [], 0
    while i < len(text):
        j = text.find("{", i)
        if j < 0:
            parts.append(text[i:])
            break
        k = text.index("}", j)
        parts += [text[i:j], text[j:k + 1]]
        i = k + 1
    return [p for p in parts if p]


def _cyclic(graph: Graph, members: Set[Node], pos: Optional[Dict[Node, int]] = None) -> bool:
    """True when a path leaves ``members`` and comes back (fusing them would make a cycle).
    ``pos``: graph positions of a topological order, to stop at nodes after the last member."""
    limit = max(pos[n] for n in members) if pos else None
    stack = [u for n in members for o in n.outputs for u in o.users if u not in members]
    seen: Set[Node] = set()
    while stack:
        n = stack.pop()
        if n in seen or (limit is not None and pos.get(n, limit + 1) > limit):
            continue
        seen.add(n)
        for o in n.outputs:
            for u in o.users:
                if u in members:
                    return True
                stack.append(u)
    return False


__all__ = ["FuseElementwise", "MIN_OPS", "why_not"]
