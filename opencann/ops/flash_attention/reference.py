"""Attention semantics in one place: causal alignment, masks, and a float64 reference.

Every kernel (numba, triton) and every test takes its meaning of ``causal`` and
``attn_mask`` from here.

Conventions (BNSD: batch, heads, sequence, head dim):

* ``causal=False``: no causal mask.
* ``causal=True`` or ``"top_left"``: query ``i`` may see key ``j`` iff ``j <= i``
  (aligned at the top-left corner of the ``S_q x S_k`` score matrix). This is what
  ``torch.nn.functional.scaled_dot_product_attention(is_causal=True)`` does.
* ``causal="bottom_right"``: query ``i`` may see key ``j`` iff ``j <= i + (S_k - S_q)``
  (the last query sees the last key), the convention of FlashAttention-2 >= 2.1 and
  of decoding with a KV cache. When ``S_q > S_k`` its first ``S_q - S_k`` rows see
  no key at all.
* ``attn_mask`` bool: ``True`` = keep (as in torch SDPA); float: added to the scaled
  scores (``-inf`` removes a key). It must broadcast to ``(B, H, S_q, S_k)``.
* A row that sees no key at all ("fully masked") has output 0, log-sum-exp
  ``-inf`` and contributes gradient 0, as torch's SDPA (>= 2.5, every CPU backend).
* NaN/Inf: a NaN or ``+inf`` score (NaN in q or a visible key, NaN or ``+inf`` in the
  mask) makes its row NaN, as softmax does; the causal mask overwrites the scores it
  hides (a NaN key a query does not see stays out of its row), as torch's CPU SDPA.

The reference is plain matmul + softmax in float64, used by the tests as the truth.
"""
from __future__ import annotations

import torch

_CAUSAL_VALUES = (False, True, "top_left", "bottom_right")


def causal_offset(causal, seq_q: int, seq_k: int):
    """Diagonal offset of the causal mask: key ``j`` is visible to query ``i`` iff
    ``j <= i + offset``. Returns None when ``causal`` is False.

    Raises ValueError for any value other than False, True, "top_left", "bottom_right".
    """
    if causal is False or causal is None:
        return None
    if causal is True or causal == "top_left":
        return 0
    if causal == "bottom_right":
        return seq_k - seq_q
    raise ValueError(
        f"causal={causal!r} is not understood; use False, True (= 'top_left', like "
        "torch SDPA's is_causal), 'top_left' or 'bottom_right'")


def additive_mask(attn_mask, B: int, H: int, seq_q: int, seq_k: int,
                  dtype=torch.float32) -> torch.Tensor | None:
    """Turn ``attn_mask`` into an additive float mask broadcast (as a stride-0 view,
    no copy of the broadcast dimensions) to ``(B, H, seq_q, seq_k)``.

    bool masks: True = keep -> 0, False -> -inf. float masks are cast to ``dtype``.
    Raises ValueError when the mask does not broadcast to ``(B, H, S_q, S_k)``.
    """
    if attn_mask is None:
        return None
    if not isinstance(attn_mask, torch.Tensor):
        raise ValueError(f"attn_mask must be a torch.Tensor or None, got {type(attn_mask).__name__}")
    target = (B, H, seq_q, seq_k)
    if attn_mask.dim() > 4:
        raise ValueError(f"attn_mask has {attn_mask.dim()} dims; it must broadcast to "
                         f"(batch, heads, S_q, S_k) = {target}")
    shape = (1,) * (4 - attn_mask.dim()) + tuple(attn_mask.shape)
    for have, want in zip(shape, target):
        if have not in (1, want):
            raise ValueError(
                f"attn_mask of shape {tuple(attn_mask.shape)} does not broadcast to "
                f"(batch, heads, S_q, S_k) = {target}; give it size 1 or the full size "
                "in each dimension (BNSD order, whatever the layout of q/k/v)")
    m = attn_mask.reshape(shape)
    if m.dtype == torch.bool:
        m = torch.zeros(shape, dtype=dtype, device=m.device).masked_fill_(~m, float("-inf"))
    elif m.is_floating_point():
        m = m.to(dtype)
    else:
        raise ValueError(f"attn_mask dtype {m.dtype} is not supported; use bool (True = keep) "
                         "or a float additive mask")
    return m.expand(target)


def attention_reference(q, k, v, *, attn_mask=None, causal=False, scale=None):
    """Float64 attention by plain matmul and softmax (differentiable).

    q: (B, H, S_q, D); k, v: (B, H_kv, S_k, D) with H % H_kv == 0 (GQA/MQA).
    Returns (out (B, H, S_q, D) float64, lse (B, H, S_q) float64). Fully masked rows
    give out 0 and lse -inf.
    """
    q, k, v = q.double(), k.double(), v.double()
    B, H, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    if H != Hk:
        k = k.repeat_interleave(H // Hk, dim=1)
        v = v.repeat_interleave(H // Hk, dim=1)
    scale = D ** -0.5 if scale is None else scale
    s = (q @ k.transpose(-1, -2)) * scale
    bias = additive_mask(attn_mask, B, H, Sq, Sk, dtype=torch.float64)
    if bias is not None:
        s = s + bias
    off = causal_offset(causal, Sq, Sk)
    if off is not None:
        i = torch.arange(Sq, device=q.device)[:, None]
        j = torch.arange(Sk, device=q.device)[None, :]
        s = s.masked_fill(j > i + off, float("-inf"))
    m = s.amax(dim=-1, keepdim=True).detach()
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m)
    l = p.sum(dim=-1, keepdim=True)
    safe_l = torch.where(l > 0, l, torch.ones_like(l))
    out = (p / safe_l) @ v
    lse = (m + torch.log(l)).squeeze(-1)  # log(0) = -inf for fully masked rows
    return out, lse
