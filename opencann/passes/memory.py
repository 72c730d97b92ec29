"""Memory stage: liveness, in-place and view aliasing, offsets in one arena.

Algorithm: every intermediate value gets a buffer, except outputs that may alias an
input (views, by the op's ATen schema or OpDef ``aliases``; unknown counts as aliasing:
they live in their inputs' buffers, whose lifetimes they extend) and graph outputs (which the caller keeps, so they are allocated fresh
on each call). An elementwise node whose input buffer dies at that node writes in place.
Offsets are assigned by greedy-by-size best-fit (Pisarchyk & Lee, "Efficient Memory
Management for Deep Neural Net Inference", arXiv:2001.03288, "Greedy by Size"), then
retried in lifetime order and three more orders (longest lifetime, largest
size×lifetime); the smallest arena is kept. The lower bound is the most bytes
live at any one step; the plan reports its gap to it (as XLA's buffer assignment does).
"""
from __future__ import annotations

from typing import Dict, FrozenSet, List, Tuple

from ..ir import Buffer, Graph, MemoryPlan, Node, Value, apply_schedule, is_dense
from ..ir.liveness import peak_live_bytes
from ..log import logger
from ..ops import (get_op, graph_happens_before, last_reads, output_aliases, storage_roots,
                   written_inputs)
from .base import Pass, PassContext
from .memory_check import check_plan

DEFAULT_ALIGNMENT = 64  # bytes: one cache line, and AVX-512 / oneDNN friendly


def _align(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _place(bufs: List[Buffer], order: List[Buffer], overlap=None) -> int:
    """Best-fit offset assignment in the given order; returns the arena size. Two
    buffers may share bytes unless ``overlap(a, b)`` (default: their step intervals
    meet, the rule on one stream)."""
    placed: List[Buffer] = []
    arena = 0
    for b in order:
        busy = sorted((p.offset, p.offset + p.size) for p in placed
                      if (overlap(p, b) if overlap is not None
                          else p.start <= b.end and b.start <= p.end))
        best, best_gap, cur = None, None, 0
        for lo, hi in busy:
            gap = lo - cur
            if gap >= b.size and (best_gap is None or gap < best_gap):
                best, best_gap = cur, gap
            cur = max(cur, hi)
        b.offset = best if best is not None else cur
        placed.append(b)
        arena = max(arena, b.offset + b.size)
    return arena


def writes_into_buffer(node: Node) -> bool:
    """True when the node's kernel can write into a given buffer: an ATen ``.out``
    overload exists, or the node works in place on an input."""
    op = get_op(node.op)
    if node.meta.get("no_out_kernel"):  # see frontend.torch.convert.META_DIVERGES
        return "inplace_input" in node.attrs
    return op.out_kernel is not None or "inplace_input" in node.attrs or op.writes_out(node)


def plan_memory(graph: Graph, alignment: int = DEFAULT_ALIGNMENT, inplace: bool = True,
                copy_out: bool = False, log=None) -> MemoryPlan:
    """Plan the intermediates of ``graph`` (in its current node order) into one arena.

    With ``copy_out=False`` (default) only values whose kernel can write into a given
    buffer are planned; the others (oneDNN fused convolutions, packed GEMMs, casts,
    host fallbacks) keep the kernel's own allocation and are listed in ``unplanned``
    with that reason. With ``copy_out=True`` every intermediate is planned and the
    runtime copies such results into their buffers.
    Returns a `MemoryPlan` (bytes). Raises ValueError for a symbolic shape (bind the
    shapes first: plans are made per concrete input shape) or alignment < 16."""
    if alignment < 16 or alignment & (alignment - 1):
        raise ValueError(f"alignment must be a power of two >= 16 bytes, got {alignment}")
    step = {n: i for i, n in enumerate(graph.nodes)}
    root: Dict[int, int] = {}          # value id -> the buffer it owns or writes in place into
    holds: Dict[int, FrozenSet[int]] = {}  # value id -> buffers its storage may be part of
    bufs: Dict[int, Buffer] = {}
    unplanned: Dict[str, str] = {}
    inplace_log: List[Tuple[str, str]] = []

    for v in graph.inputs + graph.constants:
        root[v.id], holds[v.id] = -1, frozenset()   # external storage
    # storage each value may share (ATen schemas / OpDef ``aliases``; unknown = may alias)
    # and the last read of each storage root through any alias (views, split outputs,
    # graph outputs): a buffer is overwritten in place only when none is read afterwards
    sroots = storage_roots(graph)
    last_read, streams = last_reads(graph, sroots, step), _stream_order(graph, sroots)
    _check_declared_writes(graph, step)

    for node in graph.nodes:
        i = step[node]
        aliased = output_aliases(node)
        none_outs = node.meta.get("none_outputs", ())
        for k, o in enumerate(node.outputs):
            if k in none_outs:  # an output the kernel does not produce (output_mask False)
                root[o.id] = -1
                holds[o.id] = frozenset()
                continue
            if not o.desc.is_static:
                raise ValueError(f"{node.name} has symbolic shape {o.desc.shape}; plans are "
                                 "made per concrete input shape")
            if aliased[k]:  # a view (or the input itself): lives in its inputs' buffers
                srcs = frozenset().union(*(holds.get(node.inputs[j].id, frozenset())
                                           for j in aliased[k]))
                holds[o.id] = srcs
                root[o.id] = next(iter(srcs)) if len(srcs) == 1 else -1
                for r in srcs:
                    bufs[r].aliases.append(o.id)
                continue
            _own_buffer(node, o, i, root, holds, bufs, unplanned, inplace_log, copy_out,
                        alignment, _inplace_candidate(node, o, root, bufs, last_read, sroots, i, *streams)
                        if inplace else None)

    overlap = _lifetimes(graph, step, holds, bufs, unplanned, streams[0])
    plan = _placed(bufs, root, len(graph.nodes), alignment, inplace_log, unplanned, overlap)
    arena, lb, naive, strategy = plan.arena_bytes, plan.lower_bound, plan.naive_bytes, plan.strategy
    if log:
        log(f"memory plan: arena {arena} B, lower bound {lb} B ({plan.ratio:.3f}x), "
            f"naive {naive} B, {len(inplace_log)} in-place reuses, {strategy}")
    return plan


def _placed(bufs, root, nsteps: int, alignment: int, inplace_log, unplanned,
            overlap=None) -> MemoryPlan:
    """Offsets for ``bufs`` (the best of `_ORDERS`) and the resulting `MemoryPlan`."""
    naive = sum(b.size for b in bufs.values())
    lb = _lower_bound(list(bufs.values()), nsteps)
    arena, strategy = _best_placement(list(bufs.values()), overlap)
    value_buffer = {vid: r for vid, r in root.items() if r in bufs}
    return MemoryPlan(buffers=bufs, value_buffer=value_buffer, arena_bytes=arena,
                      lower_bound=lb, naive_bytes=naive, alignment=alignment,
                      strategy=strategy, inplace=inplace_log, unplanned=unplanned)


def _lifetimes(graph: Graph, step, holds, bufs, unplanned, hb=None):
    """A buffer lives until the last read of its root or any alias; buffers backing a
    graph output leave the arena (allocated fresh per call). Returns the overlap rule
    of `_concurrent` for ``hb`` (None: one stream)."""
    for node in graph.nodes:
        i = step[node]
        for x in node.inputs:
            for r in holds.get(x.id, ()):
                bufs[r].end = max(bufs[r].end, i)
    fresh_roots = set()
    for v in graph.outputs:
        fresh_roots.update(holds.get(v.id, ()))
    for r in fresh_roots:
        unplanned[f"%{r}"] = "backs a graph output: allocated fresh per call so results survive the next call"
        del bufs[r]
    return _concurrent(graph, step, holds, bufs, hb)


class MemoryPlanning(Pass):
    """The memory stage: `plan_memory` on the scheduled node order with the options
    ``alignment`` (bytes, default 64), ``inplace`` and ``copy_out``. Stores the
    `MemoryPlan` in ``ctx.artifacts["memory_plan"]`` and its summary in the report;
    returns the number of in-place reuses. Raises ValueError as `plan_memory` does."""

    name, stage = "memory_plan", "memory"
    required, observed = True, False

    def run(self, graph: Graph, ctx: PassContext) -> int:
        """Plan ``graph`` in the order of the schedule stage (``ctx.artifacts["schedule"]``,
        applied to the graph by `apply_schedule`; without one, the node order); the plan
        goes to ``ctx.artifacts["memory_plan"]``. Returns the number of in-place reuses.
        Raises ValueError as `plan_memory` does, or for a schedule that does not fit."""
        if ctx.artifacts.get("schedule") is not None:
            apply_schedule(graph, ctx.artifacts["schedule"])
        o = ctx.options
        plan = plan_memory(graph, alignment=o.get("alignment", DEFAULT_ALIGNMENT),
                           inplace=o.get("inplace", True), copy_out=o.get("copy_out", False),
                           log=logger.debug)
        ctx.artifacts["memory_plan"] = plan
        if o.get("verify", False):
            check_plan(graph, plan)
        ctx.report.memory = plan.summary()
        ctx.note(plan.strategy)
        return len(plan.inplace)


def _own_buffer(node: Node, o, i: int, root, holds, bufs, unplanned, inplace_log,
                copy_out: bool, alignment: int, x) -> None:
    """Give output ``o`` of ``node`` (step ``i``) storage: none (its kernel allocates it),
    the buffer of input ``x`` (in place: an elementwise op overwrites an input that dies
    here) or a new buffer."""
    if not copy_out and not writes_into_buffer(node):
        root[o.id] = -1
        holds[o.id] = frozenset()
        unplanned[repr(o)] = (f"{node.op} allocates its own output (no .out kernel); "
                              "copying it into the arena costs more than it saves (a oneDNN reorder); plan it with options={'copy_out': True}")
        return
    if x is not None:
        root[o.id] = x.id
        holds[o.id] = frozenset((x.id,))
        bufs[x.id].aliases.append(o.id)
        inplace_log.append((node.name, repr(x)))
        return
    size = _align(max(o.desc.nbytes, 1), alignment)
    bufs[o.id] = Buffer(root=o.id, size=size, start=i, end=i)
    root[o.id] = o.id
    holds[o.id] = frozenset((o.id,))


# Placement orders tried; the smallest arena wins (each is one best-fit sweep).
_ORDERS = {
    "greedy-by-size best-fit": lambda b: (-b.size, b.start),
    "lifetime-ordered best-fit": lambda b: (b.start, -b.size),
    "size-then-longest-lifetime best-fit": lambda b: (-b.size, -(b.end - b.start)),
    "longest-lifetime best-fit": lambda b: (-(b.end - b.start), -b.size),
    "largest-area best-fit": lambda b: (-b.size * (b.end - b.start + 1), b.start),
}


def _best_placement(blist: List[Buffer], overlap=None) -> Tuple[int, str]:
    """Try each order of `_ORDERS`; keep the smallest arena (ties: the first order).
    Sets every buffer's offset; returns (arena bytes, strategy name). ``overlap`` as
    in `_place`."""
    best = None
    for name, key in _ORDERS.items():
        arena = _place(blist, sorted(blist, key=key), overlap)
        if best is None or arena < best[0]:
            best = (arena, name, {b.root: b.offset for b in blist})
        if arena == _lower_bound(blist, max((b.end for b in blist), default=0) + 1):
            break  # optimal: no order can do better
    for b in blist:
        b.offset = best[2][b.root]
    return best[0], best[1]


def _layout_key(v: Value) -> tuple:
    """How ``v`` lays out its elements in its buffer (the executor's arena view): its
    traced strides when dense, else contiguous; size-1 dims left out (they address
    nothing). Two values share a buffer in place only with the same key: an NHWC output
    written over an NCHW input would overwrite elements not read yet."""
    d = v.desc
    st = v.traced_strides
    if not d.is_static:
        return ("dynamic", None if st is None else tuple(st))
    shape = [int(s) for s in d.shape]
    if st is None or not is_dense(shape, st):
        st, acc = [0] * len(shape), 1
        for k in range(len(shape) - 1, -1, -1):
            st[k], acc = acc, acc * shape[k]
    return tuple(s for s, n in zip(st, shape) if n != 1)


def _inplace_candidate(node: Node, o, root, bufs, last_read, sroots, i, hb=None, readers=None):
    """An input of an in-place-able op that is a planned root, has the output's shape,
    dtype and layout (`_layout_key`), is read for the last time here through every
    value that may share its storage (views, views of views, split outputs, graph
    outputs) and whose storage no other input of the node may share. On several streams (``hb``, a `HappensBefore`),
    every other reader must also be known finished when the node starts."""
    if not get_op(node.op).inplace_ok or len(node.outputs) != 1:
        return None
    for x in node.inputs:
        if (root.get(x.id, -1) == x.id and x.id in bufs and x.desc.shape == o.desc.shape
                and x.desc.dtype == o.desc.dtype and last_read.get(x.id, -1) == i
                and _layout_key(x) == _layout_key(o)
                and not any(y is not x and x.id in sroots.get(y.id, ()) for y in node.inputs)
                and node.inputs.count(x) == 1
                and (hb is None or hb.all_before(readers.get(x.id, set()) - {i}, i))):
            return x
    return None


def _check_declared_writes(graph: Graph, step: Dict[Node, int]) -> None:
    """A node that writes into an input in place (`written_inputs`: a fusion's
    ``inplace_input``, an op's ``inplace_of`` such as KvCacheUpdate) must be the last
    reader of that memory's contents before the write, through every alias, in the final
    order; and the memory must be an intermediate, or a graph input the calling
    convention says the model writes (``graph.signature.input_mutations``: the caller's
    tensor, written directly, TorchAir's ``input_inplace_pass``), never a constant.
    Raises ValueError naming the node otherwise (a pass broke its own rule, or a graph
    writes an input it does not declare)."""
    writers = [n for n in graph.nodes if written_inputs(n)]
    if not writers:
        return
    before = storage_roots(graph, writes_as_fresh=True)  # contents before each write
    last = last_reads(graph, before, step)
    consts = {v.id for v in graph.constants}
    index = {v.id: i for i, v in enumerate(graph.inputs)}
    declared = set(graph.signature.input_mutations)
    for n in writers:
        for j in written_inputs(n):
            x = n.inputs[j]
            mem = before.get(x.id, frozenset())
            late = max((last.get(r, -1) for r in mem), default=-1)
            undeclared = [graph.inputs[index[r]].name for r in mem
                          if r in index and index[r] not in declared]
            if late > step[n] or mem & consts or undeclared:
                raise ValueError(f"{n.name} ({n.op}) at {n.where()} writes in place into {x!r}, "
                                 "whose memory is still read afterwards (through it or a view), "
                                 "is a constant, or is a graph input the model does not declare "
                                 "written; the pass that made it in place must leave it out of "
                                 "place, and a graph must list the inputs it writes")


def _stream_order(graph: Graph, sroots):
    """(`HappensBefore`, `_readers`) when the graph runs on several streams, where a
    value's memory is free only once all its users are known finished from the next
    user's stream (happens-before, not the node order); (None, None) on one stream."""
    if not any(n.stream for n in graph.nodes):
        return None, None
    return graph_happens_before(graph), _readers(graph, sroots)


def _readers(graph: Graph, sroots) -> Dict[int, set]:
    """Storage root id -> steps of the nodes reading its memory through any alias."""
    out: Dict[int, set] = {}
    for i, node in enumerate(graph.nodes):
        for x in node.inputs:
            for r in sroots.get(x.id, (x.id,)):
                out.setdefault(r, set()).add(i)
    return out


def _concurrent(graph: Graph, step, holds, bufs, hb):
    """The overlap rule on several streams: buffers ``a`` and ``b`` may share bytes only
    when every user of one (its producer, in-place writers and readers through any
    alias) is known finished (`HappensBefore`) before the other's producer starts.
    A buffer's users are summed up as its frontier: per stream, the position of its
    last user there (-1: none). None (the one-stream rule) when ``hb`` is None."""
    if hb is None:
        return None
    users: Dict[int, set] = {r: {b.start} for r, b in bufs.items()}
    for node in graph.nodes:
        for v in (*node.inputs, *node.outputs):
            for r in holds.get(v.id, ()):
                if r in users:
                    users[r].add(step[node])
    front = {}
    for r, us in users.items():
        f = [-1] * hb.nstreams
        for u in us:
            f[hb.streams[u]] = max(f[hb.streams[u]], hb.pos[u])
        front[r] = f

    def before(a: Buffer, b: Buffer) -> bool:
        c = hb.clock[b.start]
        return all(x < y for x, y in zip(front[a.root], c))

    return lambda a, b: not (before(a, b) or before(b, a))


def _lower_bound(bufs: List[Buffer], nsteps: int) -> int:
    """Max over steps of the bytes of buffers live at that step (`peak_live_bytes`)."""
    return peak_live_bytes((b.start, b.end, b.size) for b in bufs)
