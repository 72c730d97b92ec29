"""``flash_attention``: eager, differentiable FlashAttention-2 with per-device kernels.

Dispatch: CPU tensors -> numba kernels (``cpu.py``), CUDA tensors -> Triton kernels
(``triton_kernels.py``). ``backend=`` or the env var ``OPENCANN_FA_BACKEND`` forces
"numba", "triton" (CPU tensors then need ``TRITON_INTERPRET=1`` set before triton is
first imported) or "reference" (float64 matmul + softmax, for checking).

Algorithm: FlashAttention-2, Dao 2023, arXiv:2307.08691. The forward saves only the
output and the row log-sum-exp; the backward recomputes the scores tile by tile.
Semantics of ``causal`` and ``attn_mask``: see ``reference.py``.
"""
from __future__ import annotations

import functools
import math
import numbers
import os

import torch

from ..kernels.scratch import thread_scratch
from .planner import TilePlan, cpu_l2, cuda_smem, plan_tiles
from .reference import additive_mask, attention_reference, causal_offset

_LAYOUTS = ("BNSD", "BSND")
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_BACKENDS = ("numba", "triton", "reference")
TRITON_MAX_BLOCK = 128  # register-file limit per program; the smem plan is an upper bound


def _check(q, k, v, layout):
    if layout not in _LAYOUTS:
        raise ValueError(f"layout={layout!r} is not supported; use 'BNSD' (batch, heads, seq, "
                         "dim) or 'BSND' (batch, seq, heads, dim)")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} has {t.dim()} dims (shape {tuple(t.shape)}); layout "
                             f"{layout} needs 4 ({', '.join(layout)}): add missing dims with "
                             "unsqueeze, e.g. q.unsqueeze(0) for a missing batch")
        if t.dtype not in _DTYPES:
            raise ValueError(f"{name} has dtype {t.dtype}; use float32, float16 or bfloat16")
    if not (q.dtype == k.dtype == v.dtype):
        raise ValueError(f"q, k, v dtypes differ ({q.dtype}, {k.dtype}, {v.dtype}); cast them to one")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v are on different devices ({q.device}, {k.device}, {v.device})")


def _check_scale(scale) -> float:
    """``scale`` as a float; ValueError naming it unless it is a finite real number."""
    if isinstance(scale, torch.Tensor) and scale.numel() == 1:
        scale = scale.item()
    if isinstance(scale, bool) or not isinstance(scale, numbers.Real) \
            or not math.isfinite(scale):
        raise ValueError(f"scale={scale!r}: give a finite number (the factor on q k^T; None "
                         "means 1/sqrt(head dim))")
    return float(scale)


def _to_bnsd(q, k, v, layout):
    if layout == "BSND":
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    B, H, Sq, D = q.shape
    if D == 0:
        raise ValueError(f"head dim is 0 (q shape {tuple(q.shape)} in BNSD order); attention "
                         "needs at least one feature per head")
    if k.shape[-1] != D or v.shape[-1] != D:
        raise ValueError(f"head dim mismatch: q has {D}, k has {k.shape[-1]}, v has "
                         f"{v.shape[-1]}; q, k and v need the same head dim (last axis)")
    if k.shape != v.shape:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must have the same shape "
                         f"(in {layout} order)")
    if k.shape[0] != B:
        raise ValueError(f"batch mismatch: q has {B}, k/v have {k.shape[0]}")
    if k.shape[1] == 0 or H % k.shape[1] != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads "
                         f"({k.shape[1]}) for grouped-/multi-query attention; pick "
                         "k/v heads that divide the query heads")
    return q, k, v


def _pick_backend(backend, device):
    backend = backend or os.environ.get("OPENCANN_FA_BACKEND") or (
        "triton" if device.type == "cuda" else "numba")
    if backend not in _BACKENDS:
        raise ValueError(f"backend={backend!r} is unknown; use one of {_BACKENDS}")
    if backend == "numba" and device.type != "cpu":
        raise ValueError("the numba backend runs on CPU tensors; move them with .cpu() or use "
                         "backend='triton'")
    return backend


# CPU forward without a backward to feed: 256-row query blocks (key blocks 1024 for
# d <= 64, 512 above) measured 0.97-0.99x torch's SDPA at S = 4096-8192 against
# 1.01-1.03x for the planner's 128 rows (interleaved medians, 2 cores, this machine);
# the backward was slower with 256 rows, so training keeps the planner's blocks.
CPU_FORWARD_BLOCK_Q = 256


# Causal attention on CPU: key blocks no longer than query blocks, so every key tile above
# the diagonal is skipped whole (one tile per query block is partly masked); with the
# wide key blocks above, most tiles straddle the diagonal and are computed in full, then
# masked. Forward, B=1, 12/4 heads (GQA), d=64, best of 5, 2 cores (Intel Xeon): S=512
# (128, 512) 3.24 -> (128, 128) 2.11 ms; S=2048 (256, 1024) 37.1 -> (256, 256) 26.4 ms.
# A causal forward without a backward (LLM prefill) also keeps its query blocks at
# `CPU_CAUSAL_FORWARD_BLOCKS`: the diagonal tile, computed in full and half masked, is
# smaller, and short prompts get more than one block per head. Same shapes, 2 cores (AMD
# EPYC, Zen 4), least of 7 interleaved calls, (256, 256) -> (128, 128) -> (64, 64): S=512
# 4.01 -> 3.27 -> 3.17 ms; S=1024 12.80 -> 11.43 -> 11.65; S=2048 43.4 -> 41.7 -> 43.8;
# S=4096 158.6 -> 158.1 -> 169.6 ms; where the planner gave (128, 128), S=128 0.41 -> 0.34
# ms and S=256 1.07 -> 0.99 ms at (64, 64) (torch's SDPA: 0.55, 1.74, 6.03, 15.7, 52.2,
# 185.4 ms at S=128 ... 4096).
CPU_CAUSAL_FORWARD_BLOCKS = ((256, 64), (None, 128))   # (longest S_q, block) in order


@functools.lru_cache(maxsize=256)
def _default_tiles(backend, D, Sq, Sk, dtype, forward_only=False, causal=False):
    if backend == "triton":
        plan = plan_tiles(cuda_smem()[0], D, dtype, seq_q=Sq, seq_k=Sk, target="triton")
        return min(plan.block_q, TRITON_MAX_BLOCK), min(plan.block_k, TRITON_MAX_BLOCK)
    plan = plan_tiles(cpu_l2()[0], D, torch.float32, seq_q=Sq, seq_k=Sk, target="cpu")
    bq, bk = plan.block_q, plan.block_k
    if forward_only and backend == "numba" and Sq >= 2 * CPU_FORWARD_BLOCK_Q:
        bq, bk = CPU_FORWARD_BLOCK_Q, min(plan.block_k, 1024 if D <= 64 else 512)
    if causal and backend == "numba":
        if forward_only:
            bq = next(blk for top, blk in CPU_CAUSAL_FORWARD_BLOCKS if top is None or Sq <= top)
        bk = min(bk, bq)
    return bq, bk


def _tiles(tiles, backend, D, Sq, Sk, dtype, forward_only=False, causal=False):
    if tiles is None:
        return _default_tiles(backend, D, Sq, Sk, dtype, forward_only, bool(causal))
    if isinstance(tiles, TilePlan):
        return tiles.block_q, tiles.block_k
    try:
        bq, bk = (int(x) for x in tiles)
    except (TypeError, ValueError):
        raise ValueError(f"tiles={tiles!r}: give a TilePlan or a (block_q, block_k) pair") from None
    if bq < 1 or bk < 1:
        raise ValueError(f"tiles={tiles!r}: blocks must be >= 1")
    return bq, bk


def _rows_f32(t: torch.Tensor) -> bool:
    """Whether the CPU kernel reads float32 ``t`` [B, H, S, D] in place: a unit stride
    along D, rows at least D elements apart (the tile GEMMs' leading dimension: an S
    expanded with stride 0 is copied), the others non-negative (`cpu._in_place`)."""
    return (t.dtype == torch.float32 and t.dim() == 4
            and (t.numel() == 0 or (t.stride(3) == 1 and min(t.stride()) >= 0
                                    and t.stride(2) >= t.shape[3])))


def _dense_f32(*ts):
    """NumPy views of ``ts`` as the CPU kernel reads them: a float32 tensor whose rows
    are unit-stride (`_rows_f32`: a head of eager's [B, S, H, D] memory seen as BNSD, a
    KV cache's live slice) is viewed as it is, the others (another dtype, a transposed
    D) are copied into this thread's scratch (`thread_scratch`), not into fresh memory
    each call: valid until the thread's next scratch use, i.e. for this call."""
    dense = [_rows_f32(t) for t in ts]
    buf = thread_scratch(sum(t.numel() for t, ok in zip(ts, dense) if not ok))
    out, at = [], 0
    for t, ok in zip(ts, dense):
        t = t.detach()
        if not ok:
            t, at = buf[at:at + t.numel()].view(t.shape).copy_(t), at + t.numel()
        out.append(t.numpy())
    return out


def _forward_impl(q, k, v, mask, off, scale, bq, bk, backend, out=None):
    """BNSD forward on prepared inputs; returns (out float32, lse float32)."""
    if backend == "reference":
        o, lse = _ref(q, k, v, mask, off, scale)
        return o.float(), lse.float()
    if backend == "triton":
        from . import triton_kernels
        return triton_kernels.forward(q, k, v, mask, off, scale, bq, bk)
    from . import cpu
    qn, kn, vn = _dense_f32(q, k, v)
    mn = None if mask is None else mask.detach().numpy()
    on = None if out is None else out.numpy()
    o, lse = cpu.forward(qn, kn, vn, mn, off, scale, bq, bk, out=on)
    return (out if out is not None else torch.from_numpy(o)), torch.from_numpy(lse)


def _ref(q, k, v, mask, off, scale):
    """Reference with a precomputed additive mask and causal offset (the offset of
    ``causal_offset``: 0 for top-left, S_k - S_q for bottom-right). The causal mask
    overwrites hidden scores (a NaN key a query does not see stays out of its row),
    as in torch's CPU SDPA; an additive -inf would keep the NaN."""
    Sq, Sk = q.shape[2], k.shape[2]
    causal = False if off is None else ("top_left" if off == 0 else "bottom_right")
    if off is not None and causal_offset(causal, Sq, Sk) != off:
        raise ValueError(f"causal offset {off} is neither top-left (0) nor bottom-right ({Sk - Sq})")
    return attention_reference(q, k, v, attn_mask=mask, causal=causal, scale=scale)


class _FlashAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, mask, off, scale, bq, bk, backend):
        out, lse = _forward_impl(q, k, v, mask, off, scale, bq, bk, backend)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.cfg = (mask, off, scale, bq, bk, backend)
        return out.to(q.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        mask, off, scale, bq, bk, backend = ctx.cfg
        if backend == "reference":
            with torch.enable_grad():
                qq, kk, vv = (t.detach().double().requires_grad_() for t in (q, k, v))
                o, _ = _ref(qq, kk, vv, mask, off, scale)
                dq, dk, dv = torch.autograd.grad(o, (qq, kk, vv), dout.double())
        elif backend == "triton":
            from . import triton_kernels
            dq, dk, dv = triton_kernels.backward(q, k, v, out, lse, dout, mask, off, scale, bq, bk)
        else:
            from . import cpu
            arrs = [t.detach().float().contiguous().numpy() for t in (q, k, v, out, lse, dout)]
            mn = None if mask is None else mask.numpy()
            dq, dk, dv = (torch.from_numpy(a) for a in cpu.backward(
                *arrs[:5], arrs[5], mn, off, scale, bq, bk))
        return (dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), None, None, None, None, None, None)


def _prepare(q, k, v, attn_mask, causal, scale, layout, tiles, backend, forward_only=False):
    _check(q, k, v, layout)
    q, k, v = _to_bnsd(q, k, v, layout)
    B, H, Sq, D = q.shape
    Sk = k.shape[2]
    off = causal_offset(causal, Sq, Sk)
    mask = additive_mask(attn_mask, B, H, Sq, Sk, dtype=torch.float32)
    if mask is not None and mask.device != q.device:
        raise ValueError(f"attn_mask is on {mask.device} but q is on {q.device}")
    if mask is not None:
        mask = mask.detach()
    scale = _check_scale(D ** -0.5 if scale is None else scale)
    backend = _pick_backend(backend, q.device)
    bq, bk = _tiles(tiles, backend, D, Sq, Sk, q.dtype, forward_only, causal)
    return q, k, v, mask, off, scale, bq, bk, backend


def flash_attention(q, k, v, *, attn_mask=None, causal=False, scale=None, layout="BNSD",
                    tiles=None, backend=None):
    """Memory-efficient exact attention ``softmax(scale * q k^T + mask) v`` with autograd.

    Shapes (``layout="BNSD"``): q (B, H, S_q, D), k and v (B, H_kv, S_k, D) with
    ``H % H_kv == 0`` (grouped-query; H_kv = 1 is multi-query). ``layout="BSND"``:
    q (B, S_q, H, D), k, v (B, S_k, H_kv, D); the output follows the input layout.
    dtypes: float32, float16, bfloat16 (all three equal); accumulation is float32; the
    output has the input dtype.

    attn_mask: bool (True = keep) or float (added to the scaled scores), broadcastable to
    (B, H, S_q, S_k) (BNSD order whatever ``layout``); no gradient flows to it.
    causal: False, True (= "top_left", like torch SDPA ``is_causal``), "top_left" or
    "bottom_right" (query i sees keys j <= i + S_k - S_q). scale: default D ** -0.5.
    tiles: None (planner: this CPU's L2 / the GPU's shared memory), a ``TilePlan`` or a
    (block_q, block_k) pair. backend: None (by device), "numba", "triton", "reference".

    NaN/Inf as torch's CPU SDPA: a row that sees no key (fully masked) gives output 0
    and gradient 0; a NaN or +inf score (NaN in q or a visible key, NaN or +inf in the
    mask) gives a NaN row; keys hidden by ``causal`` are out of the row even if NaN;
    finite masks such as ``finfo(float32).min`` stay finite (no overflow).
    Raises ValueError for a bad layout, wrong rank, dtype or device mismatch, head-dim
    mismatch, query heads not a multiple of kv heads, a mask that does not broadcast,
    a scale that is not a finite number, or an unknown causal/backend value.
    Source: FlashAttention-2, Dao 2023, arXiv:2307.08691.
    """
    _check(q, k, v, layout)  # before anything reads tensor attributes
    needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v))
    q_, k_, v_, mask, off, scale, bq, bk, backend = _prepare(
        q, k, v, attn_mask, causal, scale, layout, tiles, backend, forward_only=not needs_grad)
    out = _FlashAttention.apply(q_, k_, v_, mask, off, scale, bq, bk, backend)
    return out.transpose(1, 2) if layout == "BSND" else out


def bind_forward(q_shape, k_shape, *, causal=False, scale=None):
    """``run(q, k, v, out=None) -> (out, lse)``: `flash_attention_forward` without a mask
    for one static shape, its arguments checked and its tiles planned once here instead
    of on every call (a graph kernel's binding; at a 32-token Llama prefill the per-call
    checks were ~50 µs of a ~180 µs call). q (B, H, S_q, D) and k (B, H_kv, S_k, D) as
    ``q_shape`` / ``k_shape``; a call whose tensors are float32 CPU tensors of those
    shapes with unit-stride rows (`_rows_f32`) and, when given, such an ``out``
    (`_non_overlapping`) runs the numba kernel on them in place; any other call (another
    backend in ``OPENCANN_FA_BACKEND``, dtype or shape) takes `flash_attention_forward`.
    Raises what `flash_attention_forward` raises for the shapes, ``causal`` or ``scale``."""
    B, H, Sq, D = (int(d) for d in q_shape)
    Hk, Sk = int(k_shape[1]), int(k_shape[2])
    if H % max(Hk, 1) or int(k_shape[3]) != D:
        raise ValueError(f"flash attention: q {tuple(q_shape)} and k {tuple(k_shape)} differ in "
                         "head dim or the query heads are not a multiple of the key heads")
    off = causal_offset(causal, Sq, Sk)
    sc = _check_scale(D ** -0.5 if scale is None else scale)
    numba_ok = (os.environ.get("OPENCANN_FA_BACKEND") or "numba") == "numba"
    bq, bk = _tiles(None, "numba", D, Sq, Sk, torch.float32, True, off is not None)
    from . import cpu
    qs, ks = tuple(int(d) for d in q_shape), tuple(int(d) for d in k_shape)

    def run(q, k, v, out=None):
        if not (numba_ok and q.device.type == "cpu" and tuple(q.shape) == qs
                and tuple(k.shape) == ks == tuple(v.shape) and _rows_f32(q) and _rows_f32(k)
                and _rows_f32(v) and (out is None or (tuple(out.shape) == qs and _rows_f32(out)
                                                      and _non_overlapping(out)))):
            return flash_attention_forward(q, k, v, causal=causal, scale=scale, out=out)
        with torch.no_grad():
            o, lse = cpu.forward(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), None,
                                 off, sc, bq, bk, out=None if out is None else out.numpy())
        return (out if out is not None else torch.from_numpy(o)), torch.from_numpy(lse)
    return run


def _non_overlapping(t: torch.Tensor) -> bool:
    """Whether no two elements of ``t`` share memory: its dims sorted by stride, each
    stride at least the span of the dims below it."""
    span = 1
    for st, n in sorted((st, n) for n, st in zip(t.shape, t.stride()) if n > 1):
        if st < span:
            return False
        span = st * n
    return True


def flash_attention_forward(q, k, v, *, attn_mask=None, causal=False, scale=None, tiles=None,
                            backend=None, out=None):
    """Forward only, no autograd, BNSD: returns ``(out, lse)``.

    q (B, H, S_q, D), k/v (B, H_kv, S_k, D); out (B, H, S_q, D) float32 and lse
    (B, H, S_q) float32 (natural log; -inf for fully masked rows, NaN for NaN rows). ``out``, if given,
    is a float32 CPU tensor of q's shape with a unit stride along D and no element twice
    (contiguous, or e.g. eager's [B, S_q, H, D] memory seen as BNSD), written in place
    (numba backend). Meant for graph kernels. Same arguments and errors as
    ``flash_attention``.
    """
    q, k, v, mask, off, scale, bq, bk, backend = _prepare(
        q, k, v, attn_mask, causal, scale, "BNSD", tiles, backend, forward_only=True)
    if out is not None and (backend != "numba" or out.shape != q.shape or not _rows_f32(out)
                            or not _non_overlapping(out)):
        raise ValueError("out= needs the numba backend and a float32 tensor of q's shape with a "
                         "unit stride along D and no element twice (e.g. a contiguous one)")
    with torch.no_grad():
        return _forward_impl(q, k, v, mask, off, scale, bq, bk, backend, out=out)
