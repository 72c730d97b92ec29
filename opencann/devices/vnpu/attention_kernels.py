"""Attention and KV-cache kernels of the vnpu in ND (BNSD), executed on the host with torch
the way an Ascend AI core computes them.

Compute semantics (the Cube/Vector split of CANN's FlashAttentionScore and
IncreFlashAttention kernels): Q·Kᵀ and P·V run on the Cube with operands in the input
dtype and float32 accumulation in L0C (`cube_matmul`); the scores stay float32, the
softmax runs on the Vector unit in float32, and P is rounded to the input dtype before
it is fed back to the Cube (it travels through GM/L1 in that dtype). Grouped-query
attention (GQA) reads each KV head once for its group of ``Hq / Hkv`` query heads.

* `attention`: unfused SDPA (``aten.scaled_dot_product_attention``): the S×S scores
  are a whole tensor, as separate BatchMatMul / SoftmaxV2 kernels would write them to HBM.
* `flash_attention_tiled`: FlashAttention tile by tile (``block_q`` × ``block_k`` from
  the tile planner), online softmax (Dao 2023, FlashAttention-2, arXiv:2307.08691,
  Algorithm 1), each tile's working set checked against the on-chip buffers at run time
  (`tile_occupancy`, `BufferOverflowError`).
* `incre_flash_attention`: one query per sequence against a KV cache with live lengths
  (``torch_npu.npu_incre_flash_attention``'s ``actual_seq_lengths``), float32 out.
* `scatter_update_`: the KV-cache write in place (``torch_npu.scatter_update_``).
"""
from __future__ import annotations

import math
from typing import Dict, Mapping, Optional, Tuple

import torch

from .vector_kernels import ub_dtype

__all__ = ["BufferOverflowError", "attention", "cube_matmul", "flash_attention_tiled", "incre_flash_attention",
           "repeat_kv", "scatter_update_", "tile_occupancy"]

FRACTAL = 16     # the Cube's 16 × 16 fractal: tiles are padded to it in L0A/L0B/L0C


class BufferOverflowError(ValueError):
    """A tile's working set does not fit an on-chip buffer (UB, L1, L0A, L0B, L0C)."""


def cube_matmul(a: torch.Tensor, b: torch.Tensor, out_dtype: Optional[torch.dtype] = None) -> torch.Tensor:
    """a @ b on the Cube: operands in their dtype, products accumulated in float32 (L0C;
    float64 stays float64 on the host), the result written in ``out_dtype`` (default the
    accumulator's). Shapes as ``torch.matmul``."""
    acc = torch.float64 if a.dtype == torch.float64 else torch.float32
    c = torch.matmul(a.to(acc), b.to(acc))
    return c if out_dtype is None else c.to(out_dtype)


def repeat_kv(x: torch.Tensor, heads: int) -> torch.Tensor:
    """[B, Hkv, S, D] → [B, heads, S, D], each KV head serving its ``heads / Hkv`` query
    heads (GQA). Raises ValueError when Hkv does not divide ``heads``."""
    hkv = x.shape[-3]
    if heads == hkv:
        return x
    if heads % hkv:
        raise ValueError(f"vnpu attention: {heads} query heads are not a multiple of {hkv} key/value heads; "
                         f"GQA needs Hq % Hkv == 0")
    return x.repeat_interleave(heads // hkv, dim=-3)


def _scale(scale: Optional[float], d: int) -> float:
    return 1.0 / math.sqrt(d) if scale is None else float(scale)


def _check_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, name: str) -> None:
    if q.dim() < 2 or k.dim() != q.dim() or v.dim() != q.dim():
        raise ValueError(f"vnpu {name}: q, k, v must have the same rank >= 2 (BNSD), got {list(q.shape)}, "
                         f"{list(k.shape)}, {list(v.shape)}")
    if q.shape[-1] != k.shape[-1] or k.shape[-2] != v.shape[-2]:
        raise ValueError(f"vnpu {name}: q {list(q.shape)}, k {list(k.shape)}, v {list(v.shape)} disagree "
                         f"(q and k need the same D, k and v the same S_k)")


def _bias(mask: Optional[torch.Tensor], causal: bool, sq: int, sk: int, rows: slice, cols: slice,
          dtype: torch.dtype) -> Optional[torch.Tensor]:
    """Additive score bias of the tile (rows, cols): -inf where a bool mask is False or the
    causal (top-left) mask hides a key, a float mask's values; None without either."""
    bias = None
    if mask is not None:
        m = mask
        if m.dim() >= 2 and m.shape[-2] != 1:
            m = m[..., rows, :]
        if m.shape[-1] != 1:
            m = m[..., cols]
        bias = torch.zeros((), dtype=dtype).masked_fill(~m, float("-inf")) if m.dtype == torch.bool \
            else m.to(dtype)
    if causal:
        i = torch.arange(rows.start, rows.stop).unsqueeze(-1)
        j = torch.arange(cols.start, cols.stop)
        c = torch.zeros((), dtype=dtype).masked_fill(j > i, float("-inf"))
        bias = c if bias is None else bias + c
    return bias


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: Optional[torch.Tensor] = None,
              is_causal: bool = False, scale: Optional[float] = None) -> torch.Tensor:
    """Unfused SDPA: S = scale·Q·Kᵀ (Cube, fp32) + mask, P = softmax(S) (Vector, fp32, P
    rounded to q's dtype), O = P·V (Cube, fp32 accumulation) in q's dtype.

    Args: q [..., Hq, Sq, D], k and v [..., Hkv, Sk, D] (Hq a multiple of Hkv: GQA);
        attn_mask broadcastable to [..., Hq, Sq, Sk], bool (True = keep) or float (added);
        is_causal: top-left causal mask; scale: None = D ** -0.5.
    Returns: [..., Hq, Sq, Dv] in q's dtype. A row that sees no key is NaN (softmax of an
        all -inf row), as eager's math SDPA.
    Raises ValueError: ranks or sizes that disagree, Hq not a multiple of Hkv.
    """
    _check_qkv(q, k, v, "attention")
    hq = q.shape[-3] if q.dim() >= 3 else 1
    if q.dim() >= 3:
        k, v = repeat_kv(k, hq), repeat_kv(v, hq)
    acc = ub_dtype(q.dtype)
    s = cube_matmul(q, k.transpose(-1, -2)) * _scale(scale, q.shape[-1])
    bias = _bias(attn_mask, is_causal, q.shape[-2], k.shape[-2], slice(0, q.shape[-2]), slice(0, k.shape[-2]), acc)
    if bias is not None:
        s = s + bias
    m = s.amax(-1, keepdim=True)
    e = torch.exp(s - torch.where(torch.isfinite(m), m, torch.zeros((), dtype=acc)))
    p = (e / e.sum(-1, keepdim=True)).to(q.dtype)
    return cube_matmul(p, v, q.dtype)


def tile_occupancy(block_q: int, block_k: int, head_dim: int, dtype: torch.dtype) -> Dict[str, int]:
    """Bytes one FlashAttention tile step holds in each on-chip buffer (fractal-padded to
    16 in the Cube buffers): ``l1`` Q (B_r×D) + K, V (B_c×D each) + P (B_r×B_c) in the
    input dtype; ``l0a`` the left operand, max(Q, P); ``l0b`` the right one, max(Kᵀ, V);
    ``l0c`` the float32 accumulator, max(S B_r×B_c, O partial B_r×D); ``ub`` the Vector
    side: S/P (B_r×B_c), the O accumulator (B_r×D), m and l (B_r each) in float32 and P in
    the input dtype. Source of the split: the 910B FlashAttention kernel's pipeline
    (QK → S → softmax → P → PV on 1 AIC + 2 AIV; `cost_model.flash_attention_cost`)."""
    e = torch.empty((), dtype=dtype).element_size()
    f = lambda n: -(-n // FRACTAL) * FRACTAL   # noqa: E731
    bq, bk, d = f(block_q), f(block_k), f(head_dim)
    return {"l1": (block_q * head_dim + 2 * block_k * head_dim + block_q * block_k) * e,
            "l0a": max(bq * d, bq * bk) * e, "l0b": max(bk * d, bk * d) * e,
            "l0c": max(bq * bk, bq * d) * 4,
            "ub": (block_q * block_k + block_q * head_dim + 2 * block_q) * 4 + block_q * block_k * e}


def _check_fits(occ: Mapping[str, int], capacity: Mapping[str, int], block_q: int, block_k: int) -> None:
    for buf, used in occ.items():
        cap = capacity.get(buf)
        if cap is not None and used > cap:
            raise BufferOverflowError(
                f"vnpu FlashAttention: a {block_q}x{block_k} tile needs {used} B of {buf.upper()} but the preset "
                f"has {cap} B; plan the tiles from this preset (ops.flash_attention.planner.plan_npu_tiles)")


def flash_attention_tiled(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_q: int, block_k: int,
                          capacity: Mapping[str, int], attn_mask: Optional[torch.Tensor] = None,
                          causal: bool = False, scale: Optional[float] = None, nan_rows: bool = False
                          ) -> Tuple[torch.Tensor, Dict[str, int]]:
    """FlashAttention on the vnpu, tile by tile.

    For each B_r-row query block and each B_c-row key block: S = scale·Q_i·K_jᵀ (Cube,
    fp32) + the tile's mask, online softmax in fp32 (running max m, sum l, O rescaled by
    exp(m_old − m_new); Dao 2023, Algorithm 1), P rounded to q's dtype, O += P·V_j (Cube).
    Every tile's working set (`tile_occupancy`) is checked against ``capacity`` before the
    tile runs. Batch and heads run side by side (one task per (b, h) on the AI cores).

    Args: q [B, Hq, Sq, D], k and v [B, Hkv, Sk, D] (GQA); block_q, block_k: tile sizes
        (> 0); capacity: bytes per buffer ("ub", "l1", "l0a", "l0b", "l0c"; missing ones
        are not checked); attn_mask bool (True = keep) or float, broadcastable to
        [B, Hq, Sq, Sk]; causal: top-left; scale: None = D ** -0.5; nan_rows: a row that
        sees no key gives NaN (the spelled-out softmax) instead of 0 (torch's SDPA).
    Returns: (O [B, Hq, Sq, D] in q's dtype, stats: ``tiles`` run, ``block_q``,
        ``block_k``, and the peak bytes per buffer).
    Raises BufferOverflowError: a tile exceeds a buffer; ValueError: bad shapes or blocks.
    """
    _check_qkv(q, k, v, "FlashAttention")
    if block_q <= 0 or block_k <= 0:
        raise ValueError(f"vnpu FlashAttention: block_q ({block_q}) and block_k ({block_k}) must be > 0")
    hq = q.shape[-3]
    k, v = repeat_kv(k, hq), repeat_kv(v, hq)
    peak: Dict[str, int] = {}
    out = torch.empty(*q.shape[:-1], v.shape[-1], dtype=q.dtype)
    tiles = 0
    for i0 in range(0, q.shape[-2], block_q):
        rows = slice(i0, min(i0 + block_q, q.shape[-2]))
        res, n = _query_block(q, k, v, rows, block_k, capacity, attn_mask, causal, _scale(scale, q.shape[-1]),
                              nan_rows, peak)
        out[..., rows, :] = res
        tiles += n
    return out, {"tiles": tiles, "block_q": block_q, "block_k": block_k, **{f"{b}_bytes": n for b, n in peak.items()}}


def _query_block(q, k, v, rows: slice, block_k: int, capacity, mask, causal: bool, sc: float, nan_rows: bool,
                 peak: Dict[str, int]) -> Tuple[torch.Tensor, int]:
    """One B_r-row query block of `flash_attention_tiled` over every key block (online
    softmax); returns (its output rows in q's dtype, tiles run) and raises the peak bytes
    per buffer in ``peak``."""
    acc = ub_dtype(q.dtype)
    sq, sk = q.shape[-2], k.shape[-2]
    qi = q[..., rows, :]
    br = qi.shape[-2]
    m = torch.full((*qi.shape[:-1], 1), float("-inf"), dtype=acc)
    l_ = torch.zeros_like(m)
    o = torch.zeros(*qi.shape[:-1], v.shape[-1], dtype=acc)
    tiles = 0
    for j0 in range(0, sk, block_k):
        if causal and j0 > rows.stop - 1:
            break                                  # tiles past the diagonal are skipped
        cols = slice(j0, min(j0 + block_k, sk))
        occ = tile_occupancy(br, cols.stop - cols.start, q.shape[-1], q.dtype)
        _check_fits(occ, capacity, br, cols.stop - cols.start)
        for b, n in occ.items():
            peak[b] = max(peak.get(b, 0), n)
        s = cube_matmul(qi, k[..., cols, :].transpose(-1, -2)) * sc
        bias = _bias(mask, causal, sq, sk, rows, cols, acc)
        if bias is not None:
            s = s + bias
        m_new = torch.maximum(m, s.amax(-1, keepdim=True))
        base = torch.where(torch.isfinite(m_new), m_new, torch.zeros((), dtype=acc))
        p = torch.exp(s - base)
        alpha = torch.exp(torch.where(torch.isfinite(m), m, base) - base)
        alpha = torch.where(torch.isneginf(m), torch.zeros((), dtype=acc), alpha)
        l_ = l_ * alpha + p.sum(-1, keepdim=True)
        o = o * alpha + cube_matmul(p.to(q.dtype), v[..., cols, :])
        m = m_new
        tiles += 1
    empty = l_ == 0
    res = o / torch.where(empty, torch.ones((), dtype=acc), l_)
    res = torch.where(empty, torch.full((), float("nan") if nan_rows else 0.0, dtype=acc), res)
    return res.to(q.dtype), tiles


def incre_flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                          scale: Optional[float] = None) -> torch.Tensor:
    """Decode attention: each row's single query against its first ``lengths[b]`` cached
    keys (positions past the length are never read), GQA, float32 result.

    Args: q [B, Hq, 1, D], k and v [B, Hkv, S_max, D] (the KV cache), lengths [B]
        integer in [0, S_max]; scale: None = D ** -0.5.
    Returns: [B, Hq, 1, D] float32 (zeros for a row without live keys, as the CPU kernel).
    Raises ValueError: shapes that disagree, Hq not a multiple of Hkv, a length outside
        [0, S_max] (one line naming the row).
    Source: torch_npu ``npu_incre_flash_attention`` (BNSD, ``actual_seq_lengths``).
    """
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4 or q.shape[2] != 1:
        raise ValueError(f"vnpu DecodeAttention: q must be [B, Hq, 1, D] and k, v [B, Hkv, S_max, D], got "
                         f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    _check_qkv(q, k, v, "DecodeAttention")
    b, hq, _, d = q.shape
    s_max = k.shape[2]
    if lengths.shape != (b,) or lengths.dtype.is_floating_point:
        raise ValueError(f"vnpu DecodeAttention: lengths must be an integer tensor [{b}], got "
                         f"{lengths.dtype} {list(lengths.shape)}")
    bad = ((lengths < 0) | (lengths > s_max)).nonzero()
    if bad.numel():
        r = int(bad[0, 0])
        raise ValueError(f"vnpu DecodeAttention: lengths[{r}] = {int(lengths[r])} is outside [0, {s_max}] "
                         f"(the cache holds {s_max} positions); pass each row's live length")
    kk, vv = repeat_kv(k, hq), repeat_kv(v, hq)
    s = cube_matmul(q, kk.transpose(-1, -2), torch.float32) * _scale(scale, d)     # [B, Hq, 1, S_max]
    live = torch.arange(s_max) < lengths.view(b, 1, 1, 1)
    s = s.masked_fill(~live, float("-inf"))
    p = torch.softmax(s, -1)
    p = torch.where((lengths == 0).view(b, 1, 1, 1), torch.zeros(()), p)   # no live key: zeros
    # dead positions are not read: zero their V rows' contribution exactly (NaN in a dead slot stays out)
    return cube_matmul(p, torch.where(live.transpose(-1, -2), vv.float(), torch.zeros(())), torch.float32)


def scatter_update_(cache: torch.Tensor, new: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """Write ``new`` [B, Hkv, T, D] into ``cache`` [B, Hkv, S_max, D] at positions
    positions[b] .. positions[b] + T − 1 of row b, in place (MTE copies; bit-exact);
    returns ``cache`` itself.

    Raises ValueError: shapes or dtypes that disagree, a position range past S_max or
    negative (one line naming the row)."""
    if cache.dim() != 4 or new.dim() != 4 or new.shape[:2] != cache.shape[:2] or new.shape[3] != cache.shape[3]:
        raise ValueError(f"vnpu KvCacheUpdate: new {list(new.shape)} does not fit cache {list(cache.shape)} "
                         f"(both [B, Hkv, *, D])")
    if new.dtype != cache.dtype:
        raise ValueError(f"vnpu KvCacheUpdate: new is {new.dtype} but the cache is {cache.dtype}; cast it first")
    b, t, s_max = cache.shape[0], new.shape[2], cache.shape[2]
    if positions.shape != (b,) or positions.dtype.is_floating_point:
        raise ValueError(f"vnpu KvCacheUpdate: positions must be an integer tensor [{b}], got "
                         f"{positions.dtype} {list(positions.shape)}")
    for r, p in enumerate(positions.tolist()):
        if p < 0 or p + t > s_max:
            raise ValueError(f"vnpu KvCacheUpdate: row {r} writes positions {p}..{p + t - 1}, outside the cache's "
                             f"0..{s_max - 1}; allocate a longer cache or start earlier")
        cache[r, :, p:p + t] = new[r]
    return cache
