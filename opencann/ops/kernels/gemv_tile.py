"""The decode GEMV's register tile, written in LLVM IR: a numba intrinsic that computes a
block of dot products in one pass over K with vector accumulators held across the whole
pass.

`dot_tile` ``(mr, rw)`` makes ``tile(x, w, t, h)``: the ``mr * rw`` dot products of x's
rows ``0..mr-1`` with w's rows ``t, t + h, ..., t + (rw - 1) * h`` (x [M, K], w [N, K],
fp32, C-contiguous; a row past x's last stands for x's last row, one past w's last for
w's last: computed, never to be stored), returned as a tuple of float32, the product of
x row m and w row ``t + q * h`` at index ``q * mr + m``.

Why IR and not numba Python: LLVM vectorises a numba reduction loop only when nothing
else is in it, so a loop that also prefetches must be cut into short vectorised steps,
each ending in a horizontal sum of every accumulator; at 8 rows of x those sums cost as
much as the multiply-adds (`gemv_cpu`'s earlier `_tile8`: 31 GFMA/s at 64-element steps
against 51 unchunked, L2-resident, one thread). Here the loop is written directly in
vector form: each step loads one vector of every w row and every x row, issues ``mr * rw``
vector FMAs into accumulators that live in registers for the whole K (`mem2reg` promotes
them: allocas in the entry block), and prefetches the line of each w row's successor (row
``t + q * h + 1``, the next tile of the same stream) at the same offset into L2, not L1
(``prefetcht1``: a prefetch into L1 evicts the tile's x rows, 8 rows of K = 768 being 24
KiB of a 32 KiB L1d, and the next rows' lines wait in L2 one tile ahead either way; the 49
merged decode weights of a 125M Llama, 400 MB, two threads, the 2-core EPYC, median of 16
interleaved passes: 8 rows 19.47 -> 16.30 ms, 4 rows 16.40 -> 14.17, 16 rows 27.05 ->
24.69); the horizontal sums happen once, after K. The ``rw`` rows ``h`` apart are ``rw``
independent memory streams per thread, which the hardware prefetchers run concurrently
(one stream of adjacent rows left the memory idle while the FMAs ran: see `gemv_cpu`).

Vector width: 16 fp32 lanes (one 512-bit register) on a CPU with AVX-512F, else 8
(AVX2); `rows_for` sizes ``rw`` so that the accumulators, one x vector and the w vectors
fit the register file (32 vector registers with AVX-512, 16 without). A K that is not a
multiple of the width ends in a scalar FMA loop. After K the accumulators' lanes are
summed by one transpose-and-add tree per ``width`` accumulators (`lane_sums`), not one
horizontal sum each: at 8 x rows, one thread, a weight in L2 (256 x 768 and 96 x 2048,
least of 7 x 500 calls, interleaved processes) 42.0 / 46.4 -> 35.3 / 37.1 us and 42.4 /
44.2 -> 39.2 / 37.0 us. NaN and Inf propagate as in any dot product (FMA and fixed-order
sums; no ``nnan``/``ninf``), so a NaN or Inf in x or w reaches the outputs it multiplies;
the summation order differs from MKL's (fp32 rounding, not bit for bit).

Source: LLVM Language Reference Manual ("'llvm.fma.*' Intrinsic", "'shufflevector'
Instruction", "'llvm.prefetch' Intrinsic"); numba docs, "Low-level extension API:
Implementing intrinsics"; register blocking as in Goto & van de Geijn, "Anatomy of
High-Performance Matrix Multiplication" (ACM TOMS 34(3), 2008), §4 (the micro-kernel's
accumulators in registers).
"""
from __future__ import annotations

from functools import lru_cache
from typing import List, Tuple

from llvmlite import binding as llvm_binding
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@lru_cache(maxsize=1)
def vector_width() -> int:
    """fp32 lanes per vector register on this CPU: 16 with AVX-512F, else 8."""
    try:
        feats = llvm_binding.get_host_cpu_features()
    except RuntimeError:      # llvmlite cannot read this host's features
        return 8
    return 16 if feats.get("avx512f", False) else 8


def rows_for(mr: int, width: int = 0) -> int:
    """How many w rows a tile of ``mr`` x rows takes at vector ``width`` (0: this CPU's):
    the most that keep ``mr * rw`` accumulators, one x vector and ``rw`` w vectors in the
    register file (32 vector registers at width 16, 16 at width 8), at most 8.
    Raises ValueError unless 1 <= mr <= 8."""
    if not 1 <= mr <= 8:
        raise ValueError(f"gemv_tile: mr must be 1..8, got {mr}")
    regs = 32 if (width or vector_width()) == 16 else 16
    return max(1, min(8, (regs - 1) // (mr + 1)))


def dot_tile(mr: int, rw: int, width: int = 0):
    """The numba intrinsic ``tile(x, w, t, h)`` (module docstring) for ``mr`` rows of x and
    ``rw`` rows of w at vector ``width`` lanes (0: `vector_width`). ``x``, ``w``: 2-D
    float32 C-contiguous numba arrays with the same K; ``t``, ``h``: integers, ``t < h``.
    Returns a UniTuple(float32, mr * rw). Callable from numba code only. Raises
    ValueError for ``mr``/``rw`` outside 1..8 or a width other than 8/16."""
    width = width or vector_width()
    if not (1 <= mr <= 8 and 1 <= rw <= 8 and width in (8, 16)):
        raise ValueError(f"gemv_tile: mr and rw must be 1..8 and width 8 or 16, "
                         f"got {mr}, {rw}, {width}")
    nacc = mr * rw

    @intrinsic
    def tile(typingctx, x, w, t, h):
        ok = all(isinstance(a, types.Array) and a.ndim == 2 and a.dtype == types.float32
                 for a in (x, w)) and isinstance(t, types.Integer) and isinstance(h, types.Integer)
        if not ok:
            return None
        sig = types.UniTuple(types.float32, nacc)(x, w, t, h)

        def codegen(context, builder, signature, args):
            return _emit(context, builder, signature, args, mr, rw, width)
        return sig, codegen
    return tile


class VectorIR:
    """What an fp32 IR kernel at ``width`` lanes needs in ``builder``'s function: ``intp``
    (the index type), ``const(v)`` (an index constant), ``vec``/``vptr`` (the vector type
    and its pointer), ``fma`` (``llvm.fma`` on vectors), ``load(ptr, k)`` (the vector at
    element k of ptr, unaligned) and ``item(aty, ary, i, j)`` (a pointer to 2-D array
    element [i, j], no wraparound). Shared by `dot_tile` and `decode_attention_tile`."""

    def __init__(self, context, builder, width: int):
        self.context, self.builder, self.width = context, builder, width
        self.intp = context.get_value_type(types.intp)
        self.vec = ir.VectorType(ir.FloatType(), width)
        self.vptr = self.vec.as_pointer()
        self.fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(self.vec, [self.vec] * 3), f"llvm.fma.v{width}f32")

    def const(self, v: int):
        """The index-typed IR constant ``v``."""
        return ir.Constant(self.intp, v)

    def load(self, ptr, k):
        """The ``width``-lane fp32 vector at element ``k`` of float pointer ``ptr``
        (alignment 4: any element)."""
        return self.builder.load(self.builder.bitcast(self.builder.gep(ptr, [k]), self.vptr), align=4)

    def item(self, aty, ary, i, j):
        """Pointer to element [i, j] of the 2-D numba array ``ary`` of type ``aty`` (index
        values, not checked, no negative wraparound)."""
        return cgutils.get_item_pointer(self.context, self.builder, aty, ary, [i, j], wraparound=False)


def _emit(context, builder, signature, args, mr: int, rw: int, width: int):
    """The tile's IR (`dot_tile`); returns the tuple value."""
    xty, wty, tty, hty = signature.args
    xa = context.make_array(xty)(context, builder, args[0])
    wa = context.make_array(wty)(context, builder, args[1])
    v = VectorIR(context, builder, width)
    intp, c, vec = v.intp, v.const, v.vec
    t = context.cast(builder, args[2], tty, types.intp)
    h = context.cast(builder, args[3], hty, types.intp)
    m_rows = cgutils.unpack_tuple(builder, xa.shape, 2)[0]
    n_rows, k_len = cgutils.unpack_tuple(builder, wa.shape, 2)
    f32 = ir.FloatType()
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)

    def clamp(i, n):     # min(i, n - 1)
        last = builder.sub(n, c(1))
        return builder.select(builder.icmp_signed("<", i, last), i, last)

    def row(ary, aty, i):  # pointer to ary[i, 0]
        return v.item(aty, ary, i, c(0))

    xrows = [row(xa, xty, clamp(c(m), m_rows)) for m in range(mr)]
    wids = [builder.add(t, builder.mul(h, c(q))) for q in range(rw)]
    wrows = [row(wa, wty, clamp(i, n_rows)) for i in wids]
    nexts = [builder.bitcast(row(wa, wty, clamp(builder.add(i, c(1)), n_rows)), i8p) for i in wids]
    mod = builder.module
    fma_s = cgutils.get_or_insert_function(mod, ir.FunctionType(f32, [f32, f32, f32]), "llvm.fma.f32")
    pf = cgutils.get_or_insert_function(mod, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]),
                                        "llvm.prefetch.p0i8")
    vacc = [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(mr * rw)]
    sacc = [cgutils.alloca_once_value(builder, ir.Constant(f32, 0.0)) for _ in range(mr * rw)]
    k_vec = builder.sub(k_len, builder.srem(k_len, c(width)))
    with cgutils.for_range_slice(builder, c(0), k_vec, c(width), intp) as (k, _):
        off = builder.mul(k, c(4))
        for p in nexts:     # read, locality 2 (L2 and out), data cache: prefetcht1
            builder.call(pf, [builder.gep(p, [off]), ir.Constant(i32, 0), ir.Constant(i32, 2),
                              ir.Constant(i32, 1)])
        wv = [v.load(r, k) for r in wrows]
        for m in range(mr):
            xv = v.load(xrows[m], k)
            for q in range(rw):
                a = vacc[q * mr + m]
                builder.store(builder.call(v.fma, [xv, wv[q], builder.load(a)]), a)
    with cgutils.for_range_slice(builder, k_vec, k_len, c(1), intp) as (k, _):
        wsv = [builder.load(builder.gep(r, [k])) for r in wrows]
        for m in range(mr):
            xs = builder.load(builder.gep(xrows[m], [k]))
            for q in range(rw):
                a = sacc[q * mr + m]
                builder.store(builder.call(fma_s, [xs, wsv[q], builder.load(a)]), a)
    sums = lane_sums(builder, [builder.load(a) for a in vacc], width)
    outs = [builder.fadd(x, builder.load(s)) for x, s in zip(sums, sacc)]
    return context.make_tuple(builder, signature.return_type, outs)


def transpose_sum_masks(width: int) -> List[Tuple[List[int], List[int]]]:
    """The shuffle masks of the transposition tree for ``width`` vectors of ``width``
    lanes: per level, (lo, hi) over the concatenation of a pair (a, b): ``lo + hi`` halves
    every group of lanes that holds one source vector's partial sums, a's groups first.
    After log2(width) levels lane i holds the sum of source vector i's lanes."""
    out, gs = [], width
    while gs > 1:
        half = gs // 2
        lo, hi = [], []
        for src in (0, width):
            for i in range(width // gs):
                lo += [src + i * gs + j for j in range(half)]
                hi += [src + i * gs + half + j for j in range(half)]
        out.append((lo, hi))
        gs = half
    return out


def transpose_sum(builder, vecs: list, width: int):
    """One ``width``-lane vector whose lane i is the sum of the lanes of ``vecs[i]`` (IR
    values; fewer than ``width`` padded with zero vectors): `transpose_sum_masks`' tree,
    ``width - 1`` vector adds and twice as many shuffles where one horizontal sum per
    vector takes log2(width) of each. Each lane sums one vector's lanes only (NaN and Inf
    stay in their own lane), in a fixed pairwise order."""
    vs = list(vecs) + [ir.Constant(ir.VectorType(ir.FloatType(), width), None)] * (width - len(vecs))
    mtype = ir.VectorType(ir.IntType(32), width)
    for lo, hi in transpose_sum_masks(width):
        vs = [builder.fadd(builder.shuffle_vector(vs[p], vs[p + 1], ir.Constant(mtype, lo)),
                           builder.shuffle_vector(vs[p], vs[p + 1], ir.Constant(mtype, hi)))
              for p in range(0, len(vs), 2)]
    return vs[0]


def lane_sums(builder, vecs: list, width: int) -> list:
    """The lane sums of the ``width``-lane fp32 vectors ``vecs`` (IR values), as scalar IR
    values in order: `transpose_sum` per group of ``width`` vectors (at 8 x rows x 3 w rows
    and K = 768, 24 horizontal sums were ~1/6 of the tile's FP work)."""
    i32 = ir.IntType(32)
    out = []
    for g in range(0, len(vecs), width):
        group = vecs[g:g + width]
        r = transpose_sum(builder, group, width)
        out += [builder.extract_element(r, ir.Constant(i32, i)) for i in range(len(group))]
    return out


__all__ = ["VectorIR", "dot_tile", "lane_sums", "rows_for", "transpose_sum", "transpose_sum_masks",
           "vector_width"]
