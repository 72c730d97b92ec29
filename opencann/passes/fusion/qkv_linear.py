"""Stage 2, fusion: `FuseQKVLinear`, sibling Linears on one input ⇒ one GEMM: the
LinearAct nodes that read the same x with constant weights (attention's Q, K and V
projections) become one LinearAct over the weights concatenated once at compile time,
[m, k] @ [k, n₁ + n₂ + n₃], and one StridedSlice view per former result (columns
[oᵢ, oᵢ + nᵢ) of the [m, Σn] buffer, read in place). Siblings with a bias merge with
siblings with a bias, bias-free ones (Llama's) with bias-free ones. Under the compile
option ``share_weights`` (opencann.llm's step graphs, which keep the module's weights
once) the concatenation is made once per set of weights and shared by every graph that
merges the same ones (`shared_concat_const`): one copy of Q/K/V's weights beside the module's,
not one per prefill bucket and decode graph; none at all where the module's weights are
laid out as their concatenation already (`opencann.ops.weight_concat`: opencann.llm does
that before compiling, so the module's q/k/v weights are views of the graphs' operand). ONNX Runtime does the same in its
attention fusion (``onnxruntime/core/optimizer/attention_fusion.cc`` merges the Q/K/V
MatMuls' weights into one), OpenVINO in its ``FullyConnected`` horizontal fusion.

Numerics: each column block is the same dot products as before; the GEMM's blocking
over n may differ, well within 1e-6 relative in fp32. The slices are views: their
strides are (Σn, 1), not contiguous; every view op after them takes strided input, and
the memory plan keeps the merged buffer alive while any slice (or view of one) is read
(StridedSlice's OpDef aliases its input).
"""
from __future__ import annotations

import functools
import threading
import weakref
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ...ir import Graph, Node, TensorDesc, TensorRef, Value
from ...ops import output_aliases
from ...ops.kernels.cpu import concat_row_major
from ...ops.weight_concat import concat_view
from ...ops.weight_probe import probe_bytes
from ..base import PassContext, Skip
from .common import CpuFusion, carry_keep_dtype
from .quant_names import layer_labels


@dataclass
class _QKVMatch:
    nodes: List[Node]            # the sibling LinearActs, in graph order


# concatenations made under share_weights, by their parts' memory and version counters ->
# weak references to the graph constants holding one (it lives while a graph holds it)
_SHARED: Dict[tuple, List["weakref.ref"]] = {}
_SHARED_LOCK = threading.Lock()


def shared_concat_const(graph: Graph, parts: Sequence[torch.Tensor], name: str,
                        transpose: bool = False, dim: int = 0) -> Value:
    """A constant of ``graph`` holding ``torch.cat(parts, dim)`` (contiguous; its ``.t()``
    when ``transpose``): a view of the parts' own memory where they are adjacent blocks of
    one storage already (`concat_view`: a module laid out by `concatenate_in_place`, as
    opencann.llm does, so the weights are held once), else a copy made once for parts
    viewing the same memory (data pointer, shape, strides, dtype, version counter,
    `probe_bytes`: a write through ``.data`` keeps the version): every later graph merging
    the same weights gets a constant over the same memory while one graph holds it. Each
    holder keeps references to ``parts``, so their memory (the key's addresses) cannot be
    freed and reused while the concatenation lives."""
    view = concat_view(parts, dim)
    if view is not None:
        v = graph.add_const(view.t() if transpose else view, name)
        v.const._opencann_parts = tuple(parts)   # marks a concatenation (`cpu.copy_allowed`)
        return v
    key = tuple((p.data_ptr(), tuple(p.shape), p.stride(), p.dtype, p._version, probe_bytes(p))
                for p in parts)
    key += (transpose, dim)
    with _SHARED_LOCK:
        for k in [k for k, refs in _SHARED.items() if all(r() is None for r in refs)]:
            del _SHARED[k]
        live = [t for t in (r() for r in _SHARED.get(key, ())) if t is not None]
        if live:
            cat = live[0]
        else:
            cat = torch.cat(list(parts), dim=dim)
            cat = cat.t() if transpose else cat
        v = graph.add_const(cat, name)
        v.const._opencann_parts = tuple(parts)   # keeps the parts' memory alive (see above)
        _SHARED[key] = [weakref.ref(t) for t in live] + [weakref.ref(v.const)]
    return v


def _returned(graph: Graph, nodes) -> set:
    """Ids of the outputs of ``nodes`` that are returned, themselves or through ops whose
    output may alias them (views): a local walk over their users."""
    outs = {v.id for v in graph.outputs}
    found = set()
    for n in nodes:
        todo, seen = [n.outputs[0]], set()
        while todo:
            v = todo.pop()
            if v.id in outs:
                found.add(n.outputs[0].id)
                break
            for u in v.users:
                for o, idx in zip(u.outputs, output_aliases(u)):
                    if any(u.inputs[i] is v for i in idx) and o.id not in seen:
                        seen.add(o.id)
                        todo.append(o)
    return found


def _parts(n: Node) -> Tuple[Optional[Value], Value, Value]:
    """(bias or None, x, w) of LinearAct ``n``, as its attrs index its inputs."""
    b = n.attrs.get("self")
    return (n.inputs[b.index] if isinstance(b, TensorRef) else None,
            n.inputs[n.attrs["mat1"].index], n.inputs[n.attrs["mat2"].index])


def _why_not(n: Node, act: str, dtype, returned: set, biased: bool) -> str:
    """Why sibling LinearAct ``n`` cannot join the group (whose first member has a bias
    when ``biased``), or "" when it can."""
    b, _, w = _parts(n)
    if n.outputs[0].id in returned:
        return (f"{n.name}: its result (or a view of it) is a graph output; eager returns "
                "memory of its own, contiguous, not a column slice of a shared buffer")
    if (b is not None) != biased:
        return (f"{n.name}: {'no' if biased else 'a'} bias where the first sibling has "
                f"{'one' if biased else 'none'} (eager adds no zeros to a bias-free GEMM)")
    if not (w.is_const and (b is None or b.is_const)):
        return f"{n.name}: its weight or bias is not a constant (the concatenation is made once, at compile time)"
    if n.attrs.get("act", "none") != act:
        return f"{n.name}: activation {n.attrs.get('act')!r}, the first sibling's is {act!r}"
    if w.desc.dtype != dtype or (b is not None and b.desc.dtype != dtype):
        return f"{n.name}: weight dtype {w.desc.dtype.value}, the first sibling's is {dtype.value}"
    if (b is not None and b.desc.rank != 1) or w.desc.rank != 2:
        return f"{n.name}: bias {b and b.desc} or weight {w.desc} is not [n] / [k, n]"
    return ""


class FuseQKVLinear(CpuFusion):
    """LinearAct([bᵢ,] x, Wᵢ) for i = 1..n (n ≥ 2, same x, constant Wᵢ [and bᵢ], same
    act) ⇒ LinearAct([b₁‖…‖bₙ,] x, W₁‖…‖Wₙ) → StridedSlice(dim 1, [oᵢ, oᵢ + nᵢ)) each."""

    name, stage = "fuse_qkv_linear", "fusion"
    ops = ("LinearAct",)
    switch_section = "GraphFusion"

    def match(self, root: Node, graph: Graph, ctx: PassContext):
        """A `_QKVMatch` when ``root`` is the first of ≥ 2 LinearAct nodes reading the same
        2-D x as ``mat1`` that can be merged (constant weight and bias of one dtype, or
        none, same activation); None when ``root`` is not the first such sibling or has
        none; a `Skip` naming the sibling that cannot join (and why) when no two can."""
        x = _parts(root)[1]
        sibs = [u for u in x.users if u.op == "LinearAct" and _parts(u)[1] is x
                and sum(v is x for v in u.inputs) == 1]
        if len(sibs) < 2:
            return None
        order = {n: i for i, n in enumerate(graph.nodes)}
        sibs.sort(key=order.__getitem__)
        if sibs[0] is not root:
            return None
        if x.desc.rank != 2:
            return Skip(f"the shared input {x} is {x.desc}, not a 2-D [m, k] matrix")
        returned = _returned(graph, sibs)
        if root.outputs[0].id in returned:   # the next sibling may lead a group
            sibs = [n for n in sibs if n.outputs[0].id not in returned]
            why = (f"{root.name}: its result (or a view of it) is a graph output; eager "
                   "returns memory of its own, contiguous, not a column slice of a shared buffer")
            if len(sibs) < 2:
                return Skip(f"not merged with its sibling Linears on {x}: {why}")
            ctx.skipped(root, f"left out of the merged GEMM: {why}", "sibling")
            root = sibs[0]
        first = _parts(root)[2].desc.dtype
        biased = _parts(root)[0] is not None
        why = _why_not(root, root.attrs.get("act", "none"), first, returned, biased)
        if why:
            return Skip(f"the first of {len(sibs)} Linears reading {x}: {why}")
        group, reasons = [root], []
        for n in sibs[1:]:
            why = _why_not(n, root.attrs.get("act", "none"), first, returned, biased)
            (reasons.append(why) if why else group.append(n))
        if len(group) < 2:
            return Skip(f"no sibling Linear of {root.name} on {x} can share its GEMM: "
                        + "; ".join(reasons))
        for why in reasons:
            ctx.skipped(root, f"left out of the merged GEMM: {why}", "sibling")
        return _QKVMatch(group)

    def rewrite(self, graph: Graph, m: _QKVMatch, ctx: PassContext) -> int:
        """Add the concatenated weight [k, Σn] and bias [Σn] (when the siblings have
        one) as constants (the weight stored as the transpose of a contiguous [Σn, k], the
        layout of the weights it replaces; under ``share_weights`` made once for every
        graph, `shared_concat_const`, in the layout its decode kernel reads fastest,
        `cpu.concat_row_major`), create the merged LinearAct before the first
        sibling and one StridedSlice per sibling, rewire the siblings' users to the slices
        and erase the siblings. Returns 1."""
        first = m.nodes[0]
        parts = [_parts(n) for n in m.nodes]
        x = parts[0][1]
        if ctx.options.get("share_weights"):
            # [k, Σn] in the layout its decode kernel reads fastest (`cpu.concat_row_major`):
            # no kernel keeps another copy of it (`cpu.copy_allowed`)
            const = functools.partial(shared_concat_const, graph)
            ws = [w.const for _, _, w in parts]
            k, n = int(ws[0].shape[0]), sum(int(w.shape[1]) for w in ws)
            if concat_row_major(k, n, ws[0].dtype):
                wv = const(ws, f"{first.name}_qkv_w", dim=1)
            else:
                wv = const([w.t() for w in ws], f"{first.name}_qkv_w", transpose=True)
        else:
            def const(ts, name, transpose=False):
                cat = torch.cat(list(ts))
                return graph.add_const(cat.t() if transpose else cat, name)
            # [k, Σn], column-major
            wv = const([w.const.t() for _, _, w in parts], f"{first.name}_qkv_w", transpose=True)
        if parts[0][0] is not None:
            bv = const([b.const.reshape(-1) for b, _, _ in parts], f"{first.name}_qkv_b")
            ins = [bv, x, wv]
            refs = {"self": TensorRef(0), "mat1": TensorRef(1), "mat2": TensorRef(2)}
        else:
            ins, refs = [x, wv], {"mat1": TensorRef(0), "mat2": TensorRef(1)}
        total = int(wv.desc.shape[1])
        mdim = x.desc.shape[0]
        out_dtype = first.outputs[0].desc.dtype
        merged = graph.create_node(
            "LinearAct", ins, dict(refs, act=first.attrs.get("act", "none")),
            [TensorDesc((mdim, total), out_dtype)], name=f"{first.name}_qkv",
            source=first.source, scope=first.scope, before=first)
        carry_keep_dtype(merged, *m.nodes)
        # the merged GEMM does each part's work: a skip_layers name of any part (k_proj)
        # keeps it out of int8 (`quant_names.layer_labels`), not the first part's only
        merged.meta["part_labels"] = sorted(set().union(*(layer_labels(n) for n in m.nodes)))
        start = 0
        for n, (_, _, w) in zip(m.nodes, parts):
            width = int(w.desc.shape[1])
            sl = graph.create_node(
                "StridedSlice", [merged.outputs[0]],
                {"self": TensorRef(0), "dim": 1, "start": start, "end": start + width, "step": 1},
                [n.outputs[0].desc], name=f"{n.name}_slice", source=n.source, scope=n.scope,
                before=first)
            start += width
            graph.replace_all_uses_with(n.outputs[0], sl.outputs[0])
        for n in m.nodes:
            graph.erase_node(n)
        graph.prune_constants()
        ctx.applied(m.nodes, f"{len(m.nodes)} Linears on one input as one GEMM [.., {total}]")
        return 1
