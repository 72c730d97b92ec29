"""The program a `FusedElementwise` node runs, and what its CPU (numba) and CUDA (Triton)
code generators share: reading the node's attrs, the dtypes compiled code handles, and
laying the operands out for a kernel (broadcast strides, flat storage views).

Neutral syntax (node attr ``program``: one ``[name, dtype, expr]`` per fused op, in order):
inputs are ``a0, a1, ...`` (``node.inputs`` order), results ``t0, t1, ...``; an ``expr`` is
Python operators (``+ - * / == != < <= > >= & |``) and the calls ``cast_<dtype>(x)``,
``lit_<dtype>(number)`` (a literal in that dtype; ``inf``, ``nan`` allowed), ``maximum``,
``minimum`` (NaN-propagating, as torch's), ``where(c, a, b)``, ``truth(x)`` (x != 0),
``lnot(b)``, ``abs``, ``exp``, ``log``, ``sqrt``, ``sin``, ``cos``, ``tanh``, ``erf``. Each
backend defines those names. Node attrs ``outputs``: the result names the node's outputs
are, in order (``"r"``: the reduction's); ``reduce``: None or ``[kind, source, dtype,
keepdim]`` with kind ``sum``, ``mean``, ``amax`` or ``amin`` over the last dimension;
``fastmath``: compile with LLVM fast-math (changes rounding; off unless asked).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

#: dtypes the generated code computes in (float16/bfloat16: eager rounds every op's fp32
#: result to 16 bits; numba has no such arithmetic, so those groups are not fused)
COMPUTE_DTYPES = ("float32", "float64", "int32", "int64", "bool")
FLOAT_DTYPES = ("float32", "float64")


def lit(dtype: str, value) -> str:
    """The neutral literal of ``value`` in ``dtype`` (``lit_float32(0.5)``, ``lit_float32(inf)``)."""
    if dtype == "bool":
        return f"lit_bool({int(bool(value))})"
    if dtype in FLOAT_DTYPES:
        v = float(value)
        text = "nan" if math.isnan(v) else ("inf" if v == math.inf else
                                            "(-inf)" if v == -math.inf else repr(v))
        return f"lit_{dtype}({text})"
    return f"lit_{dtype}({int(value)})"


@dataclass(frozen=True)
class Program:
    """A node's program (see the module docstring): ``lines`` (name, dtype, expr),
    ``outputs`` (names), ``reduce`` (kind, source, dtype, keepdim) or None, ``fastmath``."""

    lines: Tuple[Tuple[str, str, str], ...]
    outputs: Tuple[str, ...]
    reduce: Optional[Tuple[str, str, str, bool]]
    fastmath: bool = False

    @classmethod
    def from_attrs(cls, attrs: dict) -> "Program":
        """The program of a FusedElementwise node's attrs."""
        red = attrs.get("reduce")
        return cls(tuple(tuple(x) for x in attrs["program"]), tuple(attrs["outputs"]),
                   tuple(red) if red else None, bool(attrs.get("fastmath", False)))

    def dtype_of(self, name: str, in_dtypes: Sequence[str]) -> str:
        """The dtype of a program name (an input ``a<i>`` or a result)."""
        if name.startswith("a"):
            return in_dtypes[int(name[1:])]
        return next(d for n, d, _ in self.lines if n == name)

    @property
    def ew_outputs(self) -> List[str]:
        """The outputs that are full-size results (not the reduction's)."""
        return [o for o in self.outputs if o != "r"]

    def key(self) -> tuple:
        """What identifies the compiled code (with the dtypes and stride classes)."""
        return (self.lines, self.outputs, self.reduce, self.fastmath)


@dataclass
class Layout:
    """Operands laid out for a kernel over ``shape`` (the broadcast domain): row count
    ``m`` (product of all but the last dim), row length ``n``, and per operand (inputs,
    then full-size outputs, then the reduced output) a flat storage view, its outer
    strides and its inner stride."""

    shape: Tuple[int, ...]
    m: int
    n: int
    flat: List[torch.Tensor]
    outer: List[List[int]]
    inner: List[int]


def _flat(t: torch.Tensor, shape, strides) -> torch.Tensor:
    """A 1-D view of ``t``'s storage from its first element to its last (over ``shape``)."""
    span = 1 + sum((s - 1) * st for s, st in zip(shape, strides) if s > 1)
    return torch.as_strided(t, (span,), (1,), t.storage_offset())


def layout(inputs: Sequence[torch.Tensor], outputs: Sequence[torch.Tensor],
           reduced: Optional[torch.Tensor], shape: Tuple[int, ...]) -> Layout:
    """`Layout` of ``inputs`` (broadcast to ``shape``), ``outputs`` (of ``shape``) and
    ``reduced`` (the outer dims of ``shape``, any keepdim 1 squeezed) for a kernel."""
    shape = tuple(shape)
    n = shape[-1]
    m = math.prod(shape[:-1])
    flat, outer, inner = [], [], []
    for t in list(inputs) + list(outputs):
        e = t.expand(shape)
        st = e.stride()
        flat.append(_flat(t, shape, st))
        outer.append(list(st[:-1]))
        inner.append(st[-1] if shape[-1] > 1 else 0)
    if reduced is not None:
        r = reduced.reshape(shape[:-1]) if reduced.dim() != len(shape) - 1 else reduced
        st = r.stride()
        flat.append(_flat(r, shape[:-1], st))
        outer.append(list(st))
        inner.append(0)
    return Layout(shape, m, n, flat, outer, inner)


def stride_class(inner: int) -> str:
    """``"0"`` (broadcast along the row), ``"1"`` (contiguous) or ``"g"`` (any other)."""
    return "0" if inner == 0 else ("1" if inner == 1 else "g")


__all__ = ["COMPUTE_DTYPES", "FLOAT_DTYPES", "Layout", "Program", "layout", "lit", "stride_class"]
