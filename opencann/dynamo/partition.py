"""Recomputation (activation checkpointing): opencann's partition of the joint
forward+backward graph that AOTAutograd traces for training.

Every training step keeps some forward activations alive until the backward pass reads
them. Recomputing an activation in the backward instead of saving it trades FLOPs for
bytes (Chen et al. 2016, "Training Deep Nets with Sublinear Memory Cost",
arXiv:1604.06174). Two levels:

* always: a minimum cut of the joint graph (source = forward inputs, sink = what the
  backward needs) that saves the fewest bytes while recomputing only *cheap* ops:
  elementwise ops, casts, views and tensor creation (never matmul, conv, attention,
  normalisation, reductions or random ops). The max-flow/min-cut solver is torch's
  (``torch._functorch.partitioners.solve_min_cut``, the one behind
  ``min_cut_rematerialization_partition``): a well-kept implementation beats our own.
  The policy (what is cheap, what the budget allows) is ours: non-cheap ops are marked
  ``CheckpointPolicy.MUST_SAVE`` before the cut.
* under ``memory_budget`` (bytes, or a fraction of the no-recomputation peak): first
  training BatchNorm outputs become recomputable from their saved statistics
  (`recompute_bn`); if that does not fit, Chen et al.'s checkpoint segments (saved
  checkpoints at relaxed articulation points or non-cheap ops, everything between them
  recomputed segment by segment), over the whole forward or a prefix of it, keeping
  the fitting plan with the fewest recompute FLOPs (`_fit_budget`). Random ops are never
  recomputed. A budget below the smallest reachable peak raises `MemoryBudgetError`
  giving that peak.

Planned peak (bytes) of one training step, from liveness on the partitioned graphs:
``max(forward peak, saved bytes + backward peak)``; forward/backward peak = the most
bytes of intermediates live at any one step (views alias their base; graph inputs and
parameters are not counted; saved tensors stay alive through the whole backward, as
the runtime holds its arguments until it returns).
"""
from __future__ import annotations

import itertools
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
import torch.fx as fx

from ..ir import DataType, Node, TensorDesc, Value
from ..ir.liveness import live_bytes, peak_live_bytes
from ..log import logger
from ..ops import OpKind, is_random_call, lookup_aten
from .recompute_bn import (TRAINING_BATCH_NORMS, drop_running_stats_from_backward,
                           forward_uses_native_outputs, rewrite_batch_norm_outputs)

PARTITION_REPORTS: List[Dict[str, Any]] = []  # one dict per partitioned joint graph

CHEAP_KINDS = (OpKind.ELEMENTWISE, OpKind.VIEW, OpKind.CREATION)


class MemoryBudgetError(ValueError):
    """The memory budget cannot be met under opencann's recomputation policy."""


def last_partition_report() -> Dict[str, Any]:
    """The report of the most recent partition (see `partition`); raises LookupError
    when nothing has been partitioned in this process yet."""
    if not PARTITION_REPORTS:
        raise LookupError("no joint graph has been partitioned yet: run a training step "
                          "of a model compiled with the opencann training backend first")
    return PARTITION_REPORTS[-1]


# -- policy ------------------------------------------------------------------------

def _target(node: fx.Node):
    return node.target if node.op == "call_function" else None


def is_random(node: fx.Node) -> bool:
    """True for an FX node that draws from torch's RNG (dropout, rand*, bernoulli...;
    the rule of `opencann.ops.is_random_call`): never recomputed."""
    t = _target(node)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    schema = t._schema.arguments
    args = {a.name: v for a, v in zip(schema, node.args)}
    args.update(node.kwargs)
    return is_random_call(t, args)


def is_cheap(node: fx.Node) -> bool:
    """opencann's cheap-op policy: elementwise (opencann OpKind or torch's pointwise
    tag), casts (``_to_copy``), views and creation ops; never random ops."""
    t = _target(node)
    if not isinstance(t, torch._ops.OpOverload) or is_random(node):
        return False
    od = lookup_aten(t)
    if od is not None:
        return od.kind in CHEAP_KINDS
    return torch.Tag.pointwise in t.tags or _is_view(node)


def _is_view(node: fx.Node) -> bool:
    t = _target(node)
    if not isinstance(t, torch._ops.OpOverload):
        return False
    od = lookup_aten(t)
    if od is not None:
        return od.kind == OpKind.VIEW
    rets = t._schema.returns
    return bool(rets) and rets[0].alias_info is not None and not t._schema.is_mutable


# -- cost model --------------------------------------------------------------------

def _hint(n: Any) -> int:
    """An int size; a symbolic one (dynamo's dynamic shapes) at its example value, read
    from its hint so that no guard is added to the shape environment (``int(s)`` would
    specialise the graph to this size)."""
    if isinstance(n, torch.SymInt):
        h = n.node.hint
        return int(h) if h is not None else 0
    return int(n)


def _nbytes(val: Any) -> int:
    if isinstance(val, torch.Tensor):
        return _hint(val.numel()) * val.element_size()
    if isinstance(val, (list, tuple)):
        return sum(_nbytes(v) for v in val)
    return 0


def node_flops(node: fx.Node) -> int:
    """FLOPs of one FX node from opencann's op cost model (OpDef.cost on a stand-in IR
    node built from the FX meta values); ops without an OpDef count one FLOP per
    output element."""
    t = _target(node)
    val = node.meta.get("val")
    if not isinstance(t, torch._ops.OpOverload) or val is None:
        return 0
    od = lookup_aten(t)
    outs = [v for v in (val if isinstance(val, (list, tuple)) else [val]) if isinstance(v, torch.Tensor)]
    if od is None:
        return sum(_hint(o.numel()) for o in outs)
    try:
        ins = [a.meta["val"] for a in node.all_input_nodes
               if isinstance(a.meta.get("val"), torch.Tensor)]
        mk = lambda i, x: Value(i, TensorDesc(tuple(_hint(s) for s in x.shape), DataType.from_torch(x.dtype)))  # noqa: E731
        n = Node(od.name, [mk(i, x) for i, x in enumerate(ins)], {}, node.name)
        n.outputs = [mk(100 + i, o) for i, o in enumerate(outs)]
        return int(od.cost(n).flops)
    except Exception:  # noqa: BLE001 - symbolic or unusual shapes: a coarse estimate
        return sum(_hint(o.numel()) for o in outs)


def _liveness_peak(gm: fx.GraphModule, count_outputs: bool = True) -> int:
    """Most bytes of intermediates live at one step of ``gm`` (a sweep line over the
    node order). Views alias their base; placeholders are external (not counted);
    outputs live to the end, or are not counted at all with ``count_outputs=False``."""
    nodes = list(gm.graph.nodes)
    step = {n: i for i, n in enumerate(nodes)}
    root: Dict[fx.Node, Optional[fx.Node]] = {}
    size: Dict[fx.Node, int] = {}
    end: Dict[fx.Node, int] = {}
    out_node = nodes[-1]
    for n in nodes:
        if n.op in ("placeholder", "get_attr"):
            root[n] = None
        elif n.op == "call_function":
            src = n.args[0] if n.args and isinstance(n.args[0], fx.Node) else None
            if _is_view(n) or (n.target is operator.getitem and src is not None and _is_view(src)):
                root[n] = root.get(src) if src is not None else None
                continue
            # an op's result, or one element of a multi-output op's result
            val = n.meta.get("val")
            root[n] = n
            size[n] = 0 if isinstance(val, (list, tuple)) else _nbytes(val)
            end[n] = step[n]
    for n in nodes:
        for a in n.all_input_nodes:
            r = root.get(a)
            if r is not None:
                end[r] = max(end[r], step[n] if n is not out_node else len(nodes))
    if not count_outputs:
        for a in out_node.all_input_nodes:
            if root.get(a) is not None:
                size[root[a]] = 0
    return peak_live_bytes((step[r], end[r], s) for r, s in size.items())


def planned_peak(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> Dict[str, int]:
    """Planned activation peak of one training step (bytes): forward peak, bytes saved
    for backward (intermediates only, not parameters or inputs), backward peak
    (activation gradients and temporaries; the parameter gradients it returns are not
    activations and recomputation cannot shrink them, so they are not counted), and
    ``peak = max(forward_peak, saved_bytes + backward_peak)``."""
    fw_peak = _liveness_peak(fw)
    out = list(fw.graph.nodes)[-1]
    outs = out.args[0] if isinstance(out.args[0], (list, tuple)) else [out.args[0]]
    saved_bytes = 0
    seen = set()
    for a in outs[num_fwd_outputs:]:
        if isinstance(a, fx.Node) and a.op != "placeholder":
            base = a
            while _is_view(base) and isinstance(base.args[0], fx.Node):
                base = base.args[0]
            if base.op != "placeholder" and base not in seen:
                seen.add(base)
                saved_bytes += _nbytes(a.meta.get("val"))
    bw_peak = _liveness_peak(bw, count_outputs=False)
    return {"forward_peak": fw_peak, "saved_bytes": saved_bytes, "backward_peak": bw_peak,
            "peak": max(fw_peak, saved_bytes + bw_peak)}


# -- the partition ------------------------------------------------------------------

@dataclass
class _Joint:
    gm: fx.GraphModule
    num_fwd_outputs: int
    static_idx: List[int]
    info: Any = None
    evaluated: Dict[int, Tuple[int, Any]] = field(default_factory=dict)


def _prepare(joint: _Joint) -> None:
    from torch._functorch import partitioners as P
    gm = joint.gm
    drop_running_stats_from_backward(gm)
    gm.graph.eliminate_dead_code()
    gm.recompile()
    if P.has_recomputable_ops(gm):
        gm = joint.gm = P.cleanup_recompute_tags(gm, is_default_partition=False)
    P.force_save_collectives(gm)
    P.force_save_effectful_ops(gm)
    P.force_save_bw_mutation_src(gm)
    info = P.classify_nodes(gm, joint.static_idx, joint.num_fwd_outputs)
    for node in reversed(gm.graph.nodes):  # as min_cut_rematerialization_partition does
        if node.op == "output":
            node.dist_from_bw = int(1e9)
        elif not info.is_required_fw(node):
            node.dist_from_bw = 0
        else:
            node.dist_from_bw = int(1e9)
            for user in node.users:
                node.dist_from_bw = min(node.dist_from_bw, user.dist_from_bw + 1)
    joint.info = info


def _cut(joint: _Joint, dont_ban: Sequence[fx.Node], aggressive: bool,
         must_save: Sequence[fx.Node] = ()):
    """Min cut under our policy; ``must_save`` (checkpoints) are saved even when cheap.
    Returns (fw, bw, saved nodes)."""
    from torch._functorch import partitioners as P
    from torch.utils.checkpoint import CheckpointPolicy
    gm, info = joint.gm, joint.info
    tagged = []
    for n in must_save:
        n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
        tagged.append(n)
    for n in gm.graph.nodes:
        if (n.op == "call_function" and info.is_required_fw(n) and not is_cheap(n)
                and n.target is not operator.getitem and "recompute" not in n.meta):
            n.meta["recompute"] = CheckpointPolicy.MUST_SAVE
            tagged.append(n)
    opts = P.MinCutOptions(ban_if_used_far_apart=not aggressive,
                           ban_if_long_fusible_chains=not aggressive,
                           ban_if_materialized_backward=False,
                           ban_if_not_in_allowlist=False, ban_if_reduction=True)
    try:
        saved, _ = P.solve_min_cut(gm.graph, info, opts, P.OrderedSet(dont_ban))
    finally:
        for n in tagged:
            n.meta.pop("recompute", None)
    return _extract(joint, saved) + (saved,)


def _extract(joint: _Joint, saved: List[fx.Node]):
    from torch._functorch import partitioners as P
    sym = [n for n in saved if P.is_sym_node(n)]
    vals = [n for n in saved if not P.is_sym_node(n)]
    fw, bw = P._extract_fwd_bwd_modules(
        joint.gm, vals, saved_sym_nodes=sym, saved_opaque_nodes=[],
        num_fwd_outputs=joint.num_fwd_outputs,
        static_lifetime_input_nodes=joint.info.static_lifetime_input_nodes)
    bw = P.reordering_to_mimic_autograd_engine(bw)
    return fw, bw


def resolve_budget(budget: Any, baseline_peak: int) -> Optional[int]:
    """Bytes of planned peak allowed: None (no budget), a float fraction in (0, 1] of
    ``baseline_peak``, or an int number of bytes. Raises ValueError otherwise (booleans,
    non-numbers, NaN/inf, <= 0, a non-integral float above 1)."""
    if budget is None:
        return None
    usage = ("memory_budget must be a fraction of the no-recomputation peak in (0, 1] "
             "(e.g. 0.5) or a positive int number of bytes (e.g. 2**30)")
    if isinstance(budget, bool) or not isinstance(budget, (int, float)):
        raise ValueError(f"{usage}, got {budget!r} ({type(budget).__name__})")
    if not math.isfinite(budget) or budget <= 0:
        raise ValueError(f"{usage}, got {budget!r}")
    if isinstance(budget, float) and budget > 1:
        if not budget.is_integer():
            raise ValueError(f"{usage}, got {budget!r}: a float above 1 is neither a fraction "
                             "nor a whole number of bytes")
        budget = int(budget)
    return int(budget * baseline_peak) if isinstance(budget, float) or budget == 1 else int(budget)


def _recompute_summary(fw: fx.GraphModule, bw: fx.GraphModule) -> Tuple[List[str], int]:
    fwn = {n.name for n in fw.graph.nodes if n.op == "call_function"}
    names, flops = [], 0
    for n in bw.graph.nodes:
        if n.op == "call_function" and n.name in fwn:
            names.append(n.name)
            flops += node_flops(n)
    return names, flops


def partition(joint_module: fx.GraphModule, joint_inputs: Any = None, *, num_fwd_outputs: int,
              static_lifetime_input_indices: Optional[List[int]] = None,
              memory_budget: Any = None, name: str = "") -> Tuple[fx.GraphModule, fx.GraphModule]:
    """Partition AOTAutograd's joint graph into forward and backward graphs.

    ``memory_budget``: None (minimum cut over cheap ops only), an int > 1 (bytes of
    planned peak) or a float in (0, 1] (fraction of the no-recomputation peak).
    Returns (forward GraphModule, backward GraphModule) as AOTAutograd's
    ``partition_fn`` must. Appends a report to `PARTITION_REPORTS` (bytes, FLOPs):
    saved and recomputed tensors, planned peak without recomputation (torch's
    ``default_partition``), with the always-on cut, and chosen. Raises
    MemoryBudgetError when the budget is below the smallest reachable peak, ValueError
    for a malformed budget. Source: Chen et al. 2016, arXiv:1604.06174.
    """
    from torch._functorch import partitioners as P
    joint = _Joint(joint_module, num_fwd_outputs, list(static_lifetime_input_indices or []))
    _prepare(joint)
    gm = joint.gm
    if len(joint.info.required_bw_nodes) == 0:
        return P.default_partition(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                   static_lifetime_input_indices=joint.static_idx)
    # no recomputation: save what the original forward computed and backward reads
    fw0, bw0 = P.default_partition(gm, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                                   static_lifetime_input_indices=joint.static_idx)
    base = planned_peak(fw0, bw0, num_fwd_outputs)
    fw, bw, saved = _cut(joint, [], aggressive=False)
    cut = planned_peak(fw, bw, num_fwd_outputs)
    target = resolve_budget(memory_budget, base["peak"])
    steps, bn_rewritten, bn_kept, chosen = 0, [], {}, cut
    if target is not None and cut["peak"] > target:
        # Under a budget only: BatchNorm outputs become recomputable (an addcmul and
        # its ReLU/Add per layer in the backward: about 5% of a ResNet-50 step here)
        bn_rewritten, bn_kept = rewrite_batch_norm_outputs(gm)
        for bn, why in bn_kept.items():
            logger.info("BatchNorm output recompute not applied at %s: %s", bn, why)
        if bn_rewritten:
            _prepare(joint)
            fw, bw, saved = _cut(joint, [], aggressive=False)
            chosen = planned_peak(fw, bw, num_fwd_outputs)
        if chosen["peak"] > target:
            fw, bw, saved, chosen, steps = _fit_budget(joint, target, (fw, bw, saved, chosen))
    names, flops = _recompute_summary(fw, bw)
    forward_uses_native_outputs(fw)
    size = lambda n: _nbytes(n.meta.get("val"))  # noqa: E731
    rep = {
        "graph": name or f"joint_{len(PARTITION_REPORTS)}",
        "memory_budget": memory_budget, "budget_bytes": target,
        "saved": [{"name": n.name, "bytes": size(n)} for n in saved if n.op != "placeholder"],
        "saved_count": sum(n.op != "placeholder" for n in saved),
        "saved_inputs": [n.name for n in saved if n.op == "placeholder"],
        "recomputed": names, "recompute_flops": flops,
        "peak_without_recompute": base["peak"], "peak_min_cut": cut["peak"],
        "peak": chosen["peak"], "peak_detail": chosen,
        "saved_bytes_without_recompute": base["saved_bytes"],
        "saved_bytes": chosen["saved_bytes"], "budget_search_steps": steps,
        "batch_norm_outputs_recomputable": bn_rewritten,
        "batch_norm_outputs_kept": bn_kept,
    }
    PARTITION_REPORTS.append(rep)
    return fw, bw


def _budget_candidates(joint: _Joint) -> List[fx.Node]:
    """Forward ops (in forward order) whose outputs the budget search may recompute:
    non-random, not views or getitems, tensor-valued and needed (directly or not) by
    the backward."""
    info = joint.info
    return [n for n in joint.gm.graph.nodes
            if n.op == "call_function" and info.is_required_fw(n) and not is_random(n)
            and not is_stateful(n)
            and n.target is not operator.getitem and not _is_view(n)
            and n.dist_from_bw < int(1e9) and _nbytes(n.meta.get("val")) > 0]


def is_stateful(node: fx.Node) -> bool:
    """Ops that read state the step updates in place after the forward (BatchNorm in
    training reads the running statistics that AOTAutograd's epilogue then overwrites):
    a backward recomputation would read the overwritten buffers, so never recompute.
    Their outputs stay recomputable through `recompute_bn`."""
    return node.target in TRAINING_BATCH_NORMS


def _articulations(joint: _Joint) -> set:
    """Forward ops after which little else is live: the bytes of other forward
    intermediates still needed later are at most half of the op's own output (a
    relaxed articulation point: e.g. a transformer layer's output, with only the small
    attention mask alongside). These are Chen et al.'s natural segment boundaries."""
    info = joint.info
    fw = [n for n in joint.gm.graph.nodes if info.is_required_fw(n)]
    pos = {n: i for i, n in enumerate(fw)}
    last = {}
    for n in fw:
        for a in n.all_input_nodes:
            if a in pos:
                last[a] = max(last.get(a, -1), pos[n])
    # bytes live just after step i (including fw[i] itself): a value from its step to
    # the step before its last reader
    live = live_bytes(((pos[n], last[n] - 1, _nbytes(n.meta.get("val"))) for n in fw
                       if n.op == "call_function" and n in last and not _is_view(n)), len(fw))
    return {n for n in fw if n.op == "call_function" and n in last
            and live[pos[n]] - _nbytes(n.meta.get("val")) <= _nbytes(n.meta.get("val")) // 2}


def checkpoints(cands: Sequence[fx.Node], segment_bytes: int, boundaries: set) -> List[fx.Node]:
    """Chen et al. 2016's greedy segmentation (their "memory planning with budget"):
    walk the forward in order, accumulating output bytes; when a segment exceeds
    ``segment_bytes`` the next segment boundary (an op in ``boundaries``) becomes a
    checkpoint (saved; everything between checkpoints is recomputed, segment by
    segment, in the backward)."""
    out, acc = [], 0
    for n in cands:
        acc += _nbytes(n.meta.get("val"))
        if acc >= segment_bytes and n in boundaries:
            out.append(n)
            acc = 0
    return out


# segments per forward (Chen's budget B = total bytes / k) tried for each boundary kind,
# and the prefixes (fractions of the forward's bytes) the best plans are narrowed to
K_ARTICULATION = (2, 3, 4, 5, 6, 7, 8, 10, 12, 16, 24, 32)
K_NON_CHEAP = (2, 3, 4, 6, 8, 12, 16)
PREFIXES = (0.3, 0.5, 0.7, 0.85)


class _Plan(NamedTuple):
    flops: int          # recompute FLOPs
    peak: int           # planned peak, bytes
    fw: fx.GraphModule
    bw: fx.GraphModule
    saved: List[fx.Node]
    detail: Dict[str, int]
    k: int              # segments per forward
    bounds: set         # segment boundary kind


def _plan(joint: _Joint, region: Sequence[fx.Node], k: int, total: int, bounds: set) -> _Plan:
    """One Chen plan: checkpoints in ``region`` every total/k bytes (force-saved), the
    rest of the region recomputable, the forward after it under the always-on policy."""
    keep = checkpoints(region, max(total // k, 1), bounds)
    ks = set(keep)
    fw, bw, saved = _cut(joint, [n for n in region if n not in ks], aggressive=True,
                         must_save=keep)
    peak = planned_peak(fw, bw, joint.num_fwd_outputs)
    return _Plan(_recompute_summary(fw, bw)[1], peak["peak"], fw, bw, saved, peak, k, bounds)


def _fit_budget(joint: _Joint, target: int, current):
    """Chen et al.'s segmentation searched two ways, keeping the plan that fits
    ``target`` with the fewest recompute FLOPs (ties: lower peak):

    1. over the whole forward: segment budgets total/k for each k of `K_ARTICULATION`
       with relaxed articulation points as boundaries (the only valid ones across
       residual streams) and of `K_NON_CHEAP` with non-cheap ops as boundaries;
    2. the two cheapest fitting plans narrowed to a prefix of the forward (`PREFIXES`
       of its bytes): early layers of CNNs hold the most bytes per recompute FLOP.

    Returns (fw, bw, saved, peak dict, plans tried); raises MemoryBudgetError with the
    smallest peak found."""
    cands = _budget_candidates(joint)
    cum = list(itertools.accumulate(_nbytes(n.meta.get("val")) for n in cands))
    total = cum[-1] if cum else 0
    bound_sets = [(_articulations(joint), K_ARTICULATION),
                  ({n for n in cands if not is_cheap(n)}, K_NON_CHEAP)]
    tried = [current[3]["peak"]]
    plans = [_plan(joint, cands, k, total, bounds)
             for bounds, grid in bound_sets if bounds for k in grid]
    tried += [p.peak for p in plans]
    fits = sorted((p for p in plans if p.peak <= target), key=lambda p: (p.flops, p.peak))
    if not fits:
        best = min(tried)
        raise MemoryBudgetError(
            f"memory budget {target} B ({target / 2**20:.2f} MiB) cannot be met: the smallest "
            f"planned peak reachable by recomputation is {best} B ({best / 2**20:.2f} MiB) "
            "(random ops and the graph's own inputs are never recomputed). Fix: raise "
            f"memory_budget to at least {best} bytes, or reduce the batch size")
    for p in fits[:2]:
        for frac in PREFIXES:
            upto = next(i for i, c in enumerate(cum) if c >= frac * total) + 1
            narrowed = _plan(joint, cands[:upto], p.k, total, p.bounds)
            tried.append(narrowed.peak)
            if narrowed.peak <= target:
                fits.append(narrowed)
    best = min(fits, key=lambda p: (p.flops, p.peak))
    return best.fw, best.bw, best.saved, best.detail, len(tried) - 1


def make_partition_fn(memory_budget: Any = None):
    """A ``partition_fn`` for AOTAutograd that applies `partition` with the budget."""
    def partition_fn(joint_module, joint_inputs, *, num_fwd_outputs, **kw):
        return partition(joint_module, joint_inputs, num_fwd_outputs=num_fwd_outputs,
                         static_lifetime_input_indices=kw.get("static_lifetime_input_indices"),
                         memory_budget=memory_budget)
    return partition_fn
