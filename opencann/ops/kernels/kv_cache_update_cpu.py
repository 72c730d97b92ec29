"""KV-cache scatter update on the CPU: write the new keys (or values) of each sequence into
the preallocated cache at that sequence's position, in place.

Semantics of Ascend's ``torch_npu.scatter_update_(cache, indices, new, axis)`` with one
position per batch row (the decode step's, or a prefill's first position): for every row
b, ``cache[b, :, positions[b] : positions[b] + T] = new[b]``; every other element of the
cache keeps its bits. Layouts (BNSD, as DecodeAttention reads the cache):

  cache     [B, Hkv, S_max, D]  any dtype of 1, 2, 4 or 8 bytes — written in place
                                (any strides);
  new       [B, Hkv, T, D]      the cache's dtype (any strides; T = 1 when decoding);
  positions [B]                 integer — first cache position each row writes.

The copy is bit-exact (NaN payloads, -0.0 and Inf are moved as bits: the tensors are
viewed as same-width integers, so one compiled kernel serves fp32, bf16, fp16...). One
numba loop (no threads: a decode step writes B·Hkv·D elements, less than a thread
launch costs) instead of B sliced ``copy_`` calls, whose per-call overhead is what a
decode step would pay per row and layer.
"""
from __future__ import annotations

import numpy as np
import torch

from .numba_cache import njit

# element width in bytes -> the integer dtype the copy moves the bits as
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
# dtypes NumPy has too: viewed there (cheaper than a torch dtype view)
_NUMPY = {torch.float32: np.int32, torch.float16: np.int16, torch.float64: np.int64,
          torch.int32: np.int32, torch.int64: np.int64}


@njit(cache=True)
def _scatter(cache, new, positions):  # pragma: no cover - numba
    B, H, T, D = new.shape
    for b in range(B):
        p = positions[b]
        for h in range(H):
            for t in range(T):
                for d in range(D):
                    cache[b, h, p + t, d] = new[b, h, t, d]


def check_update(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> None:
    """Raise ValueError (one line naming the argument and the fix) unless ``cache`` is
    [B, Hkv, S_max, D], ``new`` [B, Hkv, T, D] of the cache's dtype and ``positions`` an
    integer tensor [B] (module docstring). Values are not read (see `kv_cache_update`)."""
    cs, ns = cache.shape, new.shape
    if len(cs) != 4 or len(ns) != 4 or ns[0] != cs[0] or ns[1] != cs[1] or ns[3] != cs[3]:
        raise ValueError(f"kv_cache_update: expected cache [B, Hkv, S_max, D] and new "
                         f"[B, Hkv, T, D], got cache {tuple(cs)}, new {tuple(ns)}")
    if new.dtype != cache.dtype:
        raise ValueError(f"kv_cache_update: new is {new.dtype} but the cache is {cache.dtype}; "
                         "cast the new keys/values to the cache dtype")
    if cache.element_size() not in _BITS:
        raise ValueError(f"kv_cache_update: a {cache.dtype} cache is not supported; use a "
                         "float32, bfloat16 or float16 cache")
    pd = positions.dtype
    if positions.dim() != 1 or positions.shape[0] != cs[0] or pd.is_floating_point \
            or pd.is_complex or pd == torch.bool:
        raise ValueError(f"kv_cache_update: positions must be an integer tensor "
                         f"[{cs[0]}], got {tuple(positions.shape)} {pd}")


def _array(t: torch.Tensor) -> np.ndarray:
    """``t``'s memory as a NumPy array of same-width integers (a view, any strides)."""
    if t.requires_grad:
        t = t.detach()
    if t.dtype in _NUMPY:   # NumPy has the dtype: its view is the cheaper one
        return t.numpy().view(_NUMPY[t.dtype])
    return t.view(_BITS[t.element_size()]).numpy()


def kv_cache_update(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write ``new`` [B, Hkv, T, D] into ``cache`` [B, Hkv, S_max, D] in place at
    ``positions`` [B] (integers): ``cache[b, :, p_b : p_b + T] = new[b]`` (module
    docstring); returns ``cache`` itself. Raises ValueError (one line) on shapes or dtypes
    (`check_update`), or a row whose positions fall outside [0, S_max) (a prompt or
    decode step past the cache: compile with a larger ``max_seq_len``); the cache is
    unchanged then."""
    check_update(cache, new, positions)
    B, _, T, _ = new.shape
    s_max = cache.shape[2]
    pl = positions.tolist()
    if B and T and (min(pl) < 0 or max(pl) + T > s_max):
        b = next(i for i, p in enumerate(pl) if p < 0 or p + T > s_max)
        raise ValueError(f"kv_cache_update: row {b} writes positions {pl[b]}..{pl[b] + T - 1} "
                         f"but the cache holds positions 0..{s_max - 1}; compile with a larger "
                         "max_seq_len or start a new sequence")
    if not (B and T and new.shape[1] and new.shape[3]):
        return cache
    pos = positions.numpy() if positions.dtype == torch.int64 and positions.is_contiguous() \
        else np.asarray(pl, dtype=np.int64)
    _scatter(_array(cache), _array(new), pos)
    return cache


__all__ = ["check_update", "kv_cache_update"]
