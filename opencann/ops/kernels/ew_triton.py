"""`FusedElementwise` on CUDA tensors: a Triton kernel generated from the node's program
(triton is the project's CUDA codegen dependency; optional extra ``opencann[triton]``).
Checked on CPU under the Triton interpreter (``TRITON_INTERPRET=1`` set before triton is
imported; tests/unit/test_elementwise_fusion.py).

Grid: one program per (row, block of the last dim); with a trailing reduction one program
per row, looping over the row in blocks (sums accumulate in float64 for float inputs,
which is not eager's float32 cascade: the pass ``fuse_elementwise`` never fuses a float
sum or mean, only hand-built programs have one; max/min keep NaN). Operands are read in
place through their (broadcast) strides. The generated source is written to a per-process
temporary file (``triton.jit`` reads a function's source from its file) and cached per
program, input dtypes and rank.

Rounding: +, -, *, sqrt are Triton's IEEE ones; ``/``, exp, log, tanh, erf, sin, cos are
Triton's / libdevice's and are not checked against eager on a GPU here (no GPU in CI). The
interpreter has no libdevice: there tanh is computed from exp (`_tanh`).
"""
from __future__ import annotations

import importlib.util
import os
import re
import tempfile
import threading
from typing import Dict, List, Optional, Sequence

import torch

from .ew_program import Program, layout

_CACHE: Dict[tuple, object] = {}
_LOCK = threading.Lock()
_DIR: Optional[str] = None
BLOCK = 128

_HEAD = '''import triton
import triton.language as tl
from triton.language.extra import libdevice

INF: tl.constexpr = float("inf")
NAN: tl.constexpr = float("nan")


@triton.jit
def maximum(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a > b, a, b)))


@triton.jit
def minimum(a, b):
    return tl.where(a != a, a, tl.where(b != b, b, tl.where(a < b, a, b)))


@triton.jit
def where(c, a, b):
    return tl.where(c, a, b)


@triton.jit
def truth(x):
    return x != 0


@triton.jit
def lnot(x):
    return x == 0


@triton.jit
def exp(x):
    return tl.exp(x)


@triton.jit
def log(x):
    return tl.log(x)


@triton.jit
def sqrt(x):
    return tl.sqrt_rn(x)


@triton.jit
def sin(x):
    return tl.sin(x)


@triton.jit
def cos(x):
    return tl.cos(x)


@triton.jit
def tanh(x):
    return TANH_BODY


@triton.jit
def erf(x):
    return tl.erf(x)


@triton.jit
def abs(x):
    return tl.abs(x)


@triton.jit
def cast_bool(x):
    return x != 0
'''

_TL = {"float32": "tl.float32", "float64": "tl.float64", "int32": "tl.int32", "int64": "tl.int64",
       "bool": "tl.int1"}


def _casts() -> str:
    return "".join(f"\n\n@triton.jit\ndef cast_{d}(x):\n    return x.to({t})\n"
                   for d, t in _TL.items() if d != "bool")


def _expr(text: str) -> str:
    """Neutral literals ``lit_<dtype>(v)`` as ``tl.full`` constants."""
    def sub(m):
        v = m.group(2).replace("(-inf)", "-INF").replace("inf", "INF").replace("nan", "NAN")
        if m.group(1) == "bool":
            return "(tl.full([], %s, tl.int32) != 0)" % v
        return f"tl.full([], {v}, {_TL[m.group(1)]})"
    return re.sub(r"lit_(\w+)\(((?:\(-inf\))|[^()]*)\)", sub, text)


def source(prog: Program, in_dtypes: Sequence[str], rank: int) -> str:
    """The kernel ``kern(p0.., m, n, sizes (rank-1), strides (operands × rank), BLOCK)``."""
    n_in, outs = len(in_dtypes), prog.ew_outputs
    ops = n_in + len(outs) + (1 if prog.reduce else 0)
    sizes = [f"S{d}" for d in range(rank - 1)]
    strides = [f"st{k}_{d}" for k in range(ops) for d in range(rank)]
    args = [f"p{k}" for k in range(ops)] + ["m", "n"] + sizes + strides + ["BLOCK: tl.constexpr"]
    b = ["", "", "@triton.jit", f"def kern({', '.join(args)}):", "    row = tl.program_id(0)", "    rem = row"]
    for k in range(ops):
        b.append(f"    b{k} = 0")
    for d in range(rank - 2, -1, -1):
        b += [f"    i{d} = rem % S{d}", f"    rem = rem // S{d}"]
        b += [f"    b{k} += i{d} * st{k}_{d}" for k in range(ops)]
    last = rank - 1
    ind = "    "
    if prog.reduce:
        kind, src, rdt, _ = prog.reduce
        sdt = prog.dtype_of(src, in_dtypes)
        acc_t = ("tl.float64" if sdt.startswith("float") else "tl.int64") if kind in ("sum", "mean") else _TL[sdt]
        if kind in ("sum", "mean"):
            init = "0"
        elif sdt.startswith("float"):
            init = "-INF" if kind == "amax" else "INF"
        else:
            info = torch.iinfo(getattr(torch, sdt))
            init = str(info.min if kind == "amax" else info.max)
        b += [f"    acc = tl.full([BLOCK], {init}, {acc_t})", "    for start in range(0, n, BLOCK):"]
        ind = "        "
        b.append(f"{ind}j = start + tl.arange(0, BLOCK)")
    else:
        b.append("    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)")
    b.append(f"{ind}mask = j < n")
    b += [f"{ind}a{i} = tl.load(p{i} + b{i} + j * st{i}_{last}, mask=mask)" for i in range(n_in)]
    b += [f"{ind}{name} = cast_{dt}({_expr(expr)})" if dt != "bool" else f"{ind}{name} = {_expr(expr)}"
          for name, dt, expr in prog.lines]
    for k, name in enumerate(outs):
        o = n_in + k
        b.append(f"{ind}tl.store(p{o} + b{o} + j * st{o}_{last}, {name}, mask=mask)")
    if prog.reduce:
        kind, src, rdt, _ = prog.reduce
        r = ops - 1
        if kind in ("sum", "mean"):
            b.append(f"{ind}acc += tl.where(mask, {src}.to({acc_t}), 0)")
            b.append("    res = tl.sum(acc, axis=0)" + (f".to({_TL[rdt]}) / n" if kind == "mean" else ""))
        else:
            b.append(f"{ind}acc = tl.where(mask, {'maximum' if kind == 'amax' else 'minimum'}(acc, {src}), acc)")
            red = "tl.max" if kind == "amax" else "tl.min"
            b += ["    nan = tl.max((acc != acc).to(tl.int32), axis=0)",
                  f"    res = tl.where(nan > 0, NAN, {red}(acc, axis=0))" if sdt.startswith("float")
                  else f"    res = {red}(acc, axis=0)"]
        b.append(f"    tl.store(p{r} + b{r}, res.to({_TL[rdt]}))")
    return _HEAD.replace("TANH_BODY", _tanh()) + _casts() + "\n".join(b) + "\n"


def _tanh() -> str:
    """libdevice's tanh on a GPU; the interpreter has no libdevice: tanh from exp there
    (odd, NaN-propagating, ±1 at ±inf; a few ulp; Taylor near 0)."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return "libdevice.tanh(x)"
    return ("tl.where(tl.abs(x) < 0.0005, x - x * x * x / 3, tl.where(x < 0, -1.0, 1.0) * "
            "((1 - tl.exp(-2 * tl.abs(x))) / (1 + tl.exp(-2 * tl.abs(x)))))")


def _kernel(prog: Program, in_dtypes, rank: int):
    global _DIR
    key = (prog.key(), tuple(in_dtypes), rank)
    with _LOCK:
        if key not in _CACHE:
            if _DIR is None:
                _DIR = tempfile.mkdtemp(prefix="opencann_ew_triton_")
            path = os.path.join(_DIR, f"ew_{len(_CACHE)}.py")
            with open(path, "w") as f:
                f.write(source(prog, in_dtypes, rank))
            spec = importlib.util.spec_from_file_location(f"opencann_ew_{len(_CACHE)}", path)
            mod = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(mod)
            _CACHE[key] = mod.kern
    return _CACHE[key]


def run_triton(prog: Program, inputs: Sequence[torch.Tensor], outputs: List[torch.Tensor],
               reduced, shape) -> None:
    """Run ``prog`` with Triton into ``outputs`` / ``reduced`` (allocated by the caller)."""
    shape = tuple(shape)
    lay = layout(inputs, outputs, reduced, shape)
    if lay.m == 0 or (lay.n == 0 and reduced is None):
        return
    rank = len(shape)
    in_dtypes = [str(t.dtype).replace("torch.", "") for t in inputs]
    kern = _kernel(prog, in_dtypes, rank)
    strides = [s for k in range(len(lay.flat)) for s in list(lay.outer[k]) + [lay.inner[k]]]
    grid = (lay.m,) if prog.reduce else (lay.m, triton_cdiv(lay.n, BLOCK))
    kern[grid](*lay.flat, lay.m, lay.n, *shape[:-1], *strides, BLOCK=BLOCK)


def triton_cdiv(a: int, b: int) -> int:
    """⌈a / b⌉ for positive ints (grid sizes)."""
    return (a + b - 1) // b


__all__ = ["BLOCK", "run_triton", "source"]
