"""Decode attention's two inner loops written in LLVM IR (numba intrinsics): the scores of a
block of keys, and P·V for a block of query heads and head dimensions, each with its
accumulators in vector registers.

`qk_block` ``(qg, g, kk, j0, scale, s)``: ``s[g, j0 + i] = scale * (qg[g] . kk[j0 + i])``
for the ``W`` keys ``i < W`` (``W`` = `gemv_tile.vector_width`: 16 fp32 lanes with AVX-512,
else 8); returns the largest of them, NaN when any is NaN (``llvm.vector.reduce.fmaximum``).
One vector accumulator per key over D, then the ``W`` accumulators are summed lane-wise
into one vector of ``W`` scores by a transposition tree (``log2 W`` levels of two
shuffles and one add per pair: 15 adds and 30 shuffles for 16 keys, where summing each
accumulator alone takes 4 shuffles and 4 adds per key). numba's own loop
(`decode_attention_cpu._group`'s earlier form) summed every score's 16 lanes horizontally.

`pv_block` ``(s, g0, vv, n, d0, acc)``: ``acc[g, d0 + c·W : d0 + (c+1)·W] =
sum_j s[g, j] * vv[j, same]`` over keys ``j < n``, for the query heads ``g = g0 ..
g0 + HEADS - 1`` (`pv_heads`: 4 with AVX-512, 2 with AVX2) and the 4 slices ``c = 0..3``
of W head-dimension elements: HEADS x 4 accumulators stay in registers over all n keys
(each key's value slice is loaded once for the heads, each probability broadcast once
for the 4 slices); numba's loop loaded and stored its accumulator row for every key. Heads past the last (``acc.shape[0]``) and slices past D
repeat the last one: the same values computed and stored again to the same place.

Layouts: ``qg`` [G, D], ``kk``/``vv`` [S, D] with unit stride along D (a (b, kv head)
slice of the BNSD cache), ``s`` [G, >= n], ``acc`` [G, D], float32; D a multiple of W
(the caller checks: `fits`). Numerics: FMA, lane sums reassociated; no ``nnan``/``ninf``,
so NaN and Inf propagate as in eager's softmax(QK^T)V (the caller keeps its NaN-aware
max; results agree with eager to fp32 rounding, not bit for bit).

Source: LLVM Language Reference Manual ("'llvm.fma.*'", "'shufflevector' Instruction",
"'llvm.vector.reduce.fmaximum.*'"); the transposed horizontal sum is the classic "hadd of
n vectors" reduction (Intel 64 and IA-32 Architectures Optimization Reference Manual,
SIMD horizontal operations); numba docs, "Low-level extension API: Implementing
intrinsics".
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .gemv_tile import VectorIR, transpose_sum, vector_width
from .numba_cache import njit

W = vector_width()      # fp32 lanes per vector on this CPU (16 with AVX-512, else 8)
SLICES = 4              # `pv_block`'s vector slices of D per call


def pv_heads(width: int) -> int:
    """Query heads per `pv_block` call at ``width`` lanes: 4 x `SLICES` accumulators, the
    4 value slices and a broadcast fit the 32 registers of AVX-512; 2 heads at AVX2's 16."""
    return 4 if width == 16 else 2


HEADS = pv_heads(W)     # this CPU's `pv_block` heads per call


def _block_for(width: int, ret, emit):
    """A numba intrinsic of six arguments returning ``ret``, its IR from ``emit`` at
    ``width`` lanes. Raises ValueError for a width other than 8 or 16."""
    if width not in (8, 16):
        raise ValueError(f"decode_attention_tile: width must be 8 or 16, got {width}")

    @intrinsic
    def block(typingctx, a0, a1, a2, a3, a4, a5):
        return ret(a0, a1, a2, a3, a4, a5), lambda context, builder, signature, args: emit(
            context, builder, signature, args, width)
    return block


def qk_block_for(width: int):
    """`qk_block` ``(qg, g, kk, j0, scale, s)`` at ``width`` lanes (8 or 16; a test runs
    the AVX2 width on any host). Raises ValueError for another width."""
    return _block_for(width, types.float32, _qk_emit)


def pv_block_for(width: int):
    """`pv_block` ``(s, g0, vv, n, d0, acc)`` at ``width`` lanes (8 or 16). Raises
    ValueError for another width."""
    return _block_for(width, types.void, _pv_emit)


def _splat(builder, vec, x, width: int):
    """The ``width``-lane vector of scalar ``x``."""
    one = builder.insert_element(ir.Constant(vec, ir.Undefined), x, ir.Constant(ir.IntType(32), 0))
    return builder.shuffle_vector(one, ir.Constant(vec, ir.Undefined),
                                  ir.Constant(ir.VectorType(ir.IntType(32), width), [0] * width))


def _qk_emit(context, builder, signature, args, width: int):
    """`qk_block`'s IR at ``width`` lanes; returns the max score (float32)."""
    qty, gty, kty, jty, sty, s_ty = signature.args
    qa = context.make_array(qty)(context, builder, args[0])
    ka = context.make_array(kty)(context, builder, args[2])
    sa = context.make_array(s_ty)(context, builder, args[5])
    v = VectorIR(context, builder, width)
    intp, c, vec, fma = v.intp, v.const, v.vec, v.fma
    f32 = ir.FloatType()
    gi = context.cast(builder, args[1], gty, types.intp)
    j = context.cast(builder, args[3], jty, types.intp)
    scale = context.cast(builder, args[4], sty, types.float32)
    d_len = cgutils.unpack_tuple(builder, ka.shape, 2)[1]
    qrow = v.item(qty, qa, gi, c(0))
    krows = [v.item(kty, ka, builder.add(j, c(i)), c(0)) for i in range(width)]
    acc = [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(width)]
    with cgutils.for_range_slice(builder, c(0), d_len, c(width), intp) as (d, _):
        qv = v.load(qrow, d)
        for i in range(width):
            builder.store(builder.call(fma, [qv, v.load(krows[i], d), builder.load(acc[i])]), acc[i])
    sums = transpose_sum(builder, [builder.load(a) for a in acc], width)
    scores = builder.fmul(sums, _splat(builder, vec, scale, width))
    builder.store(scores, builder.bitcast(v.item(s_ty, sa, gi, j), v.vptr), align=4)
    mx = cgutils.get_or_insert_function(builder.module, ir.FunctionType(f32, [vec]),
                                        f"llvm.vector.reduce.fmaximum.v{width}f32")
    return builder.call(mx, [scores])


def _pv_emit(context, builder, signature, args, width: int):
    """`pv_block`'s IR at ``width`` lanes."""
    s_ty, gty, vty, nty, dty, aty = signature.args
    sa = context.make_array(s_ty)(context, builder, args[0])
    va = context.make_array(vty)(context, builder, args[2])
    aa = context.make_array(aty)(context, builder, args[5])
    v = VectorIR(context, builder, width)
    intp, c, vec, fma = v.intp, v.const, v.vec, v.fma
    g0 = context.cast(builder, args[1], gty, types.intp)
    n = context.cast(builder, args[3], nty, types.intp)
    d0 = context.cast(builder, args[4], dty, types.intp)
    g_count, d_len = cgutils.unpack_tuple(builder, aa.shape, 2)

    def clamp(i, last):
        return builder.select(builder.icmp_signed("<", i, last), i, last)
    nh = pv_heads(width)
    heads = [clamp(builder.add(g0, c(q)), builder.sub(g_count, c(1))) for q in range(nh)]
    cols = [clamp(builder.add(d0, c(i * width)), builder.sub(d_len, c(width))) for i in range(SLICES)]
    srows = [v.item(s_ty, sa, h, c(0)) for h in heads]
    accs = [cgutils.alloca_once_value(builder, ir.Constant(vec, None)) for _ in range(nh * SLICES)]
    with cgutils.for_range(builder, n, intp=intp) as loop:
        j = loop.index
        vrow = v.item(vty, va, j, c(0))
        vs = [v.load(vrow, col) for col in cols]
        for q in range(nh):
            p = _splat(builder, vec, builder.load(builder.gep(srows[q], [j])), width)
            for i in range(SLICES):
                a = accs[q * SLICES + i]
                builder.store(builder.call(fma, [p, vs[i], builder.load(a)]), a)
    for q in range(nh):
        for i in range(SLICES):
            dst = v.item(aty, aa, heads[q], cols[i])
            builder.store(builder.load(accs[q * SLICES + i]), builder.bitcast(dst, v.vptr), align=4)
    return context.get_dummy_value()


qk_block = qk_block_for(W)   # this CPU's width: what `decode_attention_cpu._group` calls
pv_block = pv_block_for(W)


@njit(cache=True, inline="always")
def fits(kk, vv, d):  # pragma: no cover - compiled by numba
    """Whether `qk_block`/`pv_block` can serve key/value slices ``kk``/``vv`` [S, d]: d a
    multiple of `W` and both unit-stride along d."""
    return d % W == 0 and kk.strides[1] == 4 and vv.strides[1] == 4


__all__ = ["HEADS", "SLICES", "W", "fits", "pv_block", "pv_block_for", "pv_heads", "qk_block",
           "qk_block_for"]
