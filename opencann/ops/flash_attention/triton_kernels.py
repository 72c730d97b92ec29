"""FlashAttention-2 forward and backward in Triton (CUDA; runs on CPU tensors under the
Triton interpreter, ``TRITON_INTERPRET=1`` set before triton is imported).

Why Triton: it compiles tile programs (``tl.dot`` on tensor cores, shared-memory
staging) from Python, which is the level this operator is written at.

Algorithm: Dao 2023, arXiv:2307.08691 (Algorithms 1 and 2). Forward: one program per
(query block, batch*head), online softmax over key blocks, stores O and the row
log-sum-exp. Backward: ``D = rowsum(dO * O)`` in torch, then one program per (key
block, batch*kv-head) for dK/dV (looping over the group's query heads, no atomics)
and one per (query block, batch*head) for dQ. Semantics (causal offset, additive mask
broadcast by stride 0, fully masked rows -> 0, NaN and +inf scores -> NaN rows) follow
``reference.py``. The mask is added in natural units (``tl.exp``), so finite masks
such as ``finfo(float32).min`` do not overflow. The head dim
is padded to a power of two inside the kernel (masked loads); sequence tails are
masked. Accumulation is float32; P is cast to the value dtype before ``P @ V`` as in
the FlashAttention-2 reference kernels.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _fwd(Q, K, V, M, O, L, scale, Sq, Sk, H, group, off, D,
         sqb, sqh, sqs, skb, skh, sks, smb, smh, sms, smk,
         HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    cols0 = tl.arange(0, BLOCK_N)
    rmask = rows < Sq
    dmask = dims < D
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :],
                mask=rmask[:, None] & dmask[None, :], other=0.0)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = Sk
    if CAUSAL:  # keys beyond the block's last visible key are skipped
        hi = tl.minimum(Sk, tl.maximum((pid_m + 1) * BLOCK_M + off, 0))
    kbase = K + b * skb + hk * skh
    vbase = V + b * skb + hk * skh
    for start in range(0, hi, BLOCK_N):
        cols = start + cols0
        cmask = cols < Sk
        kv_off = cols[:, None] * sks + dims[None, :]
        kv_m = cmask[:, None] & dmask[None, :]
        k = tl.load(kbase + kv_off, mask=kv_m, other=0.0)
        v = tl.load(vbase + kv_off, mask=kv_m, other=0.0)
        s = tl.dot(q, tl.trans(k)) * scale
        valid = rmask[:, None] & cmask[None, :]
        if HAS_MASK:
            s += tl.load(M + b * smb + h * smh + rows[:, None] * sms + cols[None, :] * smk,
                         mask=valid, other=0.0)
        if CAUSAL:
            valid = valid & (cols[None, :] <= rows[:, None] + off)
        s = tl.where(valid, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m_i = m_new
    # l = 0: the row saw no key (output 0, lse -inf, as torch's CPU SDPA); a NaN score
    # or +inf - +inf made l NaN, and NaN / NaN keeps the row NaN, as eager's softmax
    empty = l_i == 0
    out = tl.where(empty[:, None], 0.0, acc / tl.where(empty, 1.0, l_i)[:, None])
    lse = tl.where(empty, float("-inf"), m_i + tl.log(tl.where(empty, 1.0, l_i)))
    tl.store(O + bh * Sq * D + rows[:, None] * D + dims[None, :], out,
             mask=rmask[:, None] & dmask[None, :])
    tl.store(L + bh * Sq + rows, lse, mask=rmask)


@triton.jit
def _probs(q, k, rows, cols, rmask, cmask, lse, M, b, h, scale, off, smb, smh, sms, smk,
           HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr):
    """P = exp(scale q k^T + mask - lse), 0 where hidden or the row is fully masked."""
    s = tl.dot(q, tl.trans(k)) * scale
    valid = rmask[:, None] & cmask[None, :]
    if HAS_MASK:
        s += tl.load(M + b * smb + h * smh + rows[:, None] * sms + cols[None, :] * smk,
                     mask=valid, other=0.0)
    if CAUSAL:
        valid = valid & (cols[None, :] <= rows[:, None] + off)
    valid = valid & (lse[:, None] != float("-inf"))
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    return tl.where(valid, tl.exp(s - lse_safe[:, None]), 0.0)


@triton.jit
def _bwd_dkdv(Q, K, V, M, DO, L, DELTA, DK, DV, scale, Sq, Sk, H, Hk, group, off, D,
              sqb, sqh, sqs, skb, skh, sks, smb, smh, sms, smk,
              HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n = tl.program_id(0)
    bhk = tl.program_id(1)
    b = bhk // Hk
    hk = bhk % Hk
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    rows0 = tl.arange(0, BLOCK_M)
    cmask = cols < Sk
    dmask = dims < D
    kv_off = b * skb + hk * skh + cols[:, None] * sks + dims[None, :]
    kv_m = cmask[:, None] & dmask[None, :]
    k = tl.load(K + kv_off, mask=kv_m, other=0.0)
    v = tl.load(V + kv_off, mask=kv_m, other=0.0)
    dk = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], tl.float32)
    lo = 0
    if CAUSAL:  # first query that can see key pid_n * BLOCK_N
        lo = (tl.maximum(pid_n * BLOCK_N - off, 0) // BLOCK_M) * BLOCK_M
    for h in range(hk * group, hk * group + group):
        for start in range(lo, Sq, BLOCK_M):
            rows = start + rows0
            rmask = rows < Sq
            q_m = rmask[:, None] & dmask[None, :]
            q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_m, other=0.0)
            bh = b * H + h
            do = tl.load(DO + bh * Sq * D + rows[:, None] * D + dims[None, :], mask=q_m, other=0.0)
            lse = tl.load(L + bh * Sq + rows, mask=rmask, other=float("-inf"))
            delta = tl.load(DELTA + bh * Sq + rows, mask=rmask, other=0.0)
            p = _probs(q, k, rows, cols, rmask, cmask, lse, M, b, h, scale, off,
                       smb, smh, sms, smk, HAS_MASK, CAUSAL)
            dv += tl.dot(tl.trans(p.to(do.dtype)), do)
            dp = tl.dot(do, tl.trans(v))
            ds = p * (dp - delta[:, None])
            dk += tl.dot(tl.trans(ds.to(q.dtype)), q)
    out_off = bhk * Sk * D + cols[:, None] * D + dims[None, :]
    tl.store(DK + out_off, dk * scale, mask=kv_m)
    tl.store(DV + out_off, dv, mask=kv_m)


@triton.jit
def _bwd_dq(Q, K, V, M, DO, L, DELTA, DQ, scale, Sq, Sk, H, group, off, D,
            sqb, sqh, sqs, skb, skh, sks, smb, smh, sms, smk,
            HAS_MASK: tl.constexpr, CAUSAL: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    hk = h // group
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    dims = tl.arange(0, BLOCK_D)
    cols0 = tl.arange(0, BLOCK_N)
    rmask = rows < Sq
    dmask = dims < D
    q_m = rmask[:, None] & dmask[None, :]
    q = tl.load(Q + b * sqb + h * sqh + rows[:, None] * sqs + dims[None, :], mask=q_m, other=0.0)
    do = tl.load(DO + bh * Sq * D + rows[:, None] * D + dims[None, :], mask=q_m, other=0.0)
    lse = tl.load(L + bh * Sq + rows, mask=rmask, other=float("-inf"))
    delta = tl.load(DELTA + bh * Sq + rows, mask=rmask, other=0.0)
    dq = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)
    hi = Sk
    if CAUSAL:
        hi = tl.minimum(Sk, tl.maximum((pid_m + 1) * BLOCK_M + off, 0))
    for start in range(0, hi, BLOCK_N):
        cols = start + cols0
        cmask = cols < Sk
        kv_off = b * skb + hk * skh + cols[:, None] * sks + dims[None, :]
        kv_m = cmask[:, None] & dmask[None, :]
        k = tl.load(K + kv_off, mask=kv_m, other=0.0)
        v = tl.load(V + kv_off, mask=kv_m, other=0.0)
        p = _probs(q, k, rows, cols, rmask, cmask, lse, M, b, h, scale, off,
                   smb, smh, sms, smk, HAS_MASK, CAUSAL)
        dp = tl.dot(do, tl.trans(v))
        ds = p * (dp - delta[:, None])
        dq += tl.dot(ds.to(k.dtype), k)
    tl.store(DQ + bh * Sq * D + rows[:, None] * D + dims[None, :], dq * scale, mask=q_m)


def _common(q, k, mask, off):
    B, H, Sq, D = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    has_mask = mask is not None
    m = mask if has_mask else q
    mstr = tuple(m.stride()) if has_mask else (0, 0, 0, 0)
    return B, H, Hk, Sq, Sk, D, has_mask, m, mstr, off is not None, int(off or 0)


def _blocks(D, bq, bk):
    return max(16, triton.next_power_of_2(D)), max(16, bq), max(16, bk)


def forward(q, k, v, mask, off, scale, block_q, block_k):
    """q (B,H,Sq,D), k/v (B,Hk,Sk,D) (last dim contiguous); mask None or float32
    (B,H,Sq,Sk) view. Returns (out float32 (B,H,Sq,D), lse float32 (B,H,Sq))."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    B, H, Hk, Sq, Sk, D, has_mask, m, mstr, causal, off = _common(q, k, mask, off)
    BD, BM, BN = _blocks(D, block_q, block_k)
    out = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.float32)
    lse = torch.empty((B, H, Sq), device=q.device, dtype=torch.float32)
    grid = (triton.cdiv(Sq, BM), B * H)
    _fwd[grid](q, k, v, m, out, lse, scale, Sq, Sk, H, H // Hk, off, D,
               *q.stride()[:3], *k.stride()[:3], *mstr,
               HAS_MASK=has_mask, CAUSAL=causal, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD)
    return out, lse


def backward(q, k, v, out, lse, dout, mask, off, scale, block_q, block_k):
    """Gradients (dq, dk, dv) in float32, shaped like q, k, v."""
    q, k, v = (t.contiguous() for t in (q, k, v))
    dout = dout.contiguous().to(q.dtype)
    B, H, Hk, Sq, Sk, D, has_mask, m, mstr, causal, off = _common(q, k, mask, off)
    BD, BM, BN = _blocks(D, block_q, block_k)
    delta = (dout.float() * out.float()).sum(-1).contiguous()
    lse = lse.contiguous()
    dq = torch.empty((B, H, Sq, D), device=q.device, dtype=torch.float32)
    dk = torch.empty((B, Hk, Sk, D), device=q.device, dtype=torch.float32)
    dv = torch.empty_like(dk)
    strides = (*q.stride()[:3], *k.stride()[:3], *mstr)
    _bwd_dkdv[(triton.cdiv(Sk, BN), B * Hk)](
        q, k, v, m, dout, lse, delta, dk, dv, scale, Sq, Sk, H, Hk, H // Hk, off, D, *strides,
        HAS_MASK=has_mask, CAUSAL=causal, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD)
    _bwd_dq[(triton.cdiv(Sq, BM), B * H)](
        q, k, v, m, dout, lse, delta, dq, scale, Sq, Sk, H, H // Hk, off, D, *strides,
        HAS_MASK=has_mask, CAUSAL=causal, BLOCK_M=BM, BLOCK_N=BN, BLOCK_D=BD)
    return dq, dk, dv
