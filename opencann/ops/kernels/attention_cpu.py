"""CPU kernel choice of ``ScaledDotProductAttention``: torch's SDPA or an explicit
``bmm + softmax + bmm`` path, chosen per shape at bind time by measuring (as LinearAct's
GEMM choice, ``ops/kernels/cpu.py``), recorded in ``node.meta["kernel"]`` (one of
`ATTENTION_KERNELS`; saved in model files).

- ``sdpa``: ``torch.nn.functional.scaled_dot_product_attention`` (on this CPU, fp32: ATen's
  flash kernel ``_scaled_dot_product_flash_attention_for_cpu``).
- ``bmm_softmax``: per batch item, all heads in one ``baddbmm`` (the scale as its ``alpha``,
  the additive mask as its ``input``: scores = mask + scale · Q Kᵀ) into a per-thread
  scratch [H, S_q, S_k] reused across calls, ``_softmax.out`` in place, ``bmm`` with V
  straight into the planned output buffer (eager's strides: SDPA returns BSND memory seen
  as BNSD). A bool mask becomes the additive mask SDPA builds from it (0 / -inf).

Exactness: values within ~1e-6 relative of SDPA's (accumulation order). NaN/Inf positions
equal SDPA's except where a score row is all -inf (a row fully masked by -inf or False,
or -inf/inf inputs): SDPA returns 0 there, softmax NaN. Every such row, and every NaN or
Inf from the inputs, leaves a non-finite value in the output, so the kernel sums its
output (one pass, ~6 µs at [1, 12, 128, 32]) and when the sum is not finite recomputes
the call with SDPA: such calls get SDPA's exact result. Measured in
tests/unit/test_attention_choice.py against eager SDPA (torch 2.13 CPU).

Covered by ``bmm_softmax`` (else ``sdpa``, `uncovered` says why): cpu device; static
shapes; q, k, v float32, rank 4, same batch and heads (no GQA); mask float32 or bool,
broadcastable to [B, H, S_q, S_k]; ``dropout_p`` 0, not ``is_causal``, not
``enable_gqa``; the scores [H, S_q, S_k] fit `SCORES_BOUND_BYTES` (per thread).
The choice depends on the shape, so a dynamic model measures it per shape
(``OpDef.kernel_per_shape``; `opencann.engine.dynamic.pin_kernel_choices` does not pin it).
"""
from __future__ import annotations

import math
import threading
import time
from typing import Callable, Dict, Optional, Sequence

import torch

from ...devices.cpu import best_time_us
from ...ir import Node, TensorDesc, TensorRef, is_dense, numel
from .scratch import thread_scratch

# the kernels a ScaledDotProductAttention node may bind (node.meta["kernel"])
ATTENTION_KERNELS = ("sdpa", "bmm_softmax")
# (shapes, strides, mask, scale, threads) -> one of ATTENTION_KERNELS, measured once
ATTENTION_CHOICES: Dict[tuple, str] = {}
_CHOICES_LOCK = threading.Lock()
_MARGIN = 0.97        # bmm_softmax must be 3% faster than SDPA to be chosen (noise guard)
_ROUNDS = 6
_BUDGET_MS = 30.0   # timed race calls per shape after 2 rounds (compile time)
# the scores scratch of one batch item, per thread: beyond this the flash kernel's tiles
# (no S_q x S_k matrix) are the only sensible path; 32 MiB = 12 heads at S = 820
SCORES_BOUND_BYTES = 32 << 20
_SDPA = torch.nn.functional.scaled_dot_product_attention
_SOFTMAX_OUT = torch.ops.aten._softmax.out


def bmm_softmax_available() -> bool:
    """Whether the explicit path's ops exist in this torch (``_softmax.out``)."""
    return hasattr(torch.ops.aten._softmax, "out")


def _args(node: Node) -> Dict[str, object]:
    """SDPA's keyword arguments of ``node``: argument name -> input index (TensorRef) or
    literal, as the frontend recorded them in ``node.attrs``."""
    return {k: (a.index if isinstance(a, TensorRef) else a) for k, a in node.attrs.items()}


def uncovered(node: Node, in_descs: Sequence[TensorDesc]) -> str:
    """Why ``node`` cannot run ``bmm_softmax`` ("" when it can; module docstring)."""
    a = _args(node)
    if not node.meta.get("attention_choice") and node.meta.get("kernel") != "bmm_softmax":
        return "the race is off (enable the pass attention_kernel_choice)"
    if node.device.kind != "cpu":
        return f"device {node.device}"
    if not bmm_softmax_available():
        return "torch lacks _softmax.out"
    if a.get("dropout_p") or a.get("is_causal") or a.get("enable_gqa"):
        return "dropout, is_causal or enable_gqa"
    if not all(d.is_static for d in in_descs):
        return "symbolic shapes"
    q, k, v = (in_descs[a[n]] for n in ("query", "key", "value"))
    if any(d.rank != 4 or d.dtype.torch != torch.float32 for d in (q, k, v)):
        return "q, k, v not float32 of rank 4"
    (b, h, sq, d), (bk, hk, sk, dk), (bv, hv, skv, _) = (tuple(int(s) for s in x.shape) for x in (q, k, v))
    if (b, h) != (bk, hk) or (b, h) != (bv, hv) or d != dk or sk != skv:
        return "q, k, v differ in batch, heads or length (broadcast, GQA)"
    if isinstance(a.get("attn_mask"), int):
        m = in_descs[a["attn_mask"]]
        if m.dtype.torch not in (torch.float32, torch.bool) or m.rank > 4:
            return "mask not float32 or bool of rank <= 4"
        try:
            if torch.broadcast_shapes(tuple(int(s) for s in m.shape), (b, h, sq, sk)) != (b, h, sq, sk):
                return "mask broadcasts beyond the scores"
        except RuntimeError:
            return "mask does not broadcast to the scores"
    if h * sq * sk * 4 > SCORES_BOUND_BYTES:
        return f"scores [{h}, {sq}, {sk}] exceed {SCORES_BOUND_BYTES >> 20} MiB"
    return ""


def _out_strides(node: Node, shape: tuple) -> tuple:
    """Eager's strides of the output (traced), else contiguous."""
    st = (node.meta.get("strides") or [None])[0]
    if st is not None and is_dense(shape, st):
        return tuple(st)
    return torch.empty(shape, device="meta").stride()


def make_sdpa(node: Node) -> Callable:
    """``run(*inputs, out=None)``: torch's SDPA with ``node``'s arguments; copied into
    ``out`` when given (a planned buffer)."""
    a = _args(node)
    tensors = {k: i for k, i in a.items() if k in ("query", "key", "value", "attn_mask")
               and isinstance(i, int)}
    lits = {k: x for k, x in a.items() if k not in tensors}

    def run(*inputs, out=None):
        r = _SDPA(**{k: inputs[i] for k, i in tensors.items()}, **lits)
        return r if out is None else out.copy_(r)
    return run


def make_bmm_softmax(node: Node, in_descs: Sequence[TensorDesc]) -> Callable:
    """``run(*inputs, out=None)``: the explicit path (module docstring) for a node that
    `uncovered` passes; the output has eager's strides (``out``, or a fresh tensor)."""
    a = _args(node)
    iq, ik, iv, im = a["query"], a["key"], a["value"], a.get("attn_mask")
    im = im if isinstance(im, int) else None
    q, v = in_descs[iq], in_descs[iv]
    b, h, sq, d = (int(s) for s in q.shape)
    sk = int(in_descs[ik].shape[2])
    shape = (b, h, sq, int(v.shape[3]))
    strides = _out_strides(node, shape)
    scale = a.get("scale")
    scale = 1.0 / math.sqrt(d) if scale is None else float(scale)
    sdpa = make_sdpa(node)

    def run(*inputs, out=None):
        qt, kt, vt = inputs[iq], inputs[ik], inputs[iv]
        if out is None:
            out = torch.empty_strided(shape, strides)
        mask = inputs[im] if im is not None else None
        if mask is not None:
            if mask.dtype == torch.bool:   # SDPA's own conversion: False -> -inf
                mask = torch.where(mask, 0.0, float("-inf"))
            mask = mask[(None,) * (4 - mask.dim())]
        s = thread_scratch(h * sq * sk).view(h, sq, sk)
        for i in range(b):   # all heads of one batch item in one bmm
            kT = kt[i].transpose(1, 2)
            if mask is None:
                torch.baddbmm(s, qt[i], kT, beta=0.0, alpha=scale, out=s)
            else:
                torch.baddbmm(mask[i if mask.shape[0] > 1 else 0], qt[i], kT, alpha=scale, out=s)
            _SOFTMAX_OUT(s, -1, False, out=s)
            torch.bmm(s, vt[i], out=out[i])
        if not math.isfinite(float(out.sum())):   # NaN/Inf or an all -inf row: SDPA's result
            sdpa(*inputs, out=out)
        return out
    return run


def _sample(desc: TensorDesc, strides, g: torch.Generator) -> torch.Tensor:
    """Random data of ``desc`` laid out with ``strides`` (traced; contiguous when None or
    not dense): normal values, or a bool mask with one key in ten masked."""
    shape = tuple(int(s) for s in desc.shape)
    if strides is None or not is_dense(shape, strides):
        strides = torch.empty(shape, device="meta").stride()
    t = torch.empty_strided(shape, strides, dtype=torch.float32)
    t.copy_(torch.randn(shape, generator=g, dtype=torch.float32))
    return t > -1.28 if desc.dtype.torch == torch.bool else t


def race(calls: Dict[str, Callable], default: str, rounds: int = _ROUNDS,
         margin: float = _MARGIN, budget_ms: float = _BUDGET_MS) -> str:
    """The fastest of ``calls`` (name -> zero-argument call): one warm-up call each,
    then up to ``rounds`` rounds in which every call runs once in turn (interleaved, so a
    burst of load on a shared machine hits them all); after 3 rounds the race stops once
    ``budget_ms`` of timed calls have passed (large shapes, or a loaded machine where one
    2-thread call can take 100x its quiet time, must not stall compiling). Another call
    wins over ``default`` only when its least time is below ``margin`` x the default's
    AND it was faster than the default in more than half of the rounds (paired per
    round: one lucky call under load must not pick a kernel 25% slower)."""
    times = {name: [] for name in calls}
    for call in calls.values():
        call()
    t0 = time.perf_counter()
    for r in range(rounds):
        if r >= 3 and (time.perf_counter() - t0) * 1e3 > budget_ms:
            break
        for name, call in calls.items():
            times[name].append(best_time_us(call, reps=1, warmup=False))
    ref = times[default]
    best, best_t = default, min(ref)
    for name, ts in times.items():
        wins = sum(t < r for t, r in zip(ts, ref))
        if name != default and min(ts) < margin * min(ref) and 2 * wins > len(ref) \
                and min(ts) < best_t:
            best, best_t = name, min(ts)
    return best


def _key(node: Node, in_descs: Sequence[TensorDesc]) -> tuple:
    """The cache key of a covered node: shapes, input strides, dtypes, scale, threads."""
    ins = tuple((tuple(int(s) for s in d.shape), str(d.dtype),
                 tuple(v.traced_strides) if v.traced_strides else None)
                for d, v in zip(in_descs, node.inputs))
    return ins, tuple(sorted(node.attrs)), node.attrs.get("scale"), torch.get_num_threads()


def _measure(node: Node, in_descs: Sequence[TensorDesc]) -> str:
    """Race ``sdpa`` and ``bmm_softmax`` for ``node``'s shape on random data (`race`)."""
    g = torch.Generator().manual_seed(0)
    inputs = [_sample(d, v.traced_strides, g) for d, v in zip(in_descs, node.inputs)]
    runs = {"sdpa": make_sdpa(node), "bmm_softmax": make_bmm_softmax(node, in_descs)}
    shape = tuple(int(s) for s in in_descs[_args(node)["query"]].shape[:3]) + \
        (int(in_descs[_args(node)["value"]].shape[3]),)
    out = torch.empty_strided(shape, _out_strides(node, shape))
    return race({k: (lambda r=r: r(*inputs, out=out)) for k, r in runs.items()}, "sdpa")


def choose(node: Node, in_descs: Optional[Sequence[TensorDesc]] = None) -> str:
    """The attention kernel ``node`` binds (one of `ATTENTION_KERNELS`), recorded in
    ``node.meta["kernel"]`` when its shapes are static: ``sdpa`` when `uncovered` gives a
    reason; else ``node.meta["kernel"]`` (an earlier bind, a model file) when it names a
    kernel; else the cached choice for the shape (`ATTENTION_CHOICES`); else measured
    (`race`, once per shape, even when binding races)."""
    in_descs = in_descs if in_descs is not None else [v.desc for v in node.inputs]
    if uncovered(node, in_descs):
        if all(d.is_static for d in in_descs):
            node.meta["kernel"] = "sdpa"
        return "sdpa"
    made = node.meta.get("kernel")
    if made not in ATTENTION_KERNELS:
        key = _key(node, in_descs)
        with _CHOICES_LOCK:
            made = ATTENTION_CHOICES.get(key)
            if made not in ATTENTION_KERNELS:
                made = ATTENTION_CHOICES[key] = _measure(node, in_descs)
    node.meta["kernel"] = made
    return made


def attention_writes_out(node: Node) -> bool:
    """``out_capable`` of ScaledDotProductAttention: True when the node binds
    ``bmm_softmax`` (which writes into the planned buffer); ``sdpa`` returns its own
    allocation, as before (a planned buffer would cost it a copy)."""
    return choose(node) == "bmm_softmax"


def make_attention_kernel(node: Node, in_descs: Sequence[TensorDesc], consts: Sequence) -> Callable:
    """Kernel factory of ScaledDotProductAttention (an OpDef's ``kernel_factories["cpu"]``):
    ``run(*inputs, out=None)`` (inputs in ``node.inputs`` order: query, key, value and
    the mask when it is a tensor) -> [B, H, S_q, D_v] in q's dtype, by the kernel
    `choose` picks for the node's shape. Inputs: q [B, H, S_q, D], k [B, H, S_k, D],
    v [B, H, S_k, D_v]; mask bool (True = keep) or float (added), broadcastable to
    [B, H, S_q, S_k]. Raises what torch's SDPA raises on bad input."""
    if choose(node, in_descs) == "bmm_softmax":
        return make_bmm_softmax(node, in_descs)
    return make_sdpa(node)


__all__ = ["ATTENTION_CHOICES", "ATTENTION_KERNELS", "SCORES_BOUND_BYTES", "attention_writes_out",
           "bmm_softmax_available", "choose", "make_attention_kernel", "race", "uncovered"]
