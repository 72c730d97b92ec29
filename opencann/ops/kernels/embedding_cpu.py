"""CPU kernel of Embedding for a decode step's few rows: out[i, :] = weight[ids[i], :], a
numba row copy into the planned buffer (`bind_embedding`).

Why: a decode step begins with its token's embedding (and, with a RoPE table, the
cos/sin rows of its position: `opencann.llm.builder`), right after the last step's LM
head streamed its weight through the caches. There ATen's ``embedding`` (index_select
through the dispatcher) took 73-114 µs a call for one 768-float row of a 32000-row table
on the 2-core EPYC (per op inside a 125M Llama's batch-1 step, 30 steps); warm, 12-16 µs.
One numba call through its compiled entry point touches far less code.

Semantics as ``torch.nn.functional.embedding``'s forward (padding_idx, max_norm unset:
the graph's Embedding node): rows copied as they are (moves, no arithmetic: NaN payloads
and -0.0 kept); an index outside [0, V) writes nothing and the call goes to ATen's
kernel, which raises eager's error ("index out of range in self"). float32 weight
[V, D], int64 indices of any shape (out: indices' shape + [D]), rows·D below
`numba_cache.GRAIN` (longer gathers keep ATen's kernel).
"""
from __future__ import annotations

from typing import Callable

import torch

from .numba_cache import GRAIN, entry_point, njit
from .numpy_views import NumpyViews
from ...ir import Node, numel

_EMBED, _EMBED_OUT = torch.ops.aten.embedding.default, torch.ops.aten.embedding.out


@njit(cache=True)
def _gather(w, ids, out):  # pragma: no cover - numba
    """1 (nothing written) when an index is outside [0, V), else 0 with the rows copied."""
    V = w.shape[0]
    for i in range(ids.shape[0]):
        if ids[i] < 0 or ids[i] >= V:
            return 1
    for i in range(ids.shape[0]):
        out[i, :] = w[ids[i], :]
    return 0


def embedding_writes_out(node: Node) -> bool:
    """``out_capable`` of Embedding: True on the CPU (`bind_embedding` writes the planned
    buffer: `_gather` for `decode_rows`, ATen's ``embedding.out`` otherwise)."""
    return node.device.kind == "cpu"


def decode_rows(node: Node) -> bool:
    """Whether `bind_embedding` gathers with `_gather`: a float32 weight [V, D] and int64
    indices, static, indices·D below `numba_cache.GRAIN` (a decode step's rows)."""
    if len(node.inputs) < 2:
        return False
    w, ids = node.inputs[0].desc, node.inputs[1].desc
    return (w.is_static and ids.is_static and w.rank == 2 and w.dtype.torch == torch.float32
            and ids.dtype.torch == torch.int64 and numel(ids.shape) * int(w.shape[1]) < GRAIN)


def bind_embedding(node: Node, in_descs, consts) -> Callable:
    """Kernel factory of Embedding on the CPU: ``run(weight, indices, *rest, out=None)``.
    For `decode_rows`, a call with a contiguous float32 ``out`` of the result's elements
    and contiguous indices runs `_gather` on memoized NumPy views (`NumpyViews`; its
    compiled entry point: every call's views have one type); any other call, and one with
    an index out of range, is ATen's ``embedding`` (``embedding.out`` into ``out`` when
    given; eager's error)."""
    rest = tuple(node.attrs.get(k, d) for k, d in (("padding_idx", -1),
                                                  ("scale_grad_by_freq", False),
                                                  ("sparse", False)))

    def general(w, ids, *_, out=None):
        if out is None:
            return _EMBED(w, ids, *rest)
        return _EMBED_OUT(w, ids, *rest, out=out)
    if not decode_rows(node):
        return general
    d = int(in_descs[0].shape[1])
    n = numel(in_descs[1].shape)
    views, i64, f32 = NumpyViews(), torch.int64, torch.float32
    entry: list = []

    def run(w, ids, *_, out=None):
        if out is None or ids.dtype is not i64 or w.dtype is not f32 or out.dtype is not f32:
            return general(w, ids, out=out)
        args = (views.shaped(w, tuple(w.shape)) if w.dim() == 2 and w.shape[1] == d else None,
                views.shaped(ids, (n,)), views.shaped(out, (n, d)))
        if any(a is None for a in args):
            return general(w, ids, out=out)
        fn = entry[0] if entry else None
        bad = (_gather if fn is None else fn)(*args)
        if fn is None:
            e = entry_point(_gather, args)
            if e is not None:
                entry.append(e)
        return general(w, ids, out=out) if bad else out
    return run


__all__ = ["bind_embedding", "decode_rows", "embedding_writes_out"]
