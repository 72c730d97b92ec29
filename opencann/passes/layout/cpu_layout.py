"""Stage 3, layout on the host (GE's stage 4 for ``cpu``): channels-last (NHWC)
activations between oneDNN convolutions, TransData (NHWC→NCHW) only at the boundaries.

`LayoutSelection` (``layout_selection``; ``disable=["layout_selection"]`` switches it off):

1. selection, in topological order. Seeds: every CPU convolution (``ConvBiasAct``,
   ``ConvAddAct``) with a constant 4-D float weight: its oneDNN kernel
   (`opencann.ops.kernels.cpu.make_conv_kernel`, weight prepacked once at bind time)
   reads NCHW or NHWC and writes NHWC. An in-place ``ConvAddAct`` writes into its
   addend, so its result is in the addend's layout. Not a seed: a convolution on an NCHW
   input too small for oneDNN's channels-last kernel (the measured size rule of
   `opencann.ops.kernels.conv_choice`: e.g. the 3→8 and 8→8 3×3 convolutions of a
   1×3×32×32 CNN ran 2-3× slower on it than on eager's NCHW kernel); it runs eager's
   kernel (``meta["kernel"] = "aten"``), its result stays NCHW and the report has a skip
   (detail "NHWC") with the rule's reason. Inside a channels-last region (NHWC input) a
   small convolution stays on oneDNN: leaving the region would cost a TransData. NHWC then spreads through the ops
   whose ATen kernel follows its input's layout (``OpDef.channels_last``: elementwise
   ops, pooling, H/W reductions, inference BatchNorm, ATen convolution; not
   random ones, not views, not a ``Cast`` that asks for a memory format, not ops with
   their own CPU kernel, e.g. ``FusedElementwise`` writes contiguous, not an
   elementwise op whose kernel gives other values (NaN, ±inf, overflow) at another
   layout on this CPU, which stays at eager's layout with the probe's reason in the
   report: `opencann.ops.parity.layout_dependent`; AVX-512's exact GELU,
   pytorch/pytorch#185770): a 4-D result the
   size of an NHWC operand (any 4-D result for pooling) is NHWC too. An NHWC value
   carries channels-last strides in ``node.meta["strides"]`` (what the memory plan's
   arena views and the executor's fresh outputs follow), so ``.out`` kernels write it
   without transposing and the next convolution reads it without a reorder.
2. insertion: one TransData NHWC→NCHW per NHWC value, before the first consumer that
   needs eager's layout: a view (flatten, reshape, permute read the strides), an op
   outside the families above, and the graph outputs (the caller gets eager's strides);
   the TransData's result carries the value's traced (eager) strides. None where eager
   itself had the value channels-last (a model's ``.contiguous(memory_format=
   torch.channels_last)``): its consumers expect NHWC.
3. elimination: inverse TransData pairs are removed and unused ones dropped (the vnpu's
   `NpuLayoutSelection` rules, shared).

Not converted: a graph input feeding a convolution stays NCHW (oneDNN's first-layer
kernel reads NCHW directly; a TransData before ResNet-50's stem measured no faster),
values with symbolic sizes (channels-last strides need sizes) and convolutions on a
non-constant weight (not prepacked: oneDNN keeps the input's layout).

Why NHWC and not NC1HWC0 (nChw8c, C0 = 8 on AVX2): measured on this 2-core AVX2 host
(docs/performance.md, "CPU layout"), ResNet-50's convolutions on opaque oneDNN tensors
(``to_mkldnn``, ``torch.mkldnn_convolution``) took 27% longer than the same
convolutions on NHWC at batch 1 and 6% at batch 8 (1 thread; `bench/cpu_layout.py`),
and torch's bindings have no fused post-ops (bias+ReLU, the residual sum) for opaque
tensors. Source: oneDNN developer guide, "Understanding Memory
Formats" (nhwc is a first-class activation format of its fp32 convolutions); PyTorch's
channels-last tutorial.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Optional, Set

import torch

from ...ir import Format, Graph, Node, Value
from ...ops import OpKind, get_op, output_aliases
from ...ops.kernels.conv_choice import choose as choose_conv_kernel
from ...ops.parity import layout_dependent
from ..base import Pass, PassContext
from .npu_layout import NpuLayoutSelection

NHWC, NCHW = Format.NHWC, Format.NCHW
_SEEDS = ("ConvBiasAct", "ConvAddAct")
# dtypes a value may be stored channels-last in (uint8: the quantized activations between
# AscendQuant / AscendDequant of an ONNX QDQ model, which the int8 kernels read NHWC)
_FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.uint8)


def channels_last_strides(shape) -> tuple:
    """Channels-last (NHWC) strides, in elements, of a 4-D NCHW ``shape`` of ints."""
    n, c, h, w = (int(s) for s in shape)
    return (h * w * c, 1, w * c, c)


def _four_d(v: Value) -> bool:
    d = v.desc
    return d.rank == 4 and d.is_static and d.dtype.torch in _FLOATS


def _distinct(v: Value) -> bool:
    """Whether NHWC and NCHW order ``v``'s elements differently (not when C == 1 or
    H*W == 1: a global pool's [N, C, 1, 1] is both)."""
    n, c, h, w = (int(s) for s in v.desc.shape)
    return c > 1 and h * w > 1


def _candidate(node: Node) -> bool:
    """Whether ``node`` is a CPU convolution on a constant weight with static 4-D float
    activations (a seed unless it is too small: `_eager_conv`)."""
    if node.op not in _SEEDS or node.device.kind != "cpu" or len(node.inputs) < 2:
        return False
    return node.inputs[1].is_const and _four_d(node.inputs[0]) and _four_d(node.outputs[0])


def _eager_conv(node: Node) -> str:
    """Why the convolution ``node`` runs eager's NCHW kernel instead of oneDNN's NHWC one
    ("" when it runs oneDNN's): chosen by `_mark_small` (``meta["kernel"] == "aten"``)."""
    if node.meta.get("kernel") != "aten":
        return ""
    return choose_conv_kernel(node)[1] or "eager's NCHW kernel recorded for this node"


def _mark_small(node: Node, fmt: Dict[int, Format]) -> None:
    """Record ``meta["kernel"] = "aten"`` on a candidate convolution with an NCHW input
    that the size rule (`opencann.ops.kernels.conv_choice`) keeps on eager's kernel; one
    with an NHWC input (inside a channels-last region) stays on oneDNN's."""
    small = (_candidate(node) and fmt.get(node.inputs[0].id) != NHWC
             and choose_conv_kernel(node)[0] == "aten")
    if small:
        node.meta["kernel"] = "aten"
    elif node.meta.get("kernel") == "aten":
        del node.meta["kernel"]


def _conv_out(node: Node, fmt: Dict[int, Format]) -> Optional[Format]:
    """A CPU convolution's result layout: NHWC (oneDNN's) with a constant weight, the
    addend's layout when it writes in place into it; None when it is not a seed (too
    small for oneDNN's channels-last kernel: `_eager_conv`, it stays NCHW)."""
    if not _candidate(node):
        return None
    if node.op == "ConvAddAct" and "inplace_input" in node.attrs:
        return fmt.get(node.inputs[node.attrs["inplace_input"]].id, NCHW)
    if _eager_conv(node):
        return None
    return NHWC


# ops with their own CPU kernel that writes its result in its input's layout (the int8
# quantize / dequantize: `opencann.ops.kernels.int8_cpu`; MaxPool: `ops.kernels.pool_cpu`),
# so NHWC goes through them
_OWN_KERNEL_FOLLOWS = frozenset({"AscendQuant", "AscendDequant", "MaxPool"})


def follows_input(node: Node) -> str:
    """Why ``node``'s kernel cannot take NHWC operands as they are ("" when it can: an ATen
    elementwise, pooling or reduction op that follows its input's layout and, for an
    elementwise op, gives the same values at every layout on this CPU:
    `ops.parity.layout_dependent`, e.g. not AVX-512's exact GELU)."""
    op = get_op(node.op)
    if any(output_aliases(node)):
        return f"{node.op} is a view of its input: it reads eager's strides"
    if not op.channels_last:
        return f"{node.op} has no channels-last kernel"
    if op.random:
        return f"{node.op} draws random numbers in eager's element order"
    if op.kernel_factory(node.device) is not None and node.op not in _OWN_KERNEL_FOLLOWS:
        return f"{node.op}'s own CPU kernel writes contiguous NCHW"
    mf = node.attrs.get("memory_format")
    if node.op == "Cast" and mf not in (None, torch.preserve_format):
        return f"Cast to memory format {mf}"
    why = layout_dependent(node)
    return f"{node.op} runs at eager's layout: {why}" if why else ""


def _select(graph: Graph) -> Dict[int, Format]:
    """Value id -> NHWC for every value stored channels-last (module docstring, step 1)."""
    fmt: Dict[int, Format] = {}
    for n in graph.nodes:
        if n.op in _SEEDS:
            _mark_small(n, fmt)
            f = _conv_out(n, fmt)
            if f is None:
                continue
            if f == NHWC and _distinct(n.outputs[0]):
                fmt[n.outputs[0].id] = NHWC
            continue
        nhwc = [v for v in n.inputs if fmt.get(v.id) == NHWC]
        if not nhwc or follows_input(n):
            continue
        pool = get_op(n.op).kind != OpKind.ELEMENTWISE
        for o in n.outputs:
            if _four_d(o) and _distinct(o) and (pool or any(tuple(v.desc.shape) == tuple(o.desc.shape) for v in nhwc)):
                fmt[o.id] = NHWC
    return fmt


def _eager_nhwc(v: Value) -> bool:
    """Whether eager already laid ``v`` out channels-last (a model calling
    ``.contiguous(memory_format=torch.channels_last)``): then nothing needs converting."""
    p = v.producer
    k = p.outputs.index(v)
    st = (p.meta.get("eager_strides") or p.meta.get("strides") or [None] * len(p.outputs))[k]
    if st is None:
        return False
    shape = [int(n) for n in v.desc.shape]
    cl = channels_last_strides(shape)
    return all(a == b for a, b, n in zip(st, cl, shape) if n != 1)


def _record(ctx: PassContext, nodes: List[Node], candidates: List[Node], used: Set[str],
            detail: str) -> None:
    """``ctx.applied(nodes, detail)`` with the rewrite's id rooted at a traced node: the
    first label of the traced program (``meta["origin"]``) among ``candidates`` not yet
    used by this pass (ids are unique and name nodes of the traced graph, as bisection
    and ``disable_rewrites`` expect); the first of ``nodes`` when none is left."""
    labels = [lab.partition(".")[0] for c in candidates for lab in (c.meta.get("origin") or ()) if lab]
    label = next((lab for lab in labels if lab not in used), None)
    if label is not None:
        used.add(label)
        ctx.root = SimpleNamespace(name=label)
    try:
        ctx.applied(nodes, detail)
    finally:
        ctx.root = None


def _needs_nchw(u: Node, v: Value, fmt: Dict[int, Format]) -> str:
    """Why consumer ``u`` needs ``v`` (NHWC) in eager's layout; "" when it reads NHWC."""
    if u.op in _SEEDS and _conv_out(u, fmt) is not None and u.inputs[1] is not v:
        return ""
    if u.op in _SEEDS and _eager_conv(u):
        return f"{u.op} runs eager's NCHW convolution: {_eager_conv(u)}"
    return follows_input(u)


class LayoutSelection(Pass):
    """cpu: NHWC activations between oneDNN convolutions, TransData at the boundaries
    (module docstring); the report lists each NHWC region, each TransData and why."""

    name, stage = "layout_selection", "layout"
    devices = ("cpu",)
    off_device_note = "no layout rules for device {device}"

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Select NHWC values, give them channels-last strides, insert TransData at the
        boundaries and eliminate inverse pairs. Returns the number of NHWC values plus
        TransData kept."""
        fmt = _select(graph)
        self._skip_inputs(graph, ctx)
        small = self._skip_small(graph, ctx)
        if not fmt:
            ctx.note(f"cpu keeps ND/NCHW: {small} convolution(s) too small for oneDNN's "
                     "channels-last kernel (see the skips)" if small else
                     "cpu keeps ND/NCHW: no oneDNN convolution on a constant weight")
            return 0
        for n in graph.nodes:
            for k, o in enumerate(n.outputs):
                if fmt.get(o.id) == NHWC:
                    st = n.meta.get("strides") or [None] * len(n.outputs)
                    n.meta["strides"] = list(st) + [None] * (len(n.outputs) - len(st))
                    n.meta.setdefault("eager_strides", list(n.meta["strides"]))
                    n.meta["strides"][k] = channels_last_strides(o.desc.shape)
        used: Set[str] = set()
        regions = self._report_regions(graph, fmt, ctx, used)
        inserted = self._insert(graph, fmt, ctx, used)
        eliminated = NpuLayoutSelection._eliminate(graph, ctx)
        dropped = NpuLayoutSelection._drop_dead(graph)
        kept = sum(1 for n in graph.nodes if n.op == "TransData")
        ctx.note(f"NHWC (channels-last) for {len(fmt)} values in {regions} region(s) around "
                 f"oneDNN convolutions; {kept} TransData kept ({inserted} inserted, "
                 f"{eliminated} inverse pairs eliminated, {dropped} unused dropped)")
        return len(fmt) + kept

    @staticmethod
    def _skip_small(graph: Graph, ctx: PassContext) -> int:
        """One skip per convolution left on eager's NCHW kernel by the size rule
        (`_mark_small`, ``meta["kernel"] == "aten"``: what binding runs, saved in model
        files), with its reason. Returns their number."""
        count = 0
        for n in graph.nodes:
            why = _eager_conv(n) if n.op in _SEEDS else ""
            if why:
                ctx.skipped(n, f"{n.name} stays NCHW on eager's convolution kernel: {why}", "NHWC")
                count += 1
        return count

    @staticmethod
    def _skip_inputs(graph: Graph, ctx: PassContext) -> None:
        for v in graph.inputs:
            convs = [u for u in v.users if u.op in _SEEDS and u.inputs[0] is v
                     and not _eager_conv(u)]
            if convs and _four_d(v):
                ctx.skipped(convs[0], f"graph input {v} stays NCHW: oneDNN's first-layer kernel "
                            "reads NCHW directly (a TransData to NHWC measured no faster)",
                            "input TransData")

    @staticmethod
    def _report_regions(graph: Graph, fmt: Dict[int, Format], ctx: PassContext,
                        used: Set[str]) -> int:
        """One report entry per connected NHWC region (its nodes); returns the count."""
        region: Dict[int, int] = {}
        members: Dict[int, List[Node]] = {}
        for n in graph.nodes:
            outs = [o for o in n.outputs if fmt.get(o.id) == NHWC]
            if not outs:
                continue
            ins = {region[v.id] for v in n.inputs if v.id in region}
            r = min(ins) if ins else len(members)
            for other in ins - {r}:   # two regions joined here (a residual add)
                for m in members.pop(other):
                    members.setdefault(r, []).append(m)
                    for o in m.outputs:
                        if o.id in region:
                            region[o.id] = r
            members.setdefault(r, []).append(n)
            for o in outs:
                region[o.id] = r
        for nodes in members.values():
            ops = sorted({m.op for m in nodes})
            _record(ctx, nodes, nodes, used, f"NHWC for {len(nodes)} nodes ({', '.join(ops)}): "
                    "oneDNN convolutions read and write it without reorders")
        return len(members)

    @staticmethod
    def _insert(graph: Graph, fmt: Dict[int, Format], ctx: PassContext, used: Set[str]) -> int:
        """TransData NHWC→NCHW before each consumer needing eager's layout (one per
        value, shared) and before NHWC graph outputs; returns the number inserted."""
        made: Dict[int, Value] = {}
        for n in list(graph.nodes):
            for v in list(n.inputs):
                why = _needs_nchw(n, v, fmt) if fmt.get(v.id) == NHWC and not _eager_nhwc(v) else ""
                if why:
                    if v.id not in made:
                        made[v.id] = _trans_to_nchw(graph, v, before=n)
                        t = made[v.id].producer
                        _record(ctx, [t, n], [t, n], used, f"TransData NHWC→NCHW: {why}")
                    n.replace_input(v, made[v.id])
        for i, v in enumerate(graph.outputs):
            if fmt.get(v.id) == NHWC and not _eager_nhwc(v):
                if v.id not in made:
                    made[v.id] = _trans_to_nchw(graph, v, before=None)
                    t = made[v.id].producer
                    _record(ctx, [t], [t, v.producer] + [u for u in v.users if u is not t], used,
                            "TransData NHWC→NCHW: a graph output, returned in eager's layout")
                graph.outputs[i] = made[v.id]
        return len(made)


def _trans_to_nchw(graph: Graph, v: Value, before: Optional[Node]) -> Value:
    """A TransData v (NHWC) → eager's layout, inserted before ``before`` (appended if
    None); its result carries v's traced (eager) strides."""
    p = v.producer
    k = p.outputs.index(v)
    eager = (p.meta.get("eager_strides") or [None] * len(p.outputs))[k]
    attrs = {"src_format": NHWC.value, "dst_format": NCHW.value,
             "origin_shape": tuple(v.desc.shape), "origin_format": NCHW.value}
    t = graph.create_node("TransData", [v], attrs, [v.desc], name=f"{p.name}_to_nchw",
                          source=p.source, scope=p.scope, before=before)
    t.device = p.device
    t.meta["strides"] = [tuple(eager) if eager is not None else None]
    if "origin" in p.meta:
        t.meta["origin"] = [p.meta["origin"][k]]
    return t.outputs[0]


__all__ = ["LayoutSelection", "channels_last_strides", "follows_input"]
