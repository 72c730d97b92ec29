"""Live bytes over a schedule: the one sweep line of the project.

A schedule is a sequence of steps 0, 1, ... (a node order: the IR graph's node list, an
FX graph's nodes, the forward part of a joint graph). A *live range* ``(start, end,
nbytes)`` says that ``nbytes`` bytes are held from step ``start`` through step ``end``,
both included: typically from the step that produces a value to the last step that
reads it (through any alias), or one past the last node for a value the caller keeps.
What counts as live, and which values are left out (graph inputs, views of a counted
base, values in another memory), is the caller's choice; this module only adds up.

Used by the memory planner (the arena's lower bound, as XLA's buffer assignment reports
its gap to it), the NPU estimate (kernel-allocated peak), and the training partition
(forward/backward activation peak, articulation points).
"""
from __future__ import annotations

from typing import Iterable, List, Sequence, Tuple

LiveRange = Tuple[int, int, int]  # (first step, last step (inclusive), bytes)


def live_bytes(ranges: Iterable[LiveRange], nsteps: int) -> List[int]:
    """Bytes live at each step ``0 .. nsteps - 1`` (a list of ``nsteps`` ints): the sum of
    ``nbytes`` over the ranges with ``start <= step <= end``. One pass over the ranges
    plus one over the steps (a difference array), O(len(ranges) + nsteps).

    Raises ValueError for a range with ``start > end``, a negative start, an end at or
    past ``nsteps``, or negative bytes."""
    delta = [0] * (nsteps + 1)
    for start, end, nbytes in ranges:
        if not 0 <= start <= end < nsteps or nbytes < 0:
            raise ValueError(f"live range ({start}, {end}, {nbytes} bytes) is not within "
                             f"steps 0..{nsteps - 1} with start <= end and bytes >= 0")
        delta[start] += nbytes
        delta[end + 1] -= nbytes
    out, cur = [], 0
    for d in delta[:nsteps]:
        cur += d
        out.append(cur)
    return out


def peak_live_bytes(ranges: Iterable[LiveRange]) -> int:
    """Most bytes live at any one step (`live_bytes` over steps up to the last range's
    end); 0 without ranges. Raises ValueError as `live_bytes` does."""
    ranges = list(ranges)
    if not ranges:
        return 0
    return max(live_bytes(ranges, max(e for _, e, _ in ranges) + 1), default=0)


class HappensBefore:
    """The happens-before order of a multi-stream schedule, as vector clocks (Lamport's
    clocks in Fidge/Mattern's vector form; the same model as CUDA/CANN streams with
    record/wait events).

    ``streams[i]`` is the stream of step ``i`` (steps in a valid global order: each
    stream runs its steps in that order); ``deps`` are (producer step, consumer step)
    pairs with producer < consumer (data edges, and write-after-read edges of in-place
    writes). A dependence between two streams becomes an *event* (record after the
    producer, wait before the consumer) unless the consumer's stream already knows the
    producer finished (through its own earlier steps and their waits, or through
    another event of the same step): the transitive reduction over stream order. GE
    does the same in two steps (``StreamAllocator::InsertSyncEvents``, an event per
    cross-stream edge, then ``OptimizeSyncEvents``, which drops send/recv pairs
    implied by others; graph/build/stream_allocator.cc); Nimble (Kwon et al., NeurIPS
    2020) likewise synchronizes only the edges of the transitive reduction.

    ``clock[i][t]`` counts the steps of stream ``t`` known finished when step ``i``
    starts; ``pos[i]`` is step ``i``'s index in its stream; ``events`` the kept
    (producer, consumer) pairs, in consumer order. Raises ValueError for a dependence
    that does not go forward or a negative stream."""

    def __init__(self, streams: Sequence[int], deps: Iterable[Tuple[int, int]]):
        n = len(streams)
        if any(s < 0 for s in streams):
            raise ValueError(f"streams must be >= 0, got {sorted(set(streams))}")
        self.streams = list(streams)
        self.nstreams = max(self.streams, default=-1) + 1
        preds: List[List[int]] = [[] for _ in range(n)]
        for p, c in deps:
            if not 0 <= p < c < n:
                raise ValueError(f"dependence ({p}, {c}) does not go forward within steps 0..{n - 1}")
            preds[c].append(p)
        self.pos: List[int] = []
        self.clock: List[List[int]] = []
        self.events: List[Tuple[int, int]] = []
        count = [0] * self.nstreams
        state = [[0] * self.nstreams for _ in range(self.nstreams)]
        done: List[List[int]] = []
        for i, s in enumerate(self.streams):
            self.pos.append(count[s])
            count[s] += 1
            c = list(state[s])
            cand = sorted({p for p in preds[i] if c[self.streams[p]] <= self.pos[p]})
            for p in cand:  # a wait that another kept wait implies is left out
                t = self.streams[p]
                if any(q != p and done[q][t] > self.pos[p] for q in cand):
                    continue
                self.events.append((p, i))
                c = [max(a, b) for a, b in zip(c, done[p])]
            self.clock.append(c)
            d = list(c)
            d[s] = self.pos[i] + 1
            done.append(d)
            state[s] = d
        self._done = done

    def before(self, a: int, b: int) -> bool:
        """True when step ``a`` is known finished before step ``b`` starts (``a != b``)."""
        return a != b and self.clock[b][self.streams[a]] > self.pos[a]

    def all_before(self, steps: Iterable[int], b: int) -> bool:
        """True when every step of ``steps`` finishes before step ``b`` starts."""
        cb = self.clock[b]
        return all(a != b and cb[self.streams[a]] > self.pos[a] for a in steps)
