"""The one comparison of the eager-parity probes: where a kernel's result and eager's
differ in NaN, ±inf, a zero's sign, overflow or (optionally) a finite value.

Rules (every probe uses them; only ``rtol`` and ``zeros`` are chosen per probe):

- Results of another dtype than eager's differ (at index 0).
- Bit-for-bit equal results agree (one pass: the common case).
- Integer and bool results are compared exactly.
- Floating results: NaN positions must match; wherever either side is ±inf (and, with
  ``zeros``, ±0.0) both must be equal with the same sign bit; with ``rtol`` a finite
  value must be within ``|got − want| ≤ rtol·(1 + |want|)`` (computed in float64).
- A difference in a special value (NaN or ±inf on either side) is named before a finite
  one; without ``rtol`` only special values count (a zero's sign included only when a
  tolerance is given too, as the layout probes of windowed ops need).
"""
from __future__ import annotations

from typing import Optional

import torch


def first_difference(got: torch.Tensor, want: torch.Tensor, rtol: Optional[float] = None,
                     zeros: bool = False, where: Optional[torch.Tensor] = None) -> Optional[int]:
    """The first flat index (row-major order of the contiguous result) where ``got``
    differs from eager's ``want`` (module docstring), or None when they agree.

    ``got``, ``want``: tensors of the same shape, any dtype; ``rtol``: the relative
    tolerance of finite values (None: finite values are not compared); ``zeros``: compare
    ±0.0 exactly with their sign; ``where``: a bool tensor broadcastable to ``want``'s
    shape marking the elements to compare (None: all)."""
    mask = None if where is None else torch.broadcast_to(where, want.shape).contiguous().reshape(-1)
    got, want = got.contiguous().reshape(-1), want.contiguous().reshape(-1)
    if got.dtype != want.dtype:
        return 0
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}.get(want.element_size())
    if want.dtype.is_floating_point and bits is not None \
            and torch.equal(got.view(bits), want.view(bits)):
        return None
    if not want.dtype.is_floating_point:
        bad = got != want
    else:
        nan, gnan = torch.isnan(want), torch.isnan(got)
        winf, ginf = torch.isinf(want), torch.isinf(got)
        exact = winf | ginf
        if zeros:
            exact = exact | (want == 0) | (got == 0)
        exact = exact & ~nan
        bad = (gnan != nan) | (exact & ((got != want) | (torch.signbit(got) != torch.signbit(want))))
        special = bad & (gnan | nan | ginf | winf)
        if mask is not None:
            special &= mask
        if rtol is not None and not special.any():
            g, w = got.double(), want.double()
            bad = bad | (~exact & ~nan & ((g - w).abs() > rtol * (1.0 + w.abs())))
        else:
            bad = special
    if mask is not None:
        bad = bad & mask
    idx = torch.nonzero(bad)
    return int(idx[0]) if idx.numel() else None


__all__ = ["first_difference"]
