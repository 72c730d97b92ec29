"""`FusedElementwise` on the CPU: one numba kernel per program, generated as Python
source and compiled by numba (the project's CPU codegen dependency, as for FlashAttention:
it compiles loops written in Python to vectorised machine code and runs ``prange`` on all
cores).

The kernel walks the broadcast domain as rows (all dims but the last, ``prange`` over
them when the domain is large) × the last dim (the inner loop, unit-stride loads where the
operand is contiguous, so LLVM vectorises it). Each operand's storage is passed as a flat
array with its strides, so broadcasting and strided inputs are read in place. A trailing
reduction accumulates per row (max/min exact, NaN-propagating; integer sums in int64, as
ATen's; float sums in float64, then rounded once, which is not eager's float32 cascade:
the pass ``fuse_elementwise`` never gives a float sum or mean to this kernel (it rounds
and overflows elsewhere than eager), only programs built by hand have one; a mean rounds
that sum to its dtype and divides by n in that dtype, as ATen does).

Rounding: compiled with numba's defaults (no fast-math: no reassociation, no FMA
contraction) and ``error_model="numpy"`` (1/0 = inf, no exceptions), every op's result cast
to its dtype: +, -, *, /, sqrt round bit-for-bit as ATen's kernels; exp, log, tanh, erf,
sin, cos call libm (≤ 1 ulp apart from ATen's SLEEF). ``fastmath`` (node attr, option
``fuse_elementwise_fastmath``) turns LLVM fast-math on.

Compiled kernels are cached per process by (program, input dtypes, stride classes,
parallel): a second node or call with the same signature compiles nothing.
`COMPILE_SECONDS` records the first-call time of each compiled signature.
"""
from __future__ import annotations

import contextlib
import math
import threading
import time
from typing import Callable, Dict, List, Sequence

import numba
import numpy as np
import torch
from numba import njit

from .ew_program import Program, layout, stride_class

_CACHE: Dict[tuple, Callable] = {}
_LOCK = threading.Lock()
#: signature -> seconds its first call took (compile + run), for the report and benchmarks
COMPILE_SECONDS: Dict[tuple, float] = {}
#: domains with at least this many elements and 2 rows run rows in parallel
PARALLEL_MIN = 1 << 15

_NP = {"float32": np.float32, "float64": np.float64, "int32": np.int32, "int64": np.int64,
       "bool": np.bool_}


@njit(inline="always")
def maximum(a, b):
    """torch.maximum of two scalars: NaN if either is NaN."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a > b else b


@njit(inline="always")
def minimum(a, b):
    """torch.minimum of two scalars: NaN if either is NaN."""
    if a != a:
        return a
    if b != b:
        return b
    return a if a < b else b


@njit(inline="always")
def where(c, a, b):
    """``a`` if the bool ``c`` else ``b``."""
    return a if c else b


@njit(inline="always")
def truth(x):
    """``x != 0`` (True for NaN), as torch's cast to bool."""
    return x != 0


@njit(inline="always")
def lnot(x):
    """Logical not of a bool."""
    return not x


def _helpers() -> dict:
    g = {"maximum": maximum, "minimum": minimum, "where": where, "truth": truth, "lnot": lnot,
         "exp": math.exp, "log": math.log, "sqrt": math.sqrt, "sin": math.sin, "cos": math.cos,
         "tanh": math.tanh, "erf": math.erf, "abs": abs, "inf": math.inf, "nan": math.nan,
         "np": np, "prange": numba.prange, "cast_bool": truth, "lit_bool": np.bool_}
    for name, t in _NP.items():
        if name != "bool":
            g[f"cast_{name}"] = t
            g[f"lit_{name}"] = t
    return g


def _acc_init(kind: str, dtype: str) -> str:
    if kind in ("sum", "mean"):
        return "np.float64(0.0)" if dtype.startswith("float") else "np.int64(0)"
    if dtype.startswith("float"):
        return f"np.{dtype}({'-' if kind == 'amax' else ''}inf)"
    if dtype == "bool":
        return f"np.bool_({kind != 'amax'})"
    info = np.iinfo(_NP[dtype])
    return f"np.{dtype}({info.min if kind == 'amax' else info.max})"


def source(prog: Program, in_dtypes: Sequence[str], classes: Sequence[str], parallel: bool) -> str:
    """The kernel's Python source: ``kern(m, n, oshape, outer, inner, *arrays)``; arrays
    are the inputs, the full-size outputs, then the reduced output (flat storage views);
    ``outer`` [operands, rank-1] strides, ``inner`` [operands] row strides."""
    n_in, outs = len(in_dtypes), prog.ew_outputs
    ops = n_in + len(outs) + (1 if prog.reduce else 0)
    arrs = [f"p{i}" for i in range(ops)]
    loop = "prange" if parallel else "range"
    body = [f"def kern(m, n, oshape, outer, inner, {', '.join(arrs)}):",
            "    rank1 = oshape.shape[0]",
            f"    for o in {loop}(m):",
            "        rem = o * 1"]
    body += [f"        b{i} = 0" for i in range(ops)]
    body += ["        for d in range(rank1 - 1, -1, -1):",
             "            sz = oshape[d]",
             "            idx = rem % sz",
             "            rem //= sz"]
    body += [f"            b{i} += idx * outer[{i}, d]" for i in range(ops)]
    body += [f"        s{i} = inner[{i}]" for i in range(ops) if classes[i] == "g"]
    for i in range(n_in):                                   # row-invariant loads hoisted
        if classes[i] == "0":
            body.append(f"        a{i} = p{i}[b{i}]")
    if prog.reduce:
        kind, src, rdt, _ = prog.reduce
        body.append(f"        acc = {_acc_init(kind, prog.dtype_of(src, in_dtypes))}")
    body.append("        for j in range(n):")
    ind = "            "

    def at(i):
        return {"0": f"b{i}", "1": f"b{i} + j", "g": f"b{i} + j * s{i}"}[classes[i]]

    body += [f"{ind}a{i} = p{i}[{at(i)}]" for i in range(n_in) if classes[i] != "0"]
    body += [f"{ind}{name} = cast_{dt}({expr})" for name, dt, expr in prog.lines]
    for k, name in enumerate(outs):
        body.append(f"{ind}p{n_in + k}[{at(n_in + k)}] = {name}")
    if prog.reduce:
        kind, src, rdt, _ = prog.reduce
        if kind in ("sum", "mean"):
            acc_t = "np.float64" if prog.dtype_of(src, in_dtypes).startswith("float") else "np.int64"
            body.append(f"{ind}acc += {acc_t}({src})")
        else:
            cmp = ">" if kind == "amax" else "<"
            body += [f"{ind}if {src} != {src} or {src} {cmp} acc:", f"{ind}    acc = {src}"]
        r = ops - 1
        # a mean rounds its sum to the result dtype before dividing, as ATen's CPU mean
        # (sum, then div_): a float32 sum past 3.4e38 is inf there, the mean too
        val = f"cast_{rdt}(acc) / cast_{rdt}(n)" if kind == "mean" else "acc"
        body.append(f"        p{r}[b{r}] = cast_{rdt}({val})")
    return "\n".join(body) + "\n"


def _compile(prog: Program, in_dtypes, classes, parallel: bool) -> Callable:
    key = (prog.key(), tuple(in_dtypes), tuple(classes), parallel)
    fn = _CACHE.get(key)
    if fn is not None:
        return fn
    with _LOCK:
        fn = _CACHE.get(key)
        if fn is None:
            ns = _helpers()
            exec(compile(source(prog, in_dtypes, classes, parallel), "<fused_elementwise>", "exec"), ns)
            flags = {"reassoc", "contract", "nsz", "arcp", "afn"} if prog.fastmath else False
            jitted = njit(parallel=parallel, error_model="numpy", fastmath=flags, nogil=True)(ns["kern"])
            fn = _first_call_timer(key, jitted)
            _CACHE[key] = fn
    return fn


def _first_call_timer(key, jitted):
    def call(*args):
        if key in COMPILE_SECONDS:
            return jitted(*args)
        t0 = time.perf_counter()
        jitted(*args)
        COMPILE_SECONDS[key] = time.perf_counter() - t0
    return call


def _guard(parallel: bool, work: int = 0):
    """numba's ``workqueue`` threading layer aborts on concurrent parallel launches:
    serialize them there (as the FlashAttention kernels do); a parallel launch of
    ``work`` elements gets `numba_cache.launch_threads` threads."""
    if not parallel:
        return contextlib.nullcontext()
    from .numba_cache import launch   # imports numba: only at a launch
    return launch(work)   # one process-wide lock for every opencann numba kernel


def run_numba(prog: Program, inputs: Sequence[torch.Tensor], outputs: List[torch.Tensor],
              reduced) -> None:
    """Run ``prog`` on CPU tensors ``inputs`` into ``outputs`` (full-size, the domain's
    shape) and ``reduced`` (or None), all allocated by the caller."""
    shape = tuple(outputs[0].shape) if outputs else \
        tuple(torch.broadcast_shapes(*(t.shape for t in inputs)))
    lay = layout(inputs, outputs, reduced, shape)
    if lay.m == 0 or (lay.n == 0 and reduced is None):
        return
    classes = [stride_class(s) for s in lay.inner]
    in_dtypes = [str(t.dtype).replace("torch.", "") for t in inputs]
    parallel = lay.m > 1 and lay.m * lay.n >= PARALLEL_MIN
    fn = _compile(prog, in_dtypes, classes, parallel)
    oshape = np.asarray(shape[:-1], dtype=np.int64)
    outer = np.asarray(lay.outer, dtype=np.int64).reshape(len(lay.flat), len(shape) - 1)
    inner = np.asarray(lay.inner, dtype=np.int64)
    arrays = [t.detach().numpy() for t in lay.flat]
    with _guard(parallel, lay.m * lay.n):
        fn(lay.m, lay.n, oshape, outer, inner, *arrays)


__all__ = ["COMPILE_SECONDS", "PARALLEL_MIN", "run_numba", "source"]
