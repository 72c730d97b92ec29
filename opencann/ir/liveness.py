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

from typing import Iterable, List, Tuple

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
