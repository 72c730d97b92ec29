"""The panel GEMM's micro-kernel, written in LLVM IR: a numba intrinsic that computes an
``MR x NR`` block of ``x @ W`` over all of K with its accumulators in vector registers.

`panel_tile` ``(mr, width, bias)`` makes ``tile(x, bp, i0, p, dst, r0, c0, b, cb)``:
``dst[r0 + m, c0 + j]`` (m < mr, j < NR = 2 * width) = the dot product of x's row ``i0 +
m`` with column ``p * NR + j`` of W (``+ b[cb + j]`` when ``bias``),
where ``bp`` [P, K, NR] is W [K, N] cut into P panels of NR columns (`gemm_panel_cpu.
pack_panels`: panel p holds columns p*NR .. p*NR + NR - 1, row k of the panel contiguous,
zero past N). A row past x's last stands for x's last row (computed, never to be stored
by the caller). Each K step loads the panel's two vectors of row k, broadcasts x[i0 + m,
k] for every m and issues ``2 * mr`` vector FMAs into accumulators that live in registers
for the whole K (`mem2reg` promotes them: allocas in the entry block); after K the bias
vector is added in registers and each row's two vectors are stored to ``dst`` (the
result itself for a whole block, a scratch tile for an edge block: storing every block
through a scratch tile and a scalar copy had cost 5-6% at K = 384). This is the register-blocked micro-kernel
of Goto & van de Geijn (B packed into NR-wide panels, A read in place), at BLIS's AVX2
shape 6 x 16: 12 accumulators, two B vectors and one broadcast fill 15 of the 16 vector
registers (on AVX-512: 12 x 32, 24 accumulators of 32 registers). LLVM unrolls the K loop
by two and folds the broadcast into ``vbroadcastss`` from memory (checked in the
generated assembly on the 2-core AMD EPYC, AVX2: 12 ``vfmadd231ps`` per K step, no spill).

One thread, the micro-kernel alone on L1-resident operands (6 x K times 2 panels, K = 128
to 768): 80-88 GFLOP/s on the 2-core AMD EPYC (AVX2, Zen 3: two 256-bit FMAs per cycle,
~2.75 GHz, 88 peak).

NaN and Inf propagate as in any dot product (FMA in K order; no ``nnan``/``ninf``): a NaN
or Inf in x or W reaches the outputs it multiplies. The summation order is K's (MKL's and
oneDNN's block K), so results agree with eager to fp32 rounding, not bit for bit.

Source: K. Goto and R. van de Geijn, "Anatomy of High-Performance Matrix Multiplication",
ACM TOMS 34(3), 2008, §4-§6 (the micro-kernel, packed B panels); F. Van Zee and R. van de
Geijn, "BLIS: A Framework for Rapidly Instantiating BLAS Functionality", ACM TOMS 41(3),
2015 (MR x NR = 6 x 16 for Haswell's 16 AVX2 registers); LLVM Language Reference Manual
("'llvm.fma.*' Intrinsic", "'shufflevector' Instruction"); numba docs, "Low-level
extension API: Implementing intrinsics".
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from .gemv_tile import VectorIR, vector_width


def panel_shape(width: int = 0) -> tuple:
    """(MR, NR) of the micro-kernel at vector ``width`` (0: this CPU's, `vector_width`):
    (6, 16) with 16 vector registers (AVX2), (12, 32) with 32 (AVX-512). Raises
    ValueError for a width other than 8 or 16."""
    width = width or vector_width()
    if width not in (8, 16):
        raise ValueError(f"gemm_tile: width must be 8 or 16, got {width}")
    return (6, 16) if width == 8 else (12, 32)


def panel_tile(mr: int, width: int = 0, bias: bool = False):
    """The numba intrinsic ``tile(x, bp, i0, p, dst, r0, c0, b, cb)`` (module docstring)
    for ``mr`` rows of x at vector ``width`` lanes (0: `vector_width`), NR = 2 * width,
    adding ``b[cb:cb + NR]`` when ``bias``. ``x``: 2-D float32 with unit stride along K
    (any row stride); ``bp``: 3-D float32 C-contiguous [P, K, NR]; ``dst``: 2-D float32
    with unit stride along its columns, rows r0..r0+mr-1 and columns c0..c0+NR-1 inside
    it; ``b``: 1-D float32 contiguous (read only when ``bias``); ``i0``, ``p``, ``r0``,
    ``c0``, ``cb``: integers (in range, not checked). Returns an intp 0. Callable from
    numba code only. Raises ValueError for ``mr`` outside 1..12 or a width other than 8/16."""
    width = width or vector_width()
    if not (1 <= mr <= 12 and width in (8, 16)):
        raise ValueError(f"gemm_tile: mr must be 1..12 and width 8 or 16, got {mr}, {width}")

    @intrinsic
    def tile(typingctx, x, bp, i0, p, dst, r0, c0, b, cb):
        ok = (all(isinstance(a, types.Array) and a.dtype == types.float32 for a in (x, bp, dst, b))
              and (x.ndim, bp.ndim, dst.ndim, b.ndim) == (2, 3, 2, 1)
              and all(isinstance(i, types.Integer) for i in (i0, p, r0, c0, cb)))
        if not ok:
            return None
        sig = types.intp(x, bp, i0, p, dst, r0, c0, b, cb)

        def codegen(context, builder, signature, args):
            return _emit(context, builder, signature, args, mr, width, bias)
        return sig, codegen
    return tile


def _emit(context, builder, signature, args, mr: int, width: int, bias: bool):
    """The tile's IR (`panel_tile`); returns the intp 0."""
    xty, bty, aty, vty = signature.args[0], signature.args[1], signature.args[4], signature.args[7]
    xa = context.make_array(xty)(context, builder, args[0])
    ba = context.make_array(bty)(context, builder, args[1])
    aa = context.make_array(aty)(context, builder, args[4])
    v = VectorIR(context, builder, width)
    c, nr = v.const, 2 * width
    i0, p, r0, c0, cb = (context.cast(builder, args[i], signature.args[i], types.intp)
                         for i in (2, 3, 5, 6, 8))
    m_rows, k_len = cgutils.unpack_tuple(builder, xa.shape, 2)
    last = builder.sub(m_rows, c(1))

    def clamp(i):    # min(i, m_rows - 1)
        return builder.select(builder.icmp_signed("<", i, last), i, last)
    xrows = [v.item(xty, xa, clamp(builder.add(i0, c(m))), c(0)) for m in range(mr)]
    panel = cgutils.get_item_pointer(context, builder, bty, ba, [p, c(0), c(0)], wraparound=False)
    vacc = [cgutils.alloca_once_value(builder, ir.Constant(v.vec, None)) for _ in range(2 * mr)]
    i32 = ir.IntType(32)
    splat = ir.Constant(ir.VectorType(i32, width), [0] * width)
    undef = ir.Constant(v.vec, ir.Undefined)
    with cgutils.for_range_slice(builder, c(0), k_len, c(1), v.intp) as (k, _):
        row = builder.mul(k, c(nr))
        bv = [v.load(panel, row), v.load(panel, builder.add(row, c(width)))]
        for m in range(mr):
            s = builder.load(builder.gep(xrows[m], [k]))
            sv = builder.shuffle_vector(builder.insert_element(undef, s, ir.Constant(i32, 0)), undef, splat)
            for q in range(2):
                a = vacc[2 * m + q]
                builder.store(builder.call(v.fma, [sv, bv[q], builder.load(a)]), a)
    bv = [None, None]
    if bias:
        bptr = cgutils.get_item_pointer(context, builder, vty, context.make_array(vty)(
            context, builder, args[7]), [cb], wraparound=False)
        bv = [v.load(bptr, c(0)), v.load(bptr, c(width))]
    for m in range(mr):
        dst = v.item(aty, aa, builder.add(r0, c(m)), c0)
        for q in range(2):
            r = builder.load(vacc[2 * m + q])
            r = builder.fadd(r, bv[q]) if bias else r
            builder.store(r, builder.bitcast(builder.gep(dst, [c(q * width)]), v.vptr), align=4)
    return c(0)


__all__ = ["panel_shape", "panel_tile"]
