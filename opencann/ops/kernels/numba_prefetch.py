"""A software prefetch for numba kernels: `prefetch` ``(a, i, j)`` asks the CPU to start
loading the cache line holding ``a[i, j]`` (a 2-D array) into every cache level, and
returns at once (no value, no fault: a prefetch of any address is harmless).

Why: a hardware prefetcher runs a bounded distance ahead of the loads it has seen and
stops at each 4 KiB page, so a loop that computes on a few short runs of memory meets
them too late; asking for the next runs' lines while the current ones are used keeps the
memory busy (decode attention's next (b, kv head) group: `decode_attention_cpu`; the
decode GEMV's register tile emits the same intrinsic inside its own IR loop,
`gemv_tile`). numba has no prefetch of its own; this is LLVM's ``llvm.prefetch``
intrinsic (LLVM Language Reference, "'llvm.prefetch' Intrinsic": address, rw = 0 read,
locality = 3 keep in all levels, cache type = 1 data; x86 ``prefetcht0``), emitted through
numba's documented ``numba.extending.intrinsic`` extension point (numba docs, "Low-level
extension API: Implementing intrinsics"). A kernel that calls it still caches
(``cache=True``): the intrinsic is lowered into the kernel's own machine code.

Caveat measured with numba 0.68 / LLVM: a call inside a loop stops LLVM from vectorising
that loop; issue prefetches from an outer loop (a chunk of the inner loop's range at a
time), not from the vectorised loop itself, or write the loop in vector form yourself
(`gemv_tile`).
"""
from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


@intrinsic
def prefetch(typingctx, a, i, j):
    """``prefetch(a, i, j)``: prefetch the cache line of ``a[i, j]`` for reading
    (``llvm.prefetch``, locality 3). ``a`` a 2-D numba array, ``i``/``j`` non-negative
    in-range integer indices (not checked, not wrapped: an out-of-range address is
    prefetched harmlessly but is wasted). Returns None. Callable from numba code only."""
    if not (isinstance(a, types.Array) and a.ndim == 2 and isinstance(i, types.Integer)
            and isinstance(j, types.Integer)):
        return None
    sig = types.void(a, i, j)

    def codegen(context, builder, signature, args):
        aryty = signature.args[0]
        ary = context.make_array(aryty)(context, builder, args[0])
        idx = [context.cast(builder, args[1], signature.args[1], types.intp),
               context.cast(builder, args[2], signature.args[2], types.intp)]
        ptr = cgutils.get_item_pointer(context, builder, aryty, ary, idx, wraparound=False)
        i8p = ir.IntType(8).as_pointer()
        i32 = ir.IntType(32)
        fnty = ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32])
        fn = cgutils.get_or_insert_function(builder.module, fnty, "llvm.prefetch.p0i8")
        builder.call(fn, [builder.bitcast(ptr, i8p), ir.Constant(i32, 0), ir.Constant(i32, 3),
                          ir.Constant(i32, 1)])
        return context.get_dummy_value()
    return sig, codegen


__all__ = ["prefetch"]
