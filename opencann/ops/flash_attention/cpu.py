"""FlashAttention-2 forward and backward on CPU, compiled with numba.

Algorithm: FlashAttention-2 (Dao 2023, arXiv:2307.08691, Algorithms 1 and 2). The
forward walks key/value tiles with an online softmax (running max ``m`` and sum
``l``) and keeps only the output and the row log-sum-exp ``lse``: extra memory is
O(S) per query block, never O(S^2). The backward recomputes the scores tile by tile:
``P = exp(S - lse)``, ``dV += P^T dO``, ``dP = dO V^T``, ``dS = P * (dP - D)``,
``dK += scale dS^T Q``, ``dQ += scale dS K`` with ``D = rowsum(dO * O)``. It runs two
race-free passes: dK/dV parallel over key blocks, dQ parallel over query blocks.

Why numba: the tile loops, the online softmax and the masking are our subject and
must be compiled; numba compiles them from Python, runs ``prange`` over
batch x heads x blocks on all cores, and caches the machine code (``cache=True``).

Matrix products on tiles go to a BLAS ``sgemm`` called from inside the compiled loops.
Measured on the 2-core AVX-512 build machine (S=4096, d=64, the two GEMMs of the
forward, 8 heads): MKL's sgemm (the one torch itself links, exported by
libtorch_cpu) ~290 GFLOP/s; numba's ``np.dot`` (scipy's OpenBLAS) 40-170 GFLOP/s
(slow on the small-N ``P @ V`` shape and it cannot accumulate in place). So we bind
the symbol ``opencann_fa_sgemm`` at run time to MKL's ``sgemm_`` when torch exports
it, else to scipy's OpenBLAS ``sgemm`` (both have the Fortran BLAS ABI);
``OPENCANN_FA_BLAS=openblas`` forces the latter. Binding by symbol name keeps the
compiled kernels cacheable.

The forward works in base 2: the ``Q K^T`` GEMM is scaled by ``scale * log2(e)``, so the
softmax needs ``2^x`` only - no multiply per element - and ``lse = ln2 * (m + log2 l)``.
With a float mask the scores stay in natural units (``mask * log2(e)`` overflows for
``finfo(float32).min``) and ``log2(e)`` multiplies ``score - max`` in the exponential.
NaN/Inf follow torch's CPU SDPA: a NaN or +inf score makes its row NaN (the row max
drops NaN, the sum keeps it; +inf - +inf is NaN); a row that sees no key is 0. A NaN or
inf in v reaches the rows that see its key only: a masked tile whose v rows are not all
finite (`_v_finite`: one pass over the tile's v rows, ~1/B_r of its GEMMs' work) takes
P V row by row over the seen keys (`_pv_seen`).

``2^x`` is ``2^round(x)`` built in the exponent bits times a degree-6 polynomial for
``2^r``, |r| <= 1/2 (Cephes ``exp2f`` coefficients, relative error < 2e-7), in one
branch-free loop that also writes P and sums the row;
LLVM vectorizes it (8 floats per AVX2 register: ~0.25 ns per element on one core here,
against ~1.1 ns for the earlier two-loop base-e version). numba has no vector ``exp``
without Intel SVML, hence the polynomial. The backward keeps the base-e ``_exp_sub``.
Lazy rescaling: once a row has a running max, later tiles are exponentiated against it
without a max pass or an O rescale while the row sum stays <= 2^20 (see ``fwd_kernel``).
Loops are compiled with the fast-math flags ``reassoc, contract`` only (vectorized
reductions, FMA); no ``nnan``/``ninf``, because masks rely on ``-inf``.

All inputs are float32 here (the API converts fp16/bf16 at the boundary; numba has no
bf16); accumulation is float32.

The tile GEMMs run on a sequential BLAS: each parallel task sets MKL's thread-local
count to 1 on entry (``MKL_Set_Num_Threads_Local``, bound by name as the GEMM is, to a
no-op under OpenBLAS) and restores it on exit. Without it MKL started a team of torch's
intra-op threads for each tile GEMM from inside numba's OpenMP region or from the
calling thread, whose spin-waits then took the CPUs the tasks needed: causal S = 512,
12/4 heads, D = 64, 2 threads, on the shared 2-core Xeon (load average 2-3), least of
15 calls: 7.3-7.8 ms with numba's team of 2 and 6.3-19 ms (medians up to 490 ms) when
the launch ran on the calling thread alone (`numba_cache.launch` under load), against
2.1-2.5 ms and 4.3-5.3 ms with the sequential BLAS; a 512-token Llama-125M prefill
spent 187 of its 430 ms there (12 layers).

Threads: the kernels keep no state between calls and may run from several threads at
once under numba's OpenMP or TBB threading layers; under its ``workqueue`` layer (the
fallback when neither loads), which aborts the process on concurrent parallel launches,
launches are serialized (`_launch_guard`).
"""
from __future__ import annotations

import ctypes
import math
import os

import numba
import numpy as np
import llvmlite.binding as llvm
from llvmlite import ir
from numba import prange, types
from numba.core import cgutils
from numba.extending import intrinsic

from ..kernels.numba_cache import general_entry, launch, launch_guard, njit
from ..kernels.numba_exp import exp2_clamped

_FM = {"reassoc", "contract"}
_LOG2E = 1.4426950408889634
_LN2 = 0.6931471805599453
#: arguments compiled for any layout (`numba_cache.general_entry`: one machine code whether
#: the caller's mask and out are contiguous or views): fwd_kernel's mask and out, the
#: backward kernels' mask; q, k and v keep their layouts (strided: ~8% slower forward)
_FWD_ANY_LAYOUT, _BWD_ANY_LAYOUT = (3, 15), (6,)
_LAZY_SUM_MAX = np.float32(2.0 ** 20)  # forward: lazy rescaling bound, see fwd_kernel
_SYMBOL = "opencann_fa_sgemm"
_THREADS_SYMBOL = "opencann_fa_blas_threads"
BLAS_NAME = None  # which library the symbol was bound to: "mkl (torch)" or "openblas (scipy)"


def _mkl_address(name):
    """The address of ``name`` in the MKL torch links (libtorch_cpu), or None."""
    import torch
    path = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
    try:
        lib = ctypes.CDLL(path)
        return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
    except (OSError, AttributeError):
        return None


def _mkl_sgemm_address():
    return _mkl_address("sgemm_")


def _keep_blas_threads_address() -> int:
    """The address of a no-op BLAS thread setter, for a BLAS that has none to call
    (OpenBLAS): a numba ``cfunc`` compiled here, only on that path, and not cached (a
    cached cfunc writes next to its source: into the package, `numba_cache`)."""
    @numba.cfunc(types.int32(types.int32))
    def keep(n):  # pragma: no cover - numba
        return 0
    _KEEP.append(keep)   # the compiled function lives as long as the module
    return keep.address


_KEEP: list = []


def _openblas_sgemm_address():
    from scipy.linalg import cython_blas
    capsule = cython_blas.__pyx_capi__["sgemm"]
    get_name = ctypes.pythonapi.PyCapsule_GetName
    get_name.restype, get_name.argtypes = ctypes.c_char_p, [ctypes.py_object]
    get_ptr = ctypes.pythonapi.PyCapsule_GetPointer
    get_ptr.restype, get_ptr.argtypes = ctypes.c_void_p, [ctypes.py_object, ctypes.c_char_p]
    return get_ptr(capsule, get_name(capsule))


def _bind_blas():
    global BLAS_NAME
    choice = os.environ.get("OPENCANN_FA_BLAS", "auto").lower()
    addr = _mkl_sgemm_address() if choice in ("auto", "mkl") else None
    threads = _mkl_address("MKL_Set_Num_Threads_Local") if addr is not None else None
    BLAS_NAME = "mkl (torch)"
    if addr is None:
        addr, BLAS_NAME = _openblas_sgemm_address(), "openblas (scipy)"
    llvm.add_symbol(_SYMBOL, addr)
    llvm.add_symbol(_THREADS_SYMBOL, threads if threads is not None else _keep_blas_threads_address())


_bind_blas()


@intrinsic
def _sgemm(typingctx, ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc):
    """Fortran ``sgemm`` (column-major, every argument by pointer) on array data."""
    sig = types.void(ta, tb, m, n, k, alpha, a, lda, b, ldb, beta, c, ldc)

    def codegen(context, builder, sig, args):
        i8, i32, f32 = ir.IntType(8), ir.IntType(32), ir.FloatType()
        fnty = ir.FunctionType(ir.VoidType(), [i8.as_pointer(), i8.as_pointer()]
                               + [i32.as_pointer()] * 3 + [f32.as_pointer()] * 2
                               + [i32.as_pointer(), f32.as_pointer(), i32.as_pointer()]
                               + [f32.as_pointer()] * 2 + [i32.as_pointer()])
        fn = cgutils.get_or_insert_function(builder.module, fnty, _SYMBOL)

        def ref(val, llty):
            p = cgutils.alloca_once(builder, llty)
            builder.store(val, p)
            return p

        def iref(v):
            return ref(builder.trunc(v, i32), i32)

        def data(i):
            arr = cgutils.create_struct_proxy(sig.args[i])(context, builder, value=args[i])
            return builder.bitcast(arr.data, f32.as_pointer())

        builder.call(fn, [ref(builder.trunc(args[0], i8), i8), ref(builder.trunc(args[1], i8), i8),
                          iref(args[2]), iref(args[3]), iref(args[4]), ref(args[5], f32), data(6),
                          iref(args[7]), data(8), iref(args[9]), ref(args[10], f32), data(11),
                          iref(args[12])])
        return context.get_dummy_value()

    return sig, codegen


@intrinsic
def _blas_threads(typingctx, n):
    """``MKL_Set_Num_Threads_Local(n)`` (bound to `_THREADS_SYMBOL`): the calling
    thread's BLAS thread count, 0 = the global one; returns the previous local count."""
    sig = types.int32(types.int32)

    def codegen(context, builder, sig, args):
        i32 = ir.IntType(32)
        fn = cgutils.get_or_insert_function(builder.module, ir.FunctionType(i32, [i32]),
                                            _THREADS_SYMBOL)
        return builder.call(fn, [args[0]])

    return sig, codegen


@njit(cache=True, inline="always")
def _mm_ld(a, lda, ta, b, ldb, tb, c, ldc, m, n, k, alpha, beta):
    """Row-major ``c[m, n] = alpha * op(a) @ op(b) + beta * c`` where each operand's data
    starts at its array's first element and its rows are ``lda`` / ``ldb`` / ``ldc``
    elements apart (a head's rows inside a [B, S, H, D] tensor: H * D); ``op(x) = x.T``
    when the flag is set. Column-major BLAS sees the transposes, so it computes
    ``c^T = op(b)^T op(a)^T``."""
    _sgemm(84 if tb else 78, 84 if ta else 78, n, m, k, np.float32(alpha),
           b, ldb, a, lda, np.float32(beta), c, ldc)


@njit(cache=True, inline="always")
def _mm(a, ta, b, tb, c, m, n, k, alpha, beta):
    """`_mm_ld` on C-contiguous data (rows of their stored length)."""
    _mm_ld(a, m if ta else k, ta, b, k if tb else n, tb, c, n, m, n, k, alpha, beta)


@njit(fastmath=_FM, cache=True, inline="always")
def _exp_sub(x, n, sub, ibuf):
    """In place ``x[j] = exp(x[j] - sub)`` for j < n; returns the sum. Cody-Waite
    reduction ``t = k ln2 + r``, degree-6 Taylor polynomial on |r| <= ln2/2
    (truncation error < 1.2e-7 relative), ``2^k`` built in the exponent bits; results
    below 2^-126 flush to 0 and ``exp(-inf) = 0``."""
    fb = ibuf.view(np.float32)
    for j in range(n):
        t = max(x[j] - sub, np.float32(-104.0))
        kf = np.floor(t * np.float32(1.4426950408889634) + np.float32(0.5))
        r = t - kf * np.float32(0.693145751953125) - kf * np.float32(1.428606765330187e-06)
        p = np.float32(1.0) + r * (np.float32(1.0) + r * (np.float32(0.5) + r * (
            np.float32(1.0 / 6) + r * (np.float32(1.0 / 24) + r * (
                np.float32(1.0 / 120) + r * np.float32(1.0 / 720))))))
        ibuf[j] = max(np.int32(kf) + np.int32(127), np.int32(0)) << 23
        x[j] = p
    s = np.float32(0.0)
    for j in range(n):
        e = x[j] * fb[j]
        x[j] = e
        s += e
    return s


@njit(fastmath=_FM, cache=True, inline="always")
def _exp2_sub(x, n, sub, unit):
    """In place ``x[j] = 2^((x[j] - sub) * unit)`` for j < n; returns the sum. ``unit``
    is 1 for scores in base-2 units (folded away when passed as a constant) or log2(e)
    for natural units (masked scores: the mask is added unscaled, so a finite mask such
    as ``finfo(float32).min`` never overflows). One branch-free loop: ``t = k + r`` with
    k = floor(t + 1/2), ``2^r`` by a degree-6 polynomial on |r| <= 1/2 (Cephes exp2f
    coefficients, relative error < 2e-7), ``2^k`` built in the exponent bits. t is
    clamped to [-127, 64]: results below ~2^-126.5 (and ``2^-inf``) are 0, and an
    argument above 64 gives 2^64 (finite, so a caller that subtracted a stale maximum
    sees it in the sum). NaN stays NaN (numba's ``max``/``min`` keep a NaN first
    argument), and ``inf - inf`` is NaN, as in eager's softmax."""
    s = np.float32(0.0)
    for j in range(n):
        e = exp2_clamped((x[j] - sub) * unit)
        x[j] = e
        s += e
    return s


@njit(fastmath=_FM, cache=True, inline="always")
def _row_max(x, n, mx):
    """max(mx, x[:n]) with 16 independent running maxima in scalars (one chain is bound
    by the latency of maxss; LLVM packs the 16 into two vector registers)."""
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = mx
    b0 = b1 = b2 = b3 = b4 = b5 = b6 = b7 = mx
    nb = n // 16
    for c in range(nb):
        o = c * 16
        v = x[o]
        a0 = v if v > a0 else a0
        v = x[o + 1]
        a1 = v if v > a1 else a1
        v = x[o + 2]
        a2 = v if v > a2 else a2
        v = x[o + 3]
        a3 = v if v > a3 else a3
        v = x[o + 4]
        a4 = v if v > a4 else a4
        v = x[o + 5]
        a5 = v if v > a5 else a5
        v = x[o + 6]
        a6 = v if v > a6 else a6
        v = x[o + 7]
        a7 = v if v > a7 else a7
        v = x[o + 8]
        b0 = v if v > b0 else b0
        v = x[o + 9]
        b1 = v if v > b1 else b1
        v = x[o + 10]
        b2 = v if v > b2 else b2
        v = x[o + 11]
        b3 = v if v > b3 else b3
        v = x[o + 12]
        b4 = v if v > b4 else b4
        v = x[o + 13]
        b5 = v if v > b5 else b5
        v = x[o + 14]
        b6 = v if v > b6 else b6
        v = x[o + 15]
        b7 = v if v > b7 else b7
    for j in range(nb * 16, n):
        mx = max(mx, x[j])
    a0 = max(max(max(a0, a1), max(a2, a3)), max(max(a4, a5), max(a6, a7)))
    b0 = max(max(max(b0, b1), max(b2, b3)), max(max(b4, b5), max(b6, b7)))
    return max(max(a0, b0), mx)


@njit(fastmath=_FM, cache=True, inline="always")
def _any_nan(x, n):
    """True when one of x[:n] is NaN."""
    for j in range(n):
        if x[j] != x[j]:
            return True
    return False


@njit(cache=True, inline="always")
def _mask_tile(s, nr, nc, b, h, q0, k0, mask, has_mask, causal, offset):
    """Add the float mask (natural units) and set causally hidden scores
    (key > query + offset) to -inf on an (nr, nc) score tile stored row-major with
    stride nc. The causal -inf overwrites the score, so a NaN key a query does not
    see stays out of its row (as in torch's CPU SDPA)."""
    ninf = np.float32(-np.inf)
    for i in range(nr):
        base = i * nc
        if has_mask:
            mrow = mask[b, h, q0 + i]
            for j in range(nc):
                s[base + j] += mrow[k0 + j]
        if causal:
            first_hidden = q0 + i + offset + 1 - k0
            for j in range(max(first_hidden, 0), nc):
                s[base + j] = ninf


@njit(fastmath=_FM, cache=True, inline="always")
def _v_finite(vh, k0, nc, D):
    """Whether rows k0 .. k0 + nc - 1 of ``vh`` (S, D) are all finite (0 * NaN and
    0 * inf are NaN; nothing here folds them away: no ``nnan``/``ninf``)."""
    acc = np.float32(0.0)
    for j in range(nc):
        for d in range(D):
            acc += vh[k0 + j, d] * np.float32(0.0)
    return acc == 0.0


@njit(fastmath=_FM, cache=True, inline="always")
def _pv_seen(p, nr, nc, vh, k0, acc, b, h, q0, mask, has_mask, causal, offset):
    """``acc[i] += sum_j P[i, j] v[k0 + j]`` over the keys row ``q0 + i`` sees only: a key
    hidden from it (causally, or by a -inf / False mask entry, where P is 0) is skipped,
    so a NaN or inf in its v row stays out of the row (0 * NaN would be NaN). The
    P V product of a masked tile whose v rows are not all finite (`_v_finite`)."""
    D = acc.shape[1]
    ninf = np.float32(-np.inf)
    for i in range(nr):
        stop = nc
        if causal:
            stop = min(nc, q0 + i + offset + 1 - k0)
        for j in range(max(stop, 0)):
            if has_mask and mask[b, h, q0 + i, k0 + j] == ninf:
                continue
            pij = p[i * nc + j]
            for d in range(D):
                acc[i, d] += pij * vh[k0 + j, d]


@njit(parallel=True, fastmath=_FM, cache=True)
def fwd_kernel(q, k, v, mask, has_mask, causal, offset, scale, B, H, Hk, Sq, Sk,
               br, bc, out, lse):
    """q (B, H, Sq, D), k/v (B, Hk, Sk, D), out (B, H, Sq, D): float32 arrays of any
    non-negative strides with D unit-stride (`_in_place`), so a head's rows may be H·D
    apart (eager's [B, S, H, D] memory seen as BNSD), read and written in place: the
    tile GEMMs take the row stride as their leading dimension. lse: (B*H*Sq,)
    contiguous. mask: float32 (B, H, Sq, Sk) view (stride 0 allowed)."""
    D = q.shape[3]
    qs, ks, vs = q.strides[2] // 4, k.strides[2] // 4, v.strides[2] // 4
    nqb = (Sq + br - 1) // br
    nkb_all = (Sk + bc - 1) // bc
    group = H // Hk
    # scores in base-2 units (no per-element multiply in the exponential), except with a
    # float mask: mask * log2(e) overflows for |mask| > FLT_MAX / log2(e) (transformers'
    # finfo.min masks), so masked scores stay in natural units, scaled inside _exp2_sub
    qk_alpha = np.float32(np.float64(scale) * (1.0 if has_mask else _LOG2E))
    unit = _LOG2E if has_mask else 1.0  # base-2 units per score unit
    for t in prange(B * H * nqb):
        blas = _blas_threads(np.int32(1))  # tile GEMMs on a sequential BLAS (module docstring)
        bh = t // nqb
        qb = t - bh * nqb
        b = bh // H
        h = bh - b * H
        hk = h // group
        q0 = qb * br
        nr = min(br, Sq - q0)
        qrow = bh * Sq + q0  # lse row
        qb_ = q[b, h, q0:]  # the block's query rows
        kh, vh, oh = k[b, hk], v[b, hk], out[b, h]
        nkb = nkb_all
        if causal:
            last = q0 + nr - 1 + offset  # last key any row of this block may see
            nkb = 0 if last < 0 else min(nkb_all, last // bc + 1)
        acc = np.zeros((nr, D), np.float32)
        m = np.full(nr, -np.inf, np.float32)  # running row max, base-2 units
        l = np.zeros(nr, np.float32)
        sbuf = np.empty(nr * bc, np.float32)
        for kb in range(nkb):
            k0 = kb * bc
            nc = min(bc, Sk - k0)
            _mm_ld(qb_, qs, False, kh[k0:], ks, True, sbuf, nc,
                   nr, nc, D, qk_alpha, 0.0)
            masked = has_mask or (causal and k0 + nc - 1 > q0 + offset)
            if masked:
                _mask_tile(sbuf, nr, nc, b, h, q0, k0, mask, has_mask, causal, offset)
            for i in range(nr):
                row = sbuf[i * nc:(i + 1) * nc]
                mi = m[i]
                if mi != mi:  # a NaN reached this row (l and O are NaN): nothing to add
                    for j in range(nc):
                        row[j] = 0.0
                    continue
                if mi != -np.inf:
                    # Lazy rescaling: P = 2^(S - m_old) without a max pass while no score
                    # exceeds m_old + 20 (every P <= row sum <= 2^20, no overflow; P may
                    # exceed 1, the final 1/l normalises). Else recompute this row's
                    # scores (a 1-row GEMM) and take the exact path below.
                    if has_mask:
                        rs = _exp2_sub(row, nc, mi, np.float32(_LOG2E))
                    else:
                        rs = _exp2_sub(row, nc, mi, np.float32(1.0))
                    if rs <= _LAZY_SUM_MAX:  # False for NaN: the exact path propagates it
                        l[i] += rs
                        continue
                    _mm_ld(qb_[i:], qs, False, kh[k0:], ks, True,
                           row, nc, 1, nc, D, qk_alpha, 0.0)
                    if has_mask or causal:
                        _mask_tile(row, 1, nc, b, h, q0 + i, k0, mask, has_mask, causal,
                                   offset)
                mx = _row_max(row, nc, mi)  # drops NaN; the sum below keeps it
                if mx == -np.inf:
                    if not _any_nan(row, nc):  # row sees nothing yet: P = 0
                        for j in range(nc):
                            row[j] = 0.0
                        continue
                    mx = np.float32(np.nan)  # only NaN scores: the row is NaN
                if has_mask:
                    rs = _exp2_sub(row, nc, mx, np.float32(_LOG2E))
                else:
                    rs = _exp2_sub(row, nc, mx, np.float32(1.0))
                # max moved (else the lazy path had taken it): rescale l and O; on the
                # first tile mi = -inf and alpha = 0. A NaN (a NaN score, or +inf - +inf)
                # makes l NaN and so the row's output NaN, as eager's softmax.
                alpha = np.float32(math.exp((np.float64(mi) - np.float64(mx)) * unit * _LN2))
                if rs != rs:
                    l[i] = np.float32(np.nan)
                    m[i] = np.float32(np.nan)
                    for d in range(D):
                        acc[i, d] = np.nan
                    continue
                l[i] = l[i] * alpha + rs
                m[i] = mx
                for d in range(D):
                    acc[i, d] *= alpha
            if masked and not _v_finite(vh, k0, nc, D):   # hidden keys' NaN/inf v: skipped
                _pv_seen(sbuf, nr, nc, vh, k0, acc, b, h, q0, mask, has_mask, causal, offset)
            else:
                _mm_ld(sbuf, nc, False, vh[k0:], vs, False, acc, D, nr, D, nc, 1.0, 1.0)
        for i in range(nr):
            if l[i] != l[i]:  # NaN reached the row's softmax: NaN, as eager
                for d in range(D):
                    oh[q0 + i, d] = np.nan
                lse[qrow + i] = np.nan
            elif l[i] > 0:
                inv = np.float32(1.0) / l[i]
                for d in range(D):
                    oh[q0 + i, d] = acc[i, d] * inv
                lse[qrow + i] = np.float32((np.float64(m[i]) * unit + math.log2(np.float64(l[i])))
                                           * _LN2)
            else:  # fully masked row: output 0, lse -inf (as torch's CPU SDPA)
                for d in range(D):
                    oh[q0 + i, d] = 0.0
                lse[qrow + i] = -np.inf
        _blas_threads(blas)


@njit(fastmath=_FM, cache=True, inline="always")
def _probs_and_ds(q, k, v, do, lse, dd, mask, has_mask, causal, offset, scale, b, h,
                  qrow, kvrow, q0, k0, nr, nc, D, pbuf, dsbuf, ibuf):
    """Recompute P = exp(scale Q K^T + mask - lse) into pbuf and dS = P * (dO V^T - Dvec)
    into dsbuf for one (nr, nc) tile. Rows with lse = -inf (fully masked) get P = 0."""
    _mm(q[qrow:qrow + nr], False, k[kvrow + k0:kvrow + k0 + nc], True, pbuf, nr, nc, D, scale, 0.0)
    if has_mask or (causal and k0 + nc - 1 > q0 + offset):
        _mask_tile(pbuf, nr, nc, b, h, q0, k0, mask, has_mask, causal, offset)
    for i in range(nr):
        row = pbuf[i * nc:(i + 1) * nc]
        li = lse[qrow + i]
        if li == -np.inf:
            for j in range(nc):
                row[j] = 0.0
        else:
            _exp_sub(row, nc, li, ibuf)
    _mm(do[qrow:qrow + nr], False, v[kvrow + k0:kvrow + k0 + nc], True, dsbuf, nr, nc, D, 1.0, 0.0)
    for i in range(nr):
        di = dd[qrow + i]
        base = i * nc
        for j in range(nc):
            dsbuf[base + j] = pbuf[base + j] * (dsbuf[base + j] - di)


@njit(parallel=True, fastmath=_FM, cache=True)
def bwd_dkdv_kernel(q, k, v, do, lse, dd, mask, has_mask, causal, offset, scale,
                    B, H, Hk, Sq, Sk, br, bc, dk, dv):
    """dK, dV (B*Hk*Sk, D), parallel over (batch, kv head, key block); each task loops
    over the query heads of its group and the query blocks that can see its keys."""
    D = q.shape[1]
    nkb = (Sk + bc - 1) // bc
    nqb = (Sq + br - 1) // br
    group = H // Hk
    for t in prange(B * Hk * nkb):
        blas = _blas_threads(np.int32(1))  # tile GEMMs on a sequential BLAS (module docstring)
        bhk = t // nkb
        kb = t - bhk * nkb
        b = bhk // Hk
        hk = bhk - b * Hk
        kvrow = bhk * Sk
        k0 = kb * bc
        nc = min(bc, Sk - k0)
        qb_start = 0
        if causal:  # first query that sees key k0: i >= k0 - offset
            qb_start = max(k0 - offset, 0) // br
        dka = np.zeros((nc, D), np.float32)
        dva = np.zeros((nc, D), np.float32)
        pbuf = np.empty(br * nc, np.float32)
        dsbuf = np.empty(br * nc, np.float32)
        ibuf = np.empty(nc, np.int32)
        for h in range(hk * group, (hk + 1) * group):
            for qb in range(qb_start, nqb):
                q0 = qb * br
                nr = min(br, Sq - q0)
                qrow = (b * H + h) * Sq + q0
                _probs_and_ds(q, k, v, do, lse, dd, mask, has_mask, causal, offset, scale,
                              b, h, qrow, kvrow, q0, k0, nr, nc, D, pbuf, dsbuf, ibuf)
                _mm(pbuf, True, do[qrow:qrow + nr], False, dva, nc, D, nr, 1.0, 1.0)
                _mm(dsbuf, True, q[qrow:qrow + nr], False, dka, nc, D, nr, scale, 1.0)
        for j in range(nc):
            for d in range(D):
                dk[kvrow + k0 + j, d] = dka[j, d]
                dv[kvrow + k0 + j, d] = dva[j, d]
        _blas_threads(blas)


@njit(parallel=True, fastmath=_FM, cache=True)
def bwd_dq_kernel(q, k, v, do, lse, dd, mask, has_mask, causal, offset, scale,
                  B, H, Hk, Sq, Sk, br, bc, dq):
    """dQ (B*H*Sq, D), parallel over (batch, head, query block)."""
    D = q.shape[1]
    nqb = (Sq + br - 1) // br
    nkb_all = (Sk + bc - 1) // bc
    group = H // Hk
    for t in prange(B * H * nqb):
        blas = _blas_threads(np.int32(1))  # tile GEMMs on a sequential BLAS (module docstring)
        bh = t // nqb
        qb = t - bh * nqb
        b = bh // H
        h = bh - b * H
        kvrow = (b * Hk + h // group) * Sk
        q0 = qb * br
        nr = min(br, Sq - q0)
        qrow = bh * Sq + q0
        nkb = nkb_all
        if causal:
            last = q0 + nr - 1 + offset
            nkb = 0 if last < 0 else min(nkb_all, last // bc + 1)
        dqa = np.zeros((nr, D), np.float32)
        pbuf = np.empty(nr * bc, np.float32)
        dsbuf = np.empty(nr * bc, np.float32)
        ibuf = np.empty(bc, np.int32)
        for kb in range(nkb):
            k0 = kb * bc
            nc = min(bc, Sk - k0)
            _probs_and_ds(q, k, v, do, lse, dd, mask, has_mask, causal, offset, scale,
                          b, h, qrow, kvrow, q0, k0, nr, nc, D, pbuf, dsbuf, ibuf)
            _mm(dsbuf, False, k[kvrow + k0:kvrow + k0 + nc], False, dqa, nr, D, nc, scale, 1.0)
        for i in range(nr):
            for d in range(D):
                dq[qrow + i, d] = dqa[i, d]
        _blas_threads(blas)


_DUMMY_MASK = np.zeros((1, 1, 1, 1), np.float32)


def _launch_guard(work: int = 0):
    """A lock when numba's threading layer is ``workqueue`` (not thread-safe: concurrent
    launches terminate the process), else a no-op context. Starts the layer if needed;
    a launch of ``work`` (> 0) elements gets `numba_cache.launch_threads` threads."""
    if work:
        return launch(work)
    return launch_guard()   # one process-wide lock for every opencann numba kernel


def _args(q, k, mask, causal_off):
    """Common scalar arguments. q: (B, H, Sq, D), k: (B, Hk, Sk, D) float32 numpy."""
    B, H, Sq, _ = q.shape
    Hk, Sk = k.shape[1], k.shape[2]
    has_mask = mask is not None
    mask = mask if has_mask else _DUMMY_MASK
    causal = causal_off is not None
    return mask, has_mask, causal, int(causal_off or 0), B, H, Hk, Sq, Sk


def _in_place(a) -> bool:
    """Whether `fwd_kernel` reads or writes the 4-D float32 array ``a`` as it is: its last
    stride one element, the others non-negative multiples of it, rows (along S) at least
    D elements apart: the row stride is the tile GEMMs' leading dimension, which BLAS
    requires to be at least the row length (an S expanded with stride 0 made MKL refuse
    the call and leave the tile unwritten); empty: any."""
    st = a.strides
    return a.size == 0 or (st[3] == 4 and min(st) >= 0 and not (st[0] | st[1] | st[2]) % 4
                           and st[2] >= 4 * a.shape[3])


def forward(q, k, v, mask, causal_off, scale, block_q, block_k, out=None):
    """Numpy float32 BNSD forward. q (B,H,Sq,D), k/v (B,Hk,Sk,D), each with a unit
    stride along D (any other non-negative strides: read in place, `_in_place`; else
    copied); mask: None
    or float32 (B,H,Sq,Sk) view; ``out`` None or float32 (B,H,Sq,D) with a unit stride
    along D and no element twice (written in place: e.g. eager's [B, S, H, D] memory
    seen as BNSD). Returns (out (B,H,Sq,D), lse (B,H,Sq))."""
    mask, has_mask, causal, off, B, H, Hk, Sq, Sk = _args(q, k, mask, causal_off)
    D = q.shape[3]
    if out is None:
        out = np.empty((B, H, Sq, D), np.float32)
    if out.size and not _in_place(out):
        raise ValueError("flash attention forward: out must have a unit stride along D, rows "
                         "at least D apart and non-negative strides (e.g. a contiguous array)")
    lse = np.empty((B, H, Sq), np.float32)
    q, k, v = (a if _in_place(a) else np.ascontiguousarray(a) for a in (q, k, v))
    with _launch_guard(B * H * Sq * Sk * D):
        old = numba.get_parallel_chunksize()  # thread-local in numba
        numba.set_parallel_chunksize(1)  # dynamic schedule: causal tasks have unequal work
        try:
            args = (q, k, v, mask, has_mask, causal, off, np.float32(scale), B, H, Hk, Sq, Sk,
                    int(block_q), int(block_k), out, lse.reshape(-1))
            general_entry(fwd_kernel, args, _FWD_ANY_LAYOUT)(*args)
        finally:
            numba.set_parallel_chunksize(old)
    return out, lse


def backward(q, k, v, out, lse, do, mask, causal_off, scale, block_q, block_k):
    """Numpy float32 BNSD backward; returns (dq, dk, dv) shaped like q, k, v."""
    mask, has_mask, causal, off, B, H, Hk, Sq, Sk = _args(q, k, mask, causal_off)
    D = q.shape[3]
    dd = np.einsum("bhsd,bhsd->bhs", do, out, dtype=np.float32).reshape(-1)
    dq = np.empty_like(q)
    dk = np.empty_like(k)
    dv = np.empty_like(v)
    flat = [x.reshape(-1, D) for x in (q, k, v, do)]
    common = (lse.reshape(-1), dd, mask, has_mask, causal, off, np.float32(scale),
              B, H, Hk, Sq, Sk, int(block_q), int(block_k))
    with _launch_guard(B * H * Sq * Sk * D):
        old = numba.get_parallel_chunksize()
        numba.set_parallel_chunksize(1)
        try:
            args = (*flat, *common, dk.reshape(-1, D), dv.reshape(-1, D))
            general_entry(bwd_dkdv_kernel, args, _BWD_ANY_LAYOUT)(*args)
            args = (*flat, *common, dq.reshape(-1, D))
            general_entry(bwd_dq_kernel, args, _BWD_ANY_LAYOUT)(*args)
        finally:
            numba.set_parallel_chunksize(old)
    return dq, dk, dv
