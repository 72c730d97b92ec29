"""Stage 3, layout for the virtual NPU: place nodes on the vnpu, choose NPU storage
formats, insert TransData at format boundaries and remove inverse TransData pairs.

`NpuLayoutSelection` (runs only when the device is ``vnpu[:<preset>]``):

1. placement: every node except host fallbacks gets ``node.device = ctx.device``;
2. selection, in topological order (by each op's ``OpDef.npu_format`` column):
   Conv2D (float) takes NC1HWC0 activations and a FRACTAL_Z weight and gives NC1HWC0;
   a grouped or depthwise Conv2D takes GE's grouped FRACTAL_Z (e groups packed per
   block-diagonal block, `formats.fz_groups`) and runs on the Cube, as CANN does (ATC
   converts DepthwiseConv to Convolution with group = num_output: CANN 9.0.0 operator list,
   "Convolution (DepthwiseConv, ConvolutionDepthwise)"; the report says which packing);
   MatMul/BatchMatMul/MatMulV2 take and give FRACTAL_NZ (int8 operands too: the int8
   path of ``vnpu_quantize_int8``, C0 = 32, an int32 result at C0 = 16); an int8
   AscendQuant writes the format its Cube consumer reads (NC1HWC0 / FRACTAL_NZ, C0 = 32)
   from the fp32 value in that format, and a per-channel AscendDequant stays in its int32
   input's format (`_quant`); an elementwise op whose
   full-size operands are all in the same NPU format (same logical shape and C0, so
   fp16 <-> fp32 Casts stay) stays in it, on FRACTAL_NZ also with an ND operand broadcast
   along the last axis only (a bias [N], read into UB by the Vector unit; `_elementwise`);
   pooling, H/W reductions (keepdim) and inference BatchNorm on an NC1HWC0 input stay in
   NC1HWC0; LayerNorm and (Log)SoftmaxV2 over the last axis of a FRACTAL_NZ input stay in
   FRACTAL_NZ (`_last_axis`); everything else runs in ND;
3. insertion (as GE does): each NPU-format node gets TransData ND→format on its inputs
   (constant weights are converted once, at compile time, into new constants) and
   TransData format→ND on its outputs, so the graph is correct edge by edge;
4. elimination: TransData(A→B) feeding TransData(B→A) of the same logical tensor is
   removed (reported as "TransData elimination"), then unused TransData are dropped.

Per-preset rules (capabilities on `NpuSpec`): where ``spec.cube_nd_direct`` (Atlas A2,
910B) MatMul/BatchMatMul/MatMulV2 read and write ND, so no TransData surrounds them (the
Cube converts ND to fractals while loading); where float32 is not in ``spec.cube_dtypes``
(910, 310) the float32 operands of Conv2D, the matmuls, the attention ops (SDPA,
FlashAttention; an additive mask stays fp32) and GatedMLP are cast to float16 before the
Cube and the result back to float32 (reported as "fp32 to fp16 for the Cube"; a
fp16→fp32→fp16 pair between two Cube ops is exact and skipped), as GE's default
precision mode does on those chips. Under ``precision_mode`` ``must_keep_origin_dtype``
or ``force_fp32`` an fp32 Cube op cannot keep its dtype there: as CANN does, the compile
fails (`CubeDtypeError`) naming the op, its source line, the mode, the preset and what to
use instead, rather than computing it in fp16.

Formatted values carry ``format``, the padded storage ``shape`` (`format_shape`) and
their ``origin_shape``/``origin_format``, so the memory planner sizes storage correctly;
graph outputs are always TransData'd back to their origin format. A node that consumes
an NPU-format value but cannot run in that format is reported with ``ctx.skipped``.
Source: CANN Graph Engine developer guide (format selection, TransData insertion,
"TransOpDepthFusionPass"/"TransOpSymmetryEliminationPass" in GE's graph optimizer).
"""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from ...devices import Device
from ...devices.vnpu import NpuSpec, c0_for, format_shape, fz_groups, trans_data
from ...ir import DataType, Format, Graph, Node, TensorDesc, TensorRef, Value
from ...ops import OpKind, get_op
from ...ops.kernels.vnpu import origin_format_for
from ..base import Pass, PassContext
from ..prepare.precision import _cast

ND = Format.ND
_FLOATS = (torch.float32, torch.float16, torch.bfloat16)
_CUBE_IN = _FLOATS + (torch.int8,)      # operand dtypes of the Cube kernels here (int8 -> int32)


def npu_desc(desc: TensorDesc, fmt: Format, groups: int = 1) -> TensorDesc:
    """Desc of a plain tensor ``desc`` stored in ``fmt``: padded storage shape
    (`format_shape`; ``groups``: a grouped conv weight's FRACTAL_Z), ``origin_shape`` =
    the logical shape."""
    of = origin_format_for(fmt)
    storage = format_shape(desc.shape, fmt.value, desc.dtype.torch, origin_format=of.value, groups=groups)
    return TensorDesc(storage, desc.dtype, fmt, origin_shape=tuple(desc.shape), origin_format=of)


def _pos(node: Node, name: str) -> Optional[int]:
    a = node.attrs.get(name)
    return a.index if isinstance(a, TensorRef) else None


class _Choice:
    """Per-input required formats and per-output formats of one node; ``groups``: the
    convolution groups of a FRACTAL_Z input (GE's grouped packing); ``note``: the
    format choice worth reporting (why this packing)."""

    def __init__(self, ins: List[Format], outs: List[Format], groups: int = 1, note: str = ""):
        self.ins, self.outs, self.groups, self.note = ins, outs, groups, note


def _conv(node: Node) -> Tuple[Optional[_Choice], str]:
    x = node.arg("input")
    a = node.attrs
    if a.get("transposed"):
        return None, "transposed convolution has no NC1HWC0 kernel on the vnpu"
    if x.desc.rank != 4 or node.outputs[0].desc.rank != 4:
        return None, "not a 2-D convolution"
    if x.desc.dtype.torch not in _CUBE_IN:
        return None, f"dtype {x.desc.dtype.value}: the NC1HWC0 convolution takes floating point or int8"
    ins = [ND] * len(node.inputs)
    ins[_pos(node, "input")] = Format.NC1HWC0
    ins[_pos(node, "weight")] = Format.FRACTAL_Z
    g = int(a.get("groups", 1))
    if g == 1:
        return _Choice(ins, [Format.NC1HWC0]), ""
    w = node.arg("weight").desc
    cout, cin_g = int(w.shape[0]), int(w.shape[1])
    e, cin_opt, cout_opt, blocks = fz_groups(cin_g, cout // g, g, c0_for(x.desc.dtype.torch))
    kind = "depthwise" if cin_g == 1 and cout == g else "grouped"
    note = (f"{kind} conv (groups={g}) on the Cube: NC1HWC0 x grouped FRACTAL_Z, {e} groups per "
            f"block-diagonal block, {blocks} blocks of {cin_opt}->{cout_opt} channels "
            f"({e * cin_g * (cout // g)}/{cin_opt * cout_opt} of each block's MACs useful); "
            f"GE packs groups this way (TransShapeToFzWithGroups)")
    return _Choice(ins, [Format.NC1HWC0], groups=g, note=note), ""


def _matmul(node: Node) -> Tuple[Optional[_Choice], str]:
    names = ("mat1", "mat2") if node.op == "MatMulV2" else ("self", "mat2")
    rank = 3 if node.op == "BatchMatMul" else 2
    ops = [node.inputs[_pos(node, n)] for n in names]
    if any(v.desc.rank != rank for v in ops):
        return None, f"operands are not rank {rank}"
    if any(v.desc.dtype.torch not in _CUBE_IN for v in ops) or \
            len({v.desc.dtype.torch == torch.int8 for v in ops}) != 1:
        return None, "integer matmul other than int8 x int8: the FRACTAL_NZ kernel takes floating point or int8"
    ins = [ND] * len(node.inputs)
    for n in names:
        ins[_pos(node, n)] = Format.FRACTAL_NZ
    return _Choice(ins, [Format.FRACTAL_NZ]), ""


def _last_axis_bias(v: Value, out: TensorDesc) -> bool:
    """True when ``v`` (plain ND) broadcasts to ``out`` along the last axis only: shape
    [N] or [1, ..., 1, N] with N = out's last dim (a Linear bias)."""
    s, o = tuple(v.desc.shape), tuple(out.shape)
    return (len(o) >= 1 and 1 <= len(s) <= len(o) and s[-1] == o[-1] and o[-1] > 1
            and all(d == 1 for d in s[:-1]))


def _same_storage(v: Value, out: TensorDesc, f: Format) -> bool:
    """``v`` (in ``f``) holds every element where ``out`` (in ``f``) does: same logical
    shape and the same C0 (fp16/bf16/fp32 share C0 = 16, so a Cast between them keeps
    the padding in place; int8's C0 is 32)."""
    if tuple(v.desc.origin_shape) != tuple(out.shape):
        return False
    of = origin_format_for(f).value
    return format_shape(out.shape, f.value, v.desc.dtype.torch, origin_format=of) == \
        format_shape(out.shape, f.value, out.dtype.torch, origin_format=of)


def _cube_demand(v: Value, spec: Optional[NpuSpec]) -> Format:
    """The NPU format a Cube consumer of ``v`` takes it in (NC1HWC0 for a convolution's
    input, FRACTAL_NZ for a matmul operand where the Cube does not read ND), else ND."""
    for u in v.users:
        kind = get_op(u.op).npu_format
        if kind == "conv" and u.arg("input") is v and _conv(u)[0] is not None:
            return Format.NC1HWC0
        if kind == "matmul" and not (spec is not None and spec.cube_nd_direct) and _matmul(u)[0] is not None:
            return Format.FRACTAL_NZ
    return ND


def _elementwise(node: Node, fmt: Dict[int, Format], wanted: Optional[Dict[int, Format]] = None,
                 spec: Optional[NpuSpec] = None) -> Tuple[Optional[_Choice], str]:
    """Elementwise ops stay in the NPU format of their full-size operands (same logical
    shape, same C0). On FRACTAL_NZ an ND operand that broadcasts along the last (N) axis
    only (a bias [N]) stays too: the Vector unit reads it into UB and repeats it over the
    M fractal rows, so no TransData is needed (CANN's elementwise ops take NZ with a
    last-axis broadcast operand); a broadcast along any other axis sends the op to ND. An
    ND operand that an earlier node already takes in an NPU format (``wanted``: value id ->
    format, e.g. a block input both convolved and added as the residual) is read from that
    shared TransData. A precision Cast (fp32 -> fp16 before a Cube op, same C0) of an ND
    value runs in the format its Cube consumer takes, so the TransData moves before it and
    is shared with the value's other users (a residual Add)."""
    out = node.outputs[0].desc
    if len(node.outputs) != 1:
        return None, "multi-output elementwise op"
    x = node.inputs[0] if node.inputs else None
    if node.op == "Cast" and node.meta.get("precision") and x is not None and not x.is_const \
            and fmt.get(x.id, ND) == ND:
        f = _cube_demand(node.outputs[0], spec)
        if f != ND and _same_storage(x, out, f):
            return _Choice([f] + [ND] * (len(node.inputs) - 1), [f]), ""
    ins, formats, biases = [], set(), []
    for v in node.inputs:
        if v.desc.is_static and v.desc.numel == 1:      # scalars broadcast in any layout
            ins.append(ND)
            continue
        f = fmt.get(v.id, ND)
        if f == ND and wanted and v.id in wanted and _same_storage(v, out, wanted[v.id]):
            f = wanted[v.id]
        if f == ND and _last_axis_bias(v, out) and tuple(v.desc.shape) != tuple(out.shape):
            biases.append(v)
            ins.append(ND)
            continue
        if f == ND and tuple(v.desc.shape) != tuple(out.shape):
            return None, (f"operand {v} {list(v.desc.shape)} broadcasts to {list(out.shape)} along an axis other "
                          f"than the last (N) one; FRACTAL_NZ keeps only a last-axis broadcast (a bias [N]) in "
                          f"UB, so {node.op} runs in ND behind a TransData")
        if f == ND:
            where = f"produced by {v.producer.op}" if v.producer is not None else "a graph input or constant"
            return None, (f"operand {v} ({where}) is in ND; mixing layouts would need a TransData, "
                          f"so {node.op} runs in ND")
        if not _same_storage(v, out, f):
            return None, (f"operand {v} is {v.desc.dtype.value}{list(v.desc.origin_shape)} but the result is "
                          f"{out.dtype.value}{list(out.shape)}: broadcasting along an axis other than the last "
                          f"(N) one, or a change of C0, moves the padding, so {node.op} runs in ND")
        formats.add(f)
        ins.append(f)
    if len(formats) != 1:
        return None, f"operands in different formats {sorted(f.value for f in formats)}"
    f = formats.pop()
    if biases and f != Format.FRACTAL_NZ:
        return None, (f"operand {biases[0]} {list(biases[0].desc.shape)} broadcasts along the last axis of a "
                      f"{f.value} tensor; only FRACTAL_NZ keeps a last-axis (N) broadcast, so {node.op} runs in ND")
    return _Choice(ins, [f]), ""


def _channelwise(node: Node, fmt: Dict[int, Format]) -> Tuple[Optional[_Choice], str]:
    xi = _pos(node, "input") if "input" in node.attrs else _pos(node, "self")
    x = node.inputs[xi]
    if fmt.get(x.id, ND) != Format.NC1HWC0:
        return None, f"input is in {fmt.get(x.id, ND).value}"
    out = node.outputs[0].desc
    if x.desc.rank != 4 or out.rank != 4:
        return None, "not a 4-D (NCHW) tensor"
    if out.dtype != x.desc.dtype:
        return None, "the result changes dtype (and so C0)"
    if node.op.startswith("Reduce"):
        dims = {d % 4 for d in (node.attrs.get("dim") or [])}
        if not node.attrs.get("keepdim") or not dims or not dims <= {2, 3} or node.attrs.get("dtype"):
            return None, "reduces over channels or drops dimensions (only H/W with keepdim stay NC1HWC0)"
    ins = [ND] * len(node.inputs)
    ins[xi] = Format.NC1HWC0
    return _Choice(ins, [Format.NC1HWC0] + [ND] * (len(node.outputs) - 1)), ""


def _last_axis(node: Node, fmt: Dict[int, Format]) -> Tuple[Optional[_Choice], str]:
    """LayerNorm / (Log)SoftmaxV2 over the last axis stay in FRACTAL_NZ when their input is
    (a matmul's result on a chip whose Cube writes NZ): CANN's kernels reduce a row over
    its N1 fractals and C0 lanes; γ, β stay ND [N]; LayerNorm's mean and rstd are ND."""
    xi = _pos(node, "input") if "input" in node.attrs else _pos(node, "self")
    x = node.inputs[xi]
    if fmt.get(x.id, ND) != Format.FRACTAL_NZ:
        return None, f"input is in {fmt.get(x.id, ND).value}, so {node.op} runs in ND"
    rank, out = x.desc.rank, node.outputs[0].desc
    if rank < 2 or out.dtype != x.desc.dtype:
        return None, "rank-1 input or a change of dtype (and so of C0): runs in ND"
    last = len(node.attrs["normalized_shape"]) == 1 if node.op == "LayerNorm" \
        else int(node.attrs["dim"]) % rank == rank - 1
    if not last:
        return None, (f"{node.op} normalises over more than the last axis; on FRACTAL_NZ only the last "
                      f"(N) axis is a row of fractals, so it runs in ND")
    ins = [ND] * len(node.inputs)
    ins[xi] = Format.FRACTAL_NZ
    return _Choice(ins, [Format.FRACTAL_NZ] + [ND] * (len(node.outputs) - 1)), ""


def _quant(node: Node, fmt: Dict[int, Format], spec: Optional[NpuSpec]) -> Tuple[Optional[_Choice], str]:
    """An int8 AscendQuant takes and gives the format its Cube consumer reads (`_cube_demand`:
    the fp32 value converted in, int8 out at C0 = 32, as CANN's AscendQuant writes NC1HWC0
    int8 for the Cube); a per-channel AscendDequant (``deq_scale``) stays in the format of
    its int32 input (same C0 as fp32). A uint8 AscendQuant / per-tensor AscendDequant (an
    ONNX QDQ model's) runs in ND."""
    if node.op == "AscendQuant":
        if node.outputs[0].desc.dtype != DataType.INT8:
            return None, "a uint8 AscendQuant (a QDQ model's) runs in ND"
        f = _cube_demand(node.outputs[0], spec)
        if f == ND:
            return None, "its int8 Cube consumer reads ND"
        return _Choice([f], [f]), ""
    f = fmt.get(node.inputs[0].id, ND)
    if not isinstance(node.attrs.get("deq_scale"), TensorRef) or f == ND:
        return None, f"{node.op} of an ND value or without deq_scale runs in ND"
    ins = [ND] * len(node.inputs)
    ins[0] = f
    return _Choice(ins, [f]), ""


def select(node: Node, fmt: Dict[int, Format], spec: Optional[NpuSpec] = None,
           wanted: Optional[Dict[int, Format]] = None) -> Tuple[Optional[_Choice], str]:
    """Formats for ``node`` given its operands' formats, the chip ``spec`` (None: no
    per-preset rules) and ``wanted`` (ND values earlier nodes take converted to an NPU
    format), or (None, why it runs in ND)."""
    kind = get_op(node.op).npu_format
    if kind == "matmul" and spec is not None and spec.cube_nd_direct:
        return None, f"{spec.name} matmuls read ND directly (ND-direct Cube load): no TransData"
    if kind is None and get_op(node.op).is_view:
        return None, (f"{node.op} is a view of the logical (ND) layout; padded, blocked NPU storage "
                      "cannot be viewed that way, so its input is TransData'd back to ND")
    if kind is None and "vnpu" in get_op(node.op).kernel_factories:
        return None, f"{node.op}'s vnpu kernel takes ND (ops/kernels/vnpu_nd.py), so its input is TransData'd to ND"
    if kind is None:
        return None, f"{node.op} has no vnpu kernel in NPU formats; it runs in ND on the host"
    if kind == "conv":
        return _conv(node)
    if kind == "matmul":
        return _matmul(node)
    if kind == "elementwise":
        return _elementwise(node, fmt, wanted, spec)
    if kind == "lastaxis":
        return _last_axis(node, fmt)
    if kind == "quant":
        return _quant(node, fmt, spec)
    return _channelwise(node, fmt)


class NpuLayoutSelection(Pass):
    """vnpu placement + format selection + TransData insertion and elimination."""

    name, stage = "npu_layout", "layout"
    devices = ("vnpu",)

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Place, select formats, insert and eliminate TransData (module docstring,
        steps 1-4) for ``ctx.device`` (a ``vnpu[:<preset>]``; another kind: 0, unchanged).
        Returns the number of nodes in NPU formats plus the TransData nodes kept. Raises
        `DeviceError` for an unknown preset."""
        dev = ctx.device
        if dev.kind != "vnpu":
            return 0
        spec = dev.spec
        _check_cube_bf16(graph, ctx)
        casts = 0 if "float32" in spec.cube_dtypes else _cube_fp16_casts(graph, ctx)
        for n in graph.nodes:
            if n.op != "HostFallback":
                n.device = ctx.device
        fmt: Dict[int, Format] = {}
        choices: Dict[Node, _Choice] = {}
        reasons: Dict[Node, str] = {}
        wanted: Dict[int, Format] = {}
        for n in graph.nodes:
            ch, why = select(n, fmt, spec, wanted)
            if ch is None:
                if any(fmt.get(v.id, ND) != ND for v in n.inputs):
                    reasons[n] = why
                continue
            choices[n] = ch
            if ch.note:
                ctx.applied([n], ch.note)
            for v, r in zip(n.inputs, ch.ins):
                if r in (Format.NC1HWC0, Format.FRACTAL_NZ) and fmt.get(v.id, ND) == ND and not v.is_const:
                    wanted.setdefault(v.id, r)
            for o, f in zip(n.outputs, ch.outs):
                fmt[o.id] = f
        self._consts: Dict[Tuple[int, Format], Value] = {}
        self._converted: Dict[Tuple[int, Format], Value] = {}
        inserted = 0
        for n in list(graph.nodes):
            ch = choices.get(n)
            if ch is None:
                continue
            for i, r in enumerate(ch.ins):
                if r != ND:
                    inserted += self._convert_input(graph, n, i, r, ch.groups if r == Format.FRACTAL_Z else 1)
            for j, f in enumerate(ch.outs):
                if f != ND:
                    self._wrap_output(graph, n, j, f)
                    inserted += 1
        eliminated = self._eliminate(graph, ctx)
        dropped = self._drop_dead(graph)
        graph.prune_constants()
        for n, why in reasons.items():
            if not n.erased:
                ctx.skipped(n, why)
        left = sum(1 for n in graph.nodes if n.op == "TransData")
        ctx.artifacts["note"] = (f"{len(choices)} nodes in NPU formats, {left} TransData kept "
                                 f"({inserted} inserted, {eliminated} inverse pairs eliminated, {dropped} unused "
                                 f"dropped), {len(self._consts)} weights converted at compile time"
                                 + (f", {casts} fp32 Cube ops cast to fp16 ({spec.name})" if casts else ""))
        return len(choices) + left

    # -- surgery --------------------------------------------------------------------
    def _convert_input(self, graph: Graph, node: Node, i: int, r: Format, groups: int = 1) -> int:
        """Give input ``i`` of ``node`` in format ``r`` (``groups``: grouped FRACTAL_Z);
        returns TransData nodes added."""
        v = node.inputs[i]
        key = (v.id, r, groups)
        if v.is_const:
            if key not in self._consts:
                of = origin_format_for(r)
                t = trans_data(v.const, of.value, r.value, groups=groups)
                c = graph.add_const(t.contiguous(), f"{v.name or v.id}_{r.value.lower()}")
                c.desc = npu_desc(v.desc, r, groups)
                self._consts[key] = c
            node.set_input(i, self._consts[key])
            return 0
        added = 0
        if key not in self._converted:
            t = _trans(graph, v, ND, r, before=node, device=node.device, groups=groups)
            self._converted[key] = t.outputs[0]
            added = 1
        node.set_input(i, self._converted[key])
        return added

    def _wrap_output(self, graph: Graph, node: Node, j: int, f: Format) -> None:
        """Store output ``j`` in ``f`` and give its users an ND copy (TransData f→ND)."""
        o = node.outputs[j]
        plain = o.desc
        users = list(o.users)
        o.desc = npu_desc(plain, f)
        strides = node.meta.pop("strides", None)
        t = _trans(graph, o, f, ND, before=node.next, out_desc=plain, device=node.device)
        if strides:  # the ND copy stands for the traced value: it keeps eager's strides
            t.meta["strides"] = [strides[j]]
        nd = t.outputs[0]
        for u in users:
            u.replace_input(o, nd)
        graph.outputs = [nd if v is o else v for v in graph.outputs]

    @staticmethod
    def _eliminate(graph: Graph, ctx: PassContext) -> int:
        n = 0
        for t2 in list(graph.nodes):
            if t2.op != "TransData" or t2.erased:
                continue
            t1 = t2.inputs[0].producer
            if t1 is None or t1.op != "TransData":
                continue
            a1, a2 = t1.attrs, t2.attrs
            if (a1["src_format"], a1["dst_format"]) != (a2["dst_format"], a2["src_format"]) \
                    or tuple(a1["origin_shape"]) != tuple(a2["origin_shape"]):
                continue
            graph.replace_all_uses_with(t2.outputs[0], t1.inputs[0])
            graph.erase_node(t2)
            ctx.applied([t1, t2], "TransData elimination")
            n += 1
        return n

    @staticmethod
    def _drop_dead(graph: Graph) -> int:
        n = 0
        for t in reversed(list(graph.nodes)):
            if t.op == "TransData" and not t.outputs[0].users and t.outputs[0] not in graph.outputs:
                graph.erase_node(t)
                n += 1
        return n


class CubeDtypeError(ValueError):
    """A Cube op (conv, matmul) must keep float32 (``precision_mode``
    ``must_keep_origin_dtype`` / ``force_fp32``) on a vnpu preset whose Cube has no fp32,
    or has bfloat16 operands on one whose Cube has no bf16."""


KEEP_DTYPE_MODES = ("must_keep_origin_dtype", "force_fp32")


def _refuse_fp16(n: Node, mode: str, spec: NpuSpec) -> CubeDtypeError:
    from ...devices.vnpu import PRESETS
    fp32 = [p for p, s in PRESETS.items() if "float32" in s.cube_dtypes]
    return CubeDtypeError(
        f"{n.name} ({n.op}) at {n.where()}: precision_mode {mode!r} keeps it in float32, but "
        f"the Cube unit of vnpu preset {spec.name!r} takes {'/'.join(spec.cube_dtypes)} only "
        f"(no fp32), so it cannot keep its dtype. Fix: use precision_mode "
        f"'allow_fp32_to_fp16' (fp16 where the Cube needs it) or 'allow_mix_precision', or a "
        f"preset with an fp32 Cube ({', '.join('vnpu:' + p for p in fp32) or 'none built in'})")


def _check_cube_bf16(graph: Graph, ctx: PassContext) -> None:
    """Raise `CubeDtypeError` for the first Cube op (`_on_cube`) with a bfloat16 operand on
    a preset whose Cube takes no bfloat16 (``NpuSpec.cube_dtypes``: Ascend 910 and 310 take
    float16 and int8; CANN has no bf16 kernel there, and allow_mix_precision_bf16 is an
    Atlas A2 mode), instead of costing and running a kernel that chip does not have."""
    spec = ctx.device.spec
    if "bfloat16" in spec.cube_dtypes:
        return
    for n in graph.nodes:
        if _on_cube(n) and any(v.desc.dtype == DataType.BF16 for v in n.inputs):
            from ...devices.vnpu import PRESETS
            bf16 = [p for p, s in PRESETS.items() if "bfloat16" in s.cube_dtypes]
            mode = ctx.options.get("precision_mode")
            raise CubeDtypeError(
                f"{n.name} ({n.op}) at {n.where()}: bfloat16 operands"
                + (f" (precision_mode {mode!r})" if mode else "")
                + f", but the Cube unit of vnpu preset {spec.name!r} takes "
                f"{'/'.join(spec.cube_dtypes)} only (no bf16). Fix: precision_mode "
                f"'allow_mix_precision' (fp16) on this chip, or a preset with a bf16 Cube "
                f"({', '.join('vnpu:' + p for p in bf16) or 'none built in'})")


def _on_cube(n: Node) -> bool:
    """Whether ``n``'s products run on the Cube: the conv and matmul families, and the
    attention ops and GatedMLP (QKᵀ, PV and the GEMMs are Cube work); an op whose kernel is
    fp32 only (``fp32_kernel``: DecodeAttention, which reads the fp32 KV cache) keeps its dtype."""
    op = get_op(n.op)
    if op.npu_format in ("conv", "matmul"):
        return True
    return (op.kind == OpKind.ATTENTION or n.op == "GatedMLP") and not op.fp32_kernel


def _cube_fp16_casts(graph: Graph, ctx: PassContext) -> int:
    """Cast the float32 operands of Cube ops (conv, matmul, attention, GatedMLP: `_on_cube`;
    an additive attention mask stays float32) to float16 and their float32 results back
    (chips whose Cube has no fp32). Returns the number of Cube ops changed.
    Raises `CubeDtypeError` for the first such op when ``precision_mode`` is
    ``must_keep_origin_dtype`` or ``force_fp32`` (CANN fails such a compile)."""
    cache: Dict = {}
    changed = 0
    mode = ctx.options["precision_mode"]
    for n in list(graph.nodes):
        if not _on_cube(n) or len(n.outputs) != 1 or n.outputs[0].desc.dtype != DataType.FLOAT:
            continue
        if mode in KEEP_DTYPE_MODES:
            raise _refuse_fp16(n, mode, ctx.device.spec)
        keep = {n.attrs[k].index for k in ("attn_mask", *get_op(n.op).precision_keeps)
                if isinstance(n.attrs.get(k), TensorRef)}
        for i, v in enumerate(n.inputs):
            if v.desc.dtype == DataType.FLOAT and i not in keep:
                n.set_input(i, _cast(graph, v, DataType.FLOAT16, n, cache))
        o = n.outputs[0]
        users = list(o.users)
        o.desc = o.desc.with_(dtype=DataType.FLOAT16)
        after = n.next
        back = graph.create_node("Cast", [o], {"self": TensorRef(0), "dtype": torch.float32},
                                 [o.desc.with_(dtype=DataType.FLOAT)], name=f"{n.name}_fp32",
                                 source=n.source, scope=n.scope, before=after)
        back.meta["precision"] = True     # lets _cast skip an exact fp16 -> fp32 -> fp16 pair
        if "strides" in n.meta:
            back.meta["strides"] = n.meta.pop("strides")
        for u in users:
            u.replace_input(o, back.output)
        graph.outputs = [back.output if v is o else v for v in graph.outputs]
        ctx.applied([n], "fp32 to fp16 for the Cube")
        changed += 1
    for t in reversed(list(graph.nodes)):   # casts back to fp32 that only fed the next Cube op
        if t.op == "Cast" and t.meta.get("precision") and not t.outputs[0].users \
                and t.outputs[0] not in graph.outputs:
            graph.erase_node(t)
    graph.prune_constants()
    return changed


def _trans(graph: Graph, v: Value, src: Format, dst: Format, before: Optional[Node],
           device: Device, out_desc: Optional[TensorDesc] = None, groups: int = 1) -> Node:
    """A TransData node v(src) → dst, inserted before ``before`` (appended if None);
    ``groups`` > 1: to GE's grouped FRACTAL_Z (attr ``groups``); ``device``: its placement."""
    npu = dst if dst != ND else src
    origin = tuple(v.desc.origin_shape)
    if out_desc is None:
        out_desc = npu_desc(v.desc, dst, groups)
    attrs = {"src_format": src.value, "dst_format": dst.value, "origin_shape": origin,
             "origin_format": origin_format_for(npu).value}
    if groups != 1:
        attrs["groups"] = groups
    base = v.producer.name if v.producer is not None else (v.name or f"v{v.id}")
    t = graph.create_node("TransData", [v], attrs, [out_desc], name=f"{base}_to_{dst.value.lower()}",
                          source=v.producer.source if v.producer is not None else "",
                          scope=v.producer.scope if v.producer is not None else "", before=before)
    t.device = device
    return t


__all__ = ["NpuLayoutSelection", "npu_desc", "select"]
