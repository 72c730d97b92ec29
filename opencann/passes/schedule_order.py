"""Memory-aware operator order (schedule stage): a topological order of the graph's
nodes that lowers the planned peak of live bytes, never above the capture order's.

The measure is the memory plan's own: the most bytes of arena buffers live at any one
step (`ir.liveness`, the plan's ``lower_bound``), with the plan's rules (`passes.memory`):
graph inputs and constants are external, outputs that may alias an input (views) live
in their inputs' buffers and extend them, values whose kernel allocates its own result
are not planned (unless ``copy_out``), buffers backing a graph output leave the arena,
and an in-place-able elementwise node whose input buffer dies there reuses it.
`PeakModel` replays that over any order in O(nodes + reads); the chosen order is then
checked with `plan_memory` itself before it is kept.

Orders tried, the lowest modelled peak kept (ties: the first listed, so the capture
order wins when nothing improves), as XLA's ``DefaultMemoryScheduler`` runs several
schedulers and keeps the one with the least memory (xla/service/hlo_memory_scheduler.cc):

1. the capture order (`Graph.topo_sort`: stable with respect to the node list);
2. a greedy list scheduler (XLA's ``ListScheduler``): among ready nodes, the one that
   frees the most bytes net of what it allocates, ties by capture position;
3. a depth-first post-order from the graph's sinks visiting the producer with the
   largest subtree of bytes first (XLA's ``DFSMemoryScheduler``; the Sethi-Ullman order,
   Sethi & Ullman, "The Generation of Optimal Code for Arithmetic Expressions",
   JACM 1970, for trees);
4. for graphs of at most ``EXACT_MAX_NODES`` nodes, an exact search: dynamic
   programming over the sets of scheduled nodes (each set's live bytes do not depend on
   the order that reached it), keeping the lowest peak per set, expanded best-first,
   bounded by the best heuristic's peak and by a budget of moves (as SERENITY does: Ahn et
   al., "Ordering Chaos: Memory-Aware Scheduling of Irregularly Wired Neural Networks
   for Edge Devices", MLSys 2020).

No search runs when the capture order's peak already equals `lower_bound` (the bytes
some node's own step needs in any order): the common case of chain-like graphs.

The searches replay the plan forwards, step by step; one rule of the plan is known only
afterwards: an input buffer overwritten in place by a node whose result is a graph
output leaves the arena over its whole life. `PeakModel.peak` applies it, so orders are
compared by the plan's own figure; the exact search guesses it when such a buffer is
made and keeps the guess only if it comes true; the heuristics do not aim for it.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

from ..ir import Graph, Node
from ..log import logger
from ..ops import get_op, is_random, output_aliases, storage_roots, written_inputs
from .memory import DEFAULT_ALIGNMENT, _align, plan_memory, writes_into_buffer

EXACT_MAX_NODES = 20
"""Graphs with at most this many nodes also get the exact search."""
EXACT_BUDGET = 2000
"""Most moves (a node run from a state) the exact search tries before giving up: it
bounds the search's time (a few tens of ms) on wide graphs."""


@dataclass
class OrderChoice:
    """The result of `memory_aware_order`: the ``order`` (nodes), the ``method`` that
    found it ("capture", "list", "dfs", "exact"), and the planned peak of live bytes
    (the plan's ``lower_bound``) of the capture order (``before``) and of ``order``
    (``after``); ``after == before`` and ``method == "capture"`` when nothing improved.
    ``note``: why the search did not run (symbolic shapes, fewer than two nodes; the
    capture order, ``before`` and ``after`` 0), else ""."""

    order: List[Node]
    method: str
    before: int
    after: int
    note: str = ""


class PeakModel:
    """The memory plan's live bytes, replayed over any topological order of ``graph``.

    Built once per graph (the storage each value may share, which values own a planned
    buffer, each buffer's readers); `peak` gives the most bytes live at one step for an
    order. Options as `plan_memory`'s: ``alignment`` (bytes), ``inplace``, ``copy_out``.
    Raises ValueError for a symbolic shape (as `plan_memory` does)."""

    def __init__(self, graph: Graph, alignment: int = DEFAULT_ALIGNMENT, inplace: bool = True,
                 copy_out: bool = False):
        self.nodes = list(graph.nodes)
        self.index = {n: i for i, n in enumerate(self.nodes)}
        sroots = storage_roots(graph)
        rid: Dict[int, int] = {}        # storage root value id -> root index
        self.size: List[int] = []       # bytes of each root's buffer (0: not in the arena)
        self.readers: List[int] = []    # number of nodes reading each root
        self.kept: List[bool] = []      # backs a graph output: never freed, never in place

        def root(vid: int) -> int:
            if vid not in rid:
                rid[vid] = len(self.size)
                self.size.append(0)
                self.readers.append(0)
                self.kept.append(False)
            return rid[vid]

        for v in graph.inputs + graph.constants:
            root(v.id)
        self.allocs: List[List[int]] = []        # per node: the roots it allocates
        self.reads: List[Tuple[int, ...]] = []   # per node: the roots it reads (once each)
        self.inplace: List[Optional[Tuple[int, List[int]]]] = []  # (out root, candidate roots)
        self.preds: List[Tuple[int, ...]] = []
        for n in self.nodes:
            aliased, none_outs = output_aliases(n), n.meta.get("none_outputs", ())
            owns = copy_out or writes_into_buffer(n)
            mine = []
            for k, o in enumerate(n.outputs):
                r = root(o.id) if o.id in sroots.get(o.id, (o.id,)) else None
                if r is None or k in none_outs or aliased[k] or not owns:
                    continue
                if not o.desc.is_static:
                    raise ValueError(f"{n.name} has symbolic shape {o.desc.shape}")
                self.size[r] = _align(max(o.desc.nbytes, 1), alignment)
                mine.append(r)
            self.allocs.append(mine)
            reads = tuple(dict.fromkeys(root(r) for x in n.inputs
                                        for r in sroots.get(x.id, (x.id,))))
            for r in reads:
                self.readers[r] += 1
            self.reads.append(reads)
            self.preds.append(tuple(dict.fromkeys(self.index[x.producer] for x in n.inputs
                                                  if x.producer in self.index)))
            self.inplace.append(self._inplace_facts(n, mine, sroots, rid) if inplace else None)
        for a, b in order_edges(graph):
            if self.index[a] not in self.preds[self.index[b]]:
                self.preds[self.index[b]] += (self.index[a],)
        for v in graph.outputs:
            for r in sroots.get(v.id, (v.id,)):
                if r in rid:
                    self.kept[rid[r]] = True
                    self.size[rid[r]] = 0   # allocated fresh per call, out of the arena
        self.users: List[List[int]] = [[] for _ in self.nodes]
        for i, ps in enumerate(self.preds):
            for p in ps:
                self.users[p].append(i)

    def _inplace_facts(self, n: Node, mine, sroots, rid):
        """(output root, roots of the inputs it may overwrite, in input order) for an
        in-place-able node (`_inplace_candidate`'s order-independent conditions), else
        None; whether one of them dies here is decided per order."""
        if not get_op(n.op).inplace_ok or len(n.outputs) != 1 or len(mine) != 1:
            return None
        o = n.outputs[0]
        cands = []
        for x in n.inputs:
            if (x.id in rid and sroots.get(x.id, (x.id,)) == frozenset((x.id,))
                    and x.producer is not None and x.desc.shape == o.desc.shape
                    and x.desc.dtype == o.desc.dtype and n.inputs.count(x) == 1
                    and not any(y is not x and x.id in sroots.get(y.id, ()) for y in n.inputs)):
                cands.append(rid[x.id])
        return (mine[0], cands) if cands else None

    def step(self, i: int, left: List[int], placed: set) -> Tuple[int, int, Optional[int]]:
        """Node ``i`` run now, with ``left[r]`` readers of each root still to run and the
        roots ``placed`` in place (not buffers of their own, so not overwritable):
        (bytes added at its step, change of the live bytes once it ran, the root it
        writes in place into or None). Does not change ``left``."""
        alloc = sum(self.size[r] for r in self.allocs[i])
        at, into = alloc, None
        facts = self.inplace[i]
        if facts is not None:
            for x in facts[1]:
                if left[x] == 1 and not self.kept[x] and x not in placed and self.size[x]:
                    into = x   # the output takes over x's buffer: not counted twice here
                    at -= self.size[facts[0]]
                    break
        freed = sum(self.size[r] for r in self.reads[i] if left[r] == 1 and not self.kept[r])
        freed += sum(self.size[r] for r in self.allocs[i] if self.readers[r] == 0)
        return at, alloc - freed, into

    def peak(self, order: Sequence[int], afterwards: bool = True) -> int:
        """The most bytes live at one step when the nodes run in ``order`` (indices into
        ``nodes``, a topological order): the plan's ``lower_bound``. An input buffer
        overwritten in place by a node whose result backs a graph output leaves the arena
        with it, over its whole life (`plan_memory` drops buffers backing an output);
        ``afterwards=False`` leaves that rule out (the forward replay the heuristics use)."""
        left, placed, start, steps = list(self.readers), set(), {}, []
        live = 0
        for k, i in enumerate(order):
            at, net, into = self.step(i, left, placed)
            steps.append(live + at)
            live += net
            for r in self.allocs[i]:
                start[r] = k
            if afterwards and into is not None and self.kept[self.inplace[i][0]]:
                for j in range(start[into], k + 1):
                    steps[j] -= self.size[into]
            self._advance(i, left, placed, into)
        return max(steps, default=0)

    def _advance(self, i: int, left: List[int], placed: set, into) -> None:
        for r in self.reads[i]:
            left[r] -= 1
        if into is not None:
            placed.add(self.inplace[i][0])


def order_edges(graph: Graph) -> List[Tuple[Node, Node]]:
    """Pairs (a, b): node a must run before node b although b reads nothing a makes.
    Random nodes keep their capture order (each call draws torch's RNG in eager's
    sequence); a node that writes in place into an input (`written_inputs`: a fusion's
    ``inplace_input``, an op's ``inplace_of``) runs after every other reader of that memory's contents before the write (as `plan_memory`
    requires). The graph must be in capture (topological) order."""
    pos = {n: i for i, n in enumerate(graph.nodes)}
    rnd = [n for n in graph.nodes if is_random(n)]
    edges = list(zip(rnd, rnd[1:]))
    writers = [n for n in graph.nodes if written_inputs(n)]
    if writers:
        before = storage_roots(graph, writes_as_fresh=True)
        for w in writers:
            mem = frozenset().union(*(before.get(w.inputs[j].id, frozenset((w.inputs[j].id,)))
                                      for j in written_inputs(w)))
            edges += [(u, w) for u in graph.nodes if pos[u] < pos[w] and any(
                before.get(v.id, frozenset((v.id,))) & mem for v in u.inputs)]
    return edges


def list_order(m: PeakModel) -> List[int]:
    """Greedy list scheduling: repeatedly run the ready node with the least net bytes
    (allocated minus freed), ties by capture position."""
    missing = [len(p) for p in m.preds]
    ready = {i for i, k in enumerate(missing) if k == 0}
    left, placed, order = list(m.readers), set(), []
    while ready:
        best = None
        for i in ready:
            _, net, into = m.step(i, left, placed)
            key = (net, i)
            if best is None or key < best[0]:
                best = (key, i, into)
        _, i, into = best
        ready.discard(i)
        order.append(i)
        m._advance(i, left, placed, into)
        for u in m.users[i]:
            missing[u] -= 1
            if missing[u] == 0:
                ready.add(u)
    return order


def dfs_order(m: PeakModel) -> List[int]:
    """Post-order depth-first from the sinks (in capture order), each node's producers
    visited largest subtree of bytes first (ties: capture position)."""
    sub = [0] * len(m.nodes)
    for i in range(len(m.nodes)):   # capture order is topological
        sub[i] = sum(m.size[r] for r in m.allocs[i]) + sum(sub[p] for p in m.preds[i])
    seen, order = [False] * len(m.nodes), []
    for s in [i for i, us in enumerate(m.users) if not us]:
        stack = [(s, False)]
        while stack:
            i, expanded = stack.pop()
            if expanded:
                order.append(i)
                continue
            if seen[i]:
                continue
            seen[i] = True
            stack.append((i, True))
            for p in sorted(m.preds[i], key=lambda p: (sub[p], -p)):   # biggest popped first
                if not seen[p]:
                    stack.append((p, False))
    return order


def _droppable(m: PeakModel) -> frozenset:
    """Roots a node whose result backs a graph output may overwrite in place: in an
    order where it does, the root leaves the arena over its whole life."""
    return frozenset(x for f in m.inplace if f and m.kept[f[0]] for x in f[1])


def _moves(m: PeakModel, i: int, left, placed, dropped, droppable):
    """The ways node ``i`` can run next in the exact search: (bytes at its step, change
    of the live bytes, in-place root or None, roots of its outputs taken as leaving the
    arena). A root is taken as leaving the arena when it is made (both guesses are
    tried); a guess is kept only if it comes true (the node reading it last overwrites
    it in place and backs a graph output) and made whenever that happens, so each
    order is replayed once, with the plan's figure."""
    fx, into = m.inplace[i], None
    if fx is not None:
        for x in fx[1]:
            if left[x] == 1 and not m.kept[x] and x not in placed and m.size[x]:
                into = x
                break
    drops = into is not None and m.kept[fx[0]]
    for r in m.reads[i]:
        if left[r] == 1 and (r in dropped) != (drops and r == into):
            return   # a guess that does not come true (or a drop not guessed)
    freed = sum(m.size[r] for r in m.reads[i]
                if left[r] == 1 and not m.kept[r] and r not in dropped)
    new = [r for r in m.allocs[i] if r in droppable]
    for k in range(1 << len(new)):
        guess = frozenset(r for j, r in enumerate(new) if k >> j & 1)
        alloc = sum(m.size[r] for r in m.allocs[i] if r not in guess)
        gone = sum(m.size[r] for r in m.allocs[i] if m.readers[r] == 0 and r not in guess)
        at = alloc - (m.size[fx[0]] if into is not None else 0)
        yield at, alloc - freed - gone, into, guess


def exact_order(m: PeakModel, bound: Optional[int] = None,
                budget: int = EXACT_BUDGET) -> Optional[Tuple[int, List[int]]]:
    """The lowest-peak order (``m.peak``, the plan's figure) by a best-first search over
    states: the set of nodes run, the in-place roots still read (they decide later
    in-place reuse) and the roots taken as leaving the arena (`_moves`); a state's live
    bytes do not depend on the order that reached it. States are expanded in order of
    the peak that reached them (a bottleneck Dijkstra), so the first complete one is
    optimal. Returns (peak, order as node indices; among equal peaks, the first found),
    or None when no order has a peak below ``bound`` (None: no bound) or more than
    ``budget`` moves would be tried."""
    n = len(m.nodes)
    if n == 0:
        return None
    full, droppable = (1 << n) - 1, _droppable(m)
    pred_mask = [sum(1 << p for p in ps) for ps in m.preds]
    start = (0, frozenset(), frozenset())
    best = {start: 0}
    info = {start: (0, tuple(m.readers), None, -1)}   # live bytes, readers left, parent, node
    heap, pushed, tried = [(0, 0, start)], 0, 0
    while heap:
        pk, _, key = heapq.heappop(heap)
        if best[key] < pk:
            continue   # reached more cheaply since
        done, placed, dropped = key
        if done == full:
            order = []
            while key != start:
                _, _, key, i = info[key]
                order.append(i)
            return pk, order[::-1]
        live, left, _, _ = info[key]
        for i in range(n):
            if done >> i & 1 or pred_mask[i] & ~done:
                continue
            for at, net, into, guess in _moves(m, i, left, placed, dropped, droppable):
                tried += 1
                if tried > budget:
                    return None
                p2 = max(pk, live + at)
                if bound is not None and p2 >= bound:
                    continue
                left2 = list(left)
                for r in m.reads[i]:
                    left2[r] -= 1
                pl = placed | {m.inplace[i][0]} if into is not None else placed
                k2 = (done | 1 << i, frozenset(r for r in pl if left2[r] > 0),
                      frozenset(r for r in dropped | guess if left2[r] > 0))
                if k2 not in best or p2 < best[k2]:
                    best[k2] = p2
                    info[k2] = (live + net, tuple(left2), key, i)
                    pushed += 1
                    heapq.heappush(heap, (p2, pushed, k2))
    return None


def lower_bound(m: PeakModel) -> int:
    """A peak no order can go below: at each node's step its inputs' buffers and its
    outputs are live (an in-place output sharing an input's; a buffer that a node
    with a graph output may overwrite in place, so leaving the arena, not counted)."""
    maybe_dropped = _droppable(m)
    lb = 0
    for i in range(len(m.nodes)):
        held = sum(m.size[r] for r in m.reads[i] if r not in maybe_dropped)
        alloc = sum(m.size[r] for r in m.allocs[i] if r not in maybe_dropped)
        if m.inplace[i]:
            alloc -= m.size[m.inplace[i][0]]
        lb = max(lb, held + max(alloc, 0))
    return lb


def memory_aware_order(graph: Graph, options: Optional[dict] = None) -> OrderChoice:
    """Choose a topological order of ``graph``'s nodes (in capture order now: run
    `Graph.topo_sort` first) with the lowest planned peak of live bytes among the
    orders of the module docstring. A candidate is kept only when `plan_memory` confirms
    it: a lower ``lower_bound`` and an arena no larger than the capture order's;
    otherwise, and on ties, the capture order. ``options``: the compile options
    (``alignment``, ``inplace``, ``copy_out``, as the memory stage reads them). The graph
    is left in its order. Returns an `OrderChoice`."""
    o = options or {}
    kw = dict(alignment=o.get("alignment", DEFAULT_ALIGNMENT), inplace=o.get("inplace", True),
              copy_out=o.get("copy_out", False))
    capture = list(graph.nodes)
    if len(capture) < 2:
        return OrderChoice(capture, "capture", 0, 0, "one order only")
    try:
        m = PeakModel(graph, **kw)
    except ValueError:
        return OrderChoice(capture, "capture", 0, 0, "symbolic shapes: capture order")
    base = m.peak(range(len(capture)))
    floor = lower_bound(m)
    if base <= floor:   # capture order reaches the bound: nothing can be lower
        return OrderChoice(capture, "capture", base, base)
    found = [("list", list_order(m)), ("dfs", dfs_order(m))]
    if len(capture) <= EXACT_MAX_NODES:
        bound = min(m.peak(o) for o in [range(len(capture))] + [f[1] for f in found])
        if bound > floor:
            ex = exact_order(m, bound=bound)
            if ex is not None:
                found.append(("exact", ex[1]))
    cands = [(m.peak(order), k, name, order) for k, (name, order) in enumerate(found)]
    better = sorted(c for c in cands if c[0] < base)
    if not better:
        return OrderChoice(capture, "capture", base, base)
    _, _, name, order = better[0]
    nodes = [capture[i] for i in order]
    ref = plan_memory(graph, **kw)
    try:
        graph.reorder(nodes)
        new = plan_memory(graph, **kw)
    except ValueError as e:   # an ordering rule the model missed: keep capture order
        logger.debug("memory-aware order of %s not kept: %s", graph.name, e)
        new = None
    finally:
        graph.reorder(capture)
    if new is not None and new.lower_bound < ref.lower_bound and new.arena_bytes <= ref.arena_bytes:
        return OrderChoice(nodes, name, ref.lower_bound, new.lower_bound)
    return OrderChoice(capture, "capture", ref.lower_bound, ref.lower_bound)
