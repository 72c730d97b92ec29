"""Inputs of one call that share memory, where the compiled model writes into one of them.

A compiled graph treats its inputs as separate tensors: a model that writes into input
``a`` (``a.add_(1)``) computes the new value apart and copies it into the caller's tensor
after the run. In eager PyTorch, an input ``b`` that shares memory with ``a`` (the same
tensor passed twice, overlapping views of one buffer) sees the write at once, so every
read of ``b`` after it differs: the compiled result would be silently wrong. Such calls
are refused with one error naming both inputs (torch.compile handles them: AOTAutograd
builds a "synthetic base" for aliased mutated inputs, and dynamo guards on aliasing).

`overlaps` is exact: two tensors overlap when they share a storage and some byte of
one is a byte of the other (``b[::2]`` and ``b[1::2]`` do not); the element-wise check
runs only when their byte ranges intersect.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence, Tuple

import torch


def _span(t: torch.Tensor) -> Tuple[int, int]:
    """[first, last + 1) bytes of ``t`` in its storage (an empty tensor: an empty range)."""
    size = t.element_size()
    first = t.storage_offset() * size
    if t.numel() == 0:
        return first, first
    last = first + sum((n - 1) * s for n, s in zip(t.shape, t.stride()) if n > 1) * size
    return first, last + size


#: above this many elements the exact check is skipped: intersecting byte ranges count
#: as shared memory (a refused call, never a wrong result)
EXACT_MAX = 1 << 22


def _offsets(t: torch.Tensor, unit: int) -> torch.Tensor:
    """The storage offsets of ``t``'s elements in units of ``unit`` bytes (each element
    covers ``element_size() // unit`` consecutive units), int64, flat."""
    per = t.element_size() // unit
    off = torch.tensor([t.storage_offset() * per], dtype=torch.int64)
    for n, s in zip(t.shape, t.stride()):
        off = (off.unsqueeze(-1) + torch.arange(n, dtype=torch.int64) * (s * per)).flatten()
    return (off.unsqueeze(-1) + torch.arange(per, dtype=torch.int64)).flatten()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    """True when tensors ``a`` and ``b`` (any shapes, strides and dtypes) share at least
    one byte of memory."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    (a0, a1), (b0, b1) = _span(a), _span(b)
    if a1 <= b0 or b1 <= a0:
        return False
    if (a.is_contiguous() and b.is_contiguous()) or a.numel() + b.numel() > EXACT_MAX:
        return True                      # two dense ranges that intersect share bytes
    unit = min(a.element_size(), b.element_size())
    return bool(torch.isin(_offsets(a, unit), _offsets(b, unit)).any())


def overlapping_pair(tensors: Sequence[torch.Tensor],
                     written: Sequence[int]) -> Optional[Tuple[int, int]]:
    """The first (written input, other input) pair of ``tensors`` that share memory, where
    ``written`` are the indices of the inputs the model writes into; None if none do.

    Inputs are first grouped by (device, storage): only a pair in one group can share
    memory, so a call whose inputs are all separate storages (a decode step's 2 x layers
    KV-cache views) costs one storage read per input, not one `overlaps` per pair."""
    groups: dict = {}
    for j, t in enumerate(tensors):
        if t.numel():
            groups.setdefault((t.device, t.untyped_storage().data_ptr()), []).append(j)
    for i in dict.fromkeys(written):
        t = tensors[i]
        if not t.numel():
            continue
        for j in groups[(t.device, t.untyped_storage().data_ptr())]:
            if j != i and overlaps(t, tensors[j]):
                return i, j
    return None


def check_written_inputs(tensors: Sequence[torch.Tensor], written: Sequence[int],
                         label: Callable[[int], str]) -> None:
    """Raise ValueError when an input the model writes into (index in ``written``) shares
    memory with another input of this call (``label(i)`` names input ``i``)."""
    pair = overlapping_pair(tensors, written) if written else None
    if pair is None:
        return
    i, j = pair
    same = tensors[i] is tensors[j]
    raise ValueError(
        f"{label(i)} and {label(j)} {'are the same tensor' if same else 'share memory'}, and "
        f"the model writes into {label(i)} in place: the compiled graph reads them as separate "
        "tensors, so it would not see that write as eager does. Pass separate tensors (e.g. "
        f"{'.clone() of one' if same else 'a .clone()'}), or use torch.compile(model, "
        "backend='opencann'), which handles aliased inputs")
