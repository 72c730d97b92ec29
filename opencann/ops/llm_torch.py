"""The torch custom ops an LLM decode graph is written with (namespace ``opencann``).

A model builder (`opencann.llm`) writes its decoder with these two ops; capture keeps
them whole and maps them to the graph ops ``KvCacheUpdate`` and ``DecodeAttention``
(names and semantics after Ascend's ``torch_npu.scatter_update_`` and
``npu_incre_flash_attention`` with ``actual_seq_lengths``). Both run eagerly too (the
implementations below), so a builder's module is checked against eager transformers
without compiling.

- ``torch.ops.opencann.kv_cache_update(cache, new, positions) -> None`` writes in place:
  ``cache`` [B, Hkv, S_max, D] (BNSD; the preallocated KV cache of one layer),
  ``new`` [B, Hkv, T, D] (same dtype), ``positions`` [B] int64: for each row b,
  ``cache[b, :, positions[b] : positions[b] + T] = new[b]`` (scatter-update semantics;
  every other cache element is left as it was). Raises ValueError (one line) on shapes,
  dtypes or a position range past S_max.
- ``torch.ops.opencann.decode_attention(q, k_cache, v_cache, lengths, scale) -> Tensor``:
  ``q`` [B, Hq, 1, D], ``k_cache``/``v_cache`` [B, Hkv, S_max, D] float32, ``lengths``
  [B] integers (row b attends to cache positions 0 .. lengths[b]-1), ``scale`` a float
  (D ** -0.5 for the usual attention); result [B, Hq, 1, D] float32
  (`opencann.ops.kernels.decode_attention_cpu.decode_attention`; GQA when Hq is a
  multiple of Hkv).
"""
from __future__ import annotations

import torch


@torch.library.custom_op("opencann::kv_cache_update", mutates_args=("cache",))
def kv_cache_update(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> None:
    """Write ``new`` [B, Hkv, T, D] into ``cache`` [B, Hkv, S_max, D] in place at
    ``positions`` [B] (int64): ``cache[b, :, positions[b]:positions[b]+T] = new[b]``
    (scatter-update semantics of ``torch_npu.scatter_update_``; the graph op
    ``KvCacheUpdate``'s kernel, `opencann.ops.kernels.kv_cache_update_cpu`). Raises
    ValueError on shapes, dtypes or a write past S_max."""
    from .kernels.kv_cache_update_cpu import kv_cache_update as kernel
    kernel(cache, new, positions)


@kv_cache_update.register_fake
def _(cache, new, positions):
    from .kernels.kv_cache_update_cpu import check_update
    check_update(cache, new, positions)
    return None


@torch.library.custom_op("opencann::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                     lengths: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention of one query per sequence over a KV cache: ``q`` [B, Hq, 1, D],
    ``k_cache``/``v_cache`` [B, Hkv, S_max, D] float32, ``lengths`` [B] (live positions
    per row, data not shape), ``scale`` float -> [B, Hq, 1, D] float32; GQA when Hq is a
    multiple of Hkv (semantics of ``npu_incre_flash_attention`` with
    ``actual_seq_lengths``; FlashDecoding split-KV kernel, Dao et al. 2023)."""
    from .kernels.decode_attention_cpu import decode_attention as kernel
    return kernel(q, k_cache, v_cache, lengths, scale=scale)


@decode_attention.register_fake
def _(q, k_cache, v_cache, lengths, scale):
    return q.new_empty(q.shape, dtype=torch.float32)


__all__ = ["decode_attention", "kv_cache_update"]
