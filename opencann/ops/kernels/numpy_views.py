"""`NumpyViews`: a bound kernel's memo of the NumPy views of the tensors it is handed at
every call.

A compiled graph's generated code hands a kernel the same tensor objects at every call
(its arena buffers, its constants, a generator's KV-cache views): a numba kernel needs
NumPy arrays, and ``Tensor.numpy()`` plus a reshape cost ~1-1.5 µs a tensor — at a
decode step's sizes (an AddRmsNorm of one 768-element row: the numba call itself is
under 1 µs) most of the kernel's time, paid on each of a few hundred nodes per token.
The memo makes that once per tensor object.

What a hit checks: the tensor object is the one seen before (the memo holds a reference
to it: a NumPy view's base is a new alias tensor, not the object, so without it a freed
tensor's ``id`` could be reused by another tensor over the same memory, e.g. an arena
buffer viewed at another shape by a dynamic-shape graph), and its ``data_ptr``, shape
and strides are unchanged (``set_``/``.data =``/``resize_`` give a miss).
Only contiguous tensors are memoized (a reshape of a non-contiguous one copies, and a
copy must never be reused); the others, and tensors requiring grad, are converted afresh
at each call. The memo holds at
most `CAPACITY` tensors (the oldest entry goes first), so tensors a caller makes afresh
for every call (e.g. a ``lengths`` tensor) are kept alive for a few calls at most.
"""
from __future__ import annotations

import math
import threading
from typing import Dict, Optional, Tuple

import numpy as np
import torch

#: tensors a memo keeps (a decode attention node takes 9-12, an AddRmsNorm 5)
CAPACITY = 24

# dtypes NumPy has, viewed as same-width integers (bit-exact copies)
_INT = {torch.float32: np.int32, torch.float64: np.int64, torch.float16: np.int16,
        torch.int32: np.int32, torch.int64: np.int64}


class NumpyViews:
    """Per bound kernel: ``views.array(t)`` is ``t.numpy()``, ``views.bits(t)`` the same
    memory as same-width integers (float32 -> int32), ``views.shaped(t, shape)`` is
    ``t.numpy().reshape(shape)``; each memoized per tensor object when ``t`` is contiguous
    (`array` and `bits` make the view afresh otherwise, `shaped` returns None then).
    Thread-safe: a lookup is one ``dict.get``; an insertion (and the eviction it makes)
    holds the memo's lock, so threads calling one compiled model at once (each executor
    shares its bound kernels) never evict under one another (two threads missing at once
    both insert the same view)."""

    def __init__(self, capacity: int = CAPACITY):
        self.capacity = capacity
        self._memo: Dict[Tuple[int, object], tuple] = {}
        self._lock = threading.Lock()

    def _get(self, t: torch.Tensor, key: object) -> Optional[np.ndarray]:
        e = self._memo.get((id(t), key))
        if e is not None and e[0] is t and e[1] == t.data_ptr() and e[2] == t.shape \
                and e[3] == t.stride():
            return e[4]
        return None

    def _put(self, t: torch.Tensor, key: object, arr: np.ndarray) -> np.ndarray:
        entry = (t, t.data_ptr(), t.shape, t.stride(), arr)
        with self._lock:
            memo = self._memo
            if len(memo) >= self.capacity:
                del memo[next(iter(memo))]
            memo[(id(t), key)] = entry
        return arr

    def shaped(self, t: torch.Tensor, shape: Tuple[int, ...]) -> Optional[np.ndarray]:
        """``t``'s memory as a NumPy array of ``shape`` (a view: t contiguous with as many
        elements), or None when ``t`` is not contiguous, requires grad, has another
        number of elements or a dtype NumPy lacks (bfloat16)."""
        arr = self._get(t, shape)
        if arr is not None:
            return arr
        if t.requires_grad or not t.is_contiguous() or t.dtype == torch.bfloat16 \
                or t.numel() != math.prod(shape):
            return None
        return self._put(t, shape, t.numpy().reshape(shape))

    def array(self, t: torch.Tensor) -> np.ndarray:
        """``t``'s NumPy view in its own shape and strides: memoized when ``t`` is
        contiguous, else made afresh (detached first when it requires grad). Raises
        TypeError for a dtype NumPy lacks (bfloat16), as ``Tensor.numpy``."""
        arr = self._get(t, "array")
        if arr is not None:
            return arr
        if t.requires_grad or not t.is_contiguous():
            return t.detach().numpy()
        return self._put(t, "array", t.numpy())

    def bits(self, t: torch.Tensor) -> np.ndarray:
        """``t``'s memory in its own shape and strides as same-width integers (float32 as
        int32: a bit-exact copy moves NaN payloads and -0.0 as they are), memoized as
        `array`. Raises KeyError for a dtype without an integer twin here (`_INT`)."""
        arr = self._get(t, "bits")
        if arr is not None:
            return arr
        if t.requires_grad or not t.is_contiguous():
            return t.detach().numpy().view(_INT[t.dtype])
        return self._put(t, "bits", t.numpy().view(_INT[t.dtype]))


def static_view(t: Optional[torch.Tensor], shape, dtype: torch.dtype = torch.float32
                ) -> Optional[np.ndarray]:
    """``t``'s memory as a NumPy array of ``shape`` (a view), made once for a prebound
    kernel call (`numba_cache.prebound`), when ``t`` is a contiguous tensor of ``dtype``
    with as many elements that does not require grad, else None."""
    if t is None or t.dtype != dtype or t.requires_grad or not t.is_contiguous() \
            or t.numel() != math.prod(shape):
        return None
    return t.numpy().reshape(shape)


__all__ = ["CAPACITY", "NumpyViews", "static_view"]
