"""Decode attention on the CPU: one new query per sequence against a KV cache, split-KV
across threads (FlashDecoding).

Source: Flash-Decoding (Tri Dao, Daniel Haziza, Francisco Massa, Grigory Sizov, 2023,
"Flash-Decoding for long-context inference", https://crfm.stanford.edu/2023/10/12/flashdecoding.html):
with one query row per sequence, FlashAttention's parallelism over query blocks is gone,
so the keys/values are split into chunks processed in parallel, each chunk producing a
partial output with its own softmax statistics (max m, sum l), merged exactly by a
log-sum-exp rescaling: ``O = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c`` with
``M = max_c m_c`` (the online softmax of Milakov & Gimelshein 2018, arXiv:1805.02867).
The semantics follow Ascend's ``npu_incre_flash_attention`` (live lengths as data,
``actual_seq_lengths``; GQA through ``num_key_value_heads``).

Layouts (BNSD, as the project's FlashAttention op and torch's SDPA):
  q       [B, Hq, 1, D]     float32 — the query of the token being decoded;
  k, v    [B, Hkv, S_max, D] float32 — the preallocated KV cache (any strides);
  lengths [B]               integer — live keys per sequence: row b attends to key
                                       positions 0 .. lengths[b]-1 only; positions at or
                                       past lengths[b] are never read (a NaN there does
                                       not leak);
  output  [B, Hq, 1, D]     float32.
GQA: Hq must be a multiple of Hkv; query head h reads KV head h // (Hq // Hkv), as
transformers' ``repeat_kv`` orders the heads. Each work item (b, kv head, chunk) reads
its chunk of K and V once for all the query heads of its group.

At decode sizes (up to `SERIAL_MAX` K/V elements) the whole call is one serial kernel on
the calling thread instead (`_serial`: one chunk's arithmetic and its merge).
`decode_attention_update` (the ``DecodeAttentionKvUpdate`` op) also writes the step's new
key and value rows into the caches first, in the same numba call, and runs whole (b, kv
head) groups (`_by_group_update`: on the calling thread, or dealt over the threads when
there are at least two groups per thread, a batch of decodes), splitting the keys only
for a long call with few groups.

Numerics: scores, softmax statistics and the output accumulate in fp32 (fastmath
``reassoc``/``contract`` only, so NaN/Inf propagate): a NaN or +Inf score in a live
position makes the row's output NaN, as eager softmax does; a row with length 0 gives
zeros (as SDPA with an all-False boolean mask row). ``exp`` is `numba_exp.exp_shifted`
(vectorized, relative error < 3e-7 + 1e-7·|score - max|). Agrees with eager
``F.scaled_dot_product_attention`` to fp32 rounding (other summation order).
"""
from __future__ import annotations

import math
import operator
from typing import Callable, Optional

import numba
import numpy as np
import torch
from numba import prange

from ...ir import TensorDesc
from .kv_cache_update_cpu import _array, check_update, kv_cache_update
from .rotary_mul_cpu import apply_rotary_pos_emb
from .numba_cache import (GRAIN, general_entry, launch, launch_guard, launch_threads, njit,
                          torch_threads)
from .decode_attention_tile import HEADS, SLICES, W as TILE_W, fits, pv_block, qk_block
from .numba_exp import exp_shifted
from .numba_prefetch import prefetch
from .numpy_views import NumpyViews
from .out_arg import check_out

_FM = {"reassoc", "contract"}
MIN_CHUNK = 64  # keys per split-KV chunk at least (smaller chunks cost more merging than they save)
#: K and V elements read (2·B·Hkv·max_len·D, by the live lengths) up to which a call with
#: few (b, kv head) groups runs them whole rather than splitting the keys (`_serial`,
#: `_by_group_update`): no partials to merge (measured, see `decode_attention`)
SERIAL_MAX = 1 << 17
#: key (and value) rows of the next (b, kv head) group prefetched while a group computes
#: (`_prefetch_group`): 64 rows of D = 64 are 32 KiB of K and V, within L1d's 48 KiB
PREFETCH_ROWS = 64


@njit(parallel=True, fastmath=_FM, cache=True)
def _partials(q, k, v, lengths, scale, chunk, pm, pl, pacc):  # pragma: no cover - numba
    """Per (b, kv head, chunk): for every query head of the group, the chunk's score max
    ``pm``, sum of exp ``pl`` and unnormalised output ``pacc`` (fp32). Chunks past a
    row's length are marked empty with pl = 0, pm = -inf."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[3]
    Hkv = k.shape[1]
    G = Hq // Hkv
    nc = pm.shape[2]
    for t in prange(B * Hkv * nc):
        b = t // (Hkv * nc)
        h = (t // nc) % Hkv
        c = t % nc
        start = c * chunk
        stop = min(start + chunk, lengths[b])
        if start >= stop:  # past this row's length: an empty chunk
            for g in range(G):
                hq = h * G + g
                pm[b, hq, c] = -np.inf
                pl[b, hq, c] = 0.0
                for d in range(D):
                    pacc[b, hq, c, d] = 0.0
            continue
        s = np.empty((G, stop - start), np.float32)
        for g in range(G):
            hq = h * G + g
            m = np.float32(-np.inf)
            for j in range(start, stop):
                acc = np.float32(0.0)
                for d in range(D):
                    acc += q[b, hq, 0, d] * k[b, h, j, d]
                sc = acc * scale
                s[g, j - start] = sc
                if sc > m:
                    m = sc
                elif sc != sc:      # NaN: keep it (the row's output becomes NaN)
                    m = sc
            pm[b, hq, c] = m
            pl[b, hq, c] = exp_shifted(s[g], stop - start, m)
        acc = np.zeros((G, D), np.float32)  # the chunk's P·V, one row per query head
        for j in range(start, stop):
            for g in range(G):
                p = s[g, j - start]
                for d in range(D):
                    acc[g, d] += p * v[b, h, j, d]
        for g in range(G):
            for d in range(D):
                pacc[b, h * G + g, c, d] = acc[g, d]


@njit(parallel=True, fastmath=_FM, cache=True)
def _merge(lengths, chunk, pm, pl, pacc, out):  # pragma: no cover - numba
    """out[b, hq, 0, :] = sum_c exp(m_c - M) acc_c / sum_c exp(m_c - M) l_c over the
    non-empty chunks (M their max); zeros for a row without live keys."""
    B, Hq, nc = pm.shape
    D = out.shape[3]
    for t in prange(B * Hq):
        b = t // Hq
        hq = t % Hq
        used = min(nc, (lengths[b] + chunk - 1) // chunk)
        for d in range(D):
            out[b, hq, 0, d] = 0.0
        if used <= 0:
            continue
        mx = pm[b, hq, 0]
        for c in range(1, used):
            mc = pm[b, hq, c]
            if mc > mx or mc != mc:
                mx = mc
        den = np.float32(0.0)
        for c in range(used):
            w = np.exp(pm[b, hq, c] - mx) if used > 1 else np.float32(1.0)
            den += w * pl[b, hq, c]
            for d in range(D):
                out[b, hq, 0, d] += w * pacc[b, hq, c, d]
        for d in range(D):
            out[b, hq, 0, d] = out[b, hq, 0, d] / den


@njit(fastmath=_FM, cache=True, inline="always")
def _score(qg, g, kk, j, scale):  # pragma: no cover - numba
    """q·k·scale for query row g of ``qg`` and key row j of ``kk``, fp32."""
    a = np.float32(0.0)
    for d in range(qg.shape[1]):
        a += qg[g, d] * kk[j, d]
    return a * scale


@njit(fastmath=_FM, cache=True, inline="always")
def _group(qg, k, v, n, scale, out, b, h, s, acc, st):  # pragma: no cover - numba
    """Attention of the G query rows ``qg`` [G, D] (C-contiguous: kv head ``h``'s group of
    row ``b``) over keys 0 .. n-1 of k[b, h] and v[b, h], into out[b, h·G + g, 0, :]; zeros
    when n <= 0. Scores q·k·scale in fp32 into ``s`` [G, >= n] with their max per head (a
    NaN kept: the row's output becomes NaN), ``exp(s - max)`` vectorized (`exp_shifted`),
    P·V accumulated in ``acc`` [G, D] and divided by the sum; ``st`` [G] scratch. Where
    the cache rows are unit-stride and D a multiple of the vector width
    (`decode_attention_tile.fits`) the scores go W keys at a time (`qk_block`, the rest one
    by one) and P·V `HEADS` heads x 4 vector slices at a time (`pv_block`), accumulators in
    registers; else one loop per score and per key (the same arithmetic, another order:
    both agree with eager to fp32 rounding)."""
    G, D = qg.shape
    if n <= 0:
        for g in range(G):
            for d in range(D):
                out[b, h * G + g, 0, d] = 0.0
        return
    kk = k[b, h]
    vv = v[b, h]
    tiled = fits(kk, vv, D)
    nb = n - n % TILE_W if tiled else 0
    for g in range(G):
        m = np.float32(-np.inf)
        for j0 in range(0, nb, TILE_W):
            bm = qk_block(qg, g, kk, j0, scale, s)
            if bm > m or bm != bm:
                m = bm
        for j in range(nb, n):
            sc = _score(qg, g, kk, j, scale)
            s[g, j] = sc
            if sc > m or sc != sc:  # NaN: keep it (the row's output becomes NaN)
                m = sc
        st[g] = exp_shifted(s[g], n, m)    # the sum of exp(s - max)
    if tiled:
        for g0 in range(0, G, HEADS):
            for d0 in range(0, D, TILE_W * SLICES):
                pv_block(s, g0, vv, n, d0, acc)
    else:
        for g in range(G):
            for d in range(D):
                acc[g, d] = 0.0
        for j in range(n):
            for g in range(G):
                p = s[g, j]
                for d in range(D):
                    acc[g, d] += p * vv[j, d]
    for g in range(G):
        for d in range(D):
            out[b, h * G + g, 0, d] = acc[g, d] / st[g]


@njit(cache=True, inline="always")
def _prefetch_group(k, v, lengths, i, Hkv):  # pragma: no cover - numba
    """Start loading group i's live key and value rows (k[b, h, :lengths[b]], v likewise;
    b, h = divmod(i, Hkv)) into the caches, one `prefetch` per 64-byte line, so that the
    next group's rows stream in while this group computes: a decode step's caches are
    cold (the layer's GEMMs streamed the weights through since), and one group's rows are
    a few short runs the hardware prefetcher meets too late (measured: 153 against 47 µs
    a call at batch 8, length 40, cold against warm caches; 123 cold with this). Only the
    first `PREFETCH_ROWS` rows: a long run the hardware prefetcher follows by itself, and
    prefetching all of it evicts the running group's rows (length 2048: 383 against 250 µs
    at batch 1). No-op for i past the last."""
    if i >= k.shape[0] * Hkv:
        return
    b, h = i // Hkv, i % Hkv
    kk = k[b, h]
    vv = v[b, h]
    for j in range(min(lengths[b], k.shape[2], PREFETCH_ROWS)):
        for d in range(0, k.shape[3], 16):
            prefetch(kk, j, d)
            prefetch(vv, j, d)


@njit(cache=True, inline="always")
def _live_max(positions, lengths, S, T):  # pragma: no cover - numba
    """The largest length, or -1 when a position p has p < 0 or p + T > S or a length lies
    outside [0, S] (the range checks `decode_attention_update` makes in Python)."""
    mx = 0
    for b in range(positions.shape[0]):
        if positions[b] < 0 or positions[b] + T > S or lengths[b] < 0 or lengths[b] > S:
            return -1
        mx = max(mx, lengths[b])
    return mx


@njit(fastmath=_FM, cache=True, inline="always")
def _update_part(kb, vb, knb, vnb, positions, q, k, v, lengths, scale, out, w, parts,
                 n_max):  # pragma: no cover - numba
    """(b, kv head) groups w, w + parts, w + 2·parts, ... of the B·Hkv: each writes its new
    key and value rows into the caches (``kb``/``vb``: the caches' memory as int32,
    ``knb``/``vnb`` the new rows': `kv_cache_update_cpu`'s bit-exact scatter) at
    positions[b], then `_group` over the updated caches ``k``/``v`` (float32 views of the
    same memory) with its query rows copied into one contiguous scratch. Groups are
    interleaved so that every part gets every batch row's share (mixed lengths balance);
    scratch sized by ``n_max`` (the longest live length), allocated once per part."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[3]
    Hkv, T = k.shape[1], knb.shape[2]
    G = Hq // Hkv
    qg = np.empty((G, D), np.float32)
    s = np.empty((G, max(n_max, 1)), np.float32)
    acc = np.empty((G, D), np.float32)
    st = np.empty(G, np.float32)
    _prefetch_group(k, v, lengths, w, Hkv)
    for i in range(w, B * Hkv, parts):
        _prefetch_group(k, v, lengths, i + parts, Hkv)
        b, h = i // Hkv, i % Hkv
        p = positions[b]
        for t in range(T):
            for d in range(D):
                kb[b, h, p + t, d] = knb[b, h, t, d]
                vb[b, h, p + t, d] = vnb[b, h, t, d]
        for g in range(G):
            for d in range(D):
                qg[g, d] = q[b, h * G + g, 0, d]
        _group(qg, k, v, lengths[b], scale, out, b, h, s, acc, st)


@njit(fastmath=_FM, cache=True)
def _serial(q, k, v, lengths, scale, out):  # pragma: no cover - numba
    """The whole attention on the calling thread (no OpenMP team, no split-KV partials, no
    merge): `_group` for every (b, kv head), its query rows copied contiguous first."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[3]
    Hkv = k.shape[1]
    G = Hq // Hkv
    n_max = 1
    for b in range(B):
        n_max = max(n_max, lengths[b])
    qg = np.empty((G, D), np.float32)
    s = np.empty((G, n_max), np.float32)
    acc = np.empty((G, D), np.float32)
    st = np.empty(G, np.float32)
    for b in range(B):
        for h in range(Hkv):
            for g in range(G):
                for d in range(D):
                    qg[g, d] = q[b, h * G + g, 0, d]
            _group(qg, k, v, lengths[b], scale, out, b, h, s, acc, st)


def _np(t: torch.Tensor) -> np.ndarray:
    """``t``'s NumPy view (detached only when it needs it: detach costs a tensor)."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


@njit(parallel=True, fastmath=_FM, cache=True)
def _by_group_update(kb, vb, knb, vnb, positions, q, k, v, lengths, scale, out,
                     parts):  # pragma: no cover - numba
    """The scatter of the new key and value rows (``kb``/``vb``: the caches' memory as
    int32, ``knb``/``vnb`` the new rows') at ``positions``, then the attention over the
    updated caches ``k``/``v`` (float32 views of the same memory), the (b, kv head) groups
    dealt over ``parts`` workers (``prange``; one per launched thread, or 1 on the calling
    thread): each group whole (its rows written, then its attention: `_update_part`), no
    split of the keys, no partials, no merge. The same bits for any ``parts``. Returns 1,
    nothing written or read, when a position p has p < 0 or p + T > S_max or a length
    lies outside [0, S_max] (the range checks `decode_attention_update` makes in Python),
    else 0."""
    n_max = _live_max(positions, lengths, k.shape[2], knb.shape[2])
    if n_max < 0:
        return 1
    for w in prange(parts):
        _update_part(kb, vb, knb, vnb, positions, q, k, v, lengths, scale, out, w, parts, n_max)
    return 0


@njit(cache=True, fastmath=False)
def _rope_row(x, c, s, b, n, y, yb, yn, yi):  # pragma: no cover - numba
    """y[yb, yn, yi, :] = x[b, n, 0, :]·cos + rotate_half(x[b, n, 0, :])·sin (cos/sin [B or
    1, 1, 1, D]): `rotary_mul_cpu`'s arithmetic, compiled without fast-math (no fused
    multiply-add), so eager's bits. Not inlined, and ``fastmath=False`` said explicitly:
    numba hands a caller's fast-math flags to a callee that sets none (``contract`` would
    fuse the multiply-add)."""
    D = x.shape[3]
    cb = b if c.shape[0] > 1 else 0
    sb = b if s.shape[0] > 1 else 0
    h = D // 2
    for d in range(h):
        y[yb, yn, yi, d] = x[b, n, 0, d] * c[cb, 0, 0, d] + (-x[b, n, 0, d + h]) * s[sb, 0, 0, d]
    for d in range(h, D):
        y[yb, yn, yi, d] = x[b, n, 0, d] * c[cb, 0, 0, d] + x[b, n, 0, d - h] * s[sb, 0, 0, d]


@njit(fastmath=_FM, cache=True, inline="always")
def _rope_update_part(vb, vnb, positions, qraw, knew, c, s, k, v, lengths, scale, out, w, parts,
                      n_max):  # pragma: no cover - numba
    """`_update_part` for a rotary step: group (b, kv head h) rotates its new key into the
    key cache at positions[b] (`_rope_row`), writes the new value row's bits into the value
    cache, rotates its query heads into the contiguous scratch, then runs `_group`."""
    B, Hq, D = qraw.shape[0], qraw.shape[1], qraw.shape[3]
    Hkv = k.shape[1]
    G = Hq // Hkv
    q4 = np.empty((1, G, 1, D), np.float32)     # `_rope_row`'s 4-D target ...
    qg = q4.reshape((G, D))                     # ... and `_group`'s [G, D] view of it
    sc = np.empty((G, max(n_max, 1)), np.float32)
    acc = np.empty((G, D), np.float32)
    st = np.empty(G, np.float32)
    _prefetch_group(k, v, lengths, w, Hkv)
    for i in range(w, B * Hkv, parts):
        _prefetch_group(k, v, lengths, i + parts, Hkv)
        b, h = i // Hkv, i % Hkv
        p = positions[b]
        _rope_row(knew, c, s, b, h, k, b, h, p)
        for d in range(D):
            vb[b, h, p, d] = vnb[b, h, 0, d]
        for g in range(G):
            _rope_row(qraw, c, s, b, h * G + g, q4, 0, g, 0)
        _group(qg, k, v, lengths[b], scale, out, b, h, sc, acc, st)


@njit(parallel=True, fastmath=_FM, cache=True)
def _by_group_rope_update(vb, vnb, positions, qraw, knew, c, s, k, v, lengths, scale, out,
                          parts):  # pragma: no cover - numba
    """`_by_group_update` for a step whose query and new key are rotated first (RoPE,
    `_rope_update_part`): the (b, kv head) groups dealt over ``parts`` workers, each
    whole; 1 returned and nothing written for a position or length out of range, else 0."""
    n_max = _live_max(positions, lengths, k.shape[2], 1)
    if n_max < 0:
        return 1
    for w in prange(parts):
        _rope_update_part(vb, vnb, positions, qraw, knew, c, s, k, v, lengths, scale, out, w,
                          parts, n_max)
    return 0


def _rope4(desc: TensorDesc, B: int, D: int) -> Optional[tuple]:
    """The 4-D shape cos/sin of description ``desc`` are read as ([B or 1, 1, 1, D],
    leading 1s added), or None when they are not one row per sequence (or one for all)."""
    shape = tuple(int(x) for x in desc.shape)
    if len(shape) > 4:
        return None
    shape = (1,) * (4 - len(shape)) + shape
    if shape[0] not in (1, B) or shape[1:] != (1, 1, D):
        return None
    return shape


def _bound_plan(descs: tuple, rope: tuple) -> Optional[tuple]:
    """(kernel, cos/sin 4-D shapes or None, Hkv, D) of
    `bind_decode_attention_update` for the static descriptions ``descs`` (q, k, v, k_new,
    v_new, positions, lengths) and ``rope`` ((cos, sin) or ()); None where every call must
    take the general path."""
    q, k, v, k_new, v_new, positions, lengths = descs
    shapes = [tuple(d.shape) for d in descs]
    if not (all(d.is_static for d in descs + rope)
            and all(d.dtype.torch == torch.float32 for d in (q, k, v, k_new, v_new) + rope)
            and positions.dtype.torch == lengths.dtype.torch == torch.int64
            and len(shapes[0]) == 4 and len(shapes[1]) == 4):
        return None
    (B, Hq, one, D), (_, Hkv, _, _) = shapes[0], shapes[1]
    if not (one == 1 and Hkv and Hq % Hkv == 0 and B * Hq * D and shapes[2] == shapes[1]
            and shapes[3] == shapes[4] == (B, Hkv, 1, D) and shapes[5] == shapes[6] == (B,)
            and shapes[1][0] == B and shapes[1][3] == D):
        return None
    r4 = tuple(_rope4(x, B, D) for x in rope) or None
    if rope and (None in r4 or D % 2):
        return None
    return (_by_group_rope_update if rope else _by_group_update), r4, Hkv, D


#: arguments compiled for any layout (`numba_cache.general_entry`): the new rows and the
#: query, read one row at a time (views of a fused QKV output in a graph, contiguous in a
#: caller's tensors); the caches and the output keep their layouts
_UPDATE_ANY_LAYOUT = (2, 3, 5)          # `_by_group_update`: knb, vnb, q
_ROPE_UPDATE_ANY_LAYOUT = (1, 3, 4)     # `_by_group_rope_update`: vnb, qraw, knew


def bind_decode_attention_update(q: TensorDesc, k: TensorDesc, v: TensorDesc, k_new: TensorDesc,
                                 v_new: TensorDesc, positions: TensorDesc, lengths: TensorDesc,
                                 scale: Optional[float], cos: Optional[TensorDesc] = None,
                                 sin: Optional[TensorDesc] = None) -> Callable:
    """``run(q, k, v, k_new, v_new, positions, lengths, out=None)``: `decode_attention_update`
    for a compiled graph whose operands have the static descriptions given. Where those
    allow it (float32, int64 positions and lengths, one new row per sequence; any strides),
    the shape and dtype checks are made once, here, and a call checks the positions and
    lengths inside the kernel: the Python around the numba call is what a decode step's
    attention costs at batch 1, so the operands' NumPy views are memoized (`NumpyViews`:
    the graph hands the same arena buffers and cache views at every call; ~21 against
    ~28 µs a call at B=1, 100 live positions, warm, median of 400 interleaved). Every call runs whole (b, kv head) groups
    (`_by_group_update`) on as many threads as `numba_cache.launch_threads` gives for the
    K/V elements its live lengths read (2·B·Hkv·max(lengths)·D), except a long call
    (above `SERIAL_MAX`) with fewer than two groups per thread, and a call whose positions
    or lengths are out of range (its one-line error): those go through
    `decode_attention_update`. Same results, bit for bit, on any path and thread count.

    With ``cos`` and ``sin`` (a RoPE step, ``fuse_decode_rope``): ``run(q, k, v, k_new,
    v_new, positions, lengths, cos, sin, out=None)`` rotates the query and the new key
    first (`apply_rotary_pos_emb`'s bits) inside the same kernel: the fast paths need
    cos/sin of one row per sequence ([B or 1, 1, 1, D] after leading 1s)."""
    rope = cos is not None

    def general(qt, kt, vt, knt, vnt, pos, lens, *cs, out=None):
        if cs:
            qt, knt = apply_rotary_pos_emb(qt, knt, cs[0], cs[1])
        return decode_attention_update(qt, kt, vt, knt, vnt, pos, lens, scale, out=out)
    plan = _bound_plan((q, k, v, k_new, v_new, positions, lengths), (cos, sin) if rope else ())
    if plan is None:
        return general
    kernel, r4, Hkv, D = plan
    any_layout, B = _ROPE_UPDATE_ANY_LAYOUT if rope else _UPDATE_ANY_LAYOUT, int(q.shape[0])
    sc = np.float32(float(D) ** -0.5 if scale is None else float(scale))
    per_len = 2 * B * Hkv * D           # K and V elements read per live position
    vw = NumpyViews()
    last: list = [None]  # the last call's (tensors, pointers, entry, args), replaced whole

    def run(qt, kt, vt, knt, vnt, pos, lens, *cs, out=None):
        if out is None or not out.is_contiguous() or out.dtype is not torch.float32:
            return general(qt, kt, vt, knt, vnt, pos, lens, *cs, out=out)  # any strides; out check
        work = per_len * max(lens.tolist())
        if not _by_group_fits(B * Hkv, work):            # few groups: split the keys
            return general(qt, kt, vt, knt, vnt, pos, lens, *cs, out=out)
        ts = (qt, kt, vt, knt, vnt, pos, lens, out) + cs
        ptrs = tuple(t.data_ptr() for t in ts)
        parts = launch_threads(work) if work >= GRAIN else 1
        m = last[0]       # read once: another thread may replace it (never mutated)
        if m is not None and ptrs == m[1] and all(map(operator.is_, ts, m[0])):
            fn, args = m[2], m[3]     # the same tensors as the last call: its views
        else:
            args = _views(vw, rope, r4, sc, ts)
            fn = general_entry(kernel, args + (parts,), any_layout)
            last[0] = (ts, ptrs, fn, args)
        with _threads(parts):
            bad = fn(*args, parts)
        if bad:   # raises its one-line error
            return general(qt, kt, vt, knt, vnt, pos, lens, *cs, out=out)
        return out, kt, vt
    return run


def _views(vw: NumpyViews, rope: bool, r4, sc, ts: tuple) -> tuple:
    """The bound kernel's arguments (all but ``parts``) for tensors ``ts`` (q, k, v,
    k_new, v_new, positions, lengths, out, then cos and sin when ``rope``), through the
    memo ``vw``; cos/sin read as their 4-D shapes ``r4``."""
    qt, kt, vt, knt, vnt, pos, lens, out = ts[:8]
    if rope:
        c, s = (vw.shaped(x, r) for x, r in zip(ts[8:], r4))
        c = _np(ts[8]).reshape(r4[0]) if c is None else c     # not contiguous: a copy
        s = _np(ts[9]).reshape(r4[1]) if s is None else s
        return (vw.bits(vt), vw.bits(vnt), vw.array(pos), vw.array(qt), vw.array(knt),
                c, s, vw.array(kt), vw.array(vt), vw.array(lens), sc, vw.array(out))
    return (vw.bits(kt), vw.bits(vt), vw.bits(knt), vw.bits(vnt), vw.array(pos),
            vw.array(qt), vw.array(kt), vw.array(vt), vw.array(lens), sc, vw.array(out))


_GUARD: list = []


def _threads(n: int):
    """`numba_cache.launch` for a thread count already chosen (`launch_threads`): numba's
    count for the calling thread set to ``n`` (capped at its pool), and `launch_guard`'s
    context, asked once (the threading layer does not change once started): the decode
    step's Python, ~2 µs less than `launch` at batch 1."""
    n = min(n, numba.config.NUMBA_NUM_THREADS)
    if numba.get_num_threads() != n:
        numba.set_num_threads(n)
    if not _GUARD:
        _GUARD.append(launch_guard())
    return _GUARD[0]


def _by_group_fits(groups: int, work: int) -> bool:
    """Whether a call with ``groups`` (B·Hkv) groups reading ``work`` K/V elements runs
    whole groups (`_by_group_update`): up to `SERIAL_MAX` elements (one thread is enough),
    or with at least two groups per thread (`torch_threads`); else the keys are split
    (FlashDecoding, `decode_attention`)."""
    return work <= SERIAL_MAX or groups >= 2 * torch_threads()


def split_chunk(max_len: int, items: int, threads: Optional[int] = None) -> int:
    """Keys per split-KV chunk: enough chunks that ``items`` (B·Hkv) × chunks fill every
    thread (``threads``, default numba's count; the kernel uses torch's) twice over, each chunk at least `MIN_CHUNK` keys (and one chunk when
    ``max_len`` is short)."""
    threads = threads or numba.get_num_threads()
    want = max(1, math.ceil(2 * threads / max(items, 1)))
    return max(MIN_CHUNK, math.ceil(max(max_len, 1) / want))


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor):
    """(B, Hq, D, Hkv, S_max, lengths as a list) of a valid `decode_attention` call; raises
    its ValueErrors (one line each) otherwise."""
    if q.dim() != 4 or q.shape[2] != 1 or k.dim() != 4 or v.shape != k.shape:
        raise ValueError(f"decode_attention: expected q [B, Hq, 1, D] and k, v [B, Hkv, S_max, D] "
                         f"(BNSD), got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    B, Hq, _, D = q.shape
    Bk, Hkv, S, Dk = k.shape
    if Bk != B or Dk != D or Hq % Hkv:
        raise ValueError(f"decode_attention: k/v {tuple(k.shape)} do not fit q {tuple(q.shape)}: "
                         f"batch and head dim must match and Hq ({Hq}) be a multiple of Hkv ({Hkv})")
    if not (q.dtype == k.dtype == v.dtype == torch.float32):
        raise ValueError(f"decode_attention: q, k, v must be float32, got {q.dtype}, {k.dtype}, "
                         f"{v.dtype}; cast the cache or use scaled_dot_product_attention")
    if lengths.shape != (B,) or lengths.dtype.is_floating_point or lengths.dtype == torch.bool:
        raise ValueError(f"decode_attention: lengths must be an integer tensor [{B}], got "
                         f"{tuple(lengths.shape)} {lengths.dtype}")
    ll = lengths.tolist()     # the bounds read from a list: NumPy's min/max cost more at B = 1
    if B and (min(ll) < 0 or max(ll) > S):
        raise ValueError(f"decode_attention: lengths must lie in [0, S_max={S}], got "
                         f"{ll}; the KV cache is too short for this position")
    return B, Hq, D, Hkv, S, ll


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lengths: torch.Tensor,
                     scale: Optional[float] = None, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Attention of one query per sequence over its first ``lengths[b]`` cached keys
    (module docstring: layouts, GQA, NaN/Inf). ``q`` [B, Hq, 1, D], ``k``/``v``
    [B, Hkv, S_max, D], all float32; ``lengths`` [B] integers in [0, S_max]; ``scale``
    None = D ** -0.5; result [B, Hq, 1, D] float32 (into ``out`` when given, contiguous).
    Raises ValueError naming the bad argument (shapes, dtypes, Hq not a multiple of Hkv,
    a length outside [0, S_max], an ``out`` that is not float32 [B, Hq, 1, D]).

    Up to `SERIAL_MAX` K and V elements read (a 125M Llama's decode step up to ~256 cached
    tokens) the call is one serial kernel on the calling thread (`_serial`): no OpenMP
    team woken right after a GEMM's, no split-KV partials or merge launch. Measured at
    B=1, Hq/Hkv 12/4, D=64 (least of 300 interleaved calls, 2-core Xeon, load ~6): 19.7
    against 29.5 µs at 64 keys, 43 against 57 µs at 256, 149 against 180 µs at 1024."""
    B, Hq, D, Hkv, S, ll = _check(q, k, v, lengths)
    check_out("decode_attention", out, (B, Hq, 1, D))
    lens = lengths.numpy() if lengths.dtype == torch.int64 and lengths.is_contiguous() \
        and not lengths.requires_grad else np.asarray(ll, dtype=np.int64)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    max_len = max(ll) if B else 0
    res = out if out is not None and out.is_contiguous() else torch.empty(B, Hq, 1, D,
                                                                          dtype=torch.float32)
    if B * Hq * D and 2 * B * Hkv * max_len * D <= SERIAL_MAX:
        _serial(_np(q), _np(k), _np(v), lens, np.float32(scale), res.numpy())
        return out.copy_(res) if out is not None and res is not out else res
    chunk = split_chunk(max_len, B * Hkv, torch_threads())   # by torch's count: values never
    # depend on how many threads a launch gets (numba_cache.launch_threads)
    nc = max(1, math.ceil(max_len / chunk))  # chunks past every row's length are not made
    pm = np.empty((B, Hq, nc), np.float32)
    pl = np.empty((B, Hq, nc), np.float32)
    pacc = np.empty((B, Hq, nc, D), np.float32)
    if B * Hq * D:
        with launch(2 * B * Hkv * max_len * D):      # K and V read
            _partials(q.detach().numpy(), k.detach().numpy(), v.detach().numpy(), lens,
                      np.float32(scale), chunk, pm, pl, pacc)
        with launch(B * Hq * nc * D):
            _merge(lens, chunk, pm, pl, pacc, res.numpy())
    if out is not None and res is not out:
        return out.copy_(res)
    return res


__all__ = ["MIN_CHUNK", "SERIAL_MAX", "bind_decode_attention_update", "decode_attention",
           "decode_attention_update", "split_chunk"]


def decode_attention_update(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            k_new: torch.Tensor, v_new: torch.Tensor, positions: torch.Tensor,
                            lengths: torch.Tensor, scale: Optional[float] = None,
                            out: Optional[torch.Tensor] = None):
    """``kv_cache_update(k, k_new, positions)``, ``kv_cache_update(v, v_new, positions)``,
    then ``decode_attention(q, k, v, lengths, scale, out)``; returns (attention output
    [B, Hq, 1, D], k, v) — the caches written in place and handed back. ``k_new``/``v_new``
    [B, Hkv, 1, D] float32, ``positions`` [B] int64. Where whole (b, kv head) groups fit
    (`_by_group_fits`) the three are one numba call (`_by_group_update`), else the three
    ops (the attention split-KV). Raises the ValueErrors of the three (one line each); on
    a bad position nothing is written."""
    check_update(k, k_new, positions)    # the cache writes' errors first, as the unfused ops
    check_update(v, v_new, positions)
    check_out("decode_attention_update", out,
              (q.shape[0], q.shape[1], 1, q.shape[-1]) if q.dim() == 4 else None)
    pl = positions.tolist()
    if pl and (min(pl) < 0 or max(pl) + k_new.shape[2] > k.shape[2]):
        kv_cache_update(k, k_new, positions)      # raises its one-line error, writes nothing
    B, Hq, D, Hkv, S, ll = _check(q, k, v, lengths)
    work = 2 * B * Hkv * (max(ll) if B else 0) * D
    if not (k_new.shape == v_new.shape == (B, Hkv, 1, D)
            and k_new.dtype == v_new.dtype == torch.float32 and B * Hq * D
            and positions.dtype == torch.int64 and _by_group_fits(B * Hkv, work)):
        kv_cache_update(k, k_new, positions)     # its checks and errors, then the general path
        kv_cache_update(v, v_new, positions)
        return decode_attention(q, k, v, lengths, scale, out), k, v
    res = out if out is not None and out.is_contiguous() else torch.empty(B, Hq, 1, D,
                                                                          dtype=torch.float32)
    lens = lengths.numpy() if lengths.dtype == torch.int64 and not lengths.requires_grad \
        else np.asarray(ll, dtype=np.int64)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    parts = launch_threads(work) if work >= GRAIN else 1
    with _threads(parts):
        args = (_array(k), _array(v), _array(k_new), _array(v_new), _np(positions), _np(q),
                _np(k), _np(v), lens, np.float32(scale), res.numpy(), parts)
        general_entry(_by_group_update, args, _UPDATE_ANY_LAYOUT)(*args)
    return (out.copy_(res) if out is not None and res is not out else res), k, v
