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
the calling thread instead (`_serial`: the same arithmetic as one chunk and its merge);
`decode_attention_update` also writes the step's new key and value rows into the caches
first, in the same numba call (the ``DecodeAttentionKvUpdate`` op).

Numerics: scores, softmax statistics and the output accumulate in fp32 (fastmath
``reassoc``/``contract`` only, so NaN/Inf propagate): a NaN or +Inf score in a live
position makes the row's output NaN, as eager softmax does; a row with length 0 gives
zeros (as SDPA with an all-False boolean mask row). Agrees with eager
``F.scaled_dot_product_attention`` to fp32 rounding (other summation order).
"""
from __future__ import annotations

import math
from typing import Callable, Optional

import numba
import numpy as np
import torch
from numba import prange

from ...ir import TensorDesc
from .kv_cache_update_cpu import _array, _scatter, check_update, kv_cache_update
from .rotary_mul_cpu import apply_rotary_pos_emb
from .numba_cache import launch, njit, torch_threads

_FM = {"reassoc", "contract"}
MIN_CHUNK = 64  # keys per split-KV chunk at least (smaller chunks cost more merging than they save)
#: K and V elements read (2·B·Hkv·max_len·D) up to which one call runs `_serial` on the
#: calling thread: no OpenMP team, no partials to merge (measured, see `decode_attention`)
SERIAL_MAX = 1 << 17


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
            tot = np.float32(0.0)
            for j in range(stop - start):
                p = np.exp(s[g, j] - m)
                s[g, j] = p
                tot += p
            pm[b, hq, c] = m
            pl[b, hq, c] = tot
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
def _group(q, k, v, lengths, scale, out, b, h, s, acc, tots):  # pragma: no cover - numba
    """Every query head of kv head ``h``'s group of row ``b`` over keys 0 .. lengths[b]-1:
    softmax by its max, P·V into ``out`` divided by the sum (``s`` [G, S_max], ``acc``
    [G, D], ``tots`` [G]: scratch). The same arithmetic as one chunk of `_partials`
    followed by `_merge` (bit for bit)."""
    Hq, D = q.shape[1], q.shape[3]
    G = Hq // k.shape[1]
    n = lengths[b]
    if n <= 0:
        for g in range(G):
            for d in range(D):
                out[b, h * G + g, 0, d] = 0.0
        return
    for g in range(G):
        hq = h * G + g
        m = np.float32(-np.inf)
        for j in range(n):
            a = np.float32(0.0)
            for d in range(D):
                a += q[b, hq, 0, d] * k[b, h, j, d]
            sc = a * scale
            s[g, j] = sc
            if sc > m:
                m = sc
            elif sc != sc:
                m = sc
        tot = np.float32(0.0)
        for j in range(n):
            p = np.exp(s[g, j] - m)
            s[g, j] = p
            tot += p
        tots[g] = tot
        for d in range(D):
            acc[g, d] = 0.0
    for j in range(n):
        for g in range(G):
            p = s[g, j]
            for d in range(D):
                acc[g, d] += p * v[b, h, j, d]
    for g in range(G):
        for d in range(D):
            out[b, h * G + g, 0, d] = acc[g, d] / tots[g]


@njit(fastmath=_FM, cache=True)
def _serial(q, k, v, lengths, scale, out):  # pragma: no cover - numba
    """The whole attention on the calling thread (no OpenMP team, no scratch arrays, no
    merge): `_group` for every (b, kv head)."""
    B, Hq, D = q.shape[0], q.shape[1], q.shape[3]
    Hkv = k.shape[1]
    G = Hq // Hkv
    s = np.empty((G, k.shape[2]), np.float32)
    acc = np.empty((G, D), np.float32)
    tots = np.empty(G, np.float32)
    for b in range(B):
        for h in range(Hkv):
            _group(q, k, v, lengths, scale, out, b, h, s, acc, tots)


@njit(parallel=True, fastmath=_FM, cache=True)
def _by_group_update(kb, vb, knb, vnb, positions, q, k, v, lengths, scale,
                     out):  # pragma: no cover - numba
    """`_serial_update_checked` with the (b, kv head) groups spread over the threads
    (``prange``): each writes its own new key and value rows, then runs `_group` on them;
    no split of the keys, no partials, no merge launch, as long as there are enough
    groups to fill the threads (`decode_attention_update`). Returns 1 (nothing written)
    for a position or length out of range, else 0."""
    S, T = kb.shape[2], knb.shape[2]
    B, Hkv, D = positions.shape[0], kb.shape[1], knb.shape[3]
    for b in range(B):
        if positions[b] < 0 or positions[b] + T > S or lengths[b] < 0 or lengths[b] > S:
            return 1
    G = q.shape[1] // Hkv
    for i in prange(B * Hkv):
        b, h = i // Hkv, i % Hkv
        p = positions[b]
        for t in range(T):
            for d in range(D):
                kb[b, h, p + t, d] = knb[b, h, t, d]
                vb[b, h, p + t, d] = vnb[b, h, t, d]
        s = np.empty((G, S), np.float32)
        acc = np.empty((G, D), np.float32)
        tots = np.empty(G, np.float32)
        _group(q, k, v, lengths, scale, out, b, h, s, acc, tots)
    return 0


def _np(t: torch.Tensor) -> np.ndarray:
    """``t``'s NumPy view (detached only when it needs it: detach costs a tensor)."""
    return t.detach().numpy() if t.requires_grad else t.numpy()


@njit(cache=True)
def _serial_update(kb, vb, knb, vnb, positions, q, k, v, lengths, scale, out):  # pragma: no cover
    """`kv_cache_update_cpu`'s bit-exact scatter of the new keys and values (``kb``/``vb``:
    the caches' memory as int32, ``knb``/``vnb`` the new rows') at ``positions``, then
    `_serial` on the updated caches ``k``/``v`` (float32 views of the same memory)."""
    _scatter(kb, knb, positions)
    _scatter(vb, vnb, positions)
    _serial(q, k, v, lengths, scale, out)


@njit(cache=True)
def _serial_update_checked(kb, vb, knb, vnb, positions, q, k, v, lengths, scale,
                           out):  # pragma: no cover - numba
    """`_serial_update` when every position p has p + T <= S_max and every length lies in
    [0, S_max] (returns 0), else nothing written or read (returns 1): the range checks
    `decode_attention_update` makes in Python, in the kernel."""
    S, T = kb.shape[2], knb.shape[2]
    for b in range(positions.shape[0]):
        if positions[b] < 0 or positions[b] + T > S or lengths[b] < 0 or lengths[b] > S:
            return 1
    _serial_update(kb, vb, knb, vnb, positions, q, k, v, lengths, scale, out)
    return 0


@njit(cache=True)
def _rope_row(x, c, s, b, n, y, yb, yn, yi):  # pragma: no cover - numba
    """y[yb, yn, yi, :] = x[b, n, 0, :]·cos + rotate_half(x[b, n, 0, :])·sin (cos/sin [B or
    1, 1, 1, D]): `rotary_mul_cpu`'s arithmetic, compiled without fast-math (no fused
    multiply-add), so eager's bits. Not inlined: the callers' fast-math flags must not
    reach it."""
    D = x.shape[3]
    cb = b if c.shape[0] > 1 else 0
    sb = b if s.shape[0] > 1 else 0
    h = D // 2
    for d in range(h):
        y[yb, yn, yi, d] = x[b, n, 0, d] * c[cb, 0, 0, d] + (-x[b, n, 0, d + h]) * s[sb, 0, 0, d]
    for d in range(h, D):
        y[yb, yn, yi, d] = x[b, n, 0, d] * c[cb, 0, 0, d] + x[b, n, 0, d - h] * s[sb, 0, 0, d]


@njit(cache=True)
def _rope_group(qraw, knew, vnb, vb, c, s, positions, k, qr, b, h):  # pragma: no cover - numba
    """Group (b, kv head h) of a rotary decode step: the new key rotated into the key
    cache at positions[b], the new value row's bits into the value cache, and the group's
    query heads rotated into ``qr``."""
    G = qraw.shape[1] // k.shape[1]
    p = positions[b]
    _rope_row(knew, c, s, b, h, k, b, h, p)
    for d in range(vnb.shape[3]):
        vb[b, h, p, d] = vnb[b, h, 0, d]
    for g in range(G):
        _rope_row(qraw, c, s, b, h * G + g, qr, b, h * G + g, 0)


@njit(cache=True)
def _serial_rope_update_checked(vb, vnb, positions, qraw, knew, c, s, k, v, lengths, scale,
                                out):  # pragma: no cover - numba
    """`_serial_update_checked` for a step whose query and new key are rotated first
    (RoPE, `_rope_group`): nothing written and 1 returned for a position or length out of
    range, else 0."""
    S = k.shape[2]
    B, Hkv = positions.shape[0], k.shape[1]
    for b in range(B):
        if positions[b] < 0 or positions[b] + 1 > S or lengths[b] < 0 or lengths[b] > S:
            return 1
    qr = np.empty(qraw.shape, np.float32)
    for b in range(B):
        for h in range(Hkv):
            _rope_group(qraw, knew, vnb, vb, c, s, positions, k, qr, b, h)
    _serial(qr, k, v, lengths, scale, out)
    return 0


@njit(parallel=True, fastmath=_FM, cache=True)
def _by_group_rope_update(vb, vnb, positions, qraw, knew, c, s, k, v, lengths, scale,
                          out):  # pragma: no cover - numba
    """`_by_group_update` for a rotary step (`_serial_rope_update_checked`'s work, the
    (b, kv head) groups spread over the threads, each whole)."""
    S = k.shape[2]
    B, Hkv, D = positions.shape[0], k.shape[1], k.shape[3]
    for b in range(B):
        if positions[b] < 0 or positions[b] + 1 > S or lengths[b] < 0 or lengths[b] > S:
            return 1
    G = qraw.shape[1] // Hkv
    qr = np.empty(qraw.shape, np.float32)
    for i in prange(B * Hkv):
        b, h = i // Hkv, i % Hkv
        _rope_group(qraw, knew, vnb, vb, c, s, positions, k, qr, b, h)
        sc = np.empty((G, S), np.float32)
        acc = np.empty((G, D), np.float32)
        tots = np.empty(G, np.float32)
        _group(qr, k, v, lengths, scale, out, b, h, sc, acc, tots)
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
    """(kernel, launch work (0: serial), cos/sin 4-D shapes or None, D) of
    `bind_decode_attention_update` for the static descriptions ``descs`` (q, k, v, k_new,
    v_new, positions, lengths) and ``rope`` ((cos, sin) or ()); None where a call must
    take the general path."""
    q, k, v, k_new, v_new, positions, lengths = descs
    shapes = [tuple(d.shape) for d in descs]
    if not (all(d.is_static for d in descs + rope)
            and all(d.dtype.torch == torch.float32 for d in (q, k, v, k_new, v_new) + rope)
            and positions.dtype.torch == lengths.dtype.torch == torch.int64
            and len(shapes[0]) == 4 and len(shapes[1]) == 4):
        return None
    (B, Hq, one, D), (_, Hkv, S, _) = shapes[0], shapes[1]
    if not (one == 1 and Hkv and Hq % Hkv == 0 and B * Hq * D and shapes[2] == shapes[1]
            and shapes[3] == shapes[4] == (B, Hkv, 1, D) and shapes[5] == shapes[6] == (B,)
            and shapes[1][0] == B and shapes[1][3] == D):
        return None
    r4 = tuple(_rope4(x, B, D) for x in rope) or None
    if rope and (None in r4 or D % 2):
        return None
    if 2 * B * Hkv * S * D <= SERIAL_MAX:
        return (_serial_rope_update_checked if rope else _serial_update_checked), 0, r4, D
    if B * Hkv >= 2 * torch_threads():
        return (_by_group_rope_update if rope else _by_group_update), 2 * B * Hkv * S * D, r4, D
    return None    # few groups: split the keys (FlashDecoding), `decode_attention`


def bind_decode_attention_update(q: TensorDesc, k: TensorDesc, v: TensorDesc, k_new: TensorDesc,
                                 v_new: TensorDesc, positions: TensorDesc, lengths: TensorDesc,
                                 scale: Optional[float], cos: Optional[TensorDesc] = None,
                                 sin: Optional[TensorDesc] = None) -> Callable:
    """``run(q, k, v, k_new, v_new, positions, lengths, out=None)``: `decode_attention_update`
    for a compiled graph whose operands have the static descriptions given. Where those
    allow it (float32, int64 positions and lengths, one new row per sequence), the shape
    and dtype checks are made once, here, and a call checks the positions and lengths
    inside the kernel: the Python around the numba call is what a decode step's
    attention costs (a 125M Llama's: 20 µs a call standalone, 6 in numba). Up to
    `SERIAL_MAX` K/V elements at S_max every call is serial (`_serial_update_checked`);
    above, with at least two (b, kv head) groups per thread (a batch of decodes), the
    groups run in parallel, each whole (`_by_group_update`: one launch, no key split and
    merge). Any other call, and one whose positions or lengths are out of range (its
    one-line error), goes through `decode_attention_update`. Same results, bit for bit.

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
    kernel, work, r4, D = plan
    sc = np.float32(float(D) ** -0.5 if scale is None else float(scale))

    def run(qt, kt, vt, knt, vnt, pos, lens, *cs, out=None):
        if out is None or not (out.is_contiguous() and knt.is_contiguous() and vnt.is_contiguous()
                               and pos.is_contiguous() and lens.is_contiguous()):
            return general(qt, kt, vt, knt, vnt, pos, lens, *cs, out=out)
        if rope:
            args = (_array(vt), _array(vnt), _np(pos), _np(qt), _np(knt),
                    _np(cs[0]).reshape(r4[0]), _np(cs[1]).reshape(r4[1]), _np(kt), _np(vt),
                    _np(lens), sc, out.numpy())
        else:
            args = (_array(kt), _array(vt), _array(knt), _array(vnt), _np(pos), _np(qt),
                    _np(kt), _np(vt), _np(lens), sc, out.numpy())
        if work:
            with launch(work):
                bad = kernel(*args)
        else:
            bad = kernel(*args)
        if bad:   # raises its one-line error
            return general(qt, kt, vt, knt, vnt, pos, lens, *cs, out=out)
        return out, kt, vt
    return run


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
    a length outside [0, S_max]).

    Up to `SERIAL_MAX` K and V elements read (a 125M Llama's decode step up to ~256 cached
    tokens) the call is one serial kernel on the calling thread (`_serial`): no OpenMP
    team woken right after a GEMM's, no split-KV partials or merge launch. Measured at
    B=1, Hq/Hkv 12/4, D=64 (least of 300 interleaved calls, 2-core Xeon, load ~6): 19.7
    against 29.5 µs at 64 keys, 43 against 57 µs at 256, 149 against 180 µs at 1024."""
    B, Hq, D, Hkv, S, ll = _check(q, k, v, lengths)
    lens = lengths.numpy() if lengths.dtype == torch.int64 and lengths.is_contiguous() \
        and not lengths.requires_grad else np.asarray(ll, dtype=np.int64)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    max_len = max(ll) if B else 0
    res = out if out is not None and out.is_contiguous() else torch.empty(B, Hq, 1, D)
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
    [B, Hkv, 1, D] float32, ``positions`` [B] integers. Where `decode_attention` would run
    `_serial` the three are one numba call (`_serial_update`). Raises the ValueErrors of
    the three (one line each); on a bad position nothing is written."""
    check_update(k, k_new, positions)    # the cache writes' errors first, as the unfused ops
    check_update(v, v_new, positions)
    pl = positions.tolist()
    if pl and (min(pl) < 0 or max(pl) + k_new.shape[2] > k.shape[2]):
        kv_cache_update(k, k_new, positions)      # raises its one-line error, writes nothing
    B, Hq, D, Hkv, S, ll = _check(q, k, v, lengths)
    max_len = max(ll) if B else 0
    if not (k_new.shape == v_new.shape == (B, Hkv, 1, D)
            and k_new.dtype == v_new.dtype == torch.float32 and B * Hq * D
            and positions.dtype == torch.int64 and positions.is_contiguous()
            and k_new.is_contiguous() and v_new.is_contiguous()
            and 2 * B * Hkv * max_len * D <= SERIAL_MAX):
        kv_cache_update(k, k_new, positions)     # its checks and errors, then the general path
        kv_cache_update(v, v_new, positions)
        return decode_attention(q, k, v, lengths, scale, out), k, v
    res = out if out is not None and out.is_contiguous() else torch.empty(B, Hq, 1, D)
    lens = lengths.numpy() if lengths.dtype == torch.int64 and lengths.is_contiguous() \
        and not lengths.requires_grad else np.asarray(ll, dtype=np.int64)
    scale = float(D) ** -0.5 if scale is None else float(scale)
    _serial_update(_array(k), _array(v), _array(k_new), _array(v_new), positions.numpy(),
                   _np(q), _np(k), _np(v), lens, np.float32(scale), res.numpy())
    return (out.copy_(res) if out is not None and res is not out else res), k, v
