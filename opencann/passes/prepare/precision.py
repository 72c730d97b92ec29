"""Mixed precision: CANN's precision modes over an IR graph, by inserting ``Cast`` nodes.

Modes (names from CANN's ATC / GE option ``precision_mode``; source: Ascend "ATC
parameters: --precision_mode" and torch_npu "precision_mode" documentation):

* ``force_fp32``: every floating-point op computes in fp32 (low-precision inputs are
  cast up; results are cast back to the original dtype at the graph outputs).
* ``must_keep_origin_dtype``: nothing changes.
* ``allow_fp32_to_fp16``: fp32 is kept where the device supports it and lowered to fp16
  only where it does not; every CPU op supports fp32, so on "cpu" nothing changes.
* ``allow_mix_precision`` (fp16) / ``allow_mix_precision_bf16``: the *low list*
  (matmul, conv, attention) runs in fp16 / bf16; the *keep-fp32 list* (softmax, norms,
  reductions, exp/log/pow, losses: the ops whose ``OpDef.keep_fp32`` is set, see
  `default_keep_fp32`; user-modifiable) runs in fp32; every other elementwise, view,
  data-movement and pooling op follows its inputs (low when all its float inputs are
  low), so activations stay low between low ops without a cast pair.
* ``force_fp16``: every floating-point op that is not a cast runs in fp16.

In every mode, an op whose kernels compute in fp32 only (``OpDef.fp32_kernel``:
DecodeAttention) stays in fp32, and an op that writes into an input in place
(``OpDef.inplace_of``: KvCacheUpdate writing the KV cache) computes in that input's
dtype: casting the cache would write into a copy instead of the caller's tensor.

Per node (CANN ATC's ``--keep_dtype`` file: node names kept in their original dtype;
and opencann's ``node_precision``: node name -> "fp32" / "bf16" / "fp16"): a named node
computes in that precision whatever the mode's lists say (`opencann.tools.tune` writes
these). Names are the captured program's node names (torch.export's FX names such as
``addmm_1`` or ``convolution``; an ONNX node's name), which are stable across compiles of
the same model; mixed precision runs before fusion, so a fused node (``addmm_1_relu``)
is named by its parts. An unknown name is one ValueError line listing near matches.

Casts of weights (graph constants) are done once at compile time. A Cast pair
low→fp32→low of the same tensor is exact and folded away.

Values keep their eager meaning (CANN reports, not changes, what a mode cannot do): an
op that would be lowered while one of its float scalar arguments or constant inputs
does not survive the cast (``finfo(float32).min`` in a ``masked_fill`` or an additive
mask becomes -inf; an epsilon of 1e-12 becomes 0 in fp16; `precision_values`) stays
in fp32, named in the log (INFO) and in the pass's note, as do the ops reading an integer
result cast to float before its dequantization scale (ConvInteger's / MatMulInteger's /
``_int_mm``'s int32 accumulator: beyond fp16's range; `integer_accumulators`) up to the
Mul / Div applying that scale, and the ops computing the scale, and, on the cpu, an op whose
low-precision kernels would put NaN or ±inf elsewhere than eager's fp32 op (a convolution
with an odd number of input channels per group, an activation: `low_kernel_differs`,
probed once per machine); an op's ``OpDef.precision_keeps``
inputs (SDPA's ``attn_mask``) are never cast down: ATen adds a float mask to
low-precision scores in fp32, as eager does with an fp32 mask. A graph output that is a
graph input or a view of one is never cast, in any mode: the caller gets its own tensor
or that view of it, as from eager (`_output_as`). An op whose float ``dtype`` argument
names its output dtype (``cumsum(x, 1, dtype=torch.float32)``, ``sum``, ``mean``: ONNX
CumSum's converter, a torch model's own) gets the dtype the mode gives its output
(`_dtype_attr_follows`), so its kernel writes the lowered output it is handed.
"""
from __future__ import annotations

import difflib
from typing import Any, Dict, Iterable, Mapping, Optional, Set, Tuple

import torch

from ...ir import DataType, Graph, Node, TensorRef, Value
from ...log import logger
from ...ops import OpKind, all_ops, get_op, inplace_inputs, written_inputs
from ..base import Pass, PassContext
from .precision_values import integer_accumulators, lost_in_cast, low_kernel_differs

MODES = ("force_fp32", "must_keep_origin_dtype", "allow_fp32_to_fp16", "allow_mix_precision",
         "allow_mix_precision_fp16", "allow_mix_precision_bf16", "force_fp16")
LOW_KINDS = (OpKind.MATMUL, OpKind.CONV, OpKind.ATTENTION)
# ops that follow their inputs' precision: elementwise, views, data movement, and pooling
# (max is exact in any dtype; ATen's bf16/fp16 average pooling accumulates in fp32)
FOLLOW_KINDS = (OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.DATA, OpKind.POOL)


def pre_fusion_names(names: Iterable[str]) -> Set[str]:
    """``names`` (op types) with each fused op replaced by the op types that stand in its
    place before fusion (``OpDef.fused_from``: LinearAct -> MatMulV2 and MatMul, ConvBiasAct and
    ConvAddAct -> Conv2D, AddLayerNorm -> LayerNorm); mixed precision runs before fusion,
    so this is what it must keep. Names of other ops pass through."""
    out: Set[str] = set()
    for name in names:
        out.update(get_op(name).fused_from or (name,))
    return out


def default_keep_fp32() -> Set[str]:
    """CANN's "black list" analogue: the IR ops whose accuracy needs fp32, i.e. whose
    ``OpDef.keep_fp32`` column is set (HostFallback nodes such as losses are never
    lowered). Change it per op (``get_op("Gelu").keep_fp32 = True``), per pass
    (``MixedPrecision(keep_fp32=...)``) or per compile (``options["keep_fp32"]``)."""
    return {op.name for op in all_ops() if op.keep_fp32}


FP32, FP16, BF16 = DataType.FLOAT, DataType.FLOAT16, DataType.BF16
#: ``node_precision`` values -> the dtype a node computes in
PRECISIONS = {"fp32": FP32, "fp16": FP16, "bf16": BF16}


def low_dtype(mode: str) -> Optional[DataType]:
    """The low-precision type of ``mode`` (None for modes that lower nothing on CPU).
    Raises ValueError naming the valid modes."""
    if mode not in MODES:
        raise ValueError(f"unknown precision_mode {mode!r}; use one of {list(MODES)}")
    return {"allow_mix_precision": FP16, "allow_mix_precision_fp16": FP16,
            "allow_mix_precision_bf16": BF16, "force_fp16": FP16}.get(mode)


def _cast(graph: Graph, v: Value, dt: DataType, before: Node, cache: Dict) -> Value:
    """``v`` as ``dt``: a folded constant, an existing cast's source, or a new Cast node."""
    key = (v.id, dt)
    if key in cache:
        return cache[key]
    if v.is_const:
        out = graph.add_const(v.const.to(dt.torch), name=f"{v.name or v.id}_{dt.value}")
    elif (v.producer is not None and v.producer.op == "Cast" and v.producer.meta.get("precision")
          and v.producer.inputs[0].desc.dtype == dt):
        out = v.producer.inputs[0]  # low -> fp32 -> low is exact
    else:
        node = graph.create_node("Cast", [v], {"self": TensorRef(0), "dtype": dt.torch},
                                 [v.desc.with_(dtype=dt)], name=f"cast_{dt.value}",
                                 source=before.source, scope=before.scope, before=before)
        node.meta["precision"] = True
        node.meta["precision_for"] = before.name   # per-node timing charges it to its reader
        if v.traced_strides is not None:  # Cast keeps its input's layout, as eager's .to()
            node.meta["strides"] = [v.traced_strides]
        out = node.output
    cache[key] = out
    return out


class MixedPrecision(Pass):
    """Rewrites float ops to the precision of ``options["precision_mode"]`` (CANN mode
    names above) by inserting Cast nodes. Kept in fp32: ``keep_fp32`` (op names; default
    `default_keep_fp32`, the ops whose OpDef column says so) plus ``options["keep_fp32"]``.
    Off unless ``precision_mode`` is set."""

    name = "precision"
    stage = "prepare"

    def __init__(self, keep_fp32: Optional[Iterable[str]] = None):
        self.keep_fp32 = set(default_keep_fp32() if keep_fp32 is None else keep_fp32)
        self._per_node: Dict[str, Optional[DataType]] = {}

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Apply ``options["precision_mode"]`` (unset: unchanged). ``force_fp32``: every
        float op in fp32; a mode whose `low_dtype` is None: unchanged (noted); ``force_fp16``:
        every float op in fp16; the mixed modes lower MATMUL/CONV/ATTENTION ops not in
        ``keep_fp32`` and let ELEMENTWISE/VIEW/DATA/POOL ops follow their non-constant float
        inputs. Host fallbacks and creation ops take fp32; graph outputs are cast back to
        their original dtypes. Returns the number of inputs redirected to casts plus the
        output casts. Raises ValueError for an unknown mode (`low_dtype`)."""
        mode = ctx.options["precision_mode"]
        per_node = node_overrides(graph, ctx.options.get("keep_dtype") or (),
                                  ctx.options.get("node_precision") or {})
        if not mode and not per_node:
            return 0
        for node in graph.nodes:   # kept out of int8 too, after fusion renames it (carry_keep_dtype)
            if node.name in per_node and per_node[node.name] is None:
                node.meta["keep_dtype"] = True
        self._per_node = per_node
        low = low_dtype(mode) if mode else None
        keep = pre_fusion_names(self.keep_fp32 | set(ctx.options["keep_fp32"]))
        keep -= set(ctx.options.get("lower_ops") or ())
        lower = set(ctx.options.get("lower_ops") or ())
        if mode == "force_fp32":
            return self._rewrite(graph, FP32, lambda n: True, set(), ctx, mode)
        if low is None and not per_node:
            ctx.artifacts["note"] = f"{mode}: every op supports fp32 on {ctx.device}; unchanged"
            return 0
        if low is None:   # per-node precisions only: every other op keeps its dtype
            return self._rewrite(graph, None, lambda n: False, keep, ctx, mode or "node_precision")
        if mode == "force_fp16":
            return self._rewrite(graph, low, lambda n: True, set(), ctx, mode)
        return self._rewrite(graph, low, lambda n: get_op(n.op).kind in LOW_KINDS
                             or n.op in lower, keep, ctx, mode)

    def _rewrite(self, graph: Graph, target: Optional[DataType], is_low, keep,
                 ctx: PassContext, mode: str) -> int:
        floats = (FP32, FP16, BF16)
        cache: Dict = {}
        origin = {id(v): v.desc.dtype for v in graph.values()}
        changed = 0
        kept = []
        accumulators = {dt: integer_accumulators(graph, dt) for dt in (FP16, BF16)}
        for node in list(graph.nodes):
            want, written = _wanted(node, target, is_low, keep, self._per_node)
            if want is None:
                continue
            if want == "origin":   # keep_dtype: its original dtype, inputs cast back to it
                outs = [origin[id(o)] for o in node.outputs if origin[id(o)] in floats]
                want = outs[0] if outs else FP32
            if want != FP32 and not written:
                why = lost_in_cast(node, want) or accumulators.get(want, {}).get(id(node)) or (
                    low_kernel_differs(node, want) if ctx.device.kind == "cpu" else None)
                if why:   # lowering would change what a value means: keep eager's
                    want = FP32
                    kept.append(f"{node.name} ({node.op}) at {node.where()}: {why}")
            held = _held_inputs(node) if want != FP32 else set()
            fl = [v for v in dict.fromkeys(node.inputs) if v.desc.dtype in floats
                  and id(v) not in held]
            # up to fp32 only what an earlier rewrite lowered (a bf16/fp16 model keeps its
            # own precision) -- but then every float input, as ATen's kernels want one dtype
            lift = want != FP32 or mode == "force_fp32" or any(
                v.desc.dtype != origin[id(v)] for v in fl)
            for v in fl:
                if v.desc.dtype != want and lift:
                    node.replace_input(v, _cast(graph, v, want, node, cache))
                    changed += 1
            for o in node.outputs:
                if o.desc.dtype in floats and o.desc.dtype != want and any(
                        v.desc.dtype == want for v in node.inputs):
                    o.desc = o.desc.with_(dtype=want)
                    _dtype_attr_follows(node, o.desc.dtype)
        changed += _cast_outputs(graph, origin, cache)
        graph.prune_constants()
        low_name = target.value if target is not None else "per node"
        ctx.artifacts["note"] = f"{mode}: {changed} casts; low precision {low_name}"
        if self._per_node:
            ctx.artifacts["note"] += f"; {len(self._per_node)} nodes set per node"
        if kept:
            ctx.artifacts["note"] += ("; kept in fp32 because a value would not survive the "
                                      "cast: " + "; ".join(kept))
            for k in kept:
                logger.info("opencann: precision %s: %s kept in fp32 (the value would not "
                            "survive the cast)", mode, k)
        return changed


def _wanted(node: Node, target: Optional[DataType], is_low, keep,
            per_node: Mapping[str, Optional[DataType]]) -> Tuple[Any, bool]:
    """(the dtype ``node`` computes in under the mode, None: leave it, "origin": its
    original dtype; whether it writes an input in place). Casts are left; host fallbacks
    and creations take fp32; an op writing into an input in place (``OpDef.inplace_of``:
    the KV cache) keeps that input's dtype, as a cast would write into a copy, not the
    caller's tensor; ``fp32_kernel`` ops take fp32; a node named in ``per_node`` (name
    -> dtype, None: its original dtype) takes that; ``keep`` ops take fp32; ``is_low``
    ops ``target``; FOLLOW_KINDS ops follow their non-constant float inputs when those
    share one low dtype; the rest fp32 (with no ``target``: their original dtype)."""
    op = get_op(node.op)
    floats = (FP32, FP16, BF16)
    rest = FP32 if target is not None else "origin"
    if node.op == "Cast":
        return None, False
    if node.op == "HostFallback" or op.kind in (OpKind.CREATION, OpKind.FALLBACK):
        return FP32, False
    if op.inplace_of:
        dt = node.inputs[written_inputs(node)[0]].desc.dtype
        return (dt if dt in floats else None), True
    if op.fp32_kernel:
        return FP32, False
    if node.name in per_node:
        return per_node[node.name] or "origin", False
    if node.op in keep:
        return rest, False
    if is_low(node):
        return target, False
    if op.kind in FOLLOW_KINDS:
        act = {v.desc.dtype for v in node.inputs if v.desc.dtype in floats and not v.is_const}
        return (act.pop() if len(act) == 1 and act & {FP16, BF16} else rest), False
    return rest, False


def _dtype_attr_follows(node: Node, dt: DataType) -> None:
    """Set ``node``'s float ``dtype`` attribute (ATen's ``cumsum(x, d, dtype=float32)``,
    ``sum(x, d, dtype=)``, ``mean``, ``full_like``: the dtype its kernel writes) to ``dt``,
    the dtype the rewrite gave its output: a pinned fp32 would make the kernel refuse the
    fp16 out tensor on every call. Integer / bool dtypes (results that are not floats) and
    view ops (``view(dtype)`` reinterprets bytes) are left."""
    pinned = node.attrs.get("dtype")
    if isinstance(pinned, torch.dtype) and pinned.is_floating_point and pinned != dt.torch \
            and not get_op(node.op).is_view:
        node.attrs["dtype"] = dt.torch


def node_overrides(graph: Graph, keep_dtype: Iterable[str],
                   node_precision: Mapping[str, str]) -> Dict[str, Optional[DataType]]:
    """Node name -> the dtype it computes in (None: its original dtype) from the options
    ``keep_dtype`` (CANN ``--keep_dtype``: names kept in their original dtype) and
    ``node_precision`` (name -> "fp32" / "bf16" / "fp16", `PRECISIONS`); ``keep_dtype``
    wins over ``node_precision`` for a name in both. Raises ValueError (one line) for a
    name that is no node of ``graph`` (listing up to 5 near matches) or an unknown
    precision."""
    names = {n.name for n in graph.nodes}
    out: Dict[str, Optional[DataType]] = {}
    for opt, given in (("node_precision", node_precision), ("keep_dtype", keep_dtype)):
        for name in given:
            if name not in names:
                near = difflib.get_close_matches(name, sorted(names), n=5, cutoff=0.5)
                hint = (f"near matches: {', '.join(near)}" if near else
                        f"nodes are named as the compile report's pre-fusion names, e.g. "
                        f"{', '.join(sorted(names)[:3])}")
                raise ValueError(f"option {opt!r}: no node named {name!r} in graph "
                                 f"{graph.name}; {hint}")
            if opt == "keep_dtype":
                out[name] = None
                continue
            p = node_precision[name]
            if p not in PRECISIONS:
                raise ValueError(f"option 'node_precision': {name!r} -> {p!r}; use one of "
                                 f"{sorted(PRECISIONS)}")
            out[name] = PRECISIONS[p]
    return out


def _cast_outputs(graph: Graph, origin: Dict, cache: Dict) -> int:
    """Cast each graph output whose dtype the rewrite changed back to its original dtype
    (``origin``: id(value) -> dtype), reusing a cast an fp32 op already reads (``cache``)
    or adding a ``cast_out`` node with the value's traced strides; a view of a graph input
    or of another output is that view of the input or of the other's result instead
    (`_output_as`). Returns the number of outputs redirected."""
    changed = 0
    roots = {v.id for v in graph.outputs} | {v.id for v in graph.inputs}
    made: Dict[int, Value] = {}
    for i, v in enumerate(list(graph.outputs)):
        want = origin.get(id(v), v.desc.dtype)
        if v.desc.dtype == want:
            continue
        changed += 1
        graph.outputs[i] = _output_as(graph, v, want, roots, made, cache)
    return changed


def _output_as(graph: Graph, v: Value, want: DataType, roots: Set[int], made: Dict,
               cache: Dict) -> Value:
    """Graph output ``v`` in dtype ``want``: ``v`` itself where it has that dtype (a graph
    input, an output the rewrite left alone); a view of a graph input or of another output
    (``roots``: their value ids; ``x[:2]`` beside ``x``, ``y[:1]`` beside ``y``, through
    this pass's casts) is the same view of that input (never cast: eager returns a view of
    the caller's tensor) or of that output's result, so the two alias as in eager (a cast
    each made them two tensors); any other a ``cast_out`` node with ``v``'s traced strides,
    or the cast an fp32 op already reads (``cache``). ``made``: value id -> its result."""
    if v.id in made:
        return made[v.id]
    if v.desc.dtype == want:
        return v
    p, base = v.producer, _view_source(v)
    if base is not None and (base.id in roots or _views_a_root(base, roots)):
        src = _output_as(graph, base, want, roots, made, cache)
        view = graph.create_node(p.op, [src], dict(p.attrs), [o.desc.with_(dtype=want)
                                                              for o in p.outputs],
                                 name=f"{p.name}_out")   # every output of a split at once
        view.meta.update({k: p.meta[k] for k in ("aten", "strides") if k in p.meta})
        for o, w in zip(p.outputs, view.outputs):
            made[o.id] = w
        return made[v.id]
    if (v.id, want) in cache:   # an op kept in fp32 reads it cast already
        made[v.id] = cache[(v.id, want)]
        return made[v.id]
    tail = graph.create_node("Cast", [v], {"self": TensorRef(0), "dtype": want.torch},
                             [v.desc.with_(dtype=want)], name="cast_out")
    if v.producer is not None:   # per-node timing charges it to the output's producer
        tail.meta["precision_for"] = v.producer.name
    if v.traced_strides is not None:  # the caller gets eager's strides
        tail.meta["strides"] = [v.traced_strides]
    made[v.id] = tail.output
    return tail.output


def _view_source(v: Value) -> Optional[Value]:
    """The value ``v`` is a single-input view of (not in place), before the casts this
    pass put in between (``meta["precision"]``: ``x[:2]`` under force_fp16 slices x's
    fp16 cast); None when ``v`` is no such view."""
    p = v.producer
    if p is None or not get_op(p.op).is_view or len(p.inputs) != 1 or inplace_inputs(p):
        return None
    base = p.inputs[0]
    while base.producer is not None and base.producer.op == "Cast" \
            and base.producer.meta.get("precision"):
        base = base.producer.inputs[0]
    return base


def _views_a_root(v: Value, roots: Set[int]) -> bool:
    """Whether ``v`` is a chain of single-input views (`_view_source`) of a value in
    ``roots`` (ids of graph inputs and outputs)."""
    v = _view_source(v)
    while v is not None:
        if v.id in roots:
            return True
        v = _view_source(v)
    return False


def _held_inputs(node: Node) -> Set[int]:
    """ids of ``node``'s inputs its OpDef's ``precision_keeps`` names (never cast down)."""
    names = get_op(node.op).precision_keeps
    refs = [node.attrs.get(n) for n in names]
    return {id(node.inputs[r.index]) for r in refs if isinstance(r, TensorRef)}


def precision_summary(graph: Graph) -> Dict[str, Dict[str, int]]:
    """Op name -> {dtype of its first output: count}, for checking what ran in which
    precision."""
    out: Dict[str, Dict[str, int]] = {}
    for n in graph.nodes:
        if n.outputs:
            d = out.setdefault(n.op, {})
            k = n.outputs[0].desc.dtype.value
            d[k] = d.get(k, 0) + 1
    return out


__all__ = ["MixedPrecision", "default_keep_fp32", "MODES", "PRECISIONS", "low_dtype",
           "node_overrides", "pre_fusion_names", "precision_summary"]
